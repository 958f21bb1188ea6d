"""compressed-tensors checkpoints: export for vLLM and HF transformers, and import.

compressed-tensors is the format llm-compressor writes and vLLM and transformers (through the
``compressed-tensors`` package) read.  An FP4 linear layer ``L`` is stored as

* ``L.weight_packed``: uint8 ``[N, K/2]``, two E2M1 codes per byte, element ``2i`` in the low
  nibble: kbbq-pl's own layout, copied byte for byte;
* ``L.weight_scale``: ``float8_e4m3fn [N, K/16]`` (``nvfp4-pack-quantized``) or the E8M0
  exponents as uint8 ``[N, K/32]`` (``mxfp4-pack-quantized``);
* ``L.weight_global_scale`` (NVFP4): float32 ``[1]``, ``448 * 6 / amax``, the reciprocal of
  kbbq-pl's ``amax / (448 * 6)`` (:func:`ct_global_scale`); the value is ``q * s / gs``;
* ``L.input_global_scale`` (NVFP4 activations with a calibrated static per-tensor scale, the
  preset's ``dynamic: "local"``: block scales at run time under a static global scale);

with ``config.json``'s ``quantization_config`` built from compressed-tensors' own classes
(``QuantizationConfig`` of the ``NVFP4`` / ``MXFP4`` presets, or ``NVFP4A16`` / ``MXFP4A16`` for
a weight-only export; ``ignore`` lists every linear layer left unquantized, ``lm_head`` among
them).  What each kbbq-pl layer becomes (:func:`plan_layers`):

* no transform (I, GPTQ): FP4 as is;
* the block Hadamard of MR-GPTQ (one Sylvester Hadamard of the block size shared by every
  block): FP4 weights ``Q(W H)`` plus ``transform_config`` (``hadamard``, ``head_dim`` = block,
  online at the ``input``, the inverse folded at ``weight_input``) and the ``±1`` matrix per
  layer under ``L.<scheme>_input.weight``, as llm-compressor saves it.  compressed-tensors and
  vLLM apply ``x H / sqrt(d)``, the same matrix as :func:`kbbq_pl.transforms.hadamard` (bit
  for bit in float64, tested).  vLLM applies it online; HF transformers drops
  ``transform_config`` on load and computes another function (``Q(W H)`` on ``x``), so the
  export warns (``strict`` refuses), naming the layers and how to load it: kbbq-pl's
  :func:`kbbq_pl.from_pretrained`, or transformers followed by compressed-tensors'
  ``apply_transform_config`` with the ``input`` transforms (the weights' are folded);
* any other transform (KBBQ, WUSH: a different ``d x d`` matrix per block; HAAR: one dense
  matrix): compressed-tensors has one matrix per size, shared, so there is no slot.  The weights
  ``Q(W T^-1)`` are written in compressed-tensors layout plus ``L.input_transform``, float32
  ``[K/d, d, d]`` (``x_hat_b = T_b x_b``; a dense ``T`` as ``[1, K, K]``), which kbbq-pl reads
  back and stock readers do not apply; the export warns and ``strict`` refuses it;
* a layer padded to whole blocks (compressed-tensors has no padding): written dense, its
  dequantized ``Q(W T^-1) T`` cut to ``in_features``, and listed in ``ignore`` (the export
  warns, ``strict`` refuses);
* the experts of a mixture-of-experts model (:mod:`kbbq_pl.quant.experts`): plain FP4 only,
  the whole model written under the names of the architecture's own checkpoints
  (:func:`checkpoint_names`: each expert's ``gate_up_proj`` split into its gate and up layers;
  experts that the checkpoints store as one 3-D tensor, Llama 4's and Qwen3-VL-MoE's, expert by
  expert), the routers in ``ignore``, as llm-compressor writes them; import regroups them
  (:func:`model_names`).  Where transformers reads such experts fused only (Qwen3-VL-MoE), the
  export warns and ``strict`` refuses (:func:`hf_expert_issues`), as it does for NVFP4 experts
  that transformers merges into fused experts without their ``weight_global_scale``;
* the layers vLLM runs as one fused linear (q/k/v, gate/up: its ``qkv_proj``,
  ``gate_up_proj``) share one NVFP4 per-tensor scale in vLLM, which decodes the fused layer with
  the largest of the stored ``448 * 6 / amax``, and a mixture-of-experts layer's experts share
  one input scale per projection; ``kbbq-pl quantize`` gives them one scale
  (:func:`kbbq_pl.quant.scales.fused_weight_scales`, as llm-compressor does; the pipeline's
  static activation scales), and the export warns (``strict`` refuses) where they differ
  (:func:`_unshared_fused_scales`).

:data:`ISSUES` is the one list of what stock readers would not compute as kbbq-pl does:
:func:`plan_layers` tags each layer with its issue, :func:`describe_issues` turns the tags into
the warnings an export logs and the error ``strict`` raises.

compressed-tensors decompresses NVFP4 in bfloat16 (``unpack_fp4_from_uint8`` returns bf16):
``bf16(q * fl32(s / gs))``.  :func:`ct_global_scale` picks the float32 ``gs`` so that this equals
kbbq-pl's ``bf16(q * fl32(s * pts))`` for every E4M3 ``s`` and E2M1 ``q`` (checked over the whole
table; no float32 ``gs`` makes the float32 products agree in general).  MXFP4 values ``q * 2^e``
are exact in every format.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..formats import Format, get_format
from ..quant.experts import (
    expert_projections,
    fused_experts,
    has_plain_experts,
    unfuse_experts,
)
from ..quant.modules import fused_groups, in_out_features, is_linear, is_transposed
from ..transforms.fit import hadamard, transform_inputs
from .checkpoint import (
    CONFIG_NAME,
    PROCESSOR_FILES,
    TOKENIZER_FILES,
    WEIGHTS_NAME,
    CheckpointError,
    checkpoint_contents,
    checkpoint_layers,
    copy_sentence_transformers_files,
    declared_dtype,
    drop_loader,
    empty_model,
    is_causal_lm_config,
    is_causal_model,
    load_safetensors,
    memory_names,
    read_metadata,
    read_tensors,
    stored_weight,
    unwrapped,
    write_hf_files,
)
from .fileio import check_output, save_safetensors, write_folder
from .hub import local_folder
from .streaming import SafetensorsSource

log = logging.getLogger(__name__)

CT_FORMATS = {"e4m3": "nvfp4-pack-quantized", "e8m0": "mxfp4-pack-quantized"}
"""compressed-tensors format of each kbbq-pl E2M1 block-scale kind."""
PRESETS = {("e4m3", False): "NVFP4", ("e4m3", True): "NVFP4A16",
           ("e8m0", False): "MXFP4", ("e8m0", True): "MXFP4A16"}
"""compressed-tensors preset scheme by (block-scale kind, weight-only)."""
IMPORT_FORMATS = {"nvfp4-pack-quantized": "nvfp4", "mxfp4-pack-quantized": "mxfp4_even"}
"""kbbq-pl format of an imported compressed-tensors layer.  MXFP4 activations round their E8M0
scale as compressed-tensors' reference does (``round_to_power_2``: the amax rounded to one
mantissa bit, then floor, torchao's EVEN); weights decode the same under every rounding."""
HADAMARD_SCHEME = "kbbq_hadamard"
INPUT_TRANSFORM = "input_transform"
EXTENSION_KEY = "kbbq_pl"
HF_SIDE_FILES = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt",
                 "chat_template.jinja", "chat_template.json", "generation_config.json",
                 *PROCESSOR_FILES)
"""Files copied from a kbbq-pl folder into its export: the tokenizer, generation config and
an image-text model's processor (and a sentence-transformers model's modules:
:func:`~kbbq_pl.io.checkpoint.copy_sentence_transformers_files`)."""


class ExportError(ValueError):
    """A kbbq-pl model that compressed-tensors cannot express (as asked)."""


