"""Module targeting, calibration token blocks and the block-sequential runner."""

from __future__ import annotations

import json

import pytest
import torch

from kbbq_pl.io.data import CalibrationDataModule, token_blocks
from kbbq_pl.io.models import load_model, tiny_model
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


def test_token_blocks_random_text_jsonl_and_errors(minilm, tmp_path):
    _, tokenizer = minilm
    a = token_blocks("random", tokenizer, n_tokens=1000, seq_len=128, seed=3)
    b = token_blocks("random", tokenizer, n_tokens=1000, seq_len=128, seed=3)
    assert a.shape == (8, 128) and torch.equal(a, b)
    assert not torch.equal(a, token_blocks("random", tokenizer, n_tokens=1000, seq_len=128, seed=4))
    assert (a[:, 0] == tokenizer.cls_token_id).all() and (a[:, -1] == tokenizer.sep_token_id).all()
    body = a[:, 1:-1]
    assert not torch.isin(body, torch.tensor(tokenizer.all_special_ids)).any()
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog . " * 200)
    blocks = token_blocks(text, tokenizer, n_tokens=256, seq_len=64, seed=0)
    assert blocks.shape == (4, 64) and tokenizer.decode(blocks[0, 1:4]).startswith(
        ("the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "."))
    lines = tmp_path / "corpus.jsonl"
    lines.write_text("\n".join(json.dumps({"body": f"sentence number {i} ."}) for i in range(300)))
    blocks = token_blocks(lines, tokenizer, n_tokens=128, seq_len=64, text_key="body")
    assert blocks.shape == (2, 64)
    with pytest.raises(ValueError, match="no 'text' field"):
        token_blocks(lines, tokenizer, n_tokens=128, seq_len=64)
    with pytest.raises(ValueError, match="fewer than the"):
        token_blocks(text, tokenizer, n_tokens=10**6, seq_len=64)
    with pytest.raises(FileNotFoundError, match="not a file"):
        token_blocks(tmp_path / "missing.txt", tokenizer, n_tokens=64, seq_len=64)
    assert token_blocks("random", None, n_tokens=64, seq_len=32, vocab_size=50).max() < 50


def test_datamodule_batches(minilm):
    _, tokenizer = minilm
    dm = CalibrationDataModule("random", tokenizer, n_tokens=512, seq_len=64, batch_size=3)
    batches = list(dm.calibration_dataloader())
    assert [b["input_ids"].shape[0] for b in batches] == [3, 3, 2]
    assert all((b["attention_mask"] == 1).all() for b in batches)


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
