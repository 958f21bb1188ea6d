"""Round to nearest onto the FP4 block formats: pure functions on tensors (the RTN weight
quantizer, :mod:`kbbq_pl.quant.rtn.quantizer`, rounds with it, and GPTQ falls back to it)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...formats import Format, QuantizedTensor
from ...formats.rounding import E2M1Scales
from ..scales import (
    MSE_NORM,
    ScaleSearch,
    assemble,
    check_fp4_format,
    group_scales,
    round_to_scales,
    weight_global_scale,
)

_F32 = torch.float32


def rtn(weight: Tensor, fmt: str | Format, *, search: ScaleSearch = "minmax",
        global_scale: Tensor | None = None, norm: float = MSE_NORM
        ) -> tuple[QuantizedTensor, Tensor]:
    """Round-to-nearest with :func:`~kbbq_pl.quant.scales.group_scales` (``minmax`` equals
    :func:`kbbq_pl.formats.quantize` bit for bit); returns the tensor and its float32 values."""
    fmt = check_fp4_format(fmt)
    w = weight.detach().to(_F32)
    out_features, size = w.shape
    d = fmt.block_size
    if global_scale is None:
        global_scale = weight_global_scale(w, fmt)
    grouped = w.reshape(out_features, size // d, d)
    scales = group_scales(grouped, fmt, global_scale, search, norm)
    values = round_to_scales(grouped, scales, fmt).reshape(out_features, size)
    flat = E2M1Scales(scales.code.squeeze(-1), scales.reciprocal.squeeze(-1),
                      scales.dequant.squeeze(-1), scales.gain, None)
    return assemble(w, flat, fmt, weight.dtype, global_scale), values
