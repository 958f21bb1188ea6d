"""Quantizing a model streamed from disk block by block: the same checkpoint as in memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_model

from kbbq_pl.cli.commands import main
from kbbq_pl.io.checkpoint import CheckpointError, read_tensors, save_quantized
from kbbq_pl.io.models import from_pretrained, load_model
from kbbq_pl.io.streaming import SafetensorsSource, model_skeleton, quantize_checkpoint
from kbbq_pl.quant import QuantizationConfig, quantize_model

RECIPES = {
    "rtn-kbbq": {"transform": {"name": "kbbq", "lam": 0.75}},
    "rtn-auto": {"transform": {"name": "kbbq", "lam": "auto"}},
    "rtn-fold": {"transform": {"name": "kbbq", "lam": 0.75, "fold_o_proj": True}},
    "gptq-kbbq-auto": {"weights": {"quantizer": "gptq"},
                       "transform": {"name": "kbbq", "lam": "auto"}},
    "gptq-mxfp4-quantized": {"format": {"name": "mxfp4"}, "weights": {"quantizer": "gptq",
                                                                      "propagate": "quantized"}},
}


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory) -> Path:
    """A three-block Llama with tied embeddings saved as bf16 safetensors in three shards."""
    folder = tmp_path_factory.mktemp("src") / "llama"
    model = tiny_model("llama", num_hidden_layers=3, tie_word_embeddings=True)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def _batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 256, (2, 32), generator=generator)}
            for _ in range(4)]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_streamed_checkpoint_is_bit_for_bit_the_in_memory_one(sharded_llama, tmp_path, recipe):
    config = QuantizationConfig.from_dict(RECIPES[recipe])
    before = _files(sharded_llama)
    model, _ = load_model(sharded_llama)
    in_memory = quantize_model(model, _batches(), config, progress=False)
    save_quantized(model, tmp_path / "memory")
    report = quantize_checkpoint(sharded_llama, tmp_path / "streamed", config, _batches(),
                                 progress=False)
    assert report.to_dict().get("autobrake") == in_memory.to_dict().get("autobrake")
    assert report.config == in_memory.config
    assert _files(sharded_llama) == before  # the source is only read
    memory, streamed = read_tensors(tmp_path / "memory"), read_tensors(tmp_path / "streamed")
    assert memory.keys() == streamed.keys()
    assert all(torch.equal(memory[k], streamed[k]) for k in memory)
    metadata = {name: json.loads((tmp_path / name / "quantization_config.json").read_text())
                for name in ("memory", "streamed")}
    assert metadata["memory"]["layers"] == metadata["streamed"]["layers"]
    assert metadata["streamed"]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    # one shard per block and one for the rest, with the index HuggingFace reads
    shards = sorted(p.name for p in (tmp_path / "streamed").glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert set(metadata["streamed"]["files"]) == set(shards)
    assert len(report.layers) == 21
    ids = torch.randint(0, 256, (1, 16))
    reloaded = [from_pretrained(tmp_path / name) for name in ("memory", "streamed")]
    assert torch.equal(reloaded[0](input_ids=ids).logits, reloaded[1](input_ids=ids).logits)


# each stores its experts differently: Qwen3-MoE each expert's gate_proj / up_proj / down_proj,
# Mixtral each expert's w1 / w3 / w2 under block_sparse_moe (its router too), gpt-oss fused and
# transposed with biases, Llama 4 fused and transposed under feed_forward (its router a linear
# layer, which stays in full precision)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "llama4_text"])
def test_a_mixture_of_experts_model_streams_bit_for_bit_as_in_memory(tmp_path, arch):
    source = tmp_path / arch
    tiny_model(arch).to(torch.bfloat16).save_pretrained(source, max_shard_size="100KB")
    before = _files(source)
    config = QuantizationConfig.from_dict(RECIPES["rtn-kbbq"])
    model, _ = load_model(source)
    quantize_model(model, _batches(), config, progress=False)
    save_quantized(model, tmp_path / "memory")
    report = quantize_checkpoint(source, tmp_path / "streamed", config, _batches(),
                                 progress=False)
    assert _files(source) == before
    memory, streamed = read_tensors(tmp_path / "memory"), read_tensors(tmp_path / "streamed")
    assert memory.keys() == streamed.keys()
    assert all(torch.equal(memory[k], streamed[k]) for k in memory)
    experts = model.config.num_local_experts
    moe = "feed_forward" if arch == "llama4_text" else "mlp"
    assert {r.name for r in report.layers} >= {f"model.layers.1.{moe}.experts.{e}.down_proj"
                                               for e in range(experts)}
    ids = torch.randint(0, 256, (1, 16))
    reloaded = [from_pretrained(tmp_path / name) for name in ("memory", "streamed")]
    assert torch.equal(reloaded[0](input_ids=ids).logits, reloaded[1](input_ids=ids).logits)


def test_a_layer_before_the_blocks_streams_as_in_memory(tmp_path):
    """Gemma 4's per_layer_model_projection, outside the blocks, is quantized in a step before
    them, from memory and from disk alike (GPTQ: the blocks see it quantized)."""
    from tiny_models import small_model

    source = tmp_path / "gemma4"
    small_model("gemma4_text").to(torch.bfloat16).save_pretrained(source,
                                                                  max_shard_size="200KB")
    config = QuantizationConfig.from_dict(RECIPES["gptq-mxfp4-quantized"])
    model, _ = load_model(source)
    memory_report = quantize_model(model, _batches(), config, progress=False)
    save_quantized(model, tmp_path / "memory")
    report = quantize_checkpoint(source, tmp_path / "streamed", config, _batches(),
                                 progress=False)
    for r in (memory_report, report):
        assert r.model["prologue"] == ["model.per_layer_model_projection"]
        assert "whole_model" not in r.model
    memory, streamed = read_tensors(tmp_path / "memory"), read_tensors(tmp_path / "streamed")
    assert memory.keys() == streamed.keys()
    assert "model.per_layer_model_projection.weight_scale" in streamed
    assert all(torch.equal(memory[k], streamed[k]) for k in memory)


def test_a_missing_expert_is_named_before_its_block_is_quantized(tmp_path):
    from safetensors.torch import load_file, save_file

    source = tmp_path / "qwen3_moe"
    tiny_model("qwen3_moe").to(torch.bfloat16).save_pretrained(source)
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    message = (r"model\.layers\.1\.mlp\.experts\.gate_up_proj cannot be made of its stored "
               r"tensors \(8 mlp\.experts\.\*\.gate_proj\.weight, 7 mlp\.experts\.\*\.up_proj")
    with pytest.raises(CheckpointError, match=message):
        quantize_checkpoint(source, tmp_path / "out", QuantizationConfig(), _batches(),
                            progress=False)
    assert not (tmp_path / "out").exists()


def test_the_skeleton_holds_no_block_weights(sharded_llama):
    model, source = model_skeleton(sharded_llama)
    blocks = [p for n, p in model.named_parameters() if n.startswith("model.layers.")]
    assert blocks and all(p.is_meta for p in blocks)
    assert not model.model.embed_tokens.weight.is_meta
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert source.total_bytes == sum(p.stat().st_size
                                     for p in sharded_llama.glob("*.safetensors"))


def test_a_block_with_nan_stops_the_run_and_leaves_no_output(sharded_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for file in sharded_llama.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    name = "model.layers.2.mlp.down_proj.weight"
    shard = broken / index["weight_map"][name]
    tensors = load_file(shard)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    message = r"model\.layers\.2\.mlp\.down_proj: its weight holds 1 NaN"
    with pytest.raises(ValueError, match=message):
        quantize_checkpoint(broken, tmp_path / "out", QuantizationConfig(), _batches(),
                            progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]  # no folder, no staging


def test_a_tensor_missing_from_the_checkpoint_is_named(sharded_llama, tmp_path):
    source = SafetensorsSource(sharded_llama)
    with pytest.raises(CheckpointError, match="no tensor model.layers.9.mlp.up_proj.weight"):
        source.read(["model.layers.9.mlp.up_proj.weight"])
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        SafetensorsSource(tmp_path)


def test_an_index_that_maps_a_tensor_to_the_wrong_shard_is_refused_before_any_work(
        sharded_llama, tmp_path):
    import shutil

    folder = tmp_path / "edited"
    shutil.copytree(sharded_llama, folder)
    index = folder / "model.safetensors.index.json"
    document = json.loads(index.read_text())
    name = "model.layers.1.mlp.down_proj.weight"
    shards = sorted(set(document["weight_map"].values()))
    document["weight_map"][name] = next(s for s in shards if s != document["weight_map"][name])
    index.write_text(json.dumps(document))
    with pytest.raises(CheckpointError, match=rf"index\.json maps 1 tensors to shards that do "
                                              rf"not hold them \(first: {name} to "):
        SafetensorsSource(folder)


def test_a_quantized_source_is_refused_by_streaming_and_never_streamed_by_default(tmp_path):
    """A checkpoint quantized by another method (block FP8 as DeepSeek-V3 ships: float8 codes
    and ``weight_scale_inv``) is not read as full-precision weights: streaming refuses it
    (in memory, transformers dequantizes it), and a quantized tensor where the config names no
    method is refused by name."""
    from safetensors.torch import load_file, save_file

    from kbbq_pl.io.streaming import streams_by_default

    folder = tmp_path / "fp8"
    tiny_model("llama", num_hidden_layers=2).save_pretrained(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name.replace(".weight", ".weight_scale_inv")] = torch.ones(1, 1)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    plain = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(
        {**plain, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    with pytest.raises(CheckpointError, match=r"is quantized \(quantization_config quant_method "
                                              r"'fp8'\): streaming reads full-precision weights"):
        model_skeleton(folder)
    assert streams_by_default(folder) == (False, "")
    (folder / "config.json").write_text(json.dumps(plain))
    with pytest.raises(CheckpointError, match=rf"{name}: stored as torch\.float8_e4m3fn "
                                              r"\[128, 64\] for a torch\.float32 parameter"):
        quantize_checkpoint(folder, tmp_path / "out", QuantizationConfig(), _batches(),
                            progress=False)
    assert not (tmp_path / "out").exists()


def test_a_blocks_full_precision_layers_are_freed_before_the_next_block_loads(
        sharded_llama, tmp_path, monkeypatch):
    """The pipeline keeps no reference to a replaced layer: when block k + 1 is read, no
    full-precision linear weight of block k is alive."""
    import gc
    import weakref

    from kbbq_pl.io import streaming

    alive: list[int] = []
    weights: list[weakref.ref] = []
    load = streaming.StreamedBlocks.load

    def counting_load(self, step):
        gc.collect()
        alive.append(sum(ref() is not None for ref in weights))
        load(self, step)
        weights.extend(weakref.ref(m.weight) for m in step.module.modules()
                       if isinstance(m, torch.nn.Linear))

    monkeypatch.setattr(streaming.StreamedBlocks, "load", counting_load)
    quantize_checkpoint(sharded_llama, tmp_path / "out", QuantizationConfig(), _batches(),
                        progress=False)
    assert alive == [0, 0, 0] and len(weights) == 3 * 7


@pytest.fixture(scope="module")
def bf16_gemma4(tmp_path_factory) -> Path:
    """A Gemma 4 saved in bf16 whose per-layer embedding scale, sqrt(24), is not a bf16 value:
    held in bf16 (as `kbbq-pl quantize` holds a bf16 model) its buffer rounds it."""
    from tiny_models import small_model

    folder = tmp_path_factory.mktemp("src") / "gemma4"
    model = small_model("gemma4_text", hidden_size_per_layer_input=24)
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size="200KB")
    return folder


@pytest.mark.parametrize("source", ["sharded_llama", "bf16_gemma4"])
def test_quantize_stream_from_the_command_line(source, request, tmp_path, capsys):
    """--stream holds and computes the model as the in-memory run does (the stored dtype,
    float32 arithmetic): the same checkpoint bit for bit."""
    common = ["--config", "rtn_kbbq_nvfp4_lam0.75", "--model",
              str(request.getfixturevalue(source)), "--data.n_tokens", "256",
              "--data.seq_len", "32"]
    assert main(["quantize", *common, "--offload", "--output_dir", str(tmp_path / "a")]) == 0
    assert main(["quantize", *common, "--stream", "--output_dir", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "fidelity | not measured when streaming" in out
    memory, streamed = read_tensors(tmp_path / "a"), read_tensors(tmp_path / "b")
    assert memory.keys() == streamed.keys()
    assert all(torch.equal(memory[k], streamed[k]) for k in memory)
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert report["model"]["calibration_tokens"] == 256


def test_streaming_refuses_a_model_run_as_one_block(sharded_llama, tmp_path):
    layers = {"targets": [r"lm_head", r"_proj$"], "ignore": []}
    config = QuantizationConfig.from_dict({"layers": layers})
    with pytest.raises(ValueError, match="cannot be read block by block"):
        quantize_checkpoint(sharded_llama, tmp_path / "out", config, _batches(), progress=False)
    assert not (tmp_path / "out").exists()


KILLED_RUN = """
import os, signal, sys, torch
from kbbq_pl.io import streaming
from kbbq_pl.quant import QuantizationConfig

