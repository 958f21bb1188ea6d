"""Folding o_proj's input transform into v_proj's rows: exact in full precision, and the
fold_o_proj recipe option."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl.io.data import token_blocks
from kbbq_pl.quant import (
    FormatConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.quant.layers import quantized_linears
from kbbq_pl.transforms.fit import transform_weight, weight_block_grams
from kbbq_pl.transforms.o_proj_fold import (
    expand_to_query_heads,
    fold_into_values,
    pooled_group_statistics,
    value_head_blocks,
)

pytestmark = pytest.mark.usefixtures("one_thread")

N_HEADS, N_KV, HEAD_DIM = 4, 2, 16  # the tiny Llama: grouped-query attention, 2 heads a group


def _batches():
    ids = token_blocks("random", None, n_tokens=256, seq_len=32, vocab_size=256)
    return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(8)]


def _per_value_head(block: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    count = N_KV * HEAD_DIM // block
    eye = torch.eye(block, dtype=torch.float64)
    return eye + 0.3 * torch.randn(count, block, block, generator=generator,
                                   dtype=torch.float64)


@pytest.mark.parametrize("block", [8, 16])
def test_fold_into_v_proj_is_exact_in_full_precision(block):
    model = tiny_model("llama", attention_bias=True).double()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        transform = expand_to_query_heads(_per_value_head(block), N_HEADS, N_KV)
        for layer in model.model.layers:
            attention = layer.self_attn
            weight, bias = fold_into_values(attention.v_proj.weight, attention.v_proj.bias,
                                            transform, HEAD_DIM, N_HEADS, N_KV)
            attention.v_proj.weight.copy_(weight)
            attention.v_proj.bias.copy_(bias)
            attention.o_proj.weight.copy_(transform_weight(attention.o_proj.weight, transform))
        folded = model(input_ids=ids).logits
    assert (folded - reference).abs().max() < 1e-10 * reference.abs().max()
    # and the fold changed the weights: without the o_proj side the function is another one
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.copy_(transform_weight(
                layer.self_attn.o_proj.weight, torch.linalg.inv(transform)))
        assert (model(input_ids=ids).logits - reference).abs().max() > 1e-3


def test_what_does_not_fold_is_refused():
    per_head = _per_value_head(16).repeat_interleave(2, 0)
    per_head[1] += 0.1  # query head 1 shares value head 0 with head 0, not its transform
    with pytest.raises(ValueError, match="query heads 0 and 1 read value head 0"):
        value_head_blocks(per_head, HEAD_DIM, N_HEADS, N_KV)
    spanning = torch.eye(32, dtype=torch.float64).expand(2, 32, 32)
    with pytest.raises(ValueError, match="blocks of 32 span heads of head_dim 16"):
        value_head_blocks(spanning, HEAD_DIM, N_HEADS, N_KV)


def test_pooled_statistics_average_the_heads_of_a_group():
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(64, N_HEADS * HEAD_DIM, generator=generator, dtype=torch.float64)
    sigma = torch.randn(N_HEADS, 16, 16, generator=generator, dtype=torch.float64)
    sigma = sigma @ sigma.transpose(-1, -2)
    stacked, pooled = pooled_group_statistics(weight, sigma, HEAD_DIM, N_HEADS, N_KV)
    grams = weight_block_grams(weight, 16)
    assert torch.allclose(weight_block_grams(stacked, 16), grams.reshape(2, 2, 16, 16).mean(1))
    assert torch.allclose(pooled, sigma.reshape(2, 2, 16, 16).mean(1))
    # multi-head attention: nothing to pool
    same_weight, same_sigma = pooled_group_statistics(weight, sigma, HEAD_DIM, N_HEADS, N_HEADS)
    assert torch.equal(same_weight, weight) and torch.equal(same_sigma, sigma)


def test_fold_o_proj_recipe():
    plain, folded = tiny_model("llama"), tiny_model("llama")
    base = QuantizationConfig(format=FormatConfig("nvfp4"), transform=TransformConfig("kbbq", 0.5))
    fold = replace(base, transform=TransformConfig("kbbq", 0.5, fold_o_proj=True))
    plain_report = quantize_model(plain, _batches(), base, progress=False)
    report = quantize_model(folded, _batches(), fold, progress=False)
    names = [f"model.layers.{i}.self_attn.o_proj" for i in range(2)]
    assert report.model["o_proj_folded_into_v_proj"] == names
    layers = quantized_linears(folded)
    for name in names:
        assert layers[name].transform is None  # no online transform left
        assert layers[name.replace("o_proj", "v_proj")].transform is not None
    snr = {r.name: r.output_snr_db for r in report.layers}
    plain_snr = {r.name: r.output_snr_db for r in plain_report.layers}
    for name in names:  # o_proj, fed T x by v_proj, as accurate as with its online transform
        assert abs(snr[name] - plain_snr[name]) < 3.0, (snr[name], plain_snr[name])
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    reference = tiny_model("llama")
    with torch.no_grad():
        exact = reference(input_ids=ids).logits
        errors = [((m(input_ids=ids).logits - exact).norm() / exact.norm()).item()
                  for m in (plain, folded)]
    assert errors[1] < 2 * errors[0], errors
    # the layers whose transforms do not change see the full-precision model's activations:
    # the same static activation scales as without folding (not those of a model whose v_proj
    # is folded while its o_proj is not, which the full-precision pass once ran on)
    plain_scales = {r.name: r.act_global_scale for r in plain_report.layers}
    kept = [r for r in report.layers if not r.name.endswith(("v_proj", "o_proj"))]
    assert kept and all(r.act_global_scale == plain_scales[r.name] for r in kept)
    for name, lam in (("haar", 0.5), ("kbbq", "auto")):
        with pytest.raises(ValueError, match="fold_o_proj"):
            TransformConfig(name, lam, fold_o_proj=True)
    with pytest.raises(ValueError, match="fold_o_proj"):
        replace(fold, weights=WeightsConfig("gptq"))


def test_an_attention_that_changes_the_values_keeps_its_online_transform(caplog):
    """Qwen3-Next gates the attention output before o_proj: the fold would not be exact, so
    the block runs once with the fold in place, sees its outputs move, and keeps o_proj's
    online transform (the same model as without the fold), with a warning."""
    import transformers as T

    config = T.Qwen3NextConfig(vocab_size=256, hidden_size=128, intermediate_size=128,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, layer_types=["full_attention"], num_experts=0,
                               mlp_only_layers=[0])
    models = []
    for fold in (False, True):
        torch.manual_seed(0)
        model = T.Qwen3NextForCausalLM(config).eval()
        recipe = QuantizationConfig(transform=TransformConfig("kbbq", 0.75, fold_o_proj=fold))
        with caplog.at_level("WARNING", logger="kbbq_pl.quant.rtn.quantizer"):
            report = quantize_model(model, _batches(), recipe, progress=False)
        models.append(model)
    assert report.model["o_proj_folded_into_v_proj"] == []
    assert "fold_o_proj: model.layers.0.self_attn.o_proj: folding moves the block's " \
           "full-precision outputs by" in caplog.text
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(models[0](input_ids=ids).logits, models[1](input_ids=ids).logits)


def test_the_fold_check_reads_token_positions_only(caplog):
    """The check compares the block's outputs at token positions: padded positions whose
    inputs dwarf the tokens' (1e3) do not hide the gate's change (the fold is still refused)."""
    import transformers as T

    config = T.Qwen3NextConfig(vocab_size=256, hidden_size=128, intermediate_size=128,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, layer_types=["full_attention"], num_experts=0,
                               mlp_only_layers=[0])
    torch.manual_seed(0)
    model = T.Qwen3NextForCausalLM(config).eval()
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    embeds = model.get_input_embeddings()(ids).detach()
    embeds[mask == 0] = 1e3
    recipe = QuantizationConfig(transform=TransformConfig("kbbq", 0.75, fold_o_proj=True))
    with caplog.at_level("WARNING", logger="kbbq_pl.quant.rtn.quantizer"):
        report = quantize_model(model, [{"inputs_embeds": embeds, "attention_mask": mask}],
                                recipe, progress=False)
    assert report.model["o_proj_folded_into_v_proj"] == []
    assert "folding moves the block's full-precision outputs" in caplog.text


def test_fold_o_proj_reads_the_heads_of_a_multimodal_models_text_config():
    from tiny_models import tiny_multimodal

    model = tiny_multimodal("llava")
    recipe = QuantizationConfig(transform=TransformConfig("kbbq", 0.75, fold_o_proj=True))
    report = quantize_model(model, _batches(), recipe, progress=False)
    assert report.model["o_proj_folded_into_v_proj"] == [
        f"model.language_model.layers.{i}.self_attn.o_proj" for i in range(2)]


def test_blocks_that_span_heads_are_refused_naming_the_layer():
    model = tiny_model("llama")  # head_dim 16, MXFP4 blocks of 32
    recipe = QuantizationConfig(format=FormatConfig("mxfp4"),
                                transform=TransformConfig("kbbq", 0.75, fold_o_proj=True))
    with pytest.raises(ValueError, match=r"fold_o_proj: model\.layers\.0\.self_attn\.o_proj into "
                                         r".*v_proj: the transform's blocks of 32 span heads of "
                                         r"head_dim 16"):
        quantize_model(model, _batches(), recipe, progress=False)
