"""NVFP4 on FP4 tensor cores (compute capability 10.x) through ``torch._scaled_mm``.

Untested here (no Blackwell GPU in this project's machines): kept small, behind
:func:`blackwell_nvfp4_available`.  The codes and E4M3 block scales have one layout in
kbbq-pl, torchao and cuBLAS; cuBLAS wants the block scales in its swizzled ("blocked")
layout, which torchao's ``to_blocked`` produces.  The per-tensor scales and the bias are
applied to the FP32 result, as the Hopper kernel's epilogue does.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import Format


def blackwell_nvfp4_available(device: torch.device, fmt: Format) -> bool:
    """NVFP4 on a CUDA device of compute capability 10.x with ``torch.float4_e2m1fn_x2``."""
    if device.type != "cuda" or fmt.name != "nvfp4" or not torch.cuda.is_available():
        return False
    if not hasattr(torch, "float4_e2m1fn_x2"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 10


def blackwell_nvfp4_matmul(a_codes: Tensor, a_scales: Tensor, a_global: Tensor,
                           w_codes: Tensor, w_scales: Tensor, w_global: Tensor,
                           bias: Tensor | None,
                           out_dtype: torch.dtype) -> Tensor:  # pragma: no cover
    """``(A W^T) * a_global * w_global + bias`` on FP4 tensor cores (NVFP4 operands)."""
    from torchao.prototype.mx_formats.utils import to_blocked

    out = torch._scaled_mm(
        a_codes.view(torch.float4_e2m1fn_x2),
        w_codes.view(torch.float4_e2m1fn_x2).t(),
        to_blocked(a_scales.view(torch.float8_e4m3fn)),
        to_blocked(w_scales.view(torch.float8_e4m3fn)),
        out_dtype=torch.float32,
    )
    # the smaller scale first, as the Hopper paths' epilogue (the larger first can overflow FP32)
    out = out * torch.minimum(a_global, w_global) * torch.maximum(a_global, w_global)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
