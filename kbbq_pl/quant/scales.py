"""The FP4 block scales of a weight (NVFP4, MXFP4): pure functions on tensors, shared by
round-to-nearest (:mod:`kbbq_pl.quant.rtn`) and GPTQ (:mod:`kbbq_pl.quant.gptq`).

* the scale group is the format's block along the input dimension (16 for NVFP4, 32 for
  MXFP4); NVFP4's per-tensor scale ``amax / (448 * 6)`` (torchao's convention;
  compressed-tensors stores the reciprocal ``448 * 6 / amax``) is fixed from the weight
  (:func:`weight_global_scale`);
* ``search="minmax"`` takes each group's scale from its amax, as
  :func:`kbbq_pl.formats.quantize`; ``search="mse"`` picks it among the 100 shrink factors
  ``1 - 0.8 i / 100`` of its amax, by the error ``sum |w - q|^2.4`` evaluated with the stored
  (rounded) scale, min-max (``i = 0``) included, so it never increases that error
  (:func:`group_scales`, FP-Quant's ``mse`` observer);
* rounding uses the format kernels' arithmetic (:mod:`kbbq_pl.formats.rounding`) with the
  scales held fixed (:func:`round_to_scales`), and :func:`assemble` stores the codes, so the
  :class:`~kbbq_pl.formats.QuantizedTensor` dequantizes bit for bit to the rounded values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from ..formats import Format, QuantizedTensor, get_format
from ..formats.rounding import (
    NVFP4_MIN_GLOBAL_SCALE,
    E2M1Scales,
    e2m1_scaled,
    e2m1_scales,
    encode_e2m1,
    nvfp4_tensor_scale,
    pack_nibbles,
    round_e2m1_fast,
)

ScaleSearch = Literal["minmax", "mse"]

MSE_GRID = 100
"""Shrink factors ``1 - MSE_SHRINK * i / MSE_GRID``, ``i = 0 .. MSE_GRID - 1`` (FP-Quant)."""
MSE_SHRINK = 0.8
MSE_NORM = 2.4
"""Exponent of the scale-search error ``sum |w - q|^p`` (FP-Quant's ``mse`` observer)."""
_MSE_CHUNK = 1 << 22
"""Candidate scales evaluated at once by the MSE search (bounds its memory)."""

_F32 = torch.float32
_F64 = torch.float64


def check_fp4_format(fmt: str | Format, name: str = "weight") -> Format:
    """The format, which must be an E2M1 block format (the scale groups are its blocks)."""
    fmt = get_format(fmt)
    if fmt.element != "e2m1" or fmt.granularity != "block":
        raise ValueError(f"{name}: GPTQ here quantizes to E2M1 block formats (nvfp4, mxfp4, "
                         f"e2m1_b<B>_<kind>), got {fmt.name!r}")
    return fmt


def weight_global_scale(weight: Tensor, fmt: Format) -> Tensor | None:
    """NVFP4's per-tensor scale ``amax / (448 * 6)`` of ``weight`` (None for other formats)."""
    if not fmt.global_scale:
        return None
    return nvfp4_tensor_scale(weight.detach().abs().amax())


def fused_weight_scales(weights: Mapping[str, Tensor], fmt: Format,
                        groups: Iterable[Sequence[str]]) -> dict[str, Tensor | None]:
    """The NVFP4 per-tensor scales of ``weights`` (name -> ``W T^-1``, one transform for
    all): each of ``groups`` (the layers vLLM runs as one fused linear, q/k/v and gate/up:
    :func:`~kbbq_pl.quant.modules.fused_groups`) shares the largest of its layers' own, since
    vLLM decodes a fused layer with one per-tensor scale (llm-compressor writes them so); the
    others keep their own (:func:`weight_global_scale`).  None for formats without one."""
    scales = {name: weight_global_scale(weight, fmt) for name, weight in weights.items()}
    if fmt.global_scale:
        for group in groups:
            shared = torch.stack([scales[name] for name in group]).amax()
            scales.update(dict.fromkeys(group, shared))
    return scales


def _scales(amax: Tensor, fmt: Format, global_scale: Tensor | None) -> E2M1Scales:
    return e2m1_scales(amax, global_scale, scale_kind=fmt.scale_kind,
                       e8m0_rounding=fmt.e8m0_rounding)


def round_to_scales(x: Tensor, scales: E2M1Scales, fmt: Format) -> Tensor:
    """``x`` rounded onto E2M1 with the given (fixed) scales, dequantized, float32: the exact
    arithmetic of :func:`kbbq_pl.formats.fake_quantize` with the scales held fixed.  The scale
    fields broadcast against ``x``."""
    y = e2m1_scaled(x, scales, fmt.scale_kind)
    q = torch.copysign(round_e2m1_fast(y.abs()), y) * scales.dequant
    return q if scales.gain is None else q / scales.gain


def _select(mask: Tensor, new: E2M1Scales, old: E2M1Scales) -> E2M1Scales:
    return E2M1Scales(torch.where(mask, new.code, old.code),
                      torch.where(mask, new.reciprocal, old.reciprocal),
                      torch.where(mask, new.dequant, old.dequant), new.gain, new.pts)


def group_error(x: Tensor, values: Tensor, norm: float = MSE_NORM) -> Tensor:
    """``sum |x - values|^norm`` over the last dimension (a group), keepdim."""
    return (x - values).abs().pow(norm).sum(-1, keepdim=True)


def group_scales(
    groups: Tensor,
    fmt: str | Format,
    global_scale: Tensor | None = None,
    search: ScaleSearch = "minmax",
    norm: float = MSE_NORM,
) -> E2M1Scales:
    """Scales of the groups ``[..., d]`` (the last dimension is one scale group), fields
    ``[..., 1]``.  ``minmax``: from each group's amax, as :func:`kbbq_pl.formats.quantize`;
    ``mse``: the best of the :data:`MSE_GRID` shrunk amaxes by :func:`group_error`, in the
    order of decreasing shrink factor (the first of equal errors wins)."""
    fmt = get_format(fmt)
    x = groups.to(_F32)
    amax = x.abs().amax(-1, keepdim=True)
    best = _scales(amax, fmt, global_scale)
    if search == "minmax":
        return best
    if search != "mse":
        raise ValueError(f"scale_search must be 'minmax' or 'mse', got {search!r}")
    groups_per_row = max(1, amax.numel() // max(1, amax.shape[0])) if amax.dim() > 1 else 1
    rows = max(1, _MSE_CHUNK // (groups_per_row * MSE_GRID))
    if amax.dim() > 1 and amax.shape[0] > rows:  # bound the [..., 100] candidate tensors
        parts = []
        for start in range(0, amax.shape[0], rows):
            gs = global_scale
            if gs is not None and gs.dim() and gs.shape[0] == amax.shape[0]:
                gs = gs[start:start + rows]
            parts.append(group_scales(x[start:start + rows], fmt, gs, search, norm))
        return E2M1Scales(*(torch.cat([getattr(p, f) for p in parts]) for f in
                            ("code", "reciprocal", "dequant")), best.gain, best.pts)
    best_error = group_error(x, round_to_scales(x, best, fmt), norm)
    for candidate in _distinct_candidates(amax, fmt, global_scale):
        error = group_error(x, round_to_scales(x, candidate, fmt), norm)
        better = error < best_error
        best = _select(better, candidate, best)
        best_error = torch.where(better, error, best_error)
    return best


def _distinct_candidates(amax: Tensor, fmt: Format, global_scale: Tensor | None
                         ) -> list[E2M1Scales]:
    """The stored scales of the shrunk amaxes ``amax * (1 - 0.8 i / 100)``, ``i >= 1``, without
    repeats: the k-th entry holds each group's k-th distinct scale below min-max (or its last
    one).  Rounded E4M3 / E8M0 scales take about 20 / 4 distinct values over the grid, so this
    evaluates those instead of 100 candidates, with the same result."""
    shrinks = 1.0 - MSE_SHRINK * torch.arange(MSE_GRID, dtype=_F64, device=amax.device) / MSE_GRID
    grid = _scales(amax * shrinks.to(_F32), fmt, global_scale)          # fields [..., 100]
    float8 = grid.code.dtype == torch.float8_e4m3fn
    code = grid.code.view(torch.uint8) if float8 else grid.code
    new = torch.ones_like(code, dtype=torch.bool)
    new[..., 1:] = code[..., 1:] != code[..., :-1]                      # non-increasing codes
    new[..., 0] = False                                                 # min-max is evaluated
    rank = torch.cumsum(new.to(torch.int64), -1)                        # 0 = min-max's code
    count = int(rank.max())
    if count == 0:
        return []
    slots = []
    for field in (code, grid.reciprocal, grid.dequant):
        slot = torch.zeros(*field.shape[:-1], count + 1, dtype=field.dtype, device=field.device)
        slots.append(slot.scatter_(-1, rank, field))                    # repeats are equal
    last = rank[..., -1:]
    candidates = []
    for k in range(1, count + 1):
        index = torch.minimum(last, torch.full_like(last, k))
        picked = [slot.gather(-1, index) for slot in slots]
        slot_code = picked[0].view(torch.float8_e4m3fn) if float8 else picked[0]
        candidates.append(E2M1Scales(slot_code, picked[1], picked[2], grid.gain, grid.pts))
    return candidates


def assemble(rounded_from: Tensor, scales: E2M1Scales, fmt: Format, orig_dtype: torch.dtype,
             global_scale: Tensor | None = None, *,
             magnitude_codes: Tensor | None = None) -> QuantizedTensor:
    """The :class:`QuantizedTensor` of ``rounded_from [out, D]`` (the float32 values that were
    rounded) with per-group scales ``[out, D / d]``: codes ``e2m1(x * reciprocal)`` packed two
    per byte, the stored block scales and NVFP4's per-tensor scale ``global_scale``.
    ``magnitude_codes`` (uint8 ``[out, D]``, 0-7): the magnitudes' codes where the caller
    rounded them already (GPTQ's column loop); the sign bit is ``x``'s, as the scales are
    positive."""
    out_features, size = rounded_from.shape
    d = fmt.block_size
    assert d is not None
    if magnitude_codes is not None:
        sign = torch.signbit(rounded_from).to(torch.uint8) << 3
        codes = pack_nibbles(magnitude_codes.to(torch.uint8) | sign)
    else:
        grouped = rounded_from.to(_F32).reshape(out_features, size // d, d)
        per_group = E2M1Scales(scales.code, scales.reciprocal.unsqueeze(-1),
                               scales.dequant.unsqueeze(-1), scales.gain, None)
        codes = pack_nibbles(encode_e2m1(e2m1_scaled(grouped, per_group, fmt.scale_kind)))
    code = scales.code
    if fmt.scale_kind == "e8m0":
        code = code.view(torch.float8_e8m0fnu)
    stored = None
    if fmt.global_scale:
        value = (global_scale if global_scale is not None
                 else torch.ones((), device=code.device)).to(_F32).reshape(())
        # an all-zero weight has no usable scale: stored as 1, as quantize() does
        stored = torch.where(value >= NVFP4_MIN_GLOBAL_SCALE, value, torch.ones_like(value))
    return QuantizedTensor(codes.reshape(out_features, size // 2), code.contiguous(), fmt,
                           orig_dtype, size, stored)