def require_compressed_tensors() -> None:
    """Raise a clear ImportError when the ``compressed-tensors`` package is missing."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "reading or writing compressed-tensors folders needs the compressed-tensors "
            "package (Python >= 3.11): pip install 'kbbq-pl[export]'") from error


# ------------------------------------------------------------------ per-tensor scales

_E4M3_SCALES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_E2M1_VALUES = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def bf16_decodes_agree(pts: Tensor, gs: Tensor) -> bool:
    """Whether kbbq-pl's ``bf16(q * (s * pts))`` equals compressed-tensors'
    ``bf16(q * (s / gs))`` for every positive finite E4M3 ``s`` and E2M1 magnitude ``q``."""
    ours = (_E2M1_VALUES[:, None] * (_E4M3_SCALES * pts.float())[None]).to(torch.bfloat16)
    theirs = (_E2M1_VALUES[:, None] * (_E4M3_SCALES / gs.float())[None]).to(torch.bfloat16)
    return bool(torch.equal(ours, theirs))


def _reciprocal(value: Tensor, agrees: Callable[[Tensor], bool], what: str) -> Tensor:
    """The float32 nearest ``1 / value`` for which ``agrees`` holds (the nearest itself, or
    the closest of its neighbours within 8 ulps), as ``[1]``."""
    nearest = (1.0 / value.detach().float().reshape(1)).contiguous()
    if not torch.isfinite(nearest).all() or float(nearest) <= 0:
        raise ExportError(f"{what}: per-tensor scale {float(value)!r} has no finite positive "
                          "reciprocal")
    bits = nearest.view(torch.int32)
    for step in sorted(range(-8, 9), key=abs):
        candidate = (bits + step).view(torch.float32)
        if agrees(candidate):
            return candidate
    log.warning("%s: no float32 reciprocal of %r decodes identically in bfloat16; using the "
                "nearest (some values differ by one bfloat16 ulp)", what, float(value))
    return nearest


def ct_global_scale(pts: Tensor, what: str = "tensor") -> Tensor:
    """compressed-tensors' ``global_scale`` ``[1]`` for kbbq-pl's per-tensor scale ``pts``:
    ``1 / pts`` in float32, nudged by an ulp where needed so that compressed-tensors' bfloat16
    decompression equals kbbq-pl's (:func:`bf16_decodes_agree`)."""
    return _reciprocal(pts, lambda gs: bf16_decodes_agree(pts, gs), what)


def kbbq_global_scale(gs: Tensor, what: str = "tensor", exact: str | None = None) -> Tensor:
    """kbbq-pl's per-tensor scale (a 0-d tensor) for compressed-tensors' ``global_scale``,
    the inverse of :func:`ct_global_scale`.  Reciprocals are not one-to-one in float32, so
    kbbq-pl's export also records its exact scale (``exact``, :meth:`float.hex`): it is
    returned when it still maps to ``gs``."""
    if exact is not None:
        value = torch.tensor(float.fromhex(exact), dtype=torch.float32)
        if torch.equal(ct_global_scale(value, what), gs.float().reshape(1)):
            return value
    return _reciprocal(gs, lambda pts: bf16_decodes_agree(pts, gs), what).reshape(())


# ------------------------------------------------------------------ transforms and weights

def transform_kind(transform: Tensor | None, block: int) -> str:
    """``none``, ``hadamard`` (every block is the Sylvester Hadamard of the format's block,
    bit for bit) or ``custom`` (per-block matrices, or a dense one)."""
    if transform is None:
        return "none"
    if transform.dim() == 3 and transform.shape[-1] == block:
        reference = hadamard(block).to(transform.dtype).expand_as(transform)
        if torch.equal(transform, reference):
            return "hadamard"
    return "custom"


def effective_weight(codes: Any, transform: Tensor | None, in_features: int,
                     dtype: torch.dtype) -> Tensor:
    """The dense weight a stored layer multiplies its input ``x`` by: ``Q(W T^-1) T`` (the
    dequantized codes, the transform folded back in float64), cut to ``in_features``."""
    if transform is None:
        return codes.dequantize(dtype)[:, :in_features].contiguous()
    t = transform.to(torch.float64)
    folded = transform_inputs(codes.dequantize(torch.float64), t.transpose(-1, -2))
    return folded[:, :in_features].to(dtype).contiguous()


def _stored_transform(transform: Tensor) -> Tensor:
    """A transform as ``input_transform``: blocks ``[K/d, d, d]``, a dense ``[K, K]`` as one."""
    return (transform if transform.dim() == 3 else transform[None]).float().contiguous()


def _loaded_transform(stored: Tensor, block: int) -> Tensor:
    """Inverse of :func:`_stored_transform` for a layer of the given format block."""
    return stored[0] if stored.shape[0] == 1 and stored.shape[-1] != block else stored


# ------------------------------------------------------------------ export

@dataclass(frozen=True)
class ExportLayer:
    """How one kbbq-pl layer is exported: ``fp4`` (compressed-tensors FP4) or ``dense``, with
    its transform ``none`` / ``hadamard`` / ``custom`` and why when not plain FP4."""

    name: str
    fp4: bool
    transform: str
    issue: str | None = None   # a key of ISSUES
    reason: str | None = None


LOAD_HINT = "load it with kbbq_pl.from_pretrained(folder)"

ISSUES = {
    "padded": ("in_features not a multiple of the block (kbbq-pl zero-pads; compressed-tensors "
               "has no padding): written dense, dequantized, and listed in ignore; stock readers "
               "compute exact weights but leave these layers' activations unquantized"),
    "transform": (f"per-block (or dense) transforms with no compressed-tensors slot (one shared "
                  f"matrix per size): written as <layer>.{INPUT_TRANSFORM}, which only kbbq-pl "
                  "applies; stock readers (vLLM, transformers) drop it and compute another "
                  f"function; {LOAD_HINT}"),
    "hadamard": ("block Hadamard (MR-GPTQ, RTN-HADAMARD) written as a hadamard transform_config: "
                 "vLLM applies it online, but HF transformers drops transform_config on load and "
                 f"computes another function; {LOAD_HINT}, or after transformers' "
                 "from_pretrained call compressed-tensors' apply_transform_config(model, config) "
                 "with only the config's location 'input' transforms (the weight_input ones are "
                 "folded into the weights)"),
    "by_expert": ("experts that this architecture's checkpoints store fused, written expert by "
                  "expert (gate_proj, up_proj, down_proj) as llm-compressor writes them: vLLM "
                  "reads them, but HF transformers reads this architecture's experts fused only "
                  f"and would leave them at random; serve it with vLLM, or {LOAD_HINT}"),
    "fused_scales": ("NVFP4 layers that vLLM runs under one per-tensor scale with different "
                     "ones (q/k/v and gate/up, one fused linear each; the inputs of one "
                     "projection of a mixture-of-experts layer's experts): a checkpoint "
                     "quantized or fine-tuned before kbbq-pl shared them, quantized through "
                     "torchao's quantize_ without KBBQConfig.filter_fn, or with a fitted "
                     "transform; vLLM decodes the weights (rounds the inputs) with one of "
                     "them, so the others' outputs are off by the ratio (clipped); HF "
                     "transformers reads them exactly; requantize "
                     "(kbbq-pl quantize shares them for data-free transforms), or "
                     f"{LOAD_HINT}"),
    "expert_global_scale": ("NVFP4 experts that HF transformers merges into its fused experts: "
                            "the installed transformers dequantizes them without their "
                            "weight_global_scale (huggingface/transformers#48371), so its experts "
                            "are off by that scale; vLLM's loader reads it; "
                            f"{LOAD_HINT}, or export MXFP4"),
    "fused_partly": ("FP4 layers whose siblings that vLLM fuses with them into one linear (q/k/v, "
                     "gate/up) are left in full precision (a recipe's layers.ignore, or "
                     "dense): vLLM refuses to load a fused layer that mixes schemes; HF "
                     "transformers reads it; quantize or ignore the whole group"),
}
"""What stock compressed-tensors readers would not compute as kbbq-pl does, by issue: the
export logs one warning per issue present (:func:`describe_issues`), ``strict`` refuses."""


def describe_issues(plans: Mapping[str, ExportLayer]) -> list[str]:
    """One line per kind of layer stock readers do not compute as kbbq-pl does
    (:data:`ISSUES`): how many layers, the first ones by name, and what to do."""
    lines = []
    for issue, text in ISSUES.items():
        names = [n for n, plan in plans.items() if plan.issue == issue]
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3
                                             else "")
            lines.append(f"{len(names)} of {len(plans)} layers ({shown}): {text}")
    return lines


