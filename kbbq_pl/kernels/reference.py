"""The CPU reference of the W4A4 kernels: pure torch, built from :mod:`kbbq_pl.formats`.

The Triton kernels of :mod:`kbbq_pl.kernels` compute exactly these functions:

* :func:`reference_transform` defines ``h = T x`` per block in FP32 as a chain of correctly
  rounded fused multiply-adds in a fixed order, ``h_i = fma(T_i,d-1 x_d-1, ... fma(T_i1 x_1,
  fma(T_i0 x_0, +0)))``: the activation kernel's explicit ``tl.fma`` chain, the same code on GPUs
  and under the interpreter (and the order in which Triton's FP32 ``tl.dot(...,
  input_precision="ieee")``, kept for benchmarks, accumulates).  A product in another order
  would differ in the last bit of some ``h``, and a code flips only when such an ``h`` sits
  within that ulp of a rounding boundary; ``tests/kernels/test_kernels.py`` measures the
  mismatch rate on the GPU.
* :func:`reference_quantize_activations` rounds ``h`` with
  :func:`kbbq_pl.formats.rounding.e2m1_groups` (NVFP4 or MXFP4, every E8M0 rounding mode), under
  the ``propagate`` policy for non-finite values (a block holding NaN or Inf gets a NaN scale,
  its elements are rounded as zeros).
* :func:`reference_w4a4_matmul` is the float64 product of the dequantized operands
  (:func:`kbbq_pl.formats.dequantize`), the quantity the GEMM approximates with FP32
  accumulation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..formats import Format, QuantizedTensor, dequantize, get_format
from ..formats.rounding import e2m1_decode_groups, e2m1_groups

_F32 = torch.float32
_F64 = torch.float64
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
KERNEL_BLOCKS = (16, 32)
"""The block sizes of the formats the W4A4 kernels multiply; other blocks run the emulation."""


def supports_format(fmt: Format) -> bool:
    """Whether the W4A4 kernels multiply ``fmt``: E2M1 blocks of 16 or 32 (the blocks their
    tiles are laid out for) with E4M3 scales under a per-tensor scale (NVFP4) or E8M0 scales
    (MXFP4, any rounding)."""
    return bool(
        fmt.element == "e2m1"
        and fmt.granularity == "block"
        and (fmt.scale_kind == "e8m0" or (fmt.scale_kind == "e4m3" and fmt.global_scale))
        and fmt.block_size in KERNEL_BLOCKS
    )


def fp4_format(fmt: str | Format) -> Format:
    """The :class:`~kbbq_pl.formats.Format` named ``fmt`` if the W4A4 kernels support it
    (:func:`supports_format`), else a ValueError saying why."""
    fmt = get_format(fmt)
    if not supports_format(fmt):
        raise ValueError(
            f"format {fmt.name!r} is not supported by the W4A4 kernels: they take E2M1 blocks "
            f"of 16 or 32 with e4m3 scales and a per-tensor scale (nvfp4) or "
            f"e8m0 scales (mxfp4*), got element={fmt.element}, block_size={fmt.block_size}, "
            f"scale_kind={fmt.scale_kind}"
        )
    return fmt


_F32_MIDPOINT = (1 << 28, (1 << 29) - 1)
"""A float64 number at least ``2^-126`` in magnitude lies halfway between two FP32 numbers when
the 29 bits of its significand below FP32's 24 read ``1000...0``: (pattern, mask)."""


