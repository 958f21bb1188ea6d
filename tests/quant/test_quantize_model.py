"""The quantized linear layer and the post-training pipeline on real and tiny models."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from kbbq_pl import formats as F
from kbbq_pl.formats import QuantizedTensor
from kbbq_pl.formats.rounding import NVFP4_MIN_GLOBAL_SCALE
from kbbq_pl.io.data import token_blocks
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import (
    FormatConfig,
    LayersConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.quant.layers import QuantizedLinear, quantized_linears
from kbbq_pl.transforms.fit import fit_transform, transform_inputs, transform_weight


def batches_of(ids: torch.Tensor, size: int = 2) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": ids[i:i + size]} for i in range(0, len(ids), size)]


def test_quantized_linear_is_exact_emulation():
    linear = nn.Linear(64, 24)
    x = torch.randn(5, 7, 64)
    t = fit_transform("hadamard", linear.weight.detach(), block=16)
    layer = QuantizedLinear.from_linear(linear, "nvfp4", t)
    w_hat = F.fake_quantize(transform_weight(linear.weight.detach(), t), "nvfp4")
    x_hat = F.fake_quantize(transform_inputs(x.reshape(-1, 64), t.float()), "nvfp4")
    expected = (x_hat @ w_hat.T + linear.bias).reshape(5, 7, 24)
    assert torch.equal(layer(x), expected)
    assert isinstance(layer.weight, F.QuantizedTensor) and not layer.weight.requires_grad


def test_unaligned_layer_is_padded():
    linear = nn.Linear(172, 32)  # the FFN width of the real tiny Llama
    layer = QuantizedLinear.from_linear(linear, "nvfp4", None, name="mlp.down_proj")
    assert layer.padded_in == 176 and layer.weight.shape == (32, 176)
    x = torch.randn(3, 172)
    padded = torch.nn.functional.pad(x, (0, 4))
    w = torch.nn.functional.pad(linear.weight.detach(), (0, 4))
    expected = F.fake_quantize(padded, "nvfp4") @ F.fake_quantize(w, "nvfp4").T + linear.bias
    assert torch.equal(layer(x), expected)


def test_trainable_layer_gets_straight_through_gradients_and_freezes():
    torch.manual_seed(0)
    linear = nn.Linear(32, 8)
    layer = QuantizedLinear.from_linear(linear, "mxfp4", None, trainable=True)
    layer.train()
    x = torch.randn(4, 32, requires_grad=True)
    layer(x).square().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    assert x.grad is not None and x.grad.abs().sum() > 0
    layer.eval()
    with torch.no_grad():
        before = layer(x)
        layer.freeze()
        assert isinstance(layer.weight, F.QuantizedTensor)
        assert torch.equal(layer(x), before)


def test_state_dict_round_trip_into_a_fresh_layer():
    linear = nn.Linear(32, 8)
    layer = QuantizedLinear.from_linear(linear, "nvfp4", torch.eye(32), act_scale="static")
    layer.act_global_scale = torch.tensor(0.01)
    shell = QuantizedLinear.from_linear(nn.Linear(32, 8), "nvfp4", None, act_scale="static")
    shell.load_state_dict(layer.state_dict())
    x = torch.randn(3, 32)
    assert torch.equal(shell(x), layer(x))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("transform", ["identity", "kbbq"])
def test_pipeline_on_tiny_causal_lms(arch, transform):
    model = tiny_model(arch)
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))
    reference = model(input_ids=ids).logits
    config = QuantizationConfig(format=FormatConfig("nvfp4"),
                                transform=TransformConfig(transform, lam=0.5))
    report = quantize_model(model, batches_of(ids), config, progress=False)
    layers = quantized_linears(model)
    assert len(layers) == len(report.layers) == 7 * 2 if arch != "gpt2" else 4 * 2
    assert not isinstance(model.lm_head, QuantizedLinear)
    logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agreement > 0.5
    for row in report.layers:
        assert row.kappa_before > 0 and row.kappa_after > 0 and 0 < row.utilization <= 1 + 1e-6
        assert row.act_global_scale is not None and row.output_snr_db > 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_outputs_are_the_layers_own_and_give_the_reports_snr(dtype):
    """The calibration pass keeps the full-precision outputs of the sampled tokens (float32
    forwards only), and the report's output SNR from them equals a fresh product's."""
    from kbbq_pl.quant.report import output_snr_db
    from kbbq_pl.quant.stats import StatisticsCollector

    linear = nn.Linear(64, 48).to(dtype)
    collector = StatisticsCollector({"fc": linear}, block=16, keep_samples=10, sample_stride=2)
    with collector.hooks():
        for _ in range(3):
            linear(torch.randn(2, 11, 64).to(dtype))
    stats = collector.stats["fc"]
    x, kept = stats.sample(), stats.sample_output()
    assert x.shape == (10, 64)
    if dtype != torch.float32:
        assert kept is None  # a bf16 output is rounded: the report multiplies again
        return
    exact = x @ linear.weight.detach().T
    torch.testing.assert_close(kept, exact, rtol=1e-5, atol=1e-5)
    layer = QuantizedLinear.from_linear(linear, "nvfp4", None, act_scale="dynamic")
    weight, bias = linear.weight.detach(), linear.bias.detach()
    fresh = output_snr_db(layer, weight, bias, x)
    assert abs(output_snr_db(layer, weight, bias, x, exact=kept) - fresh) < 1e-4
    approx = layer(x).detach().double() - bias.double()
    expected = 10 * torch.log10(exact.double().square().sum()
                                / (approx - exact.double()).square().sum())
    assert abs(fresh - float(expected)) < 1e-4


@pytest.mark.parametrize("size", [40, 64, 100])
def test_gram_from_the_upper_tiles_is_the_full_product(size):
    from kbbq_pl.quant.stats import gram

    x = torch.randn(37, size)
    got = gram(x, tile=32)
    torch.testing.assert_close(got, x.T @ x, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got, got.T, rtol=1e-6, atol=1e-5)


def test_layers_reading_one_tensor_share_its_products_and_a_refilled_buffer_does_not():
    """q/k/v read one tensor: its products are computed once and every layer's sums are what
    a collector of its own gives; a buffer refilled in place between calls is a new input."""
    from kbbq_pl.quant.stats import StatisticsCollector

    q, k, v = (nn.Linear(64, 32) for _ in range(3))
    together = StatisticsCollector({"q": q, "k": k, "v": v}, block=16, full=True)
    alone = {n: StatisticsCollector({n: m}, block=16, full=True) for n, m in
             {"q": q, "k": k, "v": v}.items()}
    buffer, seen = torch.empty(3, 7, 64), []
    with together.hooks():
        for _ in range(2):
            buffer.copy_(torch.randn(3, 7, 64))  # the same tensor object, new values
            seen.append(buffer.clone())
            for layer in (q, k, v):
                layer(buffer)
    for name, layer in {"q": q, "k": k, "v": v}.items():
        with alone[name].hooks():
            for x in seen:
                layer(x)
    for name in ("q", "k", "v"):
        got, want = together.stats[name], alone[name].stats[name]
        assert torch.equal(got.sigma_sum, want.sigma_sum), name
        assert torch.equal(got.full_sum, want.full_sum), name
    assert together._last is None  # nothing held after the hooks


def test_an_attached_collector_does_not_keep_its_last_input_alive():
    import weakref

    from kbbq_pl.quant.stats import StatisticsCollector

    layer = nn.Linear(64, 32)
    collector = StatisticsCollector({"fc": layer}, block=16)
    handles = collector.attach()  # attached for good, as the torchao observer is
    x = torch.randn(5, 64)
    layer(x)
    seen = weakref.ref(x)
    del x
    assert seen() is None
    for handle in handles:
        handle.remove()


def test_pipeline_is_deterministic_and_wush_attains_the_paired_ceiling():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    outputs, reports = [], []
    for _ in range(2):
        m = copy.deepcopy(model)
        wush = QuantizationConfig(transform=TransformConfig("wush"))
        reports.append(quantize_model(m, batches_of(ids), wush, progress=False))
        outputs.append(m(input_ids=ids).logits)
    assert torch.equal(outputs[0], outputs[1])
    # the fit damps its Gram matrices by 1%, the report measures on the undamped statistics:
    # with 128 tokens some blocks are rank-deficient and the damping costs a few 1e-3
    assert all(abs(r.utilization - 1) < 1e-2 for r in reports[0].layers)
    assert sorted(r.utilization for r in reports[0].layers)[len(reports[0].layers) // 2] > 0.9995


def test_static_activation_scales_make_outputs_independent_of_the_batch():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(2))
    quantize_model(model, batches_of(ids), QuantizationConfig(format=FormatConfig("nvfp4")),
                   progress=False)
    alone = model(input_ids=ids[:1]).logits
    loud = ids.clone()
    with torch.no_grad():
        together = model(input_ids=torch.cat([ids[:1], loud[1:]])).logits[:1]
    assert torch.allclose(alone, together, atol=1e-5)


def test_a_layer_calibrated_on_zeros_keeps_zeros_zero():
    """An all-zero up projection gives ``down_proj`` only zeros to calibrate on: its static
    activation scale is the smallest usable one, and zeros still quantize to zeros (at 2^-122
    the reciprocal chain overflowed and ``0 * inf`` made every logit NaN)."""
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.zero_()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    quantize_model(model, batches_of(ids), QuantizationConfig(), progress=False)
    down = model.model.layers[0].mlp.down_proj
    assert float(down.weight.act_global_scale) == NVFP4_MIN_GLOBAL_SCALE
    with torch.no_grad():
        assert torch.equal(down(torch.zeros(3, down.in_features)), torch.zeros(3, 64))
        assert torch.isfinite(model(input_ids=ids).logits).all()
        down.weight.act_global_scale.fill_(2.0**-122)  # what a checkpoint written before holds
        assert torch.equal(down(torch.randn(3, down.in_features)), torch.zeros(3, 64))
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_skip_policy_and_tiny_llama_width():
    model = tiny_model("llama", intermediate_size=172)
    ids = torch.randint(0, 256, (2, 16))
    skipping = copy.deepcopy(model)
    skip = QuantizationConfig(format=FormatConfig(unaligned="skip"))
    report = quantize_model(skipping, batches_of(ids), skip, progress=False)
    assert set(report.skipped) == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    assert "not a multiple" in report.skipped["model.layers.0.mlp.down_proj"]
    pad = QuantizationConfig(format=FormatConfig(unaligned="pad"))
    padded = quantize_model(model, batches_of(ids), pad, progress=False)
    down = {r.name: r for r in padded.layers}["model.layers.0.mlp.down_proj"]
    assert (down.in_features, down.padded_in) == (172, 176)
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_bad_calibration_input():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="calibration set is empty"):
        quantize_model(model, [], QuantizationConfig(), progress=False)
    ids = torch.randint(0, 256, (2, 16))
    with pytest.raises(TypeError, match=r"calibration batch 1 is a Tensor of shape \(2, 16\): "
                                        "batches are dicts of the model's keyword inputs"):
        quantize_model(model, [{"input_ids": ids}, ids], QuantizationConfig(), progress=False)
    # a tokenizer's lists (no return_tensors='pt'), a batch without tokens
    with pytest.raises(TypeError, match=r"calibration batch 0: 'input_ids' is a list; batches "
                                        r"hold tensors \(a tokenizer's return_tensors='pt'\)"):
        quantize_model(model, [{"input_ids": ids.tolist()}], QuantizationConfig(), progress=False)
    with pytest.raises(ValueError, match=r"calibration batch 1: 'input_ids' is empty \(shape "
                                         r"\(0, 16\)\)"):
        quantize_model(model, [{"input_ids": ids}, {"input_ids": ids[:0]}], QuantizationConfig(),
                       progress=False)
    with pytest.raises(TypeError, match=r"quantize_model takes a recipe: a QuantizationConfig, "
                                        r"or a packaged recipe's name or a recipe file, got 4"):
        quantize_model(model, [{"input_ids": ids}], 4, progress=False)  # type: ignore[arg-type]
    assert not quantized_linears(model)  # refused before anything changed
    # a packaged recipe by name, as the callback and kbbq-pl quantize --config take it
    report = quantize_model(model, [{"input_ids": ids}], "i_mxfp4", progress=False)
    assert report.config == QuantizationConfig.from_recipe("i_mxfp4").to_dict()
    with pytest.raises(ValueError, match="W4A4 needs a block FP4 format"):
        QuantizationConfig(format=FormatConfig("fp8_e4m3"))
    with pytest.raises(ValueError, match="no linear layer"):
        quantize_model(tiny_model("llama"), batches_of(torch.randint(0, 256, (2, 8))),
                       QuantizationConfig(layers=LayersConfig(targets=["nothing_here"])),
                       progress=False)


@pytest.mark.parametrize("weight_quantizer", ["rtn", "gptq"])
def test_non_finite_weight_names_the_layer_before_calibrating(weight_quantizer):
    model = tiny_model("llama")
    model.model.layers[1].self_attn.q_proj.weight.data[0, 0] = float("nan")
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj: its weight "
                                         r"holds 1 NaN and 0 Inf values \(shape \(64, 64\)"):
        quantize_model(model, batches_of(torch.randint(0, 256, (2, 8))),
                       QuantizationConfig(weights=WeightsConfig(weight_quantizer)), progress=False)
    assert not calls  # refused before any calibration forward


def test_token_ids_past_the_vocabulary_name_the_batch():
    model = tiny_model("llama")  # 256 embedding rows
    batches = [{"input_ids": torch.randint(0, 256, (2, 8))},
               {"input_ids": torch.full((2, 8), 300)}]
    with pytest.raises(ValueError, match=r"calibration batch 1: 'input_ids' \(shape \(2, 8\), "
                                         r"cpu\) holds token 300, outside the model's 256"):
        quantize_model(model, batches, QuantizationConfig(), progress=False)


def test_non_finite_bias_names_its_layer_not_the_next_one():
    model = tiny_model("llama", attention_bias=True)
    model.model.layers[1].self_attn.k_proj.bias.data[3] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj: its bias "
                                         r"holds 1 NaN and 0 Inf values \(shape \(32,\)"):
        quantize_model(model, batches_of(torch.randint(0, 256, (2, 8))), QuantizationConfig(),
                       progress=False)


@pytest.mark.parametrize("value, count", [(float("nan"), "16 NaN and 0 Inf"),
                                          (float("inf"), "0 NaN and 16 Inf")])
@pytest.mark.parametrize("weight_quantizer", ["rtn", "gptq"])
def test_non_finite_input_names_the_layer(poison_input, value, count, weight_quantizer):
    model = tiny_model("llama")
    poison_input(model.model.layers[0].self_attn.o_proj, 3, value)  # 2 x 8 tokens
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj: its input "
                                         rf"holds {count} values \(shape \(16, 64\)"):
        quantize_model(model, batches_of(torch.randint(0, 256, (2, 8))),
                       QuantizationConfig(weights=WeightsConfig(weight_quantizer)), progress=False)


def test_transform_fit_error_names_the_layer():
    weight = torch.randn(8, 32)
    sigma = torch.eye(16, dtype=torch.float64).expand(2, 16, 16).clone()
    sigma[1, 0, 0] = float("inf")  # finite inputs whose products overflowed
    with pytest.raises(ValueError, match=r"blocks\.0\.fc: cannot fit the transform: 0 "
                                         r"non-finite entries in the weight .* 1 in the input"):
        fit_transform("kbbq", weight, sigma, block=16, name="blocks.0.fc")


def test_minilm_kbbq_beats_identity_on_calibration_fidelity():
    model, tokenizer = load_model("minilm")
    calib = token_blocks("random", tokenizer, n_tokens=1024, seq_len=128, seed=0)
    probe = token_blocks("random", tokenizer, n_tokens=512, seq_len=64, seed=1)
    with torch.no_grad():
        reference = model(input_ids=probe).last_hidden_state.mean(1)
    scores = {}
    for transform in ("identity", "kbbq"):
        m = copy.deepcopy(model)
        config = QuantizationConfig(format=FormatConfig("mxfp4"),
                                    transform=TransformConfig(transform, lam=0.75))
        report = quantize_model(m, batches_of(calib, 4), config, progress=False)
        assert len(report.layers) == 36
        with torch.no_grad():
            out = m(input_ids=probe).last_hidden_state.mean(1)
        scores[transform] = torch.nn.functional.cosine_similarity(out, reference).mean().item()
    assert scores["kbbq"] > scores["identity"]


def test_real_tiny_llama_with_unaligned_ffn(shared_data, tmp_path):
    from kbbq_pl.eval.evaluation import perplexity
    from kbbq_pl.io.llama2c import convert_llama2c

    folder = shared_data / "tiny_llama_aidreams260K"
    out = convert_llama2c(folder / "aidreams260K.bin", folder / "tok512.bin", tmp_path / "hf")
    model, tokenizer = load_model(out)
    calib = token_blocks(shared_data / "wikitext2" / "valid.txt", tokenizer, n_tokens=1024,
                         seq_len=128)
    text = shared_data / "wikitext2" / "test.txt"
    full = perplexity(model, tokenizer, text, seq_len=128, stride=64, max_tokens=1024)
    probe = token_blocks(text, tokenizer, n_tokens=512, seq_len=128, seed=3)
    with torch.no_grad():
        reference = model(input_ids=probe).logits.argmax(-1)
    skipping = copy.deepcopy(model)
    skip = QuantizationConfig(format=FormatConfig("nvfp4", unaligned="skip"))
    report = quantize_model(skipping, batches_of(calib, 4), skip, progress=False)
    assert sorted(report.skipped) == [f"model.layers.{i}.mlp.down_proj" for i in range(4)]
    report = quantize_model(model, batches_of(calib, 4),
                            QuantizationConfig(format=FormatConfig("nvfp4")), progress=False)
    downs = [r for r in report.layers if r.name.endswith("down_proj")]
    assert len(downs) == 4 and all(r.padded_in == 176 for r in downs)
    quantized = perplexity(model, tokenizer, text, seq_len=128, stride=64, max_tokens=1024)
    # WikiText is far from this model's training text (its perplexity there is ~300), so
    # quantization noise moves it either way; the predictions themselves must mostly survive
    assert 0.8 < quantized["perplexity"] / full["perplexity"] < 1.5
    with torch.no_grad():
        agreement = (model(input_ids=probe).logits.argmax(-1) == reference).float().mean()
    assert agreement > 0.6


def to_torchao_nvfp4(q: QuantizedTensor):
    """The same NVFP4 bits as a torchao ``NVFP4Tensor`` (codes, E4M3 scales and per-tensor
    scale have one layout in both libraries)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    if q.fmt.name != "nvfp4" or q.last_dim != q.qdata.shape[-1] * 2:
        raise ValueError(f"only unpadded nvfp4 tensors convert to torchao, got {q.fmt.name}")
    return NVFP4Tensor(q.qdata, q.scale, 16, q.orig_dtype, per_tensor_scale=q.global_scale)