def is_mxfp4(fmt: Format) -> bool:
    """Whether ``fmt`` stores MXFP4 as its readers decode it: E2M1 in blocks of 32 under an
    E8M0 scale, values ``q * 2^e`` (every rounding of the scale but ``no_clip``)."""
    return (fmt.element == "e2m1" and fmt.granularity == "block" and fmt.scale_kind == "e8m0"
            and fmt.block_size == 32 and fmt.e8m0_rounding != "no_clip")


def _check_format(name: str, fmt: Format) -> None:
    nvfp4 = (fmt.element == "e2m1" and fmt.granularity == "block" and fmt.scale_kind == "e4m3"
             and fmt.block_size == 16 and fmt.global_scale)
    if not (nvfp4 or is_mxfp4(fmt)):
        extra = (" (its values are q * 2^e / 0.75, which no compressed-tensors scale expresses)"
                 if fmt.e8m0_rounding == "no_clip" and fmt.scale_kind == "e8m0" else "")
        raise ExportError(f"{name}: format {fmt.name}{extra} has no compressed-tensors "
                          "equivalent; nvfp4 and mxfp4 (floor, ceil, even, rceil) do")


def plan_layers(layers: Mapping[str, Mapping[str, Any]], tensors: Mapping[str, Tensor],
                linear_types: Mapping[str, str], strict: bool,
                expert_issues: Mapping[tuple[str, str], str] | None = None,
                weight_only: bool = False) -> dict[str, ExportLayer]:
    """What each quantized layer becomes (the module docstring); ``linear_types`` maps every
    linear module of the architecture to its class name; ``expert_issues``: the issue of
    each experts module's layers by (module, block-scale kind) (:func:`hf_expert_issues`);
    ``weight_only``: the export leaves the activations unquantized.
    Raises :class:`ExportError` for what cannot be written, and with ``strict`` for anything
    stock readers would not compute as kbbq-pl does (:data:`ISSUES`: per-block transforms, the
    block Hadamard that transformers drops, dense fallbacks, experts transformers does not
    read as written, layers vLLM fuses with different per-tensor scales), naming the
    layers."""
    plans: dict[str, ExportLayer] = {}
    for name, meta in layers.items():
        fmt = get_format(meta["format"])
        _check_format(name, fmt)
        kind = transform_kind(tensors.get(f"{name}.transform"), fmt.block_size or 1)
        if linear_types.get(name) == "expert":
            if kind != "none" or meta["padded_in"] != meta["in_features"]:
                raise ExportError(f"{name}: an expert of a mixture-of-experts layer exports as "
                                  "plain FP4 only (no transform, no padding); this one has "
                                  + (f"a {kind} transform" if kind != "none" else "padding"))
            experts = name.rsplit(".", 2)[0]
            plans[name] = ExportLayer(name, True, kind, (expert_issues or {}).get(
                (experts, fmt.scale_kind)))
            continue
        if linear_types.get(name) != "Linear":
            raise ExportError(f"{name}: compressed-tensors quantizes torch.nn.Linear layers; "
                              f"this one is a {linear_types.get(name, 'missing module')}")
        if meta["padded_in"] != meta["in_features"]:
            plans[name] = ExportLayer(name, False, kind, "padded", (
                f"in_features {meta['in_features']} is not a multiple of the {fmt.name} block "
                f"{fmt.block_size}: written dense, dequantized"))
        elif kind == "custom":
            plans[name] = ExportLayer(name, True, kind, "transform")
        elif kind == "hadamard":
            plans[name] = ExportLayer(name, True, kind, "hadamard")
        else:
            plans[name] = ExportLayer(name, True, kind)
    for name in _unshared_fused_scales(plans, tensors, linear_types, weight_only):
        if plans[name].issue is None:
            plans[name] = replace(plans[name], issue="fused_scales")
    fp4 = {n for n, plan in plans.items() if plan.fp4}
    for group in fused_groups([n for n, kind in linear_types.items() if kind == "Linear"]):
        if fp4.intersection(group) and not fp4.issuperset(group):
            for name in fp4.intersection(group):
                if plans[name].issue is None:
                    plans[name] = replace(plans[name], issue="fused_partly")
    issues = describe_issues(plans)
    if strict and issues:
        requantize = any(plan.issue in ("padded", "transform", "hadamard", "fused_scales")
                         for plan in plans.values())
        raise ExportError(
            "--strict: stock compressed-tensors readers (vLLM, transformers) would not compute "
            f"what kbbq-pl computes: {'; '.join(issues)}. Export without --strict to write "
            "them as documented" + (
                ", or, for every reader, quantize without a transform (transform identity: "
                "i_*, gptq_* recipes; unaligned: skip for the padded layers)" if requantize
                else ""))
    return plans


def _unshared_fused_scales(plans: Mapping[str, ExportLayer], tensors: Mapping[str, Tensor],
                           linear_types: Mapping[str, str], weight_only: bool) -> list[str]:
    """The FP4 layers whose NVFP4 per-tensor scales vLLM replaces by one that differ within
    their group: the weight and input scales of fused layers
    (:func:`~kbbq_pl.quant.modules.fused_groups`), and, unless ``weight_only``, the input
    scales of one projection of a mixture-of-experts layer's experts."""
    fp4 = [n for n, plan in plans.items() if plan.fp4]
    inputs = () if weight_only else ("input_global_scale",)
    experts = {n.rsplit(".", 2)[0] for n, kind in linear_types.items() if kind == "expert"}
    checks = [(group, ("weight_global_scale", *inputs)) for group in fused_groups(fp4)]
    checks += [(group, inputs) for group in expert_projections(fp4, experts.__contains__)]
    unshared = []
    for group, suffixes in checks:
        for suffix in suffixes:
            values = [tensors.get(f"{name}.{suffix}") for name in group]
            if any(v is not None for v in values) and not all(
                    v is not None and torch.equal(v, values[0]) for v in values):
                unshared += group
                break
    return unshared


def _uniform(plans: Mapping[str, ExportLayer], layers: Mapping[str, Mapping[str, Any]],
             field: Callable[[Mapping[str, Any]], Any], what: str) -> Any:
    values = {n: field(layers[n]) for n, p in plans.items() if p.fp4}
    distinct = set(values.values())
    if len(distinct) > 1:
        first, second = list(distinct)[:2]
        a = next(n for n, v in values.items() if v == first)
        b = next(n for n, v in values.items() if v == second)
        raise ExportError(f"one compressed-tensors scheme covers every layer, but {what} "
                          f"differs: {a} has {first!r}, {b} has {second!r}")
    return distinct.pop() if distinct else None


def quantization_config(scale_kind: str, weight_only: bool, ignore: list[str]):
    """compressed-tensors' ``QuantizationConfig`` of the preset for ``scale_kind``: targets
    ``Linear``, the listed layers ignored, the compressed format."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    scheme = preset_name_to_scheme(PRESETS[(scale_kind, weight_only)], ["Linear"])
    scheme.format = CT_FORMATS[scale_kind]
    return QuantizationConfig(config_groups={"group_0": scheme}, format=CT_FORMATS[scale_kind],
                              quantization_status="compressed", ignore=sorted(ignore))


def hadamard_transform_config(block: int, ignore: list[str]):
    """compressed-tensors' ``TransformConfig`` of MR-GPTQ's block Hadamard: applied online at
    the input of every targeted ``Linear``, its inverse folded into the weight."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    ignored = sorted(ignore)
    return TransformConfig(config_groups={HADAMARD_SCHEME: TransformScheme(
        type="hadamard", head_dim=block, apply=[
            TransformArgs(targets=["Linear"], location="input", ignore=ignored),
            TransformArgs(targets=["Linear"], location="weight_input", inverse=True,
                          ignore=ignored),
        ])})


