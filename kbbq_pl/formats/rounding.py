"""Rounding onto the element grids: pure functions on a 2-D group view ``[groups, group_len]``.

Every granularity is one such view: blocks are ``x.reshape(-1, block_size)``, rows are
``x.reshape(-1, K)`` and a whole tensor is ``x.reshape(1, -1)``; each function scales every row
of the view by its own scale.  The functions are written as a short chain of elementwise torch
ops so that ``torch.compile`` fuses each into one pass over the data (the hot path of
:func:`kbbq_pl.formats.fake_quantize`); run eagerly they are the reference the compiled kernels
are tested against, bit for bit.

Numerics (all in FP32, round-to-nearest-even everywhere; every division is the correctly
rounded FP32 quotient, formed by :func:`div_rn` so that it is the same on every device and
backend, see there):

* NVFP4 follows torchao's ``nvfp4_quantize`` with a per-tensor scale, which is also the MSLK /
  Triton kernel arithmetic: ``pts = amax / (448 * 6)``; block scale
  ``s = e4m3(clamp((amax_b / 6) / pts, 2^-6, 448))``; elements ``e2m1(x * ((1 / pts) / s))``;
  dequantization ``q * (pts * s)``.  Block scales never go below the smallest normal E4M3
  (2^-6), as in torchao; an all-zero tensor gives zeros (torchao gives NaN).  A tensor whose
  amax is below ``448 * 6 * 2^-121`` (about 1e-33), where the FP32 reciprocal of its smallest
  block scale would overflow, quantizes to zeros.
* MXFP4 follows torchao's ``to_mx``: the shared exponent is read off the FP32 bits of the block
  amax; elements are ``e2m1(x / 2^e)``.  ``no_clip`` multiplies the elements by 3/4 (exact) and
  dequantizes as ``(q * 2^e) / 0.75``.  Unlike torchao, a block whose exponent clamps to the
  E8M0 minimum 2^-127 uses 2^-127 both ways (torchao's FLOOR quantizes with 2^-126 there, its
  RCEIL with 1).  RCEIL rounds amax / 6 up to a power of two exactly (torchao's CPU path takes
  ``ceil(log2(.))`` in FP32, which keeps the lower exponent a few ulps above a power of two).
* FP8 E4M3: ``s = amax / 448``, codes ``e4m3(clamp(x / s, +-448))``, values ``code * s``.
* INT: ``s = amax / qmax``, codes ``clamp(round(x / s), +-qmax)``, values ``code * s``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .._compat import tracing
from .spec import E2M1_MAX, E4M3_MAX, E4M3_MIN_NORMAL

NVFP4_MIN_GLOBAL_SCALE = 2.0**-121
"""Smallest per-tensor NVFP4 scale whose reciprocal chain stays finite in FP32: with the
smallest block scale 2^-6, ``(1 / 2^-121) / 2^-6 = 2^127`` (at 2^-122 it overflows to inf, and
a zero element times inf is NaN)."""
NVFP4_SCALE_DIVISOR = E4M3_MAX * E2M1_MAX
"""``448 * 6``: NVFP4's per-tensor scale is ``amax / NVFP4_SCALE_DIVISOR``
(:func:`nvfp4_tensor_scale`; a kernel divides by this constant)."""

_F32_MANTISSA_BITS = 23
_E8M0_BIAS = 127
_E8M0_NAN = 255
_F64 = torch.float64


def div_rn(a: Tensor | float, b: Tensor | float) -> Tensor:
    """``a / b`` for FP32 operands, rounded once to nearest-even in FP32, on every device.

    An FP32 division is not the same everywhere: Triton (``torch.compile`` on CUDA) emits the
    approximate ``div.full.f32``, and eager CUDA divides by a Python scalar as ``a * (1 / b)``;
    either is one ulp off the correctly rounded quotient for a large share of inputs, which
    moves scales by an ulp and elements across grid midpoints.  Here the quotient is formed in
    FP64 and rounded once to FP32.  A correctly rounded FP64 quotient of FP32 operands rounds to
    the correctly rounded FP32 quotient (double rounding is innocuous for division when
    ``53 >= 2 * 24 + 2`` bits; Triton's FP64 division is ``div.rn.f64``, CUDA's and the CPU's
    are IEEE).  Where a backend multiplies by an FP64 reciprocal instead (eager CUDA and
    inductor for a constant divisor), the result is within 2^-52 (relative) of the quotient,
    2^-28 of an FP32 ulp; the constants divided by here (6, 7, 127, 448, 2688, 0.75: odd parts
    3, 7, 21, 127) leave every inexact quotient at least 1/254 of an FP32 ulp away from a
    rounding midpoint, and an exact one is representable, so it rounds the same.
    """
    a = a.to(_F64) if isinstance(a, Tensor) else float(a)
    b = b.to(_F64) if isinstance(b, Tensor) else float(b)
    return (a / b).to(torch.float32)  # type: ignore[union-attr]


def nvfp4_tensor_scale(amax: Tensor) -> Tensor:
    """NVFP4's FP32 per-tensor scale from a tensor's amax: ``amax / (448 * 6)``, so that the
    largest magnitude takes the largest E4M3 block scale times the largest E2M1 element
    (torchao's ``per_tensor_scale``; the one rule for weights and for static and dynamic
    activations).  Correctly rounded on every device (:func:`div_rn`)."""
    return div_rn(amax.to(torch.float32), NVFP4_SCALE_DIVISOR)


def round_e2m1(a: Tensor) -> Tensor:
    """Round magnitudes ``a >= 0`` to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even.

    The grid has step 1/2 below 2, 1 on [2, 4) and 2 on [4, 6]; on each piece ``torch.round``
    (half to even on the scaled value) is the grid's own round-to-nearest-even, and values above
    6 saturate.
    """
    a = a.clamp(max=E2M1_MAX)
    return torch.where(
        a < 2.0,
        torch.round(a * 2.0) * 0.5,
        torch.where(a < 4.0, torch.round(a), torch.round(a * 0.5) * 2.0),
    )


def e2m1_magnitude_code(q: Tensor) -> Tensor:
    """Map grid magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6} to their 3-bit codes 0..7 (as floats)."""
    return torch.where(q < 2.0, q * 2.0, torch.where(q < 4.0, q + 2.0, q * 0.5 + 4.0))


def e2m1_code_magnitude(code: Tensor) -> Tensor:
    """Inverse of :func:`e2m1_magnitude_code` on integer codes 0..7 (returns FP32)."""
    c = code.to(torch.float32)
    return torch.where(c < 4.0, c * 0.5, torch.where(c < 6.0, c - 2.0, (c - 4.0) * 2.0))


def pack_nibbles(codes: Tensor) -> Tensor:
    """Pack 4-bit codes (uint8, last dimension even) two per byte, element ``2i`` in the low
    nibble: the layout of torchao's ``pack_uint4`` and of compressed-tensors' ``weight_packed``."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Midpoints between neighbouring E2M1 magnitudes; the tie at each goes to the even code