def unload(self, step, done):  # the process dies after the first block is written
    streaming.ShardWriter.add(self.shards, streaming.checkpoint_contents(step.module, step.name))
    os.kill(os.getpid(), signal.SIGKILL)

streaming.StreamedBlocks.unload = unload
batches = [{"input_ids": torch.randint(0, 256, (2, 32))}]
streaming.quantize_checkpoint(sys.argv[1], sys.argv[2], QuantizationConfig(), batches,
                              progress=False)
"""


def test_a_killed_run_leaves_no_output_and_the_next_run_clears_its_staging(sharded_llama,
                                                                           tmp_path):
    import subprocess
    import sys

    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", KILLED_RUN, str(sharded_llama), str(out)],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == -9, result.stderr[-2000:]
    assert not out.exists()
    staging = [p for p in tmp_path.iterdir() if p.name.startswith(".out.staging-")]
    assert len(staging) == 1 and any(staging[0].glob("model-00001.part"))
    quantize_checkpoint(sharded_llama, out, QuantizationConfig(), _batches(), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    from_pretrained(out)


FULL_DISK = """
import resource, signal, sys
from kbbq_pl.cli.commands import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), like ENOSPC
resource.setrlimit(resource.RLIMIT_FSIZE, (16 * 1024, 16 * 1024))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "in-memory"])
def test_a_full_disk_is_one_line_and_leaves_nothing(sharded_llama, tmp_path, stream):
    """A file that cannot be written (the process may write at most 16 KiB a file: the first
    shard is larger) stops the command with one line naming the file, and no folder is left."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    args = ["quantize", "--model", str(sharded_llama), "--data.n_tokens", "256",
            "--data.seq_len", "32", "--output_dir", str(out), *(["--stream"] if stream else [])]
    result = subprocess.run([sys.executable, "-c", FULL_DISK, *args], capture_output=True,
                            text=True, timeout=300, check=False,
                            env={**os.environ, "KBBQ_PL_COMPILE": "0", "HF_HUB_OFFLINE": "1"})
    lines = [line for line in result.stderr.splitlines() if line.startswith("kbbq-pl")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and "kbbq-pl quantize: error:" in lines[0], result.stderr[-3000:]
    assert f"{out} was not written, nothing was left: File too large (model-" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_streamed_folder_declares_its_dtype_and_keeps_the_generation_config(tmp_path):
    """Held as stored and computed in float32 (``kbbq-pl quantize --stream``'s default), the
    streamed checkpoint's full-precision tensors are in the source's bf16 and its config.json
    says so, as the in-memory one does; the source's generation config is kept."""
    source = tmp_path / "src"
    model = tiny_model("llama", num_hidden_layers=2)
    model.generation_config.update(eos_token_id=[2, 7], temperature=0.3, do_sample=True)
    model.to(torch.bfloat16).save_pretrained(source, max_shard_size="100KB")
    quantize_checkpoint(source, tmp_path / "streamed", QuantizationConfig(), _batches(),
                        progress=False, dtype=None, compute_dtype=torch.float32)
    folder = tmp_path / "streamed"
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert read_tensors(folder)["model.embed_tokens.weight"].dtype == torch.bfloat16
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["temperature"]) == ([2, 7], 0.3)