def compressed_tensors_state(
    tensors: dict[str, Tensor], layers: Mapping[str, Mapping[str, Any]],
    plans: Mapping[str, ExportLayer], weight_only: bool,
) -> tuple[dict[str, Tensor], dict[str, dict[str, str]]]:
    """kbbq-pl checkpoint ``tensors`` (:func:`kbbq_pl.io.checkpoint.checkpoint_contents`) in
    compressed-tensors layout (module docstring), and kbbq-pl's exact per-tensor scales per
    layer (:meth:`float.hex`, for :func:`kbbq_global_scale`); ``tensors`` is consumed."""
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    out: dict[str, Tensor] = {}
    exact: dict[str, dict[str, str]] = {}
    for name, meta in layers.items():
        plan = plans[name]
        transform = tensors.pop(f"{name}.transform", None)
        act_scale = tensors.pop(f"{name}.input_global_scale", None)
        if f"{name}.bias" in tensors:
            out[f"{name}.bias"] = tensors.pop(f"{name}.bias")
        codes = stored_weight(tensors, name, meta)
        if not plan.fp4:
            out[f"{name}.weight"] = effective_weight(codes, transform, meta["in_features"],
                                                     getattr(torch, meta["dtype"]))
            continue
        out[f"{name}.weight_packed"] = codes.qdata.contiguous()
        out[f"{name}.weight_scale"] = codes.scale.view(torch.uint8).contiguous() \
            if codes.fmt.scale_kind == "e8m0" else codes.scale.contiguous()
        if codes.global_scale is not None:
            out[f"{name}.weight_global_scale"] = ct_global_scale(codes.global_scale, name)
            exact.setdefault(name, {})["weight"] = float(codes.global_scale).hex()
        if act_scale is not None and not weight_only:
            out[f"{name}.input_global_scale"] = ct_global_scale(act_scale, f"{name}.input")
            exact.setdefault(name, {})["input"] = float(act_scale).hex()
        if plan.transform == "hadamard":
            block = transform.shape[-1]
            out[f"{name}.{HADAMARD_SCHEME}_input.weight"] = deterministic_hadamard_matrix(
                block, torch.float32)
        elif plan.transform == "custom":
            out[f"{name}.{INPUT_TRANSFORM}"] = _stored_transform(transform)
    out.update(tensors)
    return out, exact


EXPERT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")
"""The tensors of an FP4 expert layer in compressed-tensors layout."""


def checkpoint_names(state: dict[str, Tensor], skeleton: nn.Module) -> dict[str, Tensor]:
    """``state`` (kbbq-pl's module names) under the names the architecture's checkpoints use,
    as transformers' ``save_pretrained`` writes them: its conversion mapping reversed
    (``revert_weight_conversion``).  ``skeleton``: the architecture with its experts fused.
    A fused experts module's per-expert tensors (``<experts>.<e>.gate_up_proj.<suffix>``,
    ``down_proj``) are stacked into the fused weight that the mapping splits into the stored
    per-expert ones (Qwen3-MoE: ``<experts>.<e>.gate_proj`` and ``up_proj``, each half of the
    rows; Mixtral: ``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2``); a per-tensor scale is
    shared by the gate and up halves.  Experts that the checkpoints store as one 3-D tensor
    (Llama 4, Qwen3-VL-MoE) are written expert by expert under the stored experts' name, as
    llm-compressor writes them and vLLM reads them (:func:`_expert_by_expert`).  ``state`` is
    consumed."""
    from transformers.core_model_loading import revert_weight_conversion

    out: dict[str, Tensor] = {}
    for prefix, experts in fused_experts(skeleton).items():
        count = experts.down_proj.shape[0]
        for proj in ("gate_up_proj", "up_proj", "down_proj"):
            fused = f"{prefix}.{proj}"
            stored_fused = stored_fused_experts(skeleton, fused, count)
            if stored_fused is not None:
                stored_fused = stored_fused.removesuffix(f".{proj}")  # checked by the export
            for suffix in EXPERT_SUFFIXES:
                keys = [f"{prefix}.{e}.{proj}.{suffix}" for e in range(count)]
                if keys[0] not in state:
                    continue
                parts = [state.pop(key) for key in keys]
                if stored_fused is not None:
                    out.update(_expert_by_expert(stored_fused, proj, suffix, parts))
                    continue
                stacked = torch.stack(parts)
                if parts[0].dim() == 1 and proj == "gate_up_proj":
                    stacked = torch.stack([stacked, stacked], dim=1)  # [experts, 2, 1]
                stored = revert_weight_conversion(skeleton, {fused: stacked})
                for key, value in stored.items():
                    value = value.reshape(parts[0].shape) if parts[0].dim() == 1 else value
                    out[f"{key.removesuffix('.weight')}.{suffix}"] = value.contiguous()
    out.update(revert_weight_conversion(skeleton, state))
    return out


BY_EXPERT = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",),
             "down_proj": ("down_proj",)}
"""The linear layers of one expert, per fused projection, as llm-compressor names them where
the checkpoints store the experts fused (its ``SequentialLlama4TextMoe``, and vLLM's loaders'
per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` mapping)."""


def stored_fused_experts(skeleton: nn.Module, fused: str, count: int) -> str | None:
    """The stored name of the one 3-D tensor that holds the fused projection ``fused`` (of
    ``count`` experts) in the architecture's checkpoints (Llama 4's, Qwen3-VL-MoE's and
    gpt-oss's ``<experts>.gate_up_proj``; Granite MoE's ``block_sparse_moe.input_linear.weight``),
    ``None`` where they hold it expert by expert: transformers' conversion mapping reversed on
    a probe ``[count, 2, 1]``."""
    from transformers.core_model_loading import revert_weight_conversion

    ((key, value), *more) = revert_weight_conversion(
        skeleton, {fused: torch.zeros(count, 2, 1)}).items()
    return key if not more and value.dim() == 3 else None


def check_experts_export(skeleton: nn.Module) -> None:
    """Raise :class:`ExportError` for fused experts that the checkpoints store whole
    (:func:`stored_fused_experts`) and that do not write expert by expert as llm-compressor
    writes them (:data:`BY_EXPERT`): plain gated MLPs under their experts module's stored
    name (not gpt-oss's, nor Granite MoE's ``input_linear``)."""
    for prefix, experts in fused_experts(skeleton).items():
        fused = f"{prefix}.down_proj"
        stored = stored_fused_experts(skeleton, fused, experts.down_proj.shape[0])
        if stored is None:
            continue
        why = ("they are not plain gated MLPs (biases, or their own gating)"
               if not has_plain_experts(experts) else
               f"they are stored as {stored}, under no experts module's name"
               if not stored.endswith(".down_proj") else None)
        if why is not None:
            raise ExportError(
                f"{prefix}: {type(skeleton).__name__} checkpoints store these experts as one "
                f"3-D tensor and {why}, which compressed-tensors does not express expert by "
                "expert; export gpt-oss's MXFP4 experts with --format mxfp4, or serve the "
                "kbbq-pl folder (kbbq-pl serve)")


def _expert_by_expert(stored_prefix: str, proj: str, suffix: str,
                      parts: list[Tensor]) -> dict[str, Tensor]:
    """Each expert's ``parts`` (its layer ``proj``'s tensor ``suffix``) under the stored experts
    module ``stored_prefix`` as :data:`BY_EXPERT` names them: ``gate_up_proj``'s rows split into
    the gate's and the up's halves, a per-tensor scale shared by both."""
    out = {}
    for e, part in enumerate(parts):
        names = BY_EXPERT[proj]
        pieces = [part] * len(names) if part.dim() == 1 else part.chunk(len(names))
        for name, piece in zip(names, pieces):
            out[f"{stored_prefix}.{e}.{name}.{suffix}"] = piece.clone()
    return out


def hf_expert_issues(skeleton: nn.Module) -> dict[tuple[str, str], str]:
    """How HF transformers reads each fused experts module of ``skeleton`` as exported (an
    :data:`ISSUES` key by (experts module, block-scale kind); absent: as written):

    * written expert by expert where the checkpoints store them fused
      (:func:`stored_fused_experts`), it reads them only where its compressed-tensors loader
      swaps the class for linear layers (``MODULES_TO_PATCH_FOR_QUANTIZATION``: Llama 4's
      ``SequentialLlama4TextExperts``): elsewhere ``by_expert``;
    * merged into the fused weight (Qwen3-MoE, Mixtral, DeepSeek-V3, ...), NVFP4 experts lose
      their ``weight_global_scale`` in the transformers that has that bug
      (:func:`hf_drops_expert_global_scale`): ``expert_global_scale``."""
    from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION
    from transformers.utils.quantization_config import QuantizationMethod

    def swapped(experts: nn.Module) -> bool:
        patch = MODULES_TO_PATCH_FOR_QUANTIZATION.get(type(experts).__name__, {})
        return QuantizationMethod.COMPRESSED_TENSORS in patch.get("quantization_methods", ())

    drops_global_scale = hf_drops_expert_global_scale()
    issues = {}
    for prefix, experts in fused_experts(skeleton).items():
        if swapped(experts):
            continue
        if stored_fused_experts(skeleton, f"{prefix}.down_proj", experts.down_proj.shape[0]):
            issues.update({(prefix, "e4m3"): "by_expert", (prefix, "e8m0"): "by_expert"})
        elif drops_global_scale:
            issues[(prefix, "e4m3")] = "expert_global_scale"
    return issues