(the upper neighbour at 0.75, 1.75 and 3.5)."""
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


def e2m1_code_bounds(device: torch.device | str = "cpu") -> Tensor:
    """The 7 float32 boundaries whose ``torch.bucketize`` index is the 3-bit E2M1 code of
    :func:`round_e2m1` (a boundary where the tie rounds up sits one float below its midpoint;
    tested bit for bit against the arithmetic)."""
    mid = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32, device=device)
    below = torch.nextafter(mid, torch.zeros_like(mid))
    return torch.where(torch.tensor(_E2M1_TIE_UP, device=device), below, mid)


_CODE_BOUNDS: dict[torch.device, Tensor] = {}


def _code_bounds(device: torch.device) -> Tensor:
    bounds = _CODE_BOUNDS.get(device)
    if bounds is None:
        bounds = _CODE_BOUNDS[device] = e2m1_code_bounds(device)
    return bounds


def count_e2m1_codes(magnitude: Tensor, out: Tensor | None = None) -> Tensor:
    """The 3-bit E2M1 codes (uint8, the shape of ``magnitude``, into ``out`` when given) of
    magnitudes: the index of :func:`e2m1_code_bounds` that ``torch.bucketize`` finds (NaN and
    Inf give 7), as ``7 - #{bounds >= m}`` counted by one broadcast comparison.

    Branch-free: on a CPU about as fast as seven separate comparisons on large tensors (some 4x
    faster than the search there) and twice as fast on one of GPTQ's 3,072-value columns, where
    the search's branches also mispredict on each fresh column."""
    not_below = torch.ge(_code_bounds(magnitude.device).view(-1, 1), magnitude.reshape(1, -1))
    count = torch.sum(not_below.view(torch.uint8), 0, dtype=torch.uint8,
                      out=None if out is None else out.view(-1))
    return count.bitwise_xor_(7).view(magnitude.shape)  # 7 - count, for count in 0..7