def fma_f32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """Correctly rounded FP32 ``a * b + c`` with one rounding (broadcasting), as ``fma.rn.f32``.

    The product of two FP32 numbers is exact in float64; the sum is rounded to float64 with
    round-to-odd (TwoSum gives the exact error, a nonzero error moves an even result one ulp
    towards it), and a round-to-odd result with 29 spare bits rounds to FP32 exactly as the
    exact sum would (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums").  The
    nudge can change the FP32 result only where the float64 sum is an FP32 midpoint (FP32
    midpoints are float64 numbers, and rounding to nearest keeps a value on its side of each),
    so it is computed only there and below ``2^-126``, where the midpoints are spaced
    otherwise: the same bits as round-to-odd everywhere, for about half the work.
    """
    p = a.to(_F64) * b.to(_F64)
    c64 = c.to(_F64)
    s = p + c64
    pattern, mask = _F32_MIDPOINT
    suspect = ((s.view(torch.int64) & mask) == pattern) | (s.abs() < 2.0**-126)
    if not bool(suspect.any()):
        return s.to(_F32)
    p, c64 = (t.expand(s.shape)[suspect] for t in (p, c64))
    near = s[suspect]
    b_virtual = near - p
    error = (p - (near - b_virtual)) + (c64 - b_virtual)
    even = (near.view(torch.int64) & 1) == 0
    nudge = (error != 0) & even & torch.isfinite(near)
    towards = torch.where(error > 0, torch.full_like(near, float("inf")),
                          torch.full_like(near, -float("inf")))
    s = s.clone()
    s[suspect] = torch.where(nudge, torch.nextafter(near, towards), near)
    return s.to(_F32)


def reference_transform(x: Tensor, transform: Tensor | None) -> Tensor:
    """``h = T x`` for ``x [M, K]`` and one ``d x d`` matrix per block, ``transform [K/d, d, d]``
    (None: the identity), in FP32 as the kernels compute it (module docstring): the input is
    upcast exactly, each output a chain of FMAs over the block in increasing order."""
    xf = x.to(_F32)
    if transform is None:
        return xf.clone()
    blocks, d, _ = transform.shape
    rows = xf.shape[0]
    xb = xf.reshape(rows, blocks, d)
    t = transform.to(_F32)
    acc = torch.zeros(rows, blocks, d, dtype=_F32, device=x.device)
    for j in range(d):
        acc = fma_f32(xb[:, :, j : j + 1], t[None, :, :, j], acc)
    return acc.reshape(rows, blocks * d)