def hf_drops_expert_global_scale() -> bool:
    """Whether the installed transformers decompresses merged MoE experts without their NVFP4
    ``weight_global_scale`` (huggingface/transformers#48371; transformers 5.24 does): its
    experts' decompression never names the tensor."""
    import inspect

    from transformers.integrations import compressed_tensors

    try:
        return "weight_global_scale" not in inspect.getsource(compressed_tensors)
    except OSError:  # installed without its source: warn, as for 5.24
        return True


def _stored_module_names(names: list[str], skeleton: nn.Module) -> list[str]:
    """Module ``names`` as the architecture's checkpoints name them (:func:`checkpoint_names`)."""
    dummies = {f"{name}.weight": torch.empty(0) for name in names}
    return sorted(key.removesuffix(".weight") for key in checkpoint_names(dummies, skeleton))


def _write_export(staging: Path, tensors: dict[str, Tensor], layers: dict[str, dict[str, Any]],
                  skeleton: nn.Module, *, weight_only: bool, strict: bool,
                  recipe: Mapping[str, Any] | None) -> None:
    """Write the compressed-tensors weights and ``quantization_config`` into ``staging``,
    which already holds the HuggingFace ``config.json``; ``skeleton``: the architecture
    (:func:`_skeleton`).  A model with mixture-of-experts layers is written under the names
    of the architecture's checkpoints (:func:`checkpoint_names`), its routers ignored."""
    from compressed_tensors.compressors import ModelCompressor

    linear_types = _linear_types(skeleton)
    moe = bool(fused_experts(skeleton))
    check_experts_export(skeleton)
    plans = plan_layers(layers, tensors, linear_types, strict, hf_expert_issues(skeleton),
                        weight_only)
    dense_experts = [n for n, kind in linear_types.items() if kind == "expert" and n not in plans]
    if dense_experts:
        raise ExportError(f"{dense_experts[0]} and {len(dense_experts) - 1} more experts are in "
                          "full precision: the export writes quantized experts only")
    fp4 = [n for n, p in plans.items() if p.fp4]
    if not fp4:
        raise ExportError("no layer can be written in compressed-tensors FP4: "
                          + "; ".join(describe_issues(plans)))
    for line in describe_issues(plans):
        log.warning("compressed-tensors export: %s", line)
    scale_kind = _uniform(plans, layers, lambda m: get_format(m["format"]).scale_kind, "format")
    act_scale = _uniform(plans, layers, lambda m: m["act_scale"], "act_scale")
    if scale_kind == "e4m3" and act_scale == "dynamic" and not weight_only:
        raise ExportError(
            "NVFP4 activations in compressed-tensors keep a static per-tensor scale "
            "(dynamic: local, with input_global_scale); this model's activation scale is "
            "dynamic (the amax of every call), which has no equivalent (dynamic: true with "
            "tensor_group has no per-tensor scale at all): export weight-only "
            "(--weight-only) or quantize with act_scale: static")
    ignore = sorted(n for n, kind in linear_types.items()
                    if kind in ("Linear", "router") and not (n in plans and plans[n].fp4))
    stored_names = ((lambda names: _stored_module_names(names, skeleton)) if moe else sorted)
    config = quantization_config(scale_kind, weight_only, stored_names(ignore))
    hadamards = [n for n in fp4 if plans[n].transform == "hadamard"]
    transform_config = None
    if hadamards:
        without = [n for n in fp4 if plans[n].transform != "hadamard"]
        block = get_format(layers[hadamards[0]]["format"]).block_size
        transform_config = hadamard_transform_config(block, stored_names(ignore + without))
    state, exact_scales = compressed_tensors_state(tensors, layers, plans, weight_only)
    if moe:
        state = checkpoint_names(state, skeleton)
    save_safetensors(state, staging / WEIGHTS_NAME, metadata={"format": "pt"})
    ModelCompressor(quantization_config=config,
                    transform_config=transform_config).update_config(str(staging))
    hf_config = json.loads((staging / "config.json").read_text())
    hf_config["quantization_config"][EXTENSION_KEY] = {
        "recipe": dict(recipe or {}),
        "formats": sorted({layers[n]["format"] for n in fp4}),
        "input_transforms": {n: list(state[f"{n}.{INPUT_TRANSFORM}"].shape)
                             for n in fp4 if plans[n].transform == "custom"},
        "dense_layers": {n: p.reason for n, p in plans.items() if not p.fp4},
        "per_tensor_scales": exact_scales,
    }
    (staging / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")


def _skeleton(config: Any, causal: bool) -> nn.Module:
    """The architecture of ``config`` on the meta device (no memory, no initialization); a
    copy of ``config`` (building a model sets the dtype of the config it is given)."""
    with torch.device("meta"):
        return empty_model(copy.deepcopy(config), causal)


def _linear_shapes(skeleton: nn.Module) -> dict[str, tuple[int, int]]:
    """Every linear module of the architecture ``skeleton`` (experts unfused, as
    :func:`_linear_types` names them) with its ``(out_features, in_features)``."""
    skeleton = copy.deepcopy(skeleton)
    unfuse_experts(skeleton)
    return {name: in_out_features(module)[::-1] for name, module in skeleton.named_modules()
            if is_linear(module)}


def _linear_types(skeleton: nn.Module) -> dict[str, str]:
    """Every linear module of the architecture ``skeleton`` (:func:`_skeleton`) with its
    class name (``Linear`` or ``Conv1D``), as it is before quantization; ``expert`` for the
    linear layers of fused experts (:func:`kbbq_pl.quant.experts.unfuse_experts`) and
    ``router`` for the other 2-D weights of a mixture-of-experts model (its routers)."""
    from ..quant.modules import weights_outside_linears

    skeleton = copy.deepcopy(skeleton)
    experts = tuple(f"{name}." for name in unfuse_experts(skeleton))
    types = {}
    for name, module in skeleton.named_modules():
        if is_linear(module):
            types[name] = ("expert" if name.startswith(experts) else
                           "Conv1D" if is_transposed(module) else "Linear")
    if experts:
        types.update({name.removesuffix(".weight"): "router"
                      for name, shape in weights_outside_linears(skeleton).items()
                      if name.endswith(".weight") and len(shape) == 2})
    return types


def export_folder(in_dir: str | Path, out_dir: str | Path,
                  write_weights: Callable[[Path, dict[str, Tensor], dict[str, Any], nn.Module],
                                          None], *, kind: str, overwrite: bool = False) -> Path:
    """Convert the kbbq-pl checkpoint ``in_dir`` into a serving format's folder ``out_dir``
    (``kind``): its ``config.json``, tokenizer and generation config copied, then
    ``write_weights(staging, tensors, metadata, skeleton)`` (the checkpoint's tensors under
    kbbq-pl's module names, its metadata, the architecture on the meta device) writes the
    weights and the ``quantization_config``.  ``in_dir`` (a local folder or a HuggingFace Hub
    id) is only read; the write is atomic."""
    from transformers import AutoConfig

    source = local_folder(in_dir)
    target = check_output(out_dir, overwrite=overwrite, sources=[source])
    metadata = read_metadata(source)
    tensors = memory_names(read_tensors(source), metadata)
    skeleton = _skeleton(AutoConfig.from_pretrained(source), metadata["causal_lm"])

    def write(staging: Path) -> None:
        for name in ("config.json", *HF_SIDE_FILES):
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
        copy_sentence_transformers_files(source, staging)
        drop_loader(staging / "config.json")  # its readers do not need kbbq-pl
        hf_config = json.loads((staging / "config.json").read_text())
        if not hf_config.get("architectures") and metadata.get("model_class"):
            # checkpoints written before write_hf_files named it; readers need the class
            hf_config["architectures"] = [metadata["model_class"]]
            (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        write_weights(staging, tensors, metadata, skeleton)

    return write_folder(target, write, kind=kind, overwrite=overwrite, sources=[source])


def export_compressed_tensors(
    in_dir: str | Path, out_dir: str | Path, *, weight_only: bool = False,
    strict: bool = False, overwrite: bool = False,
) -> Path:
    """Convert the kbbq-pl checkpoint ``in_dir`` into a compressed-tensors folder ``out_dir``
    (module docstring), with the tokenizer and generation config; ``in_dir`` is only read."""
    require_compressed_tensors()

    def write_weights(staging: Path, tensors: dict[str, Tensor], metadata: dict[str, Any],
                      skeleton: nn.Module) -> None:
        _write_export(staging, tensors, metadata["layers"], skeleton, weight_only=weight_only,
                      strict=strict, recipe=metadata.get("recipe"))

    return export_folder(in_dir, out_dir, write_weights, kind="compressed-tensors",
                         overwrite=overwrite)


def save_compressed_tensors(
    model: nn.Module, out_dir: str | Path, *, tokenizer: Any = None,
    recipe: Mapping[str, Any] | None = None, weight_only: bool = False, strict: bool = False,
    overwrite: bool = False,
) -> Path:
    """Write the quantized ``model`` as a compressed-tensors folder (module docstring) through
    the tensors :func:`kbbq_pl.io.checkpoint.save_quantized` writes."""
    require_compressed_tensors()
    model = unwrapped(model)
    if not checkpoint_layers(model):
        raise ValueError("the model has no quantized layers to save")
    skeleton = _skeleton(model.config, is_causal_model(model))

    def write(staging: Path) -> None:
        write_hf_files(staging, model, tokenizer)
        tensors, layers, _ = checkpoint_contents(model)
        _write_export(staging, tensors, layers, skeleton, weight_only=weight_only,
                      strict=strict, recipe=recipe)

    return write_folder(out_dir, write, kind="compressed-tensors", overwrite=overwrite)


# ------------------------------------------------------------------ import

def _quantization_block(folder: Path) -> dict[str, Any] | None:
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        block = json.loads(path.read_text()).get("quantization_config")
    except (json.JSONDecodeError, AttributeError):
        return None
    return block if isinstance(block, dict) else None


def is_compressed_tensors_folder(folder: str | Path) -> bool:
    """Whether ``folder``'s ``config.json`` names compressed-tensors quantization."""
    block = _quantization_block(Path(folder))
    return block is not None and block.get("quant_method") == "compressed-tensors"


def _read_tensors(folder: Path) -> dict[str, Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors file")
    tensors: dict[str, Tensor] = {}
    for file in files:
        tensors.update(load_safetensors(file))
    return tensors


def _matched(skeleton: nn.Module, sources: Mapping[str, list[str]], targets: Any,
             ignore: Any) -> set[str]:
    """The layers of ``sources`` (layer -> the stored layers it comes from: :func:`model_names`)
    that compressed-tensors' ``targets`` minus ``ignore`` match, as compressed-tensors matches
    the stored layers (an expert layer, not a module of the fused ``skeleton``, as a linear
    one); a layer matches when all its stored layers do."""
    from compressed_tensors.utils import is_match

    modules = dict(skeleton.named_modules())
    with torch.device("meta"):
        probe = nn.Linear(1, 1)
    names = set()
    for layer, stored in sources.items():
        hits = [is_match(name, modules.get(layer, probe), targets, ignore) for name in stored]
        if any(hits) and not all(hits):
            raise CheckpointError(f"{layer}: its stored layers {stored} are not all matched by "
                                  f"{list(targets)} minus {list(ignore or [])}")
        if hits and all(hits):
            names.add(layer)
    return names


def _scheme_of_layers(config: Any, skeleton: nn.Module,
                      sources: Mapping[str, list[str]]) -> dict[str, Any]:
    """Layer name -> its compressed-tensors scheme (the first config group matching it)."""
    schemes: dict[str, Any] = {}
    for scheme in config.config_groups.values():
        for name in _matched(skeleton, sources, scheme.targets, config.ignore):
            schemes.setdefault(name, scheme)
    return schemes


def _hadamard_layers(folder: Path, block: dict[str, Any], skeleton: nn.Module,
                     sources: Mapping[str, list[str]]) -> dict[str, int]:
    """Layers under an online ``hadamard`` input transform of ``transform_config`` (layer ->
    size); anything else in ``transform_config`` is refused."""
    from compressed_tensors.transform import TransformConfig

    raw = block.get("transform_config") or {}
    if not raw or not raw.get("config_groups"):
        return {}
    config = TransformConfig.model_validate(raw)
    sizes: dict[str, int] = {}
    for scheme_name, scheme in config.config_groups.items():
        for args in scheme.apply:
            if args.location == "weight_input":
                continue  # folded into the stored weight
            if scheme.type != "hadamard" or args.location != "input" or not scheme.head_dim \
                    or scheme.randomize:
                raise CheckpointError(
                    f"{folder}: transform_config {scheme_name!r} ({scheme.type} at "
                    f"{args.location}, head_dim {scheme.head_dim}, randomize "
                    f"{scheme.randomize}) is not read by kbbq-pl: only a deterministic "
                    "block hadamard at the input is")
            for name in _matched(skeleton, sources, args.targets, args.ignore):
                sizes[name] = scheme.head_dim
    return sizes


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def model_names(tensors: dict[str, Tensor], skeleton: nn.Module,
                folder: Path) -> tuple[dict[str, Tensor], dict[str, list[str]]]:
    """The inverse of :func:`checkpoint_names`: a mixture-of-experts model's ``tensors``, stored
    under the names of its architecture's checkpoints, under kbbq-pl's module names, and each
    layer with the stored layers it comes from (itself, for any other model).

    The tensors of FP4 layers are renamed by their layer: transformers' conversion mapping
    reversed on probe tensors that carry their module's index.  Every other tensor is converted
    as transformers' ``from_pretrained`` converts it (:class:`SafetensorsSource`: renamed,
    split or concatenated, e.g. Kimi-Linear's ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` into
    its ``conv1d``).  The FP4 tensors of experts stored expert by expert (Qwen3-MoE's
    ``gate_proj`` and ``up_proj``, Mixtral's ``w1`` / ``w3`` / ``w2``) are regrouped under
    kbbq-pl's expert layers (``<experts>.<e>.gate_up_proj.<suffix>``, ``down_proj``) and dense
    ones merged into the fused weight, by the mapping reversed on an index tensor, so that any
    split or reshape it makes is undone exactly.  The gate and up halves must share their
    per-tensor scales (llm-compressor fuses them, as vLLM does).  ``tensors`` is consumed."""
    experts = fused_experts(skeleton)
    plain = [name for name, _ in skeleton.named_modules()
             if name and not any(name == e or name.startswith(f"{e}.") for e in experts)]
    if not experts:
        return tensors, {name: [name] for name in plain}
    renamed: dict[str, Tensor] = {}
    sources: dict[str, list[str]] = {}
    for prefix, module in experts.items():
        sources.update(_regroup_experts(tensors, renamed, skeleton, prefix, module, folder))
    fp4 = tuple(f"{key.removesuffix('.weight_packed')}." for key in tensors
                if key.endswith(".weight_packed"))
    dense = SafetensorsSource.from_tensors(
        {key: tensors.pop(key) for key in list(tensors) if not key.startswith(fp4)}, skeleton,
        folder)
    expected = [name for name in skeleton.state_dict() if name in dense]
    renamed.update(dense.read(expected))
    tensors.update(dense.unread())
    linears = [name for name in plain if is_linear(skeleton.get_submodule(name))]
    layer_of = {stored: linears[int(index)]
                for stored, index in _stored_linears(skeleton, linears).items()}
    for key, value in tensors.items():
        parts = key.split(".")
        stored = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)
                       if ".".join(parts[:i]) in layer_of), None)
        renamed[key if stored is None else layer_of[stored] + key[len(stored):]] = value
    tensors.clear()
    sources.update({layer: [stored] for stored, layer in layer_of.items()})
    sources.update({name: [name] for name in plain if name not in sources})
    return renamed, sources


