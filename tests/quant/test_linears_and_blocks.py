"""What quantization works on: the linear layers a recipe targets (kbbq_pl.quant.modules) and
the blocks the block-sequential runner steps through (kbbq_pl.quant.sequential)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl._compat import CACHE_ARGUMENTS
from kbbq_pl.io.data import token_blocks
from kbbq_pl.io.models import load_model
from kbbq_pl.quant.modules import cell_kind, find_linears, is_targeted, linear_weight
from kbbq_pl.quant.sequential import SequentialRunner, find_blocks


@pytest.fixture(scope="module")
def minilm():
    return load_model("minilm")


def test_find_linears_targets_ignore_and_errors(minilm):
    model, _ = minilm
    linears = find_linears(model)
    assert len(linears) == 36 and "pooler.dense" not in linears
    assert [cell_kind(n) for n in list(linears)[:6]] == ["qkv", "qkv", "qkv", "out", "up", "down"]
    only_ffn = find_linears(model, targets=[r"intermediate\.dense$", r"\d\.output\.dense$"])
    assert len(only_ffn) == 12
    no_first = find_linears(model, ignore=[r"layer\.0\.", "pooler"])
    assert len(no_first) == 30
    with pytest.raises(ValueError, match=r"no linear layer of BertModel matches.*query"):
        find_linears(model, targets=["q_proj"])
    with pytest.raises(ValueError, match="invalid module-name pattern"):
        find_linears(model, targets=["("])
    # Mamba's time-step projection: the mixer reads its weight, never calls it
    assert not is_targeted("model.layers.0.mamba.dt_proj") and is_targeted("mamba.x_proj")


def test_a_task_head_is_what_lies_outside_the_base_model(minilm):
    from tiny_models import tiny_config
    from transformers import LlamaForSequenceClassification, LlamaModel

    from kbbq_pl.quant.modules import task_head_linears

    assert task_head_linears(minilm[0], find_linears(minilm[0])) == []  # a bare encoder
    causal = tiny_model("llama")
    assert task_head_linears(causal, find_linears(causal, ignore=[])) == ["lm_head"]
    reward = LlamaForSequenceClassification(tiny_config("llama", num_labels=1))
    assert task_head_linears(reward, find_linears(reward)) == ["score"]
    bare = LlamaModel(tiny_config("llama"))
    assert task_head_linears(bare, find_linears(bare)) == []


def test_llm_compressor_regex_patterns_and_an_ignore_that_matches_nothing(minilm, caplog):
    """compressed-tensors' "re:" spelling of a regular expression is read as one; an ignore
    pattern that leaves nothing out (a typo, another model's names) is named in a warning."""
    model, _ = minilm
    assert len(find_linears(model, ignore=[r"re:.*layer\.0\.", "re:pooler"])) == 30
    assert is_targeted("mlp.experts.3.up_proj", ignore=[r"re:.*self_attn.*"])
    assert not is_targeted("mlp.experts.3.up_proj", ignore=[r"re:.*mlp\.experts.*"])
    with caplog.at_level("WARNING", logger="kbbq_pl.quant.modules"):
        assert len(find_linears(model, ignore=["pooler", r"mlp\.experts"])) == 36
    assert r"layers.ignore pattern 'mlp\\.experts' matches no linear layer of BertModel" \
        in caplog.text and "pooler'" not in caplog.text


def test_gpt2_conv1d_weights_are_read_as_out_by_in():
    model = tiny_model("gpt2")
    layers = find_linears(model)
    assert "lm_head" not in layers
    c_fc = layers["transformer.h.0.mlp.c_fc"]
    weight = linear_weight(c_fc)
    assert weight.shape == (256, 64)  # [out, in]; Conv1D stores [in, out]
    x = torch.randn(3, 64)
    assert torch.allclose(c_fc(x), x @ weight.T + c_fc.bias, atol=1e-6)


@pytest.mark.parametrize("arch", ["minilm", "llama", "qwen3", "gpt2"])
def test_sequential_runner_reproduces_the_model(arch, minilm):
    if arch == "minilm":
        model = minilm[0]
        ids = token_blocks("random", minilm[1], n_tokens=128, seq_len=32)
        expected = model(input_ids=ids).last_hidden_state
        final = torch.nn.Identity()
    else:
        model = tiny_model(arch)
        ids = torch.randint(0, 256, (4, 32))
        expected = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        base = model.base_model
        final = getattr(base, "norm", None) or base.ln_f
    runner = SequentialRunner(model, [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}])
    assert len(runner) == len(find_blocks(model)[1])
    # no block replays a key-value cache (transformers names it either way)
    assert not any(set(CACHE_ARGUMENTS) & call.kwargs.keys()
                   for calls in runner.calls for call in calls)
    for step in runner:
        assert all(name.startswith(step.name) for name in step.linears())
        step.advance(step.run())
    hidden = torch.cat([c.hidden for c in runner.inputs])
    assert torch.allclose(final(hidden), expected, atol=1e-5)


# blocks called with arguments of their own: a sliding-window mask and local rotary
# embeddings on some layers (Gemma 3, gpt-oss: the window 8 of 32 tokens), per-layer inputs and
# head sizes (Gemma 4), a linear-attention layer's mask (Qwen3-Next)
PER_LAYER = {
    "gemma3_text": dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "gpt_oss": dict(sliding_window=8),
    "gemma4_text": dict(sliding_window=8),
    "qwen3_next": {},
}