def reference_quantize_activations(
    x: Tensor, transform: Tensor | None, fmt: str | Format,
    global_scale: Tensor | float | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """What :func:`kbbq_pl.kernels.quantize_activations` returns, computed on the CPU (or any
    device) with the functions of :mod:`kbbq_pl.formats.rounding`: packed codes ``uint8 [M, K/2]``,
    block scales ``[M, K/d]`` (``float8_e4m3fn`` for NVFP4, uint8 E8M0 exponents for MX) and the
    NVFP4 per-tensor scale (FP32 ``[]``; None for MX)."""
    fmt = fp4_format(fmt)
    d = fmt.block_size
    rows, length = x.shape
    h = reference_transform(x, transform)
    gs = None if global_scale is None else torch.as_tensor(global_scale, dtype=_F32,
                                                            device=x.device).reshape(())
    codes, scales, pts, _ = e2m1_groups(
        h.reshape(-1, d), gs, scale_kind=fmt.scale_kind, e8m0_rounding=fmt.e8m0_rounding,
        nonfinite="propagate", fake=False, out_dtype=_F32,
    )
    codes = codes.reshape(rows, length // 2)
    scales = scales.reshape(rows, length // d)
    return codes, scales, (pts.reshape(()) if fmt.global_scale else None)


def reference_activation_values(
    x: Tensor, transform: Tensor | None, fmt: str | Format,
    global_scale: Tensor | float | None = None, dtype: torch.dtype = _F32,
) -> tuple[Tensor, Tensor | None]:
    """What :func:`kbbq_pl.kernels.quantize_activation_values` returns: the codes of
    :func:`reference_quantize_activations` decoded to ``q * s`` (no per-tensor scale, no MX
    ``no_clip`` gain; NaN in a non-finite block) in ``dtype``, with the NVFP4 per-tensor
    scale."""
    fmt = fp4_format(fmt)
    codes, scales, pts = reference_quantize_activations(x, transform, fmt, global_scale)
    return reference_decoded_activations(codes, scales, fmt, dtype), pts


def reference_decoded_activations(codes: Tensor, scales: Tensor, fmt: str | Format,
                                  dtype: torch.dtype = _F32) -> Tensor:
    """Packed activation codes ``[M, K/2]`` and their block scales ``[M, K/d]`` (as
    :func:`reference_quantize_activations` returns them) decoded to ``q * s`` in ``dtype``
    (``[M, K]``; NaN in a block whose scale is NaN)."""
    fmt = fp4_format(fmt)
    d = fmt.block_size
    values = e2m1_decode_groups(codes.reshape(-1, d // 2), _block_scales(scales, fmt),
                                no_clip=False, out_dtype=_F32)
    return values.reshape(codes.shape[0], -1).to(dtype)


def _block_scales(scales: Tensor, fmt: Format) -> Tensor:
    """FP32 values of block scales ``[..., K/d]`` (E4M3, or E8M0 exponents; NaN bytes NaN)."""
    if fmt.scale_kind == "e4m3":
        return scales.view(torch.float8_e4m3fn).to(_F32).reshape(-1)
    biased = scales.view(torch.uint8).to(torch.int32).reshape(-1)
    value = torch.pow(torch.tensor(2.0, dtype=torch.float64, device=scales.device),
                      (biased - 127).to(torch.float64)).to(_F32)
    return torch.where(biased == 255, torch.full_like(value, float("nan")), value)


def as_quantized(codes: Tensor, scales: Tensor, global_scale: Tensor | None, fmt: str | Format,
                 dtype: torch.dtype = _F32) -> QuantizedTensor:
    """Packed codes ``[R, K/2]``, block scales ``[R, K/d]`` and the NVFP4 per-tensor scale as a
    :class:`~kbbq_pl.formats.QuantizedTensor` (the layout :func:`kbbq_pl.formats.quantize`
    stores)."""
    fmt = fp4_format(fmt)
    scale_dtype = torch.float8_e4m3fn if fmt.scale_kind == "e4m3" else torch.float8_e8m0fnu
    gs = None
    if fmt.global_scale:
        gs = torch.as_tensor(global_scale, dtype=_F32, device=codes.device).reshape(())
    return QuantizedTensor(codes, scales.view(scale_dtype), fmt, dtype, codes.shape[-1] * 2, gs)


def reference_w4a4_matmul(
    a_codes: Tensor, a_scales: Tensor, a_global: Tensor | float | None,
    w_codes: Tensor, w_scales: Tensor, w_global: Tensor | float | None,
    fmt: str | Format, bias: Tensor | None = None,
) -> Tensor:
    """The float64 product ``dequantize(a) @ dequantize(w).T + bias`` of two packed FP4 operands
    (``[M, N]``, float64): the exact result the W4A4 GEMM rounds."""
    a = dequantize(as_quantized(a_codes, a_scales, a_global, fmt), _F64)
    w = dequantize(as_quantized(w_codes, w_scales, w_global, fmt), _F64)
    out = a @ w.T
    return out if bias is None else out + bias.to(_F64)


def pad_input(x: Tensor, k: int, d: int, name: str) -> Tensor:
    """``x [..., K']`` zero-padded to ``K`` when ``K - d < K' <= K`` (a layer whose width is not
    a multiple of the block); any other width is an error."""
    width = x.shape[-1]
    if width == k:
        return x
    if k - d < width < k:
        return torch.nn.functional.pad(x, (0, k - width))
    raise ValueError(f"{name}: input of shape {tuple(x.shape)} does not match the weights' "
                     f"K = {k} (padded to the block {d})")


def reference_linear_w4a4(
    x: Tensor, weight_codes: Tensor, weight_scales: Tensor, weight_global: Tensor | None,
    fmt: str | Format, transform: Tensor | None = None,
    act_global_scale: Tensor | float | None = None, bias: Tensor | None = None,
) -> Tensor:
    """What :func:`kbbq_pl.kernels.linear_w4a4` computes, on any device: the activations
    quantized by :func:`reference_quantize_activations`, the product in float64, the result in
    ``x``'s dtype (``[..., N]``)."""
    fmt = fp4_format(fmt)
    k = weight_codes.shape[-1] * 2
    lead = x.shape[:-1]
    x2 = pad_input(x, k, fmt.block_size, "reference_linear_w4a4").reshape(-1, k)
    codes, scales, pts = reference_quantize_activations(x2, transform, fmt, act_global_scale)
    out = reference_w4a4_matmul(codes, scales, pts, weight_codes, weight_scales, weight_global,
                                fmt, bias)
    return out.to(x.dtype).reshape(*lead, -1)