def _stored_linears(skeleton: nn.Module, linears: list[str]) -> dict[str, Tensor]:
    """The stored name of each of the ``linears`` (by index): the conversion mapping reversed on
    probes that carry their index.  A layer whose conversion reshapes its weight (Kimi K2.5's
    vision ``wqkv``, split and permuted) has no probe's worth of stored name: it is left out,
    as it is never an FP4 layer."""
    probes = {f"{name}.weight": torch.tensor([i]) for i, name in enumerate(linears)}
    try:
        return _stored_pieces(skeleton, probes)
    except (RuntimeError, ValueError, IndexError):
        pieces: dict[str, Tensor] = {}
        for key, probe in probes.items():
            try:
                pieces.update(_stored_pieces(skeleton, {key: probe}))
            except (RuntimeError, ValueError, IndexError):
                continue
        return pieces


def _regroup_experts(tensors: dict[str, Tensor], regrouped: dict[str, Tensor],
                     skeleton: nn.Module, prefix: str, experts: nn.Module,
                     folder: Path) -> dict[str, list[str]]:
    """:func:`model_names` for the fused experts module ``prefix``: its stored tensors moved
    from ``tensors`` into ``regrouped``."""
    sources: dict[str, list[str]] = {}
    count = experts.down_proj.shape[0]
    for proj in ("gate_up_proj", "up_proj", "down_proj"):
        if getattr(experts, proj, None) is None:
            continue
        fused = f"{prefix}.{proj}"
        stored_fused = stored_fused_experts(skeleton, fused, count)
        if stored_fused is not None:  # whole: converted with the dense tensors
            if stored_fused.endswith(f".{proj}"):
                sources.update(_regroup_by_expert(tensors, regrouped, prefix, proj,
                                                  stored_fused.removesuffix(f".{proj}"), count,
                                                  folder))
            continue
        modules = list(_stored_pieces(skeleton, {fused: torch.zeros(count, 2, 1)}))
        present = [s for s in (*EXPERT_SUFFIXES, "weight") if f"{modules[0]}.{s}" in tensors]
        if "weight" in present and len(present) > 1:
            raise CheckpointError(f"{folder}: {modules[0]} holds both a dense weight and FP4 "
                                  "codes")
        for suffix in present:
            missing = [m for m in modules if f"{m}.{suffix}" not in tensors]
            if missing:
                raise CheckpointError(f"{folder}: the checkpoint has {modules[0]}.{suffix} "
                                      f"but no {missing[0]}.{suffix}")
            values = {m: tensors.pop(f"{m}.{suffix}") for m in modules}
            stacked, owners = _merged_experts(skeleton, fused, count, values)
            if suffix == "weight":
                if stacked.shape != getattr(experts, proj).shape:
                    raise CheckpointError(f"{folder}: {modules[0]} and the other experts "
                                          f"stack to {list(stacked.shape)}, not {fused}'s "
                                          f"{list(getattr(experts, proj).shape)}")
                regrouped[fused] = stacked
                continue
            for e in range(count):
                layer = f"{prefix}.{e}.{proj}"
                sources[layer] = owners[e]
                regrouped[f"{layer}.{suffix}"] = _expert_value(
                    stacked[e], values[owners[e][0]], f"{folder}: {layer}.{suffix}")
    return sources


