"""``kbbq-pl quantize`` holds a model in the dtype it is stored in and computes each block in
float32 (issue 48): the checkpoint's values and the report's figures are those of the model
upcast to float32 as a whole (``--no-stream --dtype float32``, the default before), bit for bit,
its full-precision tensors written in the source's dtype; a model too large for the memory
available streams by itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl.cli.commands import main
from kbbq_pl.io import streaming
from kbbq_pl.io.checkpoint import read_tensors
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import QuantizationConfig, quantize_model
from kbbq_pl.quant.sequential import computed_in, held_in

RECIPES = ["rtn_kbbq_nvfp4_lam0.75", "gptq_kbbq_mxfp4", "rtn_kbbq_nvfp4_auto"]
"""RTN and GPTQ, a fixed lambda and the auto-brake (whose held-out scores are figures too)."""
VARYING = {"peak_rss_mb", "model"}
"""Report fields that are not figures of the quantized model (memory, the source's path)."""


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory) -> Path:
    """A three-block Llama saved as bf16 safetensors in shards, as HuggingFace saves one."""
    folder = tmp_path_factory.mktemp("src") / "llama"
    model = tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=True)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")
    return folder


def _quantize(source: Path, out: Path, recipe: str, *flags: str) -> dict:
    code = main(["quantize", "--config", recipe, "--model", str(source), "--data.n_tokens", "256",
                 "--data.seq_len", "32", "--output_dir", str(out), *flags])
    assert code == 0
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_default_writes_the_float32_runs_checkpoint_and_figures(bf16_llama, tmp_path,
                                                                    recipe):
    """The same values as the float32 run's checkpoint: the quantized layers' tensors bit for
    bit, the rest (embeddings, norms) in the source's bf16, which holds them exactly; its
    ``config.json`` says bfloat16, as the source's does."""
    lean = _quantize(bf16_llama, tmp_path / "lean", recipe)
    upcast = _quantize(bf16_llama, tmp_path / "upcast", recipe, "--no-stream", "--dtype",
                       "float32")
    tensors = [read_tensors(tmp_path / name) for name in ("lean", "upcast")]
    assert tensors[0].keys() == tensors[1].keys()
    layers = json.loads((tmp_path / "lean" / "quantization_config.json").read_text())["layers"]
    for key, value in tensors[0].items():
        if key.rpartition(".")[0] in layers:
            assert value.dtype == tensors[1][key].dtype and torch.equal(value, tensors[1][key])
        else:
            assert value.dtype == torch.bfloat16 and tensors[1][key].dtype == torch.float32
            assert torch.equal(value.float(), tensors[1][key]), key
    metadata = [json.loads((tmp_path / name / "quantization_config.json").read_text())
                for name in ("lean", "upcast")]
    assert metadata[0].pop("files") != metadata[1].pop("files")  # sizes and SHA-256
    assert metadata[0] == metadata[1]
    configs = [json.loads((tmp_path / name / "config.json").read_text())
               for name in ("lean", "upcast")]
    assert (configs[0].pop("dtype"), configs[1].pop("dtype")) == ("bfloat16", "float32")
    assert configs[0] == configs[1]
    assert lean["layers"] == upcast["layers"]  # kappas, SNRs, ceilings, lambdas
    assert lean.get("autobrake") == upcast.get("autobrake")
    figures = [{k: v for k, v in r["model"].items() if k not in VARYING} for r in (lean, upcast)]
    assert figures[0] == figures[1] and "fidelity_mean_cosine" in figures[0]


def test_the_model_stays_in_its_dtype_and_computes_in_float32(bf16_llama):
    batches = [{"input_ids": torch.randint(0, 256, (2, 32),
                                           generator=torch.Generator().manual_seed(i))}
               for i in range(4)]
    config = QuantizationConfig.from_dict({"transform": {"name": "kbbq", "lam": 0.75}})
    held, _ = load_model(bf16_llama, dtype=None)
    assert held.model.embed_tokens.weight.dtype == torch.bfloat16
    upcast, _ = load_model(bf16_llama, dtype=torch.float32)
    ids = batches[0]["input_ids"]
    with torch.no_grad(), computed_in(held, torch.float32):
        assert torch.equal(held(input_ids=ids).logits, upcast(input_ids=ids).logits)
    reports = [quantize_model(held, batches, config, progress=False,
                              compute_dtype=torch.float32),
               quantize_model(upcast, batches, config, progress=False)]
    assert reports[0].to_dict()["layers"] == reports[1].to_dict()["layers"]
    # what is not quantized is held as it was stored; the quantized layers are the same
    assert held.model.embed_tokens.weight.dtype == torch.bfloat16
    assert held.model.norm.weight.dtype == torch.bfloat16
    q = [dict(m.named_buffers()) for m in (held.model.layers[1].mlp.down_proj,
                                           upcast.model.layers[1].mlp.down_proj)]
    assert q[0].keys() == q[1].keys() and all(torch.equal(q[0][k], q[1][k]) for k in q[0])


def test_held_in_gives_each_tensor_its_dtype_back_after_an_error():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="half way"), held_in(module, torch.float32):
        assert module[0].weight.dtype == torch.float32
        raise RuntimeError("half way")
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}


def test_a_model_too_large_for_the_memory_streams_by_itself(bf16_llama, tmp_path, monkeypatch,
                                                             capsys):
    weights = streaming.SafetensorsSource(bf16_llama).total_bytes
    monkeypatch.setattr(streaming, "available_memory", lambda: 2 * weights - 1)
    assert streaming.streams_by_default(bf16_llama)[0]
    assert not streaming.streams_by_default(bf16_llama.parent)[0]  # no safetensors: in memory
    _quantize(bf16_llama, tmp_path / "auto", "rtn_kbbq_nvfp4_lam0.75")
    out = capsys.readouterr().out
    assert out.count("exceed half of the memory available") == 1
    # a streamed run says what it leaves to kbbq-pl eval, and the command
    assert f"kbbq-pl eval --model {tmp_path / 'auto'} --tasks ppl,kl" in out
    assert len(list((tmp_path / "auto").glob("model-*.safetensors"))) == 4  # a shard a block
    _quantize(bf16_llama, tmp_path / "flag", "rtn_kbbq_nvfp4_lam0.75", "--no-stream")
    out = capsys.readouterr().out
    assert "memory available" not in out and "fidelity_mean_cosine" in (
        tmp_path / "flag" / "report.json").read_text()
    tensors = [read_tensors(tmp_path / name) for name in ("auto", "flag")]
    assert all(torch.equal(tensors[0][k], tensors[1][k]) for k in tensors[1])

    monkeypatch.setattr(streaming, "available_memory", lambda: 2 * weights)
    assert not streaming.streams_by_default(bf16_llama)[0]
    assert streaming.streams_by_default(bf16_llama, processes=2)[0]


def test_the_memory_available_is_read_on_linux():
    if not Path("/proc/meminfo").is_file():
        pytest.skip("not Linux: /proc/meminfo is absent")

    def mem_available() -> int:
        meminfo = dict(line.split(":", 1)
                       for line in Path("/proc/meminfo").read_text().splitlines())
        return int(meminfo["MemAvailable"].split()[0]) * 1024

    # other processes allocate and free meanwhile: bound it by the reads on either side
    before = mem_available()
    available = streaming.available_memory()
    assert 0 < available <= max(before, mem_available())