_GRID: dict[torch.device, Tensor] = {}


def round_e2m1_counted(magnitude: Tensor, code: Tensor | None = None) -> Tensor:
    """:func:`round_e2m1` of ``magnitude >= 0`` (not NaN), bit for bit: the grid value of the
    counted code (:func:`count_e2m1_codes`; the codes into ``code``, uint8, when given).  A
    comparison and a lookup instead of ten passes: faster eagerly on a CPU (4096 x 2752 values,
    140 against 233 ms, one thread) and in GPTQ's column loop, where per-op overhead
    dominates on any device."""
    grid = _GRID.get(magnitude.device)
    if grid is None:
        grid = _GRID[magnitude.device] = e2m1_code_magnitude(
            torch.arange(8, device=magnitude.device))
    code = count_e2m1_codes(magnitude, code)
    return torch.index_select(grid, 0, code.view(-1).int()).view(magnitude.shape)


def round_e2m1_fast(magnitude: Tensor) -> Tensor:
    """:func:`round_e2m1` of ``magnitude >= 0`` (not NaN), bit for bit, the fastest way on the
    device: :func:`round_e2m1_counted` eagerly on a CPU, the arithmetic elsewhere (a compiled
    graph fuses it into one pass)."""
    if magnitude.device.type != "cpu" or tracing():
        return round_e2m1(magnitude)
    return round_e2m1_counted(magnitude)


def encode_e2m1(y: Tensor) -> Tensor:
    """E2M1 codes (uint8, sign in bit 3) of the already-scaled finite values ``y``.

    Eagerly, the magnitude's code is the index of :func:`e2m1_code_bounds`: one binary search
    (``torch.bucketize``) on GPUs, :func:`count_e2m1_codes` on a CPU (the same integers).
    Either is half the time of rounding and then mapping the rounded value, which a compiled
    graph fuses instead."""
    sign = torch.signbit(y).to(torch.uint8) << 3
    magnitude = y.abs()
    if tracing():
        return e2m1_magnitude_code(round_e2m1(magnitude)).to(torch.uint8) | sign
    if y.device.type == "cpu":
        return count_e2m1_codes(magnitude) | sign
    return torch.bucketize(magnitude, _code_bounds(y.device),
                           out_int32=True).to(torch.uint8) | sign


def _clean(x: Tensor, nonfinite: str) -> Tensor:
    """Zero non-finite inputs under the ``zero`` and ``propagate`` policies."""
    if nonfinite == "raise":
        return x
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)  # one pass, not two


