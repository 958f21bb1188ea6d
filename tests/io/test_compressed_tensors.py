"""compressed-tensors export and import, checked with the real readers: compressed-tensors'
own compressors and configuration classes, and transformers' AutoModelForCausalLM."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("compressed_tensors", reason="compressed-tensors is not installed "
                    "(pip install 'kbbq-pl[test]', Python >= 3.11)")

from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig as CTConfig  # noqa: E402
from compressed_tensors.quantization import preset_name_to_scheme  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tiny_models import tiny_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

from kbbq_pl.cli.commands import main  # noqa: E402
from kbbq_pl.formats import QuantizedTensor, get_format, quantize  # noqa: E402
from kbbq_pl.io.checkpoint import CheckpointError, save_quantized  # noqa: E402
from kbbq_pl.io.compressed_tensors import (  # noqa: E402
    ExportError,
    bf16_decodes_agree,
    ct_global_scale,
    dense_model,
    export_compressed_tensors,
    hf_drops_expert_global_scale,
    kbbq_global_scale,
    save_compressed_tensors,
)
from kbbq_pl.io.data import token_blocks  # noqa: E402
from kbbq_pl.io.fileio import OutputPathError  # noqa: E402
from kbbq_pl.io.models import from_pretrained, load_model  # noqa: E402
from kbbq_pl.quant import (  # noqa: E402
    FormatConfig,
    LayersConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.quant.layers import QuantizedLinear, quantized_linears  # noqa: E402
from kbbq_pl.quant.modules import fused_groups  # noqa: E402
from kbbq_pl.transforms.fit import hadamard  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

MR_GPTQ = QuantizationConfig(format=FormatConfig("nvfp4"), transform=TransformConfig("hadamard"),
                             weights=WeightsConfig("gptq", scale_search="mse"))
"""The ``mr_gptq_nvfp4`` recipe."""


def recipe(fmt: str, transform: str, lam: float = 0.75, *, gptq: bool = False,
           act_scale: str = "static", fold_o_proj: bool = False) -> QuantizationConfig:
    return QuantizationConfig(format=FormatConfig(fmt, act_scale=act_scale),
                              transform=TransformConfig(transform, lam=lam,
                                                        fold_o_proj=fold_o_proj),
                              weights=WeightsConfig("gptq" if gptq else "rtn"))

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))


def _batches(vocab: int = 256, tokenizer=None, source="random", n_tokens=256):
    ids = token_blocks(source, tokenizer, n_tokens=n_tokens, seq_len=32, vocab_size=vocab)
    return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(8)]


_CACHE: dict[tuple, torch.nn.Module] = {}


def quantized_tiny(config: QuantizationConfig) -> torch.nn.Module:
    """A tiny random Llama (4 heads, 2 KV heads) quantized with ``config``; a fresh copy."""
    key = json.dumps(config.to_dict(), sort_keys=True)
    if key not in _CACHE:
        model = tiny_model("llama")
        quantize_model(model, _batches(), config, progress=False)
        _CACHE[key] = model
    return copy.deepcopy(_CACHE[key])


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def ct_config(folder: Path) -> tuple[dict, CTConfig]:
    block = json.loads((folder / "config.json").read_text())["quantization_config"]
    return block, CTConfig.model_validate(block)


def ct_decompressed(folder: Path, name: str) -> torch.Tensor:
    """Layer ``name``'s weight as compressed-tensors' own compressor decompresses it."""
    _, config = ct_config(folder)
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    tensors = load_file(str(folder / "model.safetensors"))
    state = {k.removeprefix(name + "."): v for k, v in tensors.items()
             if k.startswith(name + ".") and k.count(".") == name.count(".") + 1}
    return compressor.decompress(state, scheme)["weight"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.view(torch.int16 if b.element_size() == 2 else torch.int32))


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def weight_only_reference(model, fp4_layers) -> torch.nn.Module:
    """kbbq-pl's weight-only dequantized model as compressed-tensors decompresses it: the
    FP4 layers' values rounded to bfloat16 (its decompression dtype), the rest exact."""
    reference = dense_model(copy.deepcopy(model))
    for name in fp4_layers:
        weight = reference.get_submodule(name).weight
        weight.data = weight.data.bfloat16().to(weight.dtype)
    return reference


# ------------------------------------------------------------------ per-tensor scales

