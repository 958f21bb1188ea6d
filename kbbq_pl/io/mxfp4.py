"""gpt-oss's own MXFP4 checkpoints (``quant_method: mxfp4``): export for vLLM, SGLang and HF
transformers.

OpenAI ships gpt-oss with its experts in MXFP4 and every other weight in bfloat16, a layout that
transformers (``Mxfp4HfQuantizer``), vLLM and SGLang read natively.  For each fused experts
module ``E`` and projection ``P`` (``gate_up_proj``, its rows gpt-oss's interleaved gate and
up; ``down_proj``), with ``[experts, out, in]`` the products' shape:

* ``E.P_blocks``: uint8 ``[experts, out, in / 32, 16]``, two E2M1 codes a byte, element ``2i``
  in the low nibble: kbbq-pl's codes, byte for byte;
* ``E.P_scales``: uint8 ``[experts, out, in / 32]``, the E8M0 exponents (bias 127);
* ``E.P_bias``: ``[experts, out]``;

and ``config.json``'s ``quantization_config`` is ``{"quant_method": "mxfp4",
"modules_to_not_convert": [...]}`` (:data:`NOT_CONVERTED`, as gpt-oss's release lists them).
The format stores weights: readers multiply the experts' MXFP4 weights by unquantized
activations (:func:`export_mxfp4` asks for ``weight_only``).  A quantized layer outside the
experts (attention) has no slot in it: it is written dense, its dequantized ``Q(W T^-1) T``, with
a warning; ``strict`` refuses.  The experts must be MXFP4 with no transform (I, GPTQ).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..formats import get_format
from ..quant.experts import fused_experts
from .checkpoint import WEIGHTS_NAME, stored_weight
from .compressed_tensors import ExportError, effective_weight, export_folder, is_mxfp4
from .fileio import save_safetensors

log = logging.getLogger(__name__)

EXPERTS_CLASSES = ("GptOssExperts",)
"""The fused experts that transformers' MXFP4 loader reads (it replaces these alone)."""
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                 "lm_head"]
"""``modules_to_not_convert`` of gpt-oss's release: everything outside the experts."""


def _expert_codes(tensors: dict[str, Tensor], layers: dict[str, dict[str, Any]], prefix: str,
                  proj: str, count: int) -> dict[str, Tensor]:
    """The stacked tensors of ``prefix``'s ``proj`` experts (the module docstring), taken out
    of ``tensors``."""
    names = [f"{prefix}.{e}.{proj}" for e in range(count)]
    for name in names:
        meta = layers.get(name)
        if meta is None:
            raise ExportError(f"{name} is in full precision: the mxfp4 format stores quantized "
                              "experts only")
        fmt = get_format(meta["format"])
        if not is_mxfp4(fmt):
            raise ExportError(f"{name}: format {fmt.name} is not MXFP4 (E2M1 in blocks of 32 "
                              "under an E8M0 scale: mxfp4, mxfp4_even, ...)")
        if f"{name}.transform" in tensors or meta["padded_in"] != meta["in_features"]:
            raise ExportError(f"{name}: the mxfp4 format holds plain MXFP4 experts (no transform,"
                              " no padding): quantize with an I or GPTQ recipe")
    codes = torch.stack([tensors.pop(f"{n}.weight_packed") for n in names])
    scales = torch.stack([tensors.pop(f"{n}.weight_scale").view(torch.uint8) for n in names])
    for name in names:
        tensors.pop(f"{name}.input_global_scale", None)
    count, rows, half = codes.shape
    out = {f"{prefix}.{proj}_blocks": codes.reshape(count, rows, half // 16, 16),
           f"{prefix}.{proj}_scales": scales}
    if f"{names[0]}.bias" in tensors:
        out[f"{prefix}.{proj}_bias"] = torch.stack([tensors.pop(f"{n}.bias") for n in names])
    return out


def mxfp4_state(tensors: dict[str, Tensor], layers: dict[str, dict[str, Any]],
                skeleton: nn.Module, strict: bool) -> dict[str, Tensor]:
    """The tensors of a gpt-oss MXFP4 folder (the module docstring) from a kbbq-pl checkpoint's
    ``tensors`` (kbbq-pl's module names) and ``layers``; ``skeleton``: the architecture with
    its experts fused.  ``tensors`` is consumed."""
    experts = fused_experts(skeleton)
    others = sorted({type(m).__name__ for m in experts.values()} - set(EXPERTS_CLASSES))
    if not experts or others:
        raise ExportError(f"the mxfp4 format is gpt-oss's (transformers reads it for "
                          f"{', '.join(EXPERTS_CLASSES)} experts); {type(skeleton).__name__} "
                          f"has {others[0] if others else 'no fused experts'}: export it with "
                          "--format compressed-tensors")
    state: dict[str, Tensor] = {}
    for prefix, module in experts.items():
        for proj in ("gate_up_proj", "down_proj"):
            state.update(_expert_codes(tensors, layers, prefix, proj, module.down_proj.shape[0]))
    dense = [name for name in layers if f"{name}.weight_packed" in tensors]
    if dense:
        shown = ", ".join(dense[:3]) + (f" and {len(dense) - 3} more" if len(dense) > 3 else "")
        message = (f"{len(dense)} quantized layers outside the experts ({shown}) have no slot in "
                   "the mxfp4 format: written dense, dequantized (exact weights, activations "
                   "unquantized)")
        if strict:
            raise ExportError(f"--strict: {message}; quantize with them in ignore "
                              "(--recipe.layers.ignore)")
        log.warning("mxfp4 export: %s", message)
    for name in dense:
        meta = layers[name]
        codes = stored_weight(tensors, name, meta)
        tensors.pop(f"{name}.input_global_scale", None)
        tensors[f"{name}.weight"] = effective_weight(
            codes, tensors.pop(f"{name}.transform", None), meta["in_features"],
            getattr(torch, meta["dtype"]))
    state.update(tensors)
    return state


def export_mxfp4(in_dir: str | Path, out_dir: str | Path, *, weight_only: bool = False,
                 strict: bool = False, overwrite: bool = False) -> Path:
    """Convert the kbbq-pl checkpoint of a gpt-oss model ``in_dir`` into gpt-oss's own MXFP4
    folder ``out_dir`` (the module docstring), with the tokenizer and generation config;
    ``weight_only`` acknowledges that the format leaves activations unquantized."""
    if not weight_only:
        raise ExportError("the mxfp4 format stores weights only: its readers leave the "
                          "activations unquantized (vLLM may round them to MXFP8 on Blackwell); "
                          "pass --weight-only to export so, or use --format compressed-tensors "
                          "for W4A4")

    def write_weights(staging: Path, tensors: dict[str, Tensor], metadata: dict[str, Any],
                      skeleton: nn.Module) -> None:
        state = mxfp4_state(tensors, metadata["layers"], skeleton, strict)
        save_safetensors({k: v.contiguous() for k, v in state.items()}, staging / WEIGHTS_NAME,
                         metadata={"format": "pt"})
        hf_config = json.loads((staging / "config.json").read_text())
        hf_config["quantization_config"] = {"quant_method": "mxfp4",
                                            "modules_to_not_convert": NOT_CONVERTED}
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")

    return export_folder(in_dir, out_dir, write_weights, kind="mxfp4", overwrite=overwrite)


__all__ = ["EXPERTS_CLASSES", "NOT_CONVERTED", "export_mxfp4", "mxfp4_state"]
