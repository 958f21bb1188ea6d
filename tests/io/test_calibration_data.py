"""Calibration data (kbbq_pl.io.data): token blocks from random text, plain text and JSON lines,
their errors, and the calibration data module's batches."""

from __future__ import annotations

import json

import pytest
import torch

from kbbq_pl.io.data import CalibrationDataModule, token_blocks
from kbbq_pl.io.models import load_model


@pytest.fixture(scope="module")
def minilm():
    return load_model("minilm")


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