def test_global_scale_reciprocal_decodes_every_code_and_scale_like_kbbq():
    """All 16 codes under all 126 positive E4M3 block scales, through compressed-tensors'
    NVFP4 decompression, equal kbbq-pl's bfloat16 dequantization bit for bit."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = torch.arange(16, dtype=torch.uint8).repeat(126)  # one block of 16 per scale
    packed = (codes[0::2] | (codes[1::2] << 4)).reshape(1, -1)
    generator = torch.Generator().manual_seed(0)
    amax = torch.exp(torch.randn(64, generator=generator) * 4)
    fp32_exact = 0
    for value in [*amax, torch.tensor(2688.0), torch.tensor(1e-30), torch.tensor(3e30)]:
        pts = (value / 2688.0).float()
        gs = ct_global_scale(pts)
        assert bf16_decodes_agree(pts, gs)
        ours = QuantizedTensor(packed, scales.reshape(1, -1), get_format("nvfp4"),
                               torch.float32, 126 * 16, pts).dequantize(torch.bfloat16)
        theirs = NVFP4PackedCompressor.decompress(
            {"weight_packed": packed, "weight_scale": scales.reshape(1, -1),
             "weight_global_scale": gs}, scheme)["weight"]
        assert same_bits(theirs, ours)
        assert torch.equal(kbbq_global_scale(gs), pts) or bf16_decodes_agree(
            kbbq_global_scale(gs), gs)
        fp32_exact += bool(torch.equal(scales.float() * pts, scales.float() / gs))
    # why bfloat16: the float32 products agree only for some scales (here fewer than half)
    assert fp32_exact < 40


# ------------------------------------------------------------------ export: identity, GPTQ

def test_a_compiled_model_saves_under_its_own_layer_names(tmp_path):
    """``torch.compile``'s wrapper prefixes every name with ``_orig_mod.``: both writers save
    the model inside it, whose folders load back (a folder naming ``_orig_mod.model.layers...``
    was written, and refused when loaded)."""
    model = quantized_tiny(recipe("nvfp4", "identity"))
    compiled = torch.compile(model)  # compiled lazily: nothing runs until it is called
    assert next(iter(quantized_linears(compiled))).startswith("_orig_mod.")
    for out in (save_quantized(compiled, tmp_path / "kbbq"),
                save_compressed_tensors(compiled, tmp_path / "ct", strict=True)):
        assert not [key for key in load_file(str(out / "model.safetensors"))
                    if key.startswith("_orig_mod")]
        assert torch.equal(logits(from_pretrained(out)), logits(model)), out.name


@pytest.mark.parametrize("config", [
    recipe("nvfp4", "identity"), recipe("mxfp4", "identity", gptq=True),
], ids=["I-nvfp4", "GPTQ-mxfp4"])
def test_plain_export_reads_back_in_compressed_tensors_and_transformers(config, tmp_path,
                                                                       caplog):
    fmt = config.format.name
    model = quantized_tiny(config)
    with caplog.at_level(logging.WARNING, logger="kbbq_pl.io.compressed_tensors"):
        out = save_compressed_tensors(model, tmp_path / "ct", strict=True)
    assert not caplog.records  # every reader computes it: no warning, strict exports it
    block, config = ct_config(out)
    preset = "NVFP4" if fmt == "nvfp4" else "MXFP4"
    expected = preset_name_to_scheme(preset, ["Linear"])
    scheme = config.config_groups["group_0"]
    assert scheme.model_dump(exclude={"format"}) == expected.model_dump(exclude={"format"})
    assert scheme.targets == ["Linear"] and config.ignore == ["lm_head"]
    assert block["quant_method"] == "compressed-tensors" and block["version"]
    assert config.format == scheme.format == f"{fmt}-pack-quantized"
    if fmt == "nvfp4":
        assert scheme.input_activations.dynamic == "local"
    tensors = load_file(str(out / "model.safetensors"))
    layers = quantized_linears(model)
    for name, layer in layers.items():
        ours = layer.weight.dequantize(torch.bfloat16)
        assert same_bits(ct_decompressed(out, name), ours), name
        assert (f"{name}.input_global_scale" in tensors) == (fmt == "nvfp4")
    for group in fused_groups(layers) if fmt == "nvfp4" else []:  # vLLM's qkv_proj, gate_up_proj
        for suffix in ("weight_global_scale", "input_global_scale"):
            assert len({float(tensors[f"{name}.{suffix}"]) for name in group}) == 1, group
    # transformers, through compressed-tensors: the weight-only dequantized model exactly
    loaded = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))
    assert torch.equal(logits(loaded), logits(weight_only_reference(model, layers)))
    # and kbbq-pl reads it back bit-exactly (quantized layers, W4A4)
    assert torch.equal(logits(from_pretrained(out)), logits(model))


def test_fused_layers_with_different_per_tensor_scales_warn_and_strict_refuses(tmp_path, caplog):
    """vLLM decodes q/k/v and gate/up as one layer with one per-tensor scale: a checkpoint
    whose fused layers' scales differ (quantized or fine-tuned before kbbq-pl shared them)
    exports with a warning naming them, and --strict refuses it."""
    model = quantized_tiny(recipe("nvfp4", "identity"))
    k_proj = model.get_submodule("model.layers.0.self_attn.k_proj")
    own = quantize(k_proj.weight.dequantize(torch.float32) * 3, "nvfp4")  # its own, larger scale
    k_proj.weight = torch.nn.Parameter(k_proj.weight.replace(
        qdata=own.qdata, scale=own.scale, global_scale=own.global_scale), requires_grad=False)
    group = r"3 of 14 layers \(model\.layers\.0\.self_attn\.q_proj, [^)]*v_proj\)"
    with pytest.raises(ExportError, match=rf"--strict: .*{group}: NVFP4 layers that vLLM runs "
                                          r"under one per-tensor scale .* requantize"):
        save_compressed_tensors(model, tmp_path / "strict", strict=True)
    with caplog.at_level(logging.WARNING, logger="kbbq_pl.io.compressed_tensors"):
        out = save_compressed_tensors(model, tmp_path / "ct")
    (warning,) = export_warnings(caplog)
    assert re.match(rf"compressed-tensors export: {group}: ", warning), warning
    assert torch.equal(logits(from_pretrained(out)), logits(model))  # kbbq-pl reads it exactly


def test_experts_with_different_input_scales_warn(tmp_path, caplog, monkeypatch):
    """vLLM rounds one projection's inputs with one scale for all of an MoE layer's experts: a
    checkpoint whose experts' input scales differ exports with a warning (shown once the
    installed transformers reads NVFP4 experts' global scales; here patched so)."""
    monkeypatch.setattr("kbbq_pl.io.compressed_tensors.hf_drops_expert_global_scale",
                        lambda: False)
    model = tiny_model("qwen3_moe")
    quantize_model(model, _batches(), recipe("nvfp4", "identity"), progress=False)
    with caplog.at_level(logging.WARNING, logger="kbbq_pl.io.compressed_tensors"):
        save_compressed_tensors(model, tmp_path / "shared", strict=True)
    assert not export_warnings(caplog)
    down = model.get_submodule("model.layers.0.mlp.experts.3.down_proj")
    down.act_global_scale = down.act_global_scale * 2
    with caplog.at_level(logging.WARNING, logger="kbbq_pl.io.compressed_tensors"):
        save_compressed_tensors(model, tmp_path / "ct")
    (warning,) = export_warnings(caplog)
    assert re.match(r"compressed-tensors export: 8 of 40 layers \(model\.layers\.0\.mlp\.experts"
                    r"\.0\.down_proj, .*one projection of a mixture-of-experts", warning), warning