def all_finite(x: Tensor) -> bool:
    """Whether the floating tensor ``x`` holds no NaN or Inf: min and max propagate both, so
    one reduction answers it (an order of magnitude faster on a CPU than ``isfinite(x).all()``,
    which writes a boolean tensor first)."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _bad_groups(x: Tensor) -> Tensor:
    """Groups (rows of the view) holding a non-finite element, shape ``[groups, 1]``."""
    return (~torch.isfinite(x)).any(dim=-1, keepdim=True)


def _finite_flag(amax: Tensor) -> Tensor:
    """A scalar that is True when every group amax is finite (max propagates NaN and Inf)."""
    return torch.isfinite(amax.max())


def _pow2(exponent: Tensor) -> Tensor:
    """Exact ``2^e`` in FP32 for integer ``e`` in [-127, 127] (2^-127 is subnormal)."""
    normal = ((exponent + _E8M0_BIAS).clamp(min=1) << _F32_MANTISSA_BITS).view(torch.float32)
    return torch.where(exponent < -126, torch.full_like(normal, 2.0**-127), normal)


def e8m0_exponent(amax: Tensor, rounding: str) -> Tensor:
    """Unbiased shared exponent of MX blocks from their FP32 amax, clamped to [-127, 127].

    ``floor``/``no_clip``: floor(log2 amax) - 2; ``ceil``: ceil(log2 amax) - 2; ``even``:
    floor(log2 round1(amax)) - 2 with amax rounded to one mantissa bit; ``rceil``:
    ceil(log2(amax / 6)).  The exponent is read from the FP32 bits, so it is exact.
    """
    if rounding == "rceil":
        descale = div_rn(amax, E2M1_MAX)
        bits = descale.view(torch.int32)
        field = (bits >> _F32_MANTISSA_BITS) & 0xFF
        exponent = field - _E8M0_BIAS + ((bits & 0x7FFFFF) > 0).to(torch.int32)
        # subnormal descale: ceil(log2) is -127 at or below 2^-127, else -126
        subnormal = torch.where(descale <= 2.0**-127, -127, -126).to(torch.int32)
        exponent = torch.where(field == 0, subnormal, exponent)
    else:
        bits = amax.view(torch.int32)
        if rounding == "even":
            bits = (bits + (1 << (_F32_MANTISSA_BITS - 2))) & (0x1FF << _F32_MANTISSA_BITS)
        exponent = ((bits >> _F32_MANTISSA_BITS) & 0xFF) - _E8M0_BIAS - 2
        if rounding == "ceil":
            exponent = exponent + ((bits & 0x7FFFFF) > 0).to(torch.int32)
    return exponent.clamp(-_E8M0_BIAS, _E8M0_BIAS)


class E2M1Scales(NamedTuple):
    """The scale of every E2M1 group (row of a group view), in every form the arithmetic needs.

    ``code``: the stored block scale (``float8_e4m3fn``, uint8 E8M0 exponent or FP32);
    ``reciprocal``: what the elements are multiplied by before rounding (E4M3 and E8M0);
    ``dequant``: what the rounded grid values are multiplied by (``pts * s`` or ``2^e``);
    ``gain``: the MX ``no_clip`` factor 3/4 (values are ``(q * dequant) / gain``) or None;
    ``pts``: the NVFP4 per-tensor scale, None for the other kinds.
    """

    code: Tensor
    reciprocal: Tensor
    dequant: Tensor
    gain: float | None
    pts: Tensor | None


def e2m1_scales(
    amax: Tensor, global_scale: Tensor | None, *, scale_kind: str, e8m0_rounding: str
) -> E2M1Scales:
    """Scales of E2M1 groups from their FP32 amax ``[groups, 1]`` (module docstring numerics).

    ``global_scale`` fixes the NVFP4 per-tensor scale; None takes ``max(amax) / (448 * 6)``.
    """
    gain = None
    pts = None
    if scale_kind == "e4m3":
        if global_scale is None:
            pts = nvfp4_tensor_scale(amax.max())
        else:
            pts = global_scale.to(torch.float32)
        usable = pts >= NVFP4_MIN_GLOBAL_SCALE
        pts = torch.where(usable, pts, torch.ones_like(pts))
        code = div_rn(div_rn(amax, E2M1_MAX), pts).clamp(E4M3_MIN_NORMAL, E4M3_MAX)
        code = code.to(torch.float8_e4m3fn)
        block = code.to(torch.float32)
        # abs() (of a positive value) keeps inductor from folding the FP8 -> FP32 -> FP64 casts
        # into one FP8 -> FP64 conversion, which Triton cannot lower (seen on an H200).
        reciprocal = torch.where(usable, div_rn(div_rn(1.0, pts), block.abs()),
                                 torch.zeros_like(block))
        dequant = pts * block
    elif scale_kind == "e8m0":
        exponent = e8m0_exponent(amax, e8m0_rounding)
        code = (exponent + _E8M0_BIAS).to(torch.uint8)
        block = _pow2(exponent)
        if e8m0_rounding == "no_clip":
            gain = 0.75
            reciprocal = div_rn(gain, block)  # exact: block is a power of two
        else:
            reciprocal = div_rn(1.0, block)
        dequant = block
    else:
        scale = div_rn(amax, E2M1_MAX)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        code = scale
        reciprocal = div_rn(1.0, scale)
        dequant = scale
    return E2M1Scales(code, reciprocal, dequant, gain, pts)


def e2m1_scaled(x: Tensor, scales: E2M1Scales, scale_kind: str) -> Tensor:
    """The FP32 values ``x`` is rounded from: ``x * reciprocal`` (``x / scale`` for FP32 scales)."""
    return x * scales.reciprocal if scale_kind != "fp32" else div_rn(x, scales.dequant)


def e2m1_groups(
    x: Tensor,
    global_scale: Tensor | None,
    *,
    scale_kind: str,
    e8m0_rounding: str,
    nonfinite: str,
    fake: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, ...]:
    """Quantize the rows of ``x [groups, block]`` onto E2M1 with one scale per row.

    Returns ``(values, finite)`` when ``fake`` (the dequantized tensor in ``out_dtype``), else
    ``(packed_codes uint8 [groups, block/2], block_scales [groups, 1], global_scale fp32 [],
    finite)``; block scales are ``float8_e4m3fn``, uint8 E8M0 exponents or FP32 by
    ``scale_kind``.  ``finite`` is a scalar bool, False when the input held NaN or Inf.
    """
    xf = _clean(x.to(torch.float32), nonfinite)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scales = e2m1_scales(amax, global_scale, scale_kind=scale_kind, e8m0_rounding=e8m0_rounding)
    scale_code, dequant_scale, gain, pts = scales.code, scales.dequant, scales.gain, scales.pts
    y = e2m1_scaled(xf, scales, scale_kind)
    finite = _finite_flag(amax)
    if nonfinite == "propagate":
        bad = _bad_groups(x)
        nan = torch.full_like(dequant_scale, float("nan"))
        dequant_scale = torch.where(bad, nan, dequant_scale)
        if scale_kind == "e8m0":
            scale_code = torch.where(bad, _E8M0_NAN, scale_code.to(torch.int32)).to(torch.uint8)
        else:
            scale_code = torch.where(bad, nan, scale_code.to(torch.float32)).to(scale_code.dtype)
    if fake:
        q = torch.copysign(round_e2m1_fast(y.abs()), y)
        values = q * dequant_scale if gain is None else div_rn(q * dequant_scale, gain)
        return values.to(out_dtype), finite
    codes = pack_nibbles(encode_e2m1(y))
    if pts is None:
        pts = torch.ones((), dtype=torch.float32, device=x.device)
    return codes, scale_code, pts, finite


def e4m3_groups(
    x: Tensor, *, nonfinite: str, fake: bool, out_dtype: torch.dtype
) -> tuple[Tensor, ...]:
    """FP8 E4M3 with an FP32 scale ``amax / 448`` per row of ``x [groups, len]``.

    Returns ``(values, finite)`` when ``fake``, else ``(codes float8_e4m3fn, scales fp32
    [groups, 1], finite)``.
    """
    xf = _clean(x.to(torch.float32), nonfinite)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = div_rn(amax, E4M3_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = div_rn(xf, scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    finite = _finite_flag(amax)
    if nonfinite == "propagate":
        scale = torch.where(_bad_groups(x), torch.full_like(scale, float("nan")), scale)
    if fake:
        return (codes.to(torch.float32) * scale).to(out_dtype), finite
    return codes, scale, finite


def int_groups(
    x: Tensor, *, qmax: int, nonfinite: str, fake: bool, out_dtype: torch.dtype
) -> tuple[Tensor, ...]:
    """Symmetric restricted-range integers with an FP32 scale ``amax / qmax`` per row.

    Returns ``(values, finite)`` when ``fake``, else ``(codes int8, scales fp32 [groups, 1],
    finite)``; 4-bit codes are packed two per byte as two's-complement nibbles (uint8).
    """
    xf = _clean(x.to(torch.float32), nonfinite)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = div_rn(amax, qmax)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(div_rn(xf, scale)).clamp(-float(qmax), float(qmax))
    finite = _finite_flag(amax)
    if nonfinite == "propagate":
        scale = torch.where(_bad_groups(x), torch.full_like(scale, float("nan")), scale)
    codes = q.to(torch.int8)
    if fake:  # from the integer codes, which have no -0, as dequantization sees them
        return (codes.to(torch.float32) * scale).to(out_dtype), finite
    if qmax == 7:
        codes = pack_nibbles(codes.view(torch.uint8) & 0x0F)
    return codes, scale, finite


def int4_unpack(packed: Tensor) -> Tensor:
    """Signed int4 codes (int8) from two's-complement nibbles packed two per byte."""
    nibbles = unpack_nibbles(packed).to(torch.int8)
    return torch.where(nibbles > 7, nibbles - 16, nibbles)