@pytest.mark.parametrize("arch", sorted(PER_LAYER))
def test_each_block_runs_with_its_own_arguments(arch):
    from tiny_models import small_model

    model = small_model(arch, **PER_LAYER[arch])
    ids = torch.randint(3, 250, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        runner = SequentialRunner(model, [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}])
        for step in runner:
            step.advance(step.run())
        hidden = model.model.norm(torch.cat([c.hidden for c in runner.inputs]))
    assert torch.allclose(hidden, expected, atol=1e-5)


def test_layers_run_before_the_blocks_are_a_step_of_their_own():
    """Gemma 4's per_layer_model_projection (of the embeddings, outside the blocks) is
    quantized in a step before the blocks, whose arguments are then captured again through
    the layer as that step left it; a targeted layer run after the blocks (the head) still
    makes the model one block."""
    from tiny_models import small_model

    from kbbq_pl.quant.sequential import PrologueStep

    model = small_model("gemma4_text")
    ids = torch.randint(3, 250, (4, 32), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}]
    projection = "model.per_layer_model_projection"
    targets = [projection, "model.layers.0.mlp.down_proj"]
    with torch.no_grad():
        runner = SequentialRunner(model, batches, targets=targets)
        assert runner.whole_model is None and runner.prologue.names == [projection]
        steps = iter(runner)
        prologue = next(steps)
        assert isinstance(prologue, PrologueStep) and len(runner) == len(runner.blocks) + 1
        assert list(prologue.linears()) == [projection]
        captured = runner.calls
        model.get_submodule(projection).weight.mul_(2)  # as if quantized
        prologue.advance(prologue.run())
        assert runner.inputs is runner.calls[0] and len(runner.calls) == len(captured)
        per_layer_input = 1  # each block's second positional argument
        assert all(not torch.equal(before.args[per_layer_input], after.args[per_layer_input])
                   for before, after in zip(captured[1], runner.calls[1]))
        assert SequentialRunner(model, batches, targets=[*targets, "lm_head"]).whole_model == (
            "targeted layers outside its blocks model.layers not run before them: lm_head")


def test_a_list_of_linear_layers_is_not_the_stack_of_blocks():
    """A tiny Gemma 3n holds 3 ``altup_projections`` and 2 blocks: the blocks are the stack,
    and the AltUp projections run before them, in the prologue step (its AltUp unembedding,
    after the blocks, matches the ``embed`` pattern and is not targeted)."""
    from tiny_models import small_model

    model = small_model("gemma3n_text")
    assert find_blocks(model)[0] == "model.layers"
    ids = torch.randint(3, 250, (2, 16), generator=torch.Generator().manual_seed(0))
    runner = SequentialRunner(model, [{"input_ids": ids}], targets=list(find_linears(model)))
    assert runner.whole_model is None
    assert runner.prologue.names == ["model.per_layer_model_projection",
                                     *(f"model.altup_projections.{i}" for i in range(3))]


class _DictBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, hidden_states, scale):
        return {"hidden": hidden_states + scale * self.proj(hidden_states)}


class _ReadsBlockOutputs(torch.nn.Module):
    """A model whose loop reads more of a block's output than the hidden states."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_DictBlock(), _DictBlock()])

    def forward(self, x, use_cache=False):
        for layer in self.layers:
            x = layer(x, scale=torch.tensor(0.5))["hidden"]
        return x


def test_a_model_that_reads_its_blocks_outputs_gives_each_the_first_blocks_arguments(caplog):
    import logging

    model = _ReadsBlockOutputs()
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="kbbq_pl.quant.sequential"):
        runner = SequentialRunner(model, [{"x": x}])
    assert "each block is given the first block's arguments" in caplog.text
    with torch.no_grad():
        for step in runner:
            step.advance([o["hidden"] for o in [step.module(*c.args, **c.kwargs)
                                                for c in step.inputs]])
        assert torch.equal(runner.inputs[0].hidden, model(x))
    assert all(isinstance(block, _DictBlock) for block in model.layers)  # put back


def test_sequential_runner_rejects_empty_calibration():
    with pytest.raises(ValueError, match="calibration set is empty"):
        SequentialRunner(tiny_model("llama"), [])


class _Scaled(torch.nn.Linear):
    """A linear layer subclass whose forward is not the linear product."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_a_linear_subclass_with_its_own_forward_is_left_in_full_precision():
    """Quantizing it would replace its forward by the plain product; Falcon's FalconLinear
    computes that product and is quantized."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    from kbbq_pl.quant import QuantizationConfig, quantize_model
    from kbbq_pl.quant.layers import quantized_linears
    from kbbq_pl.quant.modules import has_own_forward

    assert not has_own_forward(torch.nn.Linear(4, 4)) and not has_own_forward(FalconLinear(4, 4))
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    scaled = _Scaled(128, 64, bias=False)
    scaled.weight = mlp.down_proj.weight
    mlp.down_proj = scaled
    assert has_own_forward(scaled)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    report = quantize_model(model, [{"input_ids": ids}], QuantizationConfig(), progress=False)
    name = "model.layers.0.mlp.down_proj"
    assert "_Scaled, a linear layer with its own forward" in report.skipped[name]
    assert name not in quantized_linears(model) and model.get_submodule(name) is scaled
    assert "model.layers.1.mlp.down_proj" in quantized_linears(model)