def test_vllm_check_script_writes_kbbq_pls_output_of_every_fp4_layer(tmp_path, capsys):
    """scripts/vllm_check.py's half that runs in kbbq-pl's environment (the other needs vLLM,
    which CI does not install, and says so)."""
    path = Path(__file__).parents[2] / "scripts" / "vllm_check.py"
    spec = importlib.util.spec_from_file_location("vllm_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model = quantized_tiny(recipe("nvfp4", "identity"))
    out = save_compressed_tensors(model, tmp_path / "ct", strict=True)
    assert script.main(["reference", str(out), "--out", str(tmp_path / "ref.pt")]) == 0
    layers = torch.load(tmp_path / "ref.pt")["layers"]
    assert sorted(layers) == sorted(quantized_linears(model))
    for name, entry in layers.items():
        layer = model.get_submodule(name)
        assert float(entry["x"].abs().max()) == pytest.approx(
            float(layer.act_global_scale) * 448 * 6, rel=2**-8)  # the calibrated range
        assert torch.equal(entry["x"].bfloat16().float(), entry["x"])  # bfloat16 values
        with torch.no_grad():
            assert torch.equal(entry["y"], layer(entry["x"])), name
    if importlib.util.find_spec("vllm") is None:
        assert script.main(["vllm", str(out), "--reference", str(tmp_path / "ref.pt")]) == 2
        assert "needs vLLM" in capsys.readouterr().err


def layer_outputs(model, names, x) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {name: model.get_submodule(name)(x) for name in names}


def test_transformers_runs_the_w4a4_scheme_through_compressed_tensors(tmp_path):
    """transformers' default path keeps the layers compressed and emulates the activation
    quantization; on the CPU it needs a bfloat16 model (a float32 one fails in F.linear:
    compressed-tensors decompresses NVFP4/MXFP4 weights into bfloat16).  MXFP4 activations
    round their scales as kbbq-pl's ``mxfp4_even``: every W4A4 layer gives kbbq-pl's output
    bit for bit."""
    model = quantized_tiny(recipe("mxfp4_even", "identity"))
    out = save_compressed_tensors(model, tmp_path / "ct")
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert torch.isfinite(logits(loaded)).all()  # also decompresses on the first call
    names = list(quantized_linears(model))
    x = torch.randn(8, 64, dtype=torch.bfloat16) * 3
    theirs = layer_outputs(loaded, [n for n in names if "down_proj" not in n], x)
    ours = layer_outputs(from_pretrained(out), theirs, x)
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)


def test_cli_export_from_a_checkpoint_folder(shared_data, tmp_path):
    from kbbq_pl.io.llama2c import convert_llama2c

    tiny = shared_data / "tiny_llama_aidreams260K"
    hf = convert_llama2c(tiny / "aidreams260K.bin", tiny / "tok512.bin", tmp_path / "hf")
    model, tokenizer = load_model(hf)
    quantize_model(model, _batches(512, tokenizer, shared_data / "wikitext2" / "valid.txt"),
                   recipe("nvfp4", "identity"), progress=False)
    source = save_quantized(model, tmp_path / "kbbq", tokenizer=tokenizer,
                            recipe={"format": "nvfp4", "transform": "identity"})
    before = folder_digest(source)
    out = tmp_path / "served"
    assert main(["export", "--format", "compressed-tensors", str(source), str(out)]) == 0
    assert folder_digest(source) == before, "the source checkpoint was modified"
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "generation_config.json"} <= files
    assert "quantization_config.json" not in files
    block, config = ct_config(out)
    downs = [f"model.layers.{i}.mlp.down_proj" for i in range(4)]
    # FFN 172 is not a multiple of 16: compressed-tensors has no padding, down_proj is dense
    assert config.ignore == sorted(["lm_head", *downs])
    assert sorted(block["kbbq_pl"]["dense_layers"]) == downs
    assert block["kbbq_pl"]["recipe"] == {"format": "nvfp4", "transform": "identity"}
    # the same as writing from memory
    again = save_compressed_tensors(model, tmp_path / "from-memory", tokenizer=tokenizer)
    ours, theirs = load_file(str(out / "model.safetensors")), load_file(
        str(again / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    layers = quantized_linears(model)
    fp4 = [n for n in layers if n not in downs]
    for name in fp4:
        assert same_bits(ct_decompressed(out, name), layers[name].weight.dequantize(
            torch.bfloat16)), name
    for name in downs:
        assert torch.equal(ours[f"{name}.weight"],
                           layers[name].weight.dequantize(torch.float32)[:, :172])
    loaded = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    assert torch.equal(logits(loaded, ids), logits(weight_only_reference(model, fp4), ids))
    # MXFP4 on the real model too: every FP4 layer decompresses to kbbq-pl's values
    mx_model, _ = load_model(hf)
    quantize_model(mx_model, _batches(512, tokenizer, shared_data / "wikitext2" / "valid.txt"),
                   recipe("mxfp4", "identity"), progress=False)
    mx = save_compressed_tensors(mx_model, tmp_path / "mx", tokenizer=tokenizer)
    for name, layer in quantized_linears(mx_model).items():
        if name not in downs:
            assert same_bits(ct_decompressed(mx, name), layer.weight.dequantize(torch.bfloat16))
    with pytest.raises(ExportError, match=r"4 of 28 layers \(model.layers.0.mlp.down_proj, .*"
                                          r"in_features not a multiple of the block"):
        export_compressed_tensors(source, tmp_path / "strict", strict=True)
    with pytest.raises(FileExistsError):
        export_compressed_tensors(source, out)
    with pytest.raises(OutputPathError, match="inside the source"):
        export_compressed_tensors(source, source / "inside")


# ------------------------------------------------------------------ transforms

def test_block_hadamard_is_compressed_tensors_hadamard(tmp_path):
    """MR-GPTQ's block Hadamard: transform_config (hadamard, head_dim 16, input online,
    weight_input folded), compressed-tensors' matrix equal to kbbq-pl's, applied by
    compressed-tensors' own transform code to the loaded model."""
    from compressed_tensors.transform import TransformConfig, apply_transform_config
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    model = quantized_tiny(MR_GPTQ)
    out = save_compressed_tensors(model, tmp_path / "ct")
    block, _ = ct_config(out)
    transforms = TransformConfig.model_validate(block["transform_config"])
    (scheme,) = transforms.config_groups.values()
    assert scheme.type == "hadamard" and scheme.head_dim == 16 and not scheme.randomize
    assert [(a.location, a.inverse) for a in scheme.apply] == [("input", False),
                                                              ("weight_input", True)]
    # same matrix, same sign convention: H / sqrt(d) bit for bit in float64
    ct = deterministic_hadamard_matrix(16, torch.float64) / torch.tensor(16.0).sqrt()
    assert torch.equal(ct, hadamard(16))
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["model.layers.0.mlp.up_proj.kbbq_hadamard_input.weight"],
                       deterministic_hadamard_matrix(16, torch.float32))
    reference = logits(dense_model(copy.deepcopy(model)))
    loaded = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))
    # transformers does not apply transform_config: without it the function is another one
    assert (logits(loaded) - reference).abs().max() > 1e-2
    scheme.apply = [a for a in scheme.apply if a.location == "input"]  # weights: folded
    apply_transform_config(loaded, transforms)
    error = (logits(loaded) - reference).abs().max() / reference.abs().max()
    assert error < 1e-2, error  # bfloat16 weights (compressed-tensors) against float32
    assert torch.equal(logits(from_pretrained(out)), logits(model))