def _regroup_by_expert(tensors: dict[str, Tensor], regrouped: dict[str, Tensor], prefix: str,
                       proj: str, stored_fused: str, count: int,
                       folder: Path) -> dict[str, list[str]]:
    """:func:`_regroup_experts` for the projection ``proj`` of experts that the architecture's
    checkpoints store fused, under the stored experts module ``stored_fused``: written expert
    by expert (:func:`_expert_by_expert`; llm-compressor's Llama 4 and Qwen3-VL-MoE), each
    expert's FP4 layers regrouped into kbbq-pl's ``<prefix>.<e>.<proj>``; stored fused, the
    tensor is left to :func:`model_names`' dense conversion."""
    names = BY_EXPERT[proj]
    first = f"{stored_fused}.0.{names[0]}"
    present = [s for s in (*EXPERT_SUFFIXES, "weight") if f"{first}.{s}" in tensors]
    if "weight" in present:
        raise CheckpointError(f"{folder}: {first}.weight is a dense expert stored expert by "
                              "expert where the architecture stores its experts fused; kbbq-pl "
                              "reads such experts in FP4 only")
    sources: dict[str, list[str]] = {}
    for e in range(count):
        layer, owners = f"{prefix}.{e}.{proj}", [f"{stored_fused}.{e}.{n}" for n in names]
        sources[layer] = owners
        for suffix in present:
            missing = [o for o in owners if f"{o}.{suffix}" not in tensors]
            if missing:
                raise CheckpointError(f"{folder}: the checkpoint has {first}.{suffix} but no "
                                      f"{missing[0]}.{suffix}")
            values = [tensors.pop(f"{o}.{suffix}") for o in owners]
            rows = torch.cat(values) if values[0].dim() > 1 else torch.stack(values)
            regrouped[f"{layer}.{suffix}"] = _expert_value(rows, values[0],
                                                           f"{folder}: {layer}.{suffix}")
    return sources