def _e2m1_values(device: torch.device) -> Tensor:
    """The FP32 value of every 4-bit E2M1 code (sign in bit 3; code 8 is -0), bit for bit the
    arithmetic of :func:`e2m1_code_magnitude`: the entries of the decode's byte table."""
    magnitude = e2m1_code_magnitude(torch.arange(8, device=device))
    # copysign, not negation: compiled for CUDA, Triton negates as 0 - x, which made code 8 +0
    # (seen on an H100, 2026-11-26)
    return torch.cat((magnitude, torch.copysign(magnitude, torch.full_like(magnitude, -1.0))))


_BYTE_VALUES: dict[torch.device, Tensor] = {}


def _e2m1_byte_values(device: torch.device) -> Tensor:
    """``[256]`` int64: the FP32 values of the two codes of each packed byte, low nibble first
    (:func:`pack_nibbles`'s order), side by side in one 8-byte word; made once a device
    eagerly, in the graph when traced."""
    traced = tracing()
    table = None if traced else _BYTE_VALUES.get(device)
    if table is None:
        values = _e2m1_values(device)
        byte = torch.arange(256, device=device)
        pairs = torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=-1)
        table = pairs.view(torch.int64).reshape(256)
        if not traced:
            _BYTE_VALUES[device] = table
    return table


def e2m1_decode_groups(packed: Tensor, multiplier: Tensor, *, no_clip: bool,
                       out_dtype: torch.dtype) -> Tensor:
    """The values of packed E2M1 groups ``packed [G, B/2]`` with their FP32 scale multipliers
    ``multiplier [G]`` (``pts * s``, ``2^e`` or an FP32 scale): ``[G, B]`` in ``out_dtype``.
    MX ``no_clip`` blocks are divided by 0.75 (their scale maps amax into [3, 6))."""
    # one 8-byte lookup a byte (both its codes' values), not one a code after unpacking the
    # nibbles: on a CPU 2x or more faster eagerly
    words = torch.index_select(_e2m1_byte_values(packed.device), 0,
                               packed.reshape(-1).to(torch.int32))
    values = words.view(torch.float32).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    values.mul_(multiplier.unsqueeze(-1))
    if no_clip:
        values = div_rn(values, 0.75)
    return values.to(out_dtype)
