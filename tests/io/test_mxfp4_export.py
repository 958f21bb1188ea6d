"""gpt-oss's own MXFP4 export (``kbbq-pl export --format mxfp4``), read back by transformers'
own MXFP4 loader (on the CPU it dequantizes the experts)."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import tiny_model
from transformers import AutoModelForCausalLM, Mxfp4Config

from kbbq_pl.cli.commands import main
from kbbq_pl.io.checkpoint import save_quantized
from kbbq_pl.io.compressed_tensors import ExportError, dense_model
from kbbq_pl.io.data import token_blocks
from kbbq_pl.io.mxfp4 import export_mxfp4
from kbbq_pl.quant import QuantizationConfig, quantize_model
from kbbq_pl.quant.layers import quantized_linears

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(7))
# the experts dequantized, as transformers holds them on a CPU without its hub kernel (5.25
# fetches "kernels-community/gpt-oss-triton-kernels" on the CPU too, which offline it cannot)
DEQUANTIZED = Mxfp4Config(dequantize=True)
EXPERTS_ONLY = {"ignore": [r"lm_head$", r"self_attn\."]}


def _recipe(fmt: str = "mxfp4", transform: str = "identity",
            layers: dict | None = EXPERTS_ONLY) -> QuantizationConfig:
    recipe = {"format": {"name": fmt}, "weights": {"quantizer": "gptq"},
              "transform": {"name": transform}}
    return QuantizationConfig.from_dict(recipe if layers is None else {**recipe,
                                                                       "layers": layers})


def _checkpoint(tmp_path, config: QuantizationConfig, arch: str = "gpt_oss"):
    model = tiny_model(arch)
    ids = token_blocks("random", None, n_tokens=256, seq_len=32, vocab_size=256)
    batches = [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in ids.split(8)]
    quantize_model(model, batches, config, progress=False)
    return model, save_quantized(model, tmp_path / f"{arch}-kbbq")


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def _close_to_weight_only(ours, theirs) -> None:
    """transformers' model computes kbbq-pl's weight-only model: the experts one by one there,
    fused here, sum float32 in another order."""
    reference = dense_model(copy.deepcopy(ours))
    assert torch.allclose(_logits(theirs), _logits(reference), rtol=0, atol=1e-6)


def test_gpt_oss_experts_export_in_gpt_oss_own_format(tmp_path):
    model, folder = _checkpoint(tmp_path, _recipe())
    out = export_mxfp4(folder, tmp_path / "mxfp4", weight_only=True, strict=True)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    stored = load_file(str(out / "model.safetensors"))
    layers = quantized_linears(model)
    experts = model.model.layers[0].mlp.experts
    count = len(list(experts.children()))
    blocks = stored["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert blocks.dtype == torch.uint8 and blocks.shape == (count, 128, 2, 16)
    for e in range(count):  # kbbq-pl's bytes, unchanged
        codes = layers[f"model.layers.0.mlp.experts.{e}.gate_up_proj"].weight
        assert torch.equal(blocks[e].reshape(128, 32), codes.qdata)
        assert torch.equal(stored["model.layers.0.mlp.experts.gate_up_proj_scales"][e],
                           codes.scale.view(torch.uint8))
    theirs = AutoModelForCausalLM.from_pretrained(out, quantization_config=DEQUANTIZED)
    for i in (0, 1):
        fused = theirs.model.layers[i].mlp.experts
        for e in range(count):
            for proj in ("gate_up_proj", "down_proj"):
                layer = layers[f"model.layers.{i}.mlp.experts.{e}.{proj}"]
                assert torch.equal(getattr(fused, proj)[e].T, layer.weight.dequantize(
                    getattr(fused, proj).dtype))
                assert torch.equal(getattr(fused, f"{proj}_bias")[e], layer.bias)
    _close_to_weight_only(model, theirs)


def test_quantized_attention_is_written_dense_and_strict_refuses(tmp_path, caplog):
    model, folder = _checkpoint(tmp_path, _recipe(layers=None))
    assert "model.layers.0.self_attn.q_proj" in quantized_linears(model)
    with pytest.raises(ExportError, match=r"--strict: 8 quantized layers outside the experts "
                                          r"\(model\.layers\.0\.self_attn\.q_proj"):
        export_mxfp4(folder, tmp_path / "strict", weight_only=True, strict=True)
    with caplog.at_level(logging.WARNING, logger="kbbq_pl.io.mxfp4"):
        out = export_mxfp4(folder, tmp_path / "mxfp4", weight_only=True)
    assert "written dense, dequantized" in caplog.text
    theirs = AutoModelForCausalLM.from_pretrained(out, quantization_config=DEQUANTIZED)
    q_proj = quantized_linears(model)["model.layers.0.self_attn.q_proj"]
    assert torch.equal(theirs.model.layers[0].self_attn.q_proj.weight,
                       q_proj.weight.dequantize(torch.float32))
    _close_to_weight_only(model, theirs)
    assert not (tmp_path / "strict").exists()


@pytest.mark.parametrize("arch, fmt, transform, message", [
    ("gpt_oss", "nvfp4", "identity", r"format nvfp4 is not MXFP4"),
    ("gpt_oss", "mxfp4", "kbbq", r"plain MXFP4 experts \(no transform"),
    ("qwen3_moe", "mxfp4", "identity", r"the mxfp4 format is gpt-oss's .* Qwen3MoeForCausalLM "
                                       r"has Qwen3MoeExperts: export it with --format "
                                       "compressed-tensors"),
])
def test_what_the_mxfp4_format_cannot_hold_is_refused(arch, fmt, transform, message, tmp_path):
    _, folder = _checkpoint(tmp_path, _recipe(fmt, transform), arch)
    with pytest.raises(ExportError, match=message):
        export_mxfp4(folder, tmp_path / "out", weight_only=True)
    assert not (tmp_path / "out").exists()


def test_cli_export_mxfp4_needs_weight_only(tmp_path, capsys):
    _, folder = _checkpoint(tmp_path, _recipe())
    assert main(["export", "--format", "mxfp4", str(folder), str(tmp_path / "a")]) == 2
    assert "the mxfp4 format stores weights only" in capsys.readouterr().err
    assert main(["export", "--format", "mxfp4", "--weight-only", str(folder),
                 str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "b" / "config.json").read_text())[
        "quantization_config"]["quant_method"] == "mxfp4"