def test_nvfp4_weights_convert_to_torchao_for_its_kernels():
    q = F.quantize(torch.randn(32, 64), "nvfp4")
    converted = to_torchao_nvfp4(q)
    assert torch.equal(converted.dequantize(torch.float32), q.dequantize())
    with pytest.raises(ValueError, match="only unpadded nvfp4"):
        to_torchao_nvfp4(F.quantize(torch.randn(4, 64), "mxfp4"))


@pytest.mark.parametrize("weights", ["rtn", "gptq"])
def test_padding_is_left_out_of_the_calibration(weights, caplog):
    """Padded positions (attention_mask 0, on the right and on the left) are not tokens: what
    they hold changes no bit of the quantized model (statistics, Hessians, static activation
    scales), and the report counts the real tokens only."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    mask[0, :3] = 0
    config = QuantizationConfig(weights=WeightsConfig(weights))
    models, reports = [], []
    for pad_seed in (1, 2):
        padded = ids.clone()
        pads = torch.randint(0, 256, ids.shape, generator=torch.Generator().manual_seed(pad_seed))
        padded[mask == 0] = pads[mask == 0]
        model = tiny_model("llama")
        with caplog.at_level("INFO", logger="kbbq_pl.quant.sequential"):
            reports.append(quantize_model(model, [{"input_ids": padded, "attention_mask": mask}],
                                          config, progress=False))
        models.append(model)
    assert "9 calibration positions are padding (attention_mask 0), left out of the " \
           "calibration's 23 tokens" in caplog.text
    assert {row.tokens for report in reports for row in report.layers} == {23}
    first, second = (dict(quantized_linears(m)) for m in models)
    assert first.keys() == second.keys() and first
    for name, layer in first.items():
        other = second[name]
        assert torch.equal(layer.weight.qdata, other.weight.qdata), name
        assert torch.equal(layer.weight.scale, other.weight.scale), name
        for (key, buffer), (_, other_buffer) in zip(layer.named_buffers(), other.named_buffers()):
            assert torch.equal(buffer, other_buffer), (name, key)


def test_token_rows_keep_the_rows_that_line_up_with_the_batch(caplog):
    """Inputs ``[batch, seq, d]`` and experts' ``[batch * seq, d]`` lose their padded rows;
    inputs of another shape keep every row, with a warning."""
    from kbbq_pl.quant.tokens import calibrating, count_tokens, token_positions, token_rows

    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    positions = token_positions({"input_ids": torch.zeros(2, 3), "attention_mask": mask})
    assert count_tokens([{"input_ids": torch.zeros(2, 3), "attention_mask": mask},
                         {"input_ids": torch.zeros(1, 5)}]) == 9
    x = torch.arange(2 * 3 * 2.0).reshape(2, 3, 2)
    with calibrating(positions):
        assert torch.equal(token_rows(x), x[mask.bool()])
        assert torch.equal(token_rows(x.reshape(6, 2)), x[mask.bool()])
        with caplog.at_level("WARNING", logger="kbbq_pl.quant.tokens"):
            assert token_rows(torch.ones(4, 2)).shape == (4, 2)
    assert "do not line up with the batch's attention_mask [2, 3]" in caplog.text
    assert token_rows(x).shape == (6, 2)
    assert token_positions({"input_ids": torch.zeros(2, 3), "attention_mask": torch.ones(2, 3)}) \
        is None


def test_padding_is_left_out_where_layers_read_batch_heads_seq_and_of_padding_only_batches(
        caplog):
    """Multi-head latent attention's kv_b_proj reads ``[batch, 1, seq, rank]``: its padded
    positions are left out too (DeepSeek-V3: the pad ids change no bit).  A batch of padding
    only adds nothing (static activation scales included), and a 4-D mask, whose padding
    cannot be told, is named in a warning."""
    from tiny_models import small_model

    from kbbq_pl.quant.tokens import calibrating, token_positions, token_rows

    positions = token_positions({"attention_mask": torch.tensor([[1, 1, 0], [0, 1, 1]])})
    x = torch.arange(2 * 4 * 3 * 5.0).reshape(2, 4, 3, 5)  # [batch, heads, seq, dim]
    with calibrating(positions):
        assert torch.equal(token_rows(x), x[positions[:, None, :].expand(2, 4, 3)])
        assert token_rows(x[:, :1]).shape == (4, 5)  # MLA's [batch, 1, seq, rank]
    ids = torch.randint(3, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    mask[2, 5:] = 0
    codes = []
    for pad_seed in (1, 2):
        padded = ids.clone()
        pads = torch.randint(3, 256, ids.shape, generator=torch.Generator().manual_seed(pad_seed))
        padded[mask == 0] = pads[mask == 0]
        model = small_model("deepseek_v3", num_key_value_heads=4)
        report = quantize_model(model, [{"input_ids": padded, "attention_mask": mask}],
                                QuantizationConfig(), progress=False)
        assert {row.tokens for row in report.layers if ".layers.0." in row.name} == {31}
        codes.append({n: layer.weight.qdata for n, layer in quantized_linears(model).items()})
    assert any(name.endswith("kv_b_proj") for name in codes[0])
    assert all(torch.equal(codes[0][name], codes[1][name]) for name in codes[0])
    one, two = tiny_model("llama"), tiny_model("llama")
    batch = {"input_ids": ids[:2], "attention_mask": torch.ones_like(ids[:2])}
    empty = {"input_ids": ids[:2], "attention_mask": torch.zeros_like(ids[:2])}
    quantize_model(one, [batch], QuantizationConfig(), progress=False)
    quantize_model(two, [batch, empty], QuantizationConfig(), progress=False)
    for name, layer in quantized_linears(one).items():
        other = quantized_linears(two)[name]
        assert torch.equal(layer.weight.qdata, other.weight.qdata), name
        assert torch.equal(layer.weight.act_global_scale, other.weight.act_global_scale), name
    four_d = torch.zeros(2, 1, 16, 16)
    with caplog.at_level("WARNING", logger="kbbq_pl.quant.sequential"):
        quantize_model(tiny_model("llama"), [{"input_ids": ids[:2], "attention_mask": four_d}],
                       QuantizationConfig(), progress=False)
    assert "1 of 1 calibration batches hold an attention_mask that is not 2-D" in caplog.text