def export_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "kbbq_pl.io.compressed_tensors" and r.levelno >= logging.WARNING]


def test_block_hadamard_export_warns_that_transformers_drops_it_and_strict_refuses(
        tmp_path, caplog, capsys):
    """MR-GPTQ's transform_config is applied by vLLM but dropped by transformers on load: the
    export warns (which layers, why, how to load it) and --strict refuses it, in one line."""
    model = quantized_tiny(MR_GPTQ)
    first = r"14 of 14 layers \(model\.layers\.0\.self_attn\.q_proj, [^)]* and 11 more\)"
    with pytest.raises(ExportError, match=(
            rf"--strict: .*{first}: block Hadamard .* HF transformers drops transform_config on "
            r"load .* kbbq_pl\.from_pretrained\(folder\).* apply_transform_config")):
        save_compressed_tensors(model, tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()
    with caplog.at_level(logging.WARNING, logger="kbbq_pl.io.compressed_tensors"):
        save_compressed_tensors(model, tmp_path / "ct")
    (warning,) = export_warnings(caplog)
    assert re.match(rf"compressed-tensors export: {first}: ", warning), warning
    for words in ["transform_config", "vLLM applies it online",
                  "HF transformers drops transform_config on load and computes another function",
                  "kbbq_pl.from_pretrained(folder)", "apply_transform_config"]:
        assert words in warning, words
    # the CLI: a warning without --strict, one error line and exit code 2 with it
    source = save_quantized(model, tmp_path / "kbbq", recipe=MR_GPTQ.to_dict())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kbbq_pl.io.compressed_tensors"):
        assert main(["export", "--format", "compressed-tensors", str(source),
                     str(tmp_path / "cli")]) == 0
    assert export_warnings(caplog) == [warning]
    capsys.readouterr()
    assert main(["export", "--format", "compressed-tensors", "--strict", str(source),
                 str(tmp_path / "cli-strict")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert re.match(rf"kbbq-pl export: error: --strict: .*{first}: block Hadamard", line), line
    assert not (tmp_path / "cli-strict").exists()


@pytest.mark.parametrize("config", [
    MR_GPTQ, recipe("mxfp4", "hadamard"),
], ids=["MR-GPTQ-nvfp4", "RTN-HADAMARD-mxfp4"])
def test_block_hadamard_export_loads_in_kbbq_pl_bit_for_bit(config, tmp_path):
    """The way to load a transform-carrying export that the warning names: kbbq-pl's own
    loader applies the online Hadamard and gives the exported model's logits exactly."""
    model = quantized_tiny(config)
    out = save_compressed_tensors(model, tmp_path / "ct")
    assert json.loads((out / "config.json").read_text())["quantization_config"][
        "transform_config"]
    loaded = from_pretrained(out)
    ours, theirs = quantized_linears(model), quantized_linears(loaded)
    assert ours.keys() == theirs.keys()
    for name, layer in ours.items():
        assert torch.equal(theirs[name].transform, layer.transform), name
        assert same_bits(theirs[name].weight.dequantize(torch.float32),
                         layer.weight.dequantize(torch.float32)), name
    assert torch.equal(logits(loaded), logits(model))


def test_per_block_transforms_export_as_input_transform_and_strict_refuses(tmp_path):
    model = quantized_tiny(recipe("nvfp4", "kbbq", 0.5))
    with pytest.raises(ExportError, match=r"--strict: .* 14 of 14 layers .* no "
                                          r"compressed-tensors slot"):
        save_compressed_tensors(model, tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()
    out = save_compressed_tensors(model, tmp_path / "ct")
    block, _ = ct_config(out)
    tensors = load_file(str(out / "model.safetensors"))
    layers = quantized_linears(model)
    assert block["kbbq_pl"]["input_transforms"] == {
        n: [layer.padded_in // 16, 16, 16] for n, layer in layers.items()}
    for name, layer in layers.items():
        assert torch.equal(tensors[f"{name}.input_transform"], layer.transform)
        # compressed-tensors reads Q(W T^-1): the weight without its transform
        assert same_bits(ct_decompressed(out, name), layer.weight.dequantize(torch.bfloat16))
    assert torch.equal(logits(from_pretrained(out)), logits(model))


# ------------------------------------------------------------------ refusals

def test_what_compressed_tensors_cannot_express_is_refused(tmp_path):
    dynamic = quantized_tiny(recipe("nvfp4", "identity", act_scale="dynamic"))
    with pytest.raises(ExportError, match=r"dynamic \(the amax of every call\)"):
        save_compressed_tensors(dynamic, tmp_path / "dynamic")
    out = save_compressed_tensors(dynamic, tmp_path / "weight-only", weight_only=True)
    _, config = ct_config(out)
    assert config.config_groups["group_0"].input_activations is None
    assert not any(k.endswith("input_global_scale") for k in load_file(
        str(out / "model.safetensors")))
    no_clip = quantized_tiny(recipe("mxfp4_no_clip", "identity"))
    with pytest.raises(ExportError, match=r"mxfp4_no_clip .* / 0.75"):
        save_compressed_tensors(no_clip, tmp_path / "no-clip")
    gpt2 = tiny_model("gpt2")
    quantize_model(gpt2, _batches(), recipe("nvfp4", "identity"), progress=False)
    with pytest.raises(ExportError, match=r"c_attn: .* torch.nn.Linear .* Conv1D"):
        save_compressed_tensors(gpt2, tmp_path / "gpt2")


# ------------------------------------------------------------------ import

def _compress_as_llm_compressor(model: torch.nn.Module, preset: str, ignore: list[str],
                                fused: list[list[str]] = ()) -> Any:
    """Quantize ``model``'s linear layers in place with compressed-tensors' own API as
    llm-compressor does (scales from its own observers' formulas, its compressor), each group
    of ``fused`` layers sharing one weight global scale; returns the compressor, whose
    ``update_config`` writes the folder's ``quantization_config``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig as QC
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme(preset, ["Linear"])
    apply_quantization_config(model, QC(config_groups={"group_0": scheme}, ignore=ignore))
    group_of = {name: group for group in fused for name in group}
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        weight, args = module.weight.data, module.quantization_scheme.weights
        groups = weight.reshape(weight.shape[0], -1, args.group_size)
        global_scale = None
        if hasattr(module, "weight_global_scale"):
            shared = torch.cat([model.get_submodule(n).weight.data.flatten()
                                for n in group_of.get(name, [name])])
            global_scale = generate_gparam(shared.min(), shared.max())
            module.weight_global_scale.data.copy_(global_scale)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale)
        module.weight_scale.data = scale
        if hasattr(module, "input_global_scale"):
            module.input_global_scale.data.copy_(torch.tensor([448 * 6 / 4.0]))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    return compressor


def _llm_compressor_style_folder(folder: Path, preset: str) -> Path:
    """A folder written with compressed-tensors' own API as llm-compressor does, not with
    kbbq-pl (:func:`_compress_as_llm_compressor`)."""
    model = tiny_model("llama", seed=3)
    model.config.architectures = ["LlamaForCausalLM"]
    compressor = _compress_as_llm_compressor(model, preset, ["lm_head"])
    model.save_pretrained(folder)
    compressor.update_config(str(folder))
    return folder


def test_import_reads_a_compressed_tensors_nvfp4_folder(tmp_path):
    folder = _llm_compressor_style_folder(tmp_path / "nvfp4", "NVFP4")
    model = from_pretrained(folder)
    layers = quantized_linears(model)
    assert len(layers) == 14
    for name, layer in layers.items():
        assert isinstance(layer, QuantizedLinear) and layer.act_scale == "static"
        assert same_bits(layer.weight.dequantize(torch.bfloat16), ct_decompressed(folder, name))
        assert float(layer.act_global_scale) == pytest.approx(4.0 / 2688, rel=1e-7)
    # each W4A4 layer against compressed-tensors' own emulation in transformers: the same up
    # to the activations' scale arithmetic (s / gs in bfloat16 there, s * pts in float32 here)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert torch.isfinite(logits(loaded)).all()
    x = torch.randn(64, 64, dtype=torch.bfloat16) * 3
    theirs = layer_outputs(loaded, [n for n in layers if "down_proj" not in n], x)
    ours = layer_outputs(model, theirs, x)
    for name in theirs:
        error = (ours[name].float() - theirs[name].float()).norm() / theirs[name].float().norm()
        assert error < 1e-2, (name, error)


def test_import_weight_only_mxfp4_folder_and_law(tmp_path, shared_data):
    from kbbq_pl.eval.law_report import run_law

    folder = _llm_compressor_style_folder(tmp_path / "mxfp4", "MXFP4A16")
    model = from_pretrained(folder)
    assert not quantized_linears(model)  # weight-only: dense, activations unquantized
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=CompressedTensorsConfig(dequantize=True))
    assert torch.equal(logits(model), logits(loaded))  # MXFP4 values are exact everywhere
    assert isinstance(load_model(folder)[0].model.layers[0].mlp.up_proj, torch.nn.Linear)
    paths, summary = run_law(str(folder), "random", tmp_path / "law", formats=["nvfp4"],
                             tokens=64, seq_len=16, rows=2, progress=False)
    assert summary["formats"]["nvfp4"]["records"] > 0 and paths


def test_import_refuses_what_it_cannot_read(tmp_path):
    folder = _llm_compressor_style_folder(tmp_path / "nvfp4", "NVFP4")
    original = (folder / "config.json").read_text()
    config = json.loads(original)
    config["quantization_config"]["transform_config"] = {"config_groups": {"u": {
        "type": "random-hadamard", "apply": [{"targets": ["Linear"], "location": "output"}]}}}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'u' .random-hadamard at output"):
        from_pretrained(folder)
    config = json.loads(original)
    config["quantization_config"]["config_groups"]["group_0"]["format"] = "pack-quantized"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="stored as 'pack-quantized'; kbbq-pl reads "
                                         "nvfp4-pack-quantized, mxfp4-pack-quantized"):
        from_pretrained(folder)


def test_folded_o_proj_exports_without_a_transform(tmp_path):
    """fold_o_proj: o_proj's transform lives in v_proj's weights, so o_proj is plain
    compressed-tensors; the per-block transforms of the other layers still are not."""
    model = quantized_tiny(recipe("nvfp4", "kbbq", 0.5, fold_o_proj=True))
    out = save_compressed_tensors(model, tmp_path / "ct")
    block, _ = ct_config(out)
    transformed = block["kbbq_pl"]["input_transforms"]
    assert len(transformed) == 12 and not any(n.endswith("o_proj") for n in transformed)
    for i in range(2):
        name = f"model.layers.{i}.self_attn.o_proj"
        assert same_bits(ct_decompressed(out, name),
                         quantized_linears(model)[name].weight.dequantize(torch.bfloat16))
    assert torch.equal(logits(from_pretrained(out)), logits(model))


# ------------------------------------------------------------------ mixture of experts

@pytest.mark.parametrize("arch, fmt, stored", [
    ("qwen3_moe", "nvfp4", ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                            "mlp.experts.{e}.down_proj", "mlp.gate")),
    ("mixtral", "mxfp4", ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                          "block_sparse_moe.experts.{e}.w2", "block_sparse_moe.gate")),
])
def test_moe_experts_export_under_their_architectures_checkpoint_names(arch, fmt, stored,
                                                                       tmp_path, caplog):
    """Each expert's gate_up_proj splits into the gate and up layers the architecture's
    checkpoints hold (transformers' conversion mapping reversed), decoded bit for bit as
    kbbq-pl decodes them; the routers are ignored.  transformers merges them back bit for bit,
    except NVFP4 experts in a transformers that drops their global scale (5.24): then, and
    only then, the export warns and strict refuses."""
    model = tiny_model(arch)
    quantize_model(model, _batches(), recipe(fmt, "identity", gptq=True), progress=False)
    drops = fmt == "nvfp4" and hf_drops_expert_global_scale()
    if drops:
        with pytest.raises(ExportError, match=r"--strict: .*experts\.0\.gate_up_proj.* without "
                                              "their weight_global_scale"):
            save_compressed_tensors(model, tmp_path / "strict", strict=True)
    with caplog.at_level(logging.WARNING, logger="kbbq_pl"):
        out = save_compressed_tensors(model, tmp_path / "ct", strict=not drops)
    assert any("weight_global_scale" in line for line in export_warnings(caplog)) == drops
    _, config = ct_config(out)
    gate, up, down, router = stored
    assert config.ignore == sorted(["lm_head"] + [f"model.layers.{i}.{router}" for i in (0, 1)])
    layers = quantized_linears(model)
    experts = model.model.layers[0].mlp.experts
    for i in (0, 1):
        for e in range(experts.num_experts):
            prefix = f"model.layers.{i}"
            ours = layers[f"{prefix}.mlp.experts.{e}.gate_up_proj"].weight.dequantize(
                torch.bfloat16)
            half = ours.shape[0] // 2
            assert same_bits(ct_decompressed(out, f"{prefix}.{gate.format(e=e)}"), ours[:half])
            assert same_bits(ct_decompressed(out, f"{prefix}.{up.format(e=e)}"), ours[half:])
            assert same_bits(ct_decompressed(out, f"{prefix}.{down.format(e=e)}"),
                             layers[f"{prefix}.mlp.experts.{e}.down_proj"].weight.dequantize(
                                 torch.bfloat16))
        name = f"model.layers.{i}.self_attn.q_proj"
        assert same_bits(ct_decompressed(out, name), layers[name].weight.dequantize(
            torch.bfloat16))
    loaded = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))
    for i in (0, 1):  # merged back into its fused experts
        fused = loaded.model.layers[i].mlp.experts
        for e in range(experts.num_experts):
            for proj in ("gate_up_proj", "down_proj"):
                ours = layers[f"model.layers.{i}.mlp.experts.{e}.{proj}"].weight.dequantize(
                    getattr(fused, proj).dtype)
                assert same_bits(getattr(fused, proj)[e], ours) != drops
    assert torch.equal(logits(from_pretrained(out)), logits(model))  # imported bit for bit


def _llm_compressor_style_moe_folder(folder: Path, preset: str, *, fuse_gate_up: bool = True,
                                     ignore_routers: bool = True) -> Path:
    """A tiny Qwen3-MoE written as llm-compressor writes one, without kbbq-pl: each expert's
    linear layers under the checkpoint's names (``mlp.experts.<e>.gate_proj`` ...) quantized by
    compressed-tensors' own API (:func:`_compress_as_llm_compressor`), the gate and up layers
    sharing their global scale, the routers ignored."""
    from transformers.core_model_loading import revert_weight_conversion

    model = tiny_model("qwen3_moe", seed=3)
    model.config.architectures = ["Qwen3MoeForCausalLM"]
    stored = revert_weight_conversion(model, model.state_dict())
    linear = re.compile(r".*(_proj|lm_head|mlp\.gate)\.weight$")
    tree = torch.nn.Module()
    for key, value in stored.items():
        if linear.match(key):
            *path, name = key.removesuffix(".weight").split(".")
            parent = tree
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.add_module(name, torch.nn.Linear(value.shape[1], value.shape[0], bias=False))
            getattr(parent, name).weight.data = value.clone()
    experts = [k.removesuffix(".gate_proj.weight") for k in stored
               if re.search(r"experts\.\d+\.gate_proj\.weight$", k)]
    fused = [[f"{e}.gate_proj", f"{e}.up_proj"] for e in experts] if fuse_gate_up else []
    ignore = ["lm_head", "re:.*mlp.gate$"] if ignore_routers else ["lm_head"]
    compressor = _compress_as_llm_compressor(tree, preset, ignore, fused)
    folder.mkdir()
    model.config.save_pretrained(folder)
    state = {k: v.clone() for k, v in stored.items() if not linear.match(k)}
    save_file({**state, **tree.state_dict()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    compressor.update_config(str(folder))
    return folder


def test_import_reads_an_llm_compressor_style_moe_folder(tmp_path):
    """Experts stored expert by expert regroup into kbbq-pl's expert layers, decoded bit for
    bit as compressed-tensors decodes them; weight-only, the model computes transformers'
    logits."""
    folder = _llm_compressor_style_moe_folder(tmp_path / "nvfp4", "NVFP4")
    model = from_pretrained(folder)
    layers = quantized_linears(model)
    assert len(layers) == 2 * (4 + 2 * 8)  # attention, and gate_up / down of 8 experts
    for i in (0, 1):
        for e in range(8):
            prefix = f"model.layers.{i}.mlp.experts.{e}"
            gate_up = layers[f"{prefix}.gate_up_proj"]
            assert gate_up.act_scale == "static"
            assert float(gate_up.act_global_scale) == pytest.approx(4.0 / 2688, rel=1e-7)
            assert same_bits(gate_up.weight.dequantize(torch.bfloat16), torch.cat(
                [ct_decompressed(folder, f"{prefix}.{p}") for p in ("gate_proj", "up_proj")]))
            assert same_bits(layers[f"{prefix}.down_proj"].weight.dequantize(torch.bfloat16),
                             ct_decompressed(folder, f"{prefix}.down_proj"))
    assert torch.isfinite(logits(model)).all()
    weight_only = _llm_compressor_style_moe_folder(tmp_path / "mxfp4", "MXFP4A16")
    ours = from_pretrained(weight_only)
    assert not quantized_linears(ours)  # weight-only: dense, activations unquantized
    theirs = AutoModelForCausalLM.from_pretrained(
        weight_only, quantization_config=CompressedTensorsConfig(dequantize=True))
    for i in (0, 1):  # transformers merges the experts back, in bfloat16: the same values
        fused, unfused = theirs.model.layers[i].mlp.experts, ours.model.layers[i].mlp.experts
        for e in range(8):
            for proj in ("gate_up_proj", "down_proj"):
                weight = getattr(getattr(unfused, str(e)), proj).weight
                assert torch.equal(weight, getattr(fused, proj)[e].float())
    # the experts one by one against the fused experts: float32 sums in another order
    assert torch.allclose(logits(ours), logits(theirs.float()), rtol=0, atol=1e-6)


def test_import_refuses_moe_layers_kbbq_pl_cannot_hold(tmp_path):
    unfused = _llm_compressor_style_moe_folder(tmp_path / "scales", "NVFP4", fuse_gate_up=False)
    with pytest.raises(CheckpointError, match=r"experts\.0\.gate_up_proj\.weight_global_scale: "
                                              "the gate and up layers hold different"):
        from_pretrained(unfused)
    router = _llm_compressor_style_moe_folder(tmp_path / "router", "NVFP4",
                                              ignore_routers=False)
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.gate is a mixture-of-experts "
                                              "router stored in FP4"):
        from_pretrained(router)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_experts_stored_fused_export_expert_by_expert_as_llm_compressor_writes_them(fmt,
                                                                                   tmp_path):
    """Llama 4's checkpoints hold its experts as one 3-D tensor; the export writes each expert's
    gate_proj / up_proj / down_proj (the names vLLM's and transformers' Llama 4 loaders read
    expert by expert), decoded bit for bit; transformers computes kbbq-pl's weight-only model
    bit for bit and kbbq-pl reads the folder back bit for bit."""
    model = tiny_model("llama4_text")
    quantize_model(model, _batches(), recipe(fmt, "identity", gptq=True), progress=False)
    out = save_compressed_tensors(model, tmp_path / "ct", strict=True)
    _, config = ct_config(out)
    assert config.ignore == ["lm_head"] + [f"model.layers.{i}.feed_forward.router"
                                           for i in (0, 1)]
    layers = quantized_linears(model)
    stored = load_file(str(out / "model.safetensors"))
    assert not any(re.search(r"experts\.(gate_up|down)_proj", k) for k in stored)
    for i in (0, 1):
        prefix = f"model.layers.{i}.feed_forward.experts"
        for e in range(model.config.num_local_experts):
            ours = layers[f"{prefix}.{e}.gate_up_proj"].weight.dequantize(torch.bfloat16)
            half = ours.shape[0] // 2
            assert same_bits(ct_decompressed(out, f"{prefix}.{e}.gate_proj"), ours[:half])
            assert same_bits(ct_decompressed(out, f"{prefix}.{e}.up_proj"), ours[half:])
            assert same_bits(ct_decompressed(out, f"{prefix}.{e}.down_proj"),
                             layers[f"{prefix}.{e}.down_proj"].weight.dequantize(torch.bfloat16))
    loaded = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))
    assert type(loaded.model.layers[0].feed_forward.experts).__name__ == \
        "SequentialLlama4TextExperts"  # transformers' own expert-by-expert Llama 4 experts
    assert torch.equal(logits(loaded), logits(weight_only_reference(model, layers)))
    assert torch.equal(logits(from_pretrained(out)), logits(model))
    del stored["model.layers.1.feed_forward.experts.2.up_proj.weight_packed"]
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"has model\.layers\.1\.feed_forward\.experts\.0"
                                              r"\.gate_proj\.weight_packed but no .*experts\.2"
                                              r"\.up_proj\.weight_packed"):
        from_pretrained(out)


def test_experts_transformers_reads_fused_only_export_with_a_warning(tmp_path, caplog):
    """Qwen3-VL-MoE's experts (stored fused) are written expert by expert, as vLLM reads them;
    transformers would leave them at random, so the export warns and strict refuses; kbbq-pl
    reads the folder back bit for bit."""
    from tiny_models import small_multimodal

    model = small_multimodal("qwen3_vl_moe")
    quantize_model(model, _batches(vocab=512), recipe("nvfp4", "identity"), progress=False)
    with pytest.raises(ExportError, match=r"--strict: .*experts\.0\.gate_up_proj.* HF "
                                          "transformers reads this architecture's experts fused "
                                          r"only.*as documented$"):
        save_compressed_tensors(model, tmp_path / "strict", strict=True)
    assert not (tmp_path / "strict").exists()
    with caplog.at_level(logging.WARNING, logger="kbbq_pl"):
        out = save_compressed_tensors(model, tmp_path / "ct")
    assert any("vLLM reads them" in line for line in export_warnings(caplog))
    stored = load_file(str(out / "model.safetensors"))
    prefix = "model.language_model.layers.1.mlp.experts"
    assert {f"{prefix}.3.{p}.weight_packed" for p in ("gate_proj", "up_proj", "down_proj")} \
        <= set(stored)
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(7))
    assert torch.equal(logits(from_pretrained(out), ids), logits(model, ids))


@pytest.mark.parametrize("arch", ["ernie4_5_moe", "deepseek_v4", "kimi_linear", "kimi_k25"])
def test_an_export_reads_back_with_its_renamed_and_merged_dense_tensors(arch, tmp_path):
    """Tensors outside the FP4 layers that the conversion mapping renames (ERNIE's
    ``moe_statics``, DeepSeek-V4's attention sinks and hyper-connections), merges (Kimi-Linear's
    ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` into ``conv1d``) or splits and permutes (Kimi
    K2.5's vision ``wqkv``) are read back as transformers reads them: kbbq-pl's import gives the
    quantized model's logits bit for bit."""
    from tiny_models import small_model, small_multimodal

    model = small_multimodal(arch) if arch == "kimi_k25" else small_model(arch)
    ids = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    quantize_model(model, [{"input_ids": ids}], recipe("nvfp4", "identity"), progress=False)
    out = save_compressed_tensors(model, tmp_path / "ct")
    assert torch.equal(logits(from_pretrained(out), ids), logits(model, ids))


def test_moe_experts_with_a_transform_or_stored_fused_are_refused(tmp_path):
    kbbq = tiny_model("qwen3_moe")
    quantize_model(kbbq, _batches(), recipe("nvfp4", "kbbq"), progress=False)
    with pytest.raises(ExportError, match=r"experts\.0\.gate_up_proj: .* plain FP4 only .* "
                                          r"custom transform"):
        save_compressed_tensors(kbbq, tmp_path / "kbbq")
    gpt_oss = tiny_model("gpt_oss")
    quantize_model(gpt_oss, _batches(), recipe("mxfp4", "identity"), progress=False)
    with pytest.raises(ExportError, match=r"mlp\.experts: GptOssForCausalLM "
                                          "checkpoints store these experts as one 3-D tensor "
                                          r"and they are not plain gated MLPs .* --format mxfp4"):
        save_compressed_tensors(gpt_oss, tmp_path / "gpt_oss")
    from tiny_models import small_model

    granite = small_model("granitemoehybrid")
    quantize_model(granite, _batches(), recipe("mxfp4", "identity"), progress=False)
    with pytest.raises(ExportError, match=r"block_sparse_moe\.experts: GraniteMoeHybridForCausalLM "
                                          r"checkpoints store these experts as one 3-D tensor and "
                                          r"they are stored as .*block_sparse_moe\.output_linear"):
        save_compressed_tensors(granite, tmp_path / "granite")
    dense = tiny_model("qwen3_moe")
    ignored = QuantizationConfig(transform=TransformConfig("identity"),
                                 layers=LayersConfig(ignore=[r"lm_head$", r"experts\.[1-7]\."]))
    quantize_model(dense, _batches(), ignored, progress=False)
    with pytest.raises(ExportError, match=r"experts\.1\.gate_up_proj and 27 more experts are "
                                          "in full precision"):
        save_compressed_tensors(dense, tmp_path / "dense")
    assert not any((tmp_path / name).exists() for name in ("kbbq", "gpt_oss", "granite", "dense"))


@pytest.mark.parametrize("arch", ["llava", "gemma3", "qwen2_5_vl"])
def test_a_multimodal_model_exports_its_language_model_with_the_vision_tower_ignored(arch,
                                                                                      tmp_path):
    from tiny_models import tiny_multimodal
    from transformers import AutoModelForImageTextToText

    from kbbq_pl.quant.modules import is_linear

    model = tiny_multimodal(arch)
    quantize_model(model, _batches(vocab=400), recipe("nvfp4", "identity", gptq=True),
                   progress=False)
    out = save_compressed_tensors(model, tmp_path / "ct", strict=True)
    _, config = ct_config(out)
    layers = quantized_linears(model)
    unquantized = [name for name, m in model.named_modules() if is_linear(m)]
    assert sorted(config.ignore) == sorted(unquantized)  # the vision tower, projector, head
    assert any(".visual." in n or ".vision_tower." in n for n in config.ignore)
    for name, layer in layers.items():
        assert same_bits(ct_decompressed(out, name), layer.weight.dequantize(torch.bfloat16))
    ids = torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(7))
    loaded = AutoModelForImageTextToText.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True))
    assert torch.equal(logits(loaded, ids), logits(weight_only_reference(model, layers), ids))
    assert torch.equal(logits(from_pretrained(out), ids), logits(model, ids))


def test_a_quantized_head_tied_to_the_embedding_is_untied_and_loads_everywhere(tmp_path):
    """``layers.ignore: []`` quantizes an LM head tied to the input embedding, which stays in
    full precision: the config stops tying them (as llm-compressor unties them), so the folder
    and its export load in kbbq-pl and transformers with the quantized model's logits."""
    model = tiny_model("llama", tie_word_embeddings=True)
    quantize_model(model, _batches(), QuantizationConfig(layers=LayersConfig(ignore=[])),
                   progress=False)
    assert isinstance(model.lm_head, QuantizedLinear) and not model.config.tie_word_embeddings
    expected = logits(model)
    folder = save_quantized(model, tmp_path / "kb")
    exported = export_compressed_tensors(folder, tmp_path / "ct")
    for loaded in (from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder),
                   from_pretrained(exported)):
        assert torch.equal(logits(loaded), expected)


def test_saving_leaves_the_model_s_config_as_it_was(tmp_path):
    model = quantized_tiny(recipe("nvfp4", "identity")).to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    out = save_compressed_tensors(model, tmp_path / "ct")
    assert model.config.dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_fused_group_left_partly_in_full_precision_warns_and_strict_refuses(tmp_path, caplog):
    """vLLM runs q/k/v as one linear of one scheme and refuses a checkpoint that quantizes
    some of them: an export whose recipe ignores k_proj names q_proj and v_proj."""
    model = tiny_model("llama")
    quantize_model(model, _batches(), QuantizationConfig(
        transform=TransformConfig("identity"), layers=LayersConfig(ignore=["lm_head", "k_proj"])),
        progress=False)
    group = r"4 of 12 layers \(model\.layers\.0\.self_attn\.q_proj, [^)]*v_proj[^)]*\)"
    with pytest.raises(ExportError, match=rf"--strict: .*{group}: FP4 layers whose siblings"):
        save_compressed_tensors(model, tmp_path / "strict", strict=True)
    with caplog.at_level(logging.WARNING, logger="kbbq_pl.io.compressed_tensors"):
        out = save_compressed_tensors(model, tmp_path / "ct")
    assert any(re.match(rf"compressed-tensors export: {group}: ", w)
               for w in export_warnings(caplog)), export_warnings(caplog)
    assert torch.equal(logits(from_pretrained(out)), logits(model))


def test_an_import_names_the_layer_of_nan_block_scales_and_of_a_bad_global_scale(tmp_path):
    out = save_compressed_tensors(quantized_tiny(recipe("nvfp4", "identity")), tmp_path / "ct")
    layer = "model.layers.0.self_attn.q_proj"
    tensors = load_file(str(out / "model.safetensors"))
    nan = tensors[f"{layer}.weight_scale"].clone()
    nan[3, 1] = float("nan")
    save_file({**tensors, f"{layer}.weight_scale": nan}, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{layer}\.weight_scale holds 1 NaN block scales "
                                              r"of 256 \(shape \(64, 4\)\)"):
        from_pretrained(out)
    zero = torch.zeros_like(tensors[f"{layer}.weight_global_scale"])
    save_file({**tensors, f"{layer}.weight_global_scale": zero}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{layer}\.weight_global_scale: per-tensor scale 0\.0"):
        from_pretrained(out)


def test_an_import_names_codes_of_the_wrong_shape(tmp_path):
    """A ``weight_packed`` with the wrong row count is named as such (not blamed on the block
    scales that still match the config), with the shape the architecture asks for."""
    out = save_compressed_tensors(quantized_tiny(recipe("nvfp4", "identity")), tmp_path / "ct")
    layer = "model.layers.0.self_attn.q_proj"
    tensors = load_file(str(out / "model.safetensors"))
    tensors[f"{layer}.weight_packed"] = tensors[f"{layer}.weight_packed"][:48].clone()
    tensors[f"{layer}.weight_scale"] = tensors[f"{layer}.weight_scale"][:48].clone()
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{layer}\.weight_packed is \[48, 32\] "
                                              rf"torch\.uint8 .*has {layer} \[64, 64\] \(out, "
                                              r"in\), which packs to \[64, 32\]"):
        from_pretrained(out)
