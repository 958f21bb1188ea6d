"""What quantization works on: the linear layers a recipe targets (kbbq_pl.quant.modules) and
the blocks the block-sequential runner steps through (kbbq_pl.quant.sequential)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl.io.data import token_blocks
from kbbq_pl.io.models import load_model
from kbbq_pl.quant.modules import cell_kind, find_linears, linear_weight
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
    for step in runner:
        assert all(name.startswith(step.name) for name in step.linears())
        step.advance(step.run())
    hidden = torch.cat([c.hidden for c in runner.inputs])
    assert torch.allclose(final(hidden), expected, atol=1e-5)


def test_sequential_runner_rejects_empty_calibration():
    with pytest.raises(ValueError, match="calibration set is empty"):
        SequentialRunner(tiny_model("llama"), [])