def _merged_experts(skeleton: nn.Module, fused: str, count: int,
                    values: dict[str, Tensor]) -> tuple[Tensor, list[list[str]]]:
    """The stored per-expert ``values`` of the fused weight ``fused`` stacked as
    ``[count, rows, columns]`` (each value read as ``[rows, columns]``; a per-tensor scale as
    ``[1, 1]``), and the stored layers of each expert.  The mapping is reversed on the rows'
    indices (``[count, rows, 1]``): it splits and stacks rows and experts, never columns."""
    first = next(iter(values.values()))
    width = first.shape[-1] if first.dim() > 1 else 1
    rows = sum(v.numel() for v in values.values()) // (count * width)
    index = torch.arange(count * rows).reshape(count, rows, 1)
    stacked = torch.empty(count * rows, width, dtype=_SAME_WIDTH[first.element_size()])
    owners: list[list[str]] = [[] for _ in range(count)]
    for module, piece in _stored_pieces(skeleton, {fused: index}).items():
        value = values[module].reshape(-1, width)
        if piece.shape != (value.shape[0], 1):
            raise CheckpointError(f"{module}: shape {list(values[module].shape)} does not fit "
                                  f"the {[count, rows, width]} experts of {fused}")
        stacked[piece.flatten()] = value.view(stacked.dtype)
        owners[int(piece[0, 0]) // rows].append(module)
    return stacked.view(first.dtype).reshape(count, rows, width), owners


def _stored_pieces(skeleton: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' conversion mapping reversed on ``state``, by stored layer name."""
    from transformers.core_model_loading import revert_weight_conversion

    return {key.removesuffix(".weight"): piece
            for key, piece in revert_weight_conversion(skeleton, state).items()}


def _expert_value(rows: Tensor, stored: Tensor, what: str) -> Tensor:
    """One expert's ``rows`` (:func:`_merged_experts`) in the layout of its ``stored`` value:
    a per-tensor scale must be the same for every stored layer (the gate and up halves)."""
    if stored.dim() > 1:
        return rows.contiguous()
    bits = rows.view(_SAME_WIDTH[rows.element_size()])
    if not bool((bits == bits[:1]).all()):
        raise CheckpointError(f"{what}: the gate and up layers hold different per-tensor scales "
                              f"({rows.flatten().tolist()}); kbbq-pl's expert layer has one")
    return rows[0].reshape(stored.shape).clone()


def _import_format(folder: Path, name: str, scheme: Any, block: Mapping[str, Any],
                   extension: Mapping[str, Any]) -> Format:
    """The kbbq-pl format of layer ``name`` (:data:`IMPORT_FORMATS`; kbbq-pl's own export
    names its MXFP4 rounding in its extension block)."""
    stored = getattr(scheme, "format", None) or block.get("format")
    if scheme is None or stored not in IMPORT_FORMATS:
        raise CheckpointError(f"{folder}: {name} is stored as {stored!r}; kbbq-pl reads "
                              f"{', '.join(IMPORT_FORMATS)}")
    fmt = get_format(IMPORT_FORMATS[stored])
    own = extension.get("formats", [])
    return get_format(own[0]) if fmt.scale_kind == "e8m0" and len(own) == 1 else fmt


def _import_layer(folder: Path, name: str, scheme: Any, fmt: Format, tensors: dict[str, Tensor],
                  transform: Tensor | None, exact: Mapping[str, str],
                  dtype: torch.dtype) -> dict[str, Any] | None:
    """Rewrite layer ``name``'s tensors in kbbq-pl's layout, in place; returns its metadata,
    or None for a weight-only layer, which becomes a dense ``name.weight``."""
    packed = tensors[f"{name}.weight_packed"]
    out_features, in_features = packed.shape[0], packed.shape[1] * 2
    if fmt.scale_kind == "e8m0":
        tensors[f"{name}.weight_scale"] = tensors[f"{name}.weight_scale"].view(
            torch.float8_e8m0fnu)
    scales = tensors.get(f"{name}.weight_scale")
    if scales is not None and scales.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        bad = int((~torch.isfinite(scales.float())).sum())
        if bad:
            raise CheckpointError(f"{folder}: {name}.weight_scale holds {bad} NaN block scales "
                                  f"of {scales.numel()} (shape {tuple(scales.shape)}): the "
                                  "checkpoint is corrupted")
    if f"{name}.weight_global_scale" in tensors:
        tensors[f"{name}.weight_global_scale"] = kbbq_global_scale(
            tensors[f"{name}.weight_global_scale"], f"{name}.weight_global_scale",
            exact.get("weight"))
    meta = {"in_features": in_features, "out_features": out_features, "padded_in": in_features,
            "format": fmt.name, "transform": None if transform is None else list(transform.shape),
            "act_scale": "dynamic", "bias": f"{name}.bias" in tensors,
            "dtype": str(dtype).removeprefix("torch.")}
    input_scale = tensors.pop(f"{name}.input_global_scale", None)
    if scheme.input_activations is None:
        codes = stored_weight(tensors, name, meta)
        tensors[f"{name}.weight"] = effective_weight(codes, transform, in_features, dtype)
        return None
    if transform is not None:
        tensors[f"{name}.transform"] = transform
    if input_scale is not None:
        tensors[f"{name}.input_global_scale"] = kbbq_global_scale(
            input_scale, f"{name}.input_global_scale", exact.get("input"))
        meta["act_scale"] = "static"
    elif fmt.global_scale:
        raise CheckpointError(
            f"{folder}: {name} quantizes NVFP4 activations without an input_global_scale "
            "(dynamic: true, no per-tensor scale), which kbbq-pl does not emulate")
    return meta


def _import_transform(name: str, tensors: dict[str, Tensor], hadamard_size: int | None,
                      in_features: int, block: int) -> Tensor | None:
    """Layer ``name``'s online input transform: compressed-tensors' block Hadamard (its stored
    matrices dropped) or kbbq-pl's ``input_transform``."""
    for key in [k for k in tensors if k.startswith(f"{name}.") and k.endswith("_input.weight")]:
        del tensors[key]
    stored = tensors.pop(f"{name}.{INPUT_TRANSFORM}", None)
    if hadamard_size is not None:
        size = hadamard_size
        return hadamard(size, torch.float32).expand(in_features // size, size, size).clone()
    return None if stored is None else _loaded_transform(stored, block)


def read_compressed_tensors(folder: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """A compressed-tensors NVFP4 / MXFP4 folder as kbbq-pl checkpoint metadata and tensors
    (the layout of :mod:`kbbq_pl.io.checkpoint`), for
    :func:`kbbq_pl.io.checkpoint.build_quantized_model`.

    W4A4 layers become :class:`~kbbq_pl.quant.layers.QuantizedLinear` (NVFP4 activations with the
    static ``input_global_scale``; MXFP4 as :data:`IMPORT_FORMATS` says); weight-only layers
    (``input_activations`` null) become dense linears holding the dequantized weights, their
    activations left unquantized as the config says.  Online Hadamard transforms and kbbq-pl's
    ``input_transform`` tensors are applied.  Experts stored expert by expert become kbbq-pl's
    expert layers (:func:`model_names`)."""
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoConfig

    require_compressed_tensors()
    folder = Path(folder)
    block = _quantization_block(folder)
    if block is None or block.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{folder} is not a compressed-tensors folder (config.json has no "
                              "quantization_config with quant_method compressed-tensors)")
    hf_config = AutoConfig.from_pretrained(folder)
    causal = is_causal_lm_config(hf_config)
    dtype = declared_dtype(hf_config) or torch.float32
    skeleton = _skeleton(hf_config, causal)
    tensors, sources = model_names(_read_tensors(folder), skeleton, folder)
    schemes = _scheme_of_layers(QuantizationConfig.model_validate(block), skeleton, sources)
    hadamards = _hadamard_layers(folder, block, skeleton, sources)
    extension = block.get(EXTENSION_KEY) or {}
    exact_scales = extension.get("per_tensor_scales", {})
    names = [k.removesuffix(".weight_packed") for k in tensors if k.endswith(".weight_packed")]
    if not names:
        raise CheckpointError(f"{folder}: no FP4 layer (no .weight_packed tensor)")
    kinds = _linear_types(skeleton)
    for name in names:
        if kinds.get(name) == "router":
            raise CheckpointError(f"{folder}: {name} is a mixture-of-experts router stored in "
                                  "FP4; kbbq-pl, as vLLM, keeps routers in full precision: "
                                  "quantize with the routers in ignore")
    shapes = _linear_shapes(skeleton)
    layers: dict[str, dict[str, Any]] = {}
    for name in names:
        scheme = schemes.get(name)
        fmt = _import_format(folder, name, scheme, block, extension)
        packed = tensors[f"{name}.weight_packed"]
        in_features = packed.shape[1] * 2
        expected = shapes.get(name)
        if expected is not None and (packed.shape[0], in_features) != expected:
            raise CheckpointError(
                f"{folder}: {name}.weight_packed is {list(packed.shape)} {packed.dtype} (a "
                f"[{packed.shape[0]}, {in_features}] weight); the architecture in config.json "
                f"has {name} [{expected[0]}, {expected[1]}] (out, in), which packs to "
                f"[{expected[0]}, {expected[1] // 2}]: the checkpoint does not match its config")
        transform = _import_transform(name, tensors, hadamards.get(name), in_features,
                                      fmt.block_size or 1)
        meta = _import_layer(folder, name, scheme, fmt, tensors, transform,
                             exact_scales.get(name, {}), dtype)
        if meta is not None:
            layers[name] = meta
    metadata = {"causal_lm": causal, "layers": layers, "tied": _tied_names(skeleton, tensors),
                "recipe": extension.get("recipe", {})}
    return metadata, tensors


def _tied_names(model: nn.Module, tensors: Mapping[str, Tensor]) -> dict[str, str]:
    """Parameters that ``model``'s config ties to another one and the folder does not store."""
    first: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        key = id(param)
        if key in first and name not in tensors:
            tied[name] = first[key]
        first.setdefault(key, name)
    return tied


def dense_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """``model`` with every :class:`~kbbq_pl.quant.layers.QuantizedLinear` replaced by an
    ``nn.Linear`` holding its :func:`effective_weight` (weight-only: activations unquantized),
    in the layer's stored dtype or ``dtype``; the siblings' hooks and transformers' quantizer
    (``hf_quantizer``, ``config.quantization_config``) taken off with them."""
    from ..quant.layers import swap_module
    from ..quant.siblings import ungroup_sibling_linears

    ungroup_sibling_linears(model)
    if getattr(model, "hf_quantizer", None) is not None:  # kbbq's, as the layers are
        model.hf_quantizer.remove_quantization_config(model)
    tensors, layers, _ = checkpoint_contents(model)
    for name, meta in layers.items():
        codes = stored_weight(tensors, name, meta)
        weight = effective_weight(codes, tensors.get(f"{name}.transform"), meta["in_features"],
                                  dtype or getattr(torch, meta["dtype"]))
        bias = tensors.get(f"{name}.bias")
        linear = nn.Linear(meta["in_features"], meta["out_features"], bias=bias is not None,
                           dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        swap_module(model, name, linear)
    return model


__all__ = [
    "CONFIG_NAME", "ExportError", "ExportLayer", "bf16_decodes_agree", "ct_global_scale",
    "dense_model", "effective_weight", "export_compressed_tensors", "export_folder",
    "hadamard_transform_config", "is_mxfp4",
    "is_compressed_tensors_folder", "kbbq_global_scale", "plan_layers", "quantization_config",
    "read_compressed_tensors", "save_compressed_tensors", "transform_kind",
]
