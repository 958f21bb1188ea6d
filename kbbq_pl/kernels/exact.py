"""The exact arithmetic the fast W4A4 paths rest on, as small pure torch functions.

The W4A4 product (the paper's ``S = sum_k w_k x_k`` of Sec. "Setup and Assumptions", with
``w = Q(W T^-1)`` and ``x = Q(T x)``, Sec. "Transforms: Invariance, Blindness, and the Ceiling")
multiplies decoded FP4 values ``q * s``: ``q`` an E2M1 value (2 significant bits, magnitude
0.5 to 6), ``s`` a block scale (E4M3: 4 significant bits, 2^-9 to 448; E8M0: a power of two,
2^-127 to 2^127).  The kernels may hand these values to fp16 / bf16 tensor cores or to cuBLAS
only where each one is exactly representable there; this module states where, and the tests
(``tests/kernels/test_fast_paths.py``) check every code against every scale byte:

* ``q * s`` in **bf16** (8 significant bits, FP32's exponent range): exact for E4M3 scales
  (at most 6 significant bits, ``[2^-10, 2688]``) and for E8M0 scales wherever the value is
  finite in FP32 (exponents above 125 overflow both; :func:`bf16_exact_scale`).
* ``q * s * 2^-14`` in **fp16** for E4M3 scales: exact (multiples of 2^-24, the fp16
  subnormal step, at most 0.164); and ``q * s`` in fp16 (at most 2688, multiples of 2^-10).
  So the NVFP4 decode path multiplies fp16 operands and puts ``2^14`` in its epilogue
  (:data:`NVFP4_DECODE_SHIFT`).
* The bit pattern of an E2M1 code laid into the low exponent bits of a 16-bit float is the
  value times a power of two, subnormal 0.5 included (:func:`e2m1_half_bits`): fp16
  ``q * 2^-14``, bf16 ``q * 2^-126``.  One multiply by the block's multiplier then finishes
  the decode: fp16 ``s`` (NVFP4), bf16 ``2^(e - shift + 126)`` (MX, :func:`mx_shift`).

The decode GEMM's activations arrive in :func:`word_order_index` order, which is where the
nibbles of the weights' standard packing (element ``2i`` low), decoded two at a time from
32-bit words, meet them: the weights are read as :func:`kbbq_pl.formats.quantize` stores them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..formats.rounding import e2m1_code_magnitude, unpack_nibbles

NVFP4_DECODE_SHIFT = 14
"""The NVFP4 decode path multiplies ``q * s * 2^-14`` (fp16, exact) and its epilogue ``2^14``."""
MX_MULTIPLIER_BIAS = 126
"""bf16 ``q * 2^-126`` (:func:`e2m1_half_bits`) times ``2^(e - shift + 126)`` is
``q * 2^(e - shift)``."""
E8M0_NAN = 255


WORD_ORDER_CHUNK = 128
"""Elements per chunk of :func:`word_order_index` (16 words of 8 codes)."""


def word_order_index(k: Tensor) -> Tensor:
    """Where element ``k`` of a row lands in word order, the order in which the decode GEMM
    meets the activations.  It reads the weights' codes as 32-bit words of 8 (element ``8c + e``
    in nibble ``e``) and decodes, per shift, two nibbles at once: elements ``e`` and ``e + 4``
    of every word, side by side.  So within each chunk of 128 (16 words) element
    ``8c + e`` goes to ``32 (e % 4) + 2c + e // 4``."""
    return ((k // WORD_ORDER_CHUNK) * WORD_ORDER_CHUNK + 32 * (k % 4)
            + 2 * ((k % WORD_ORDER_CHUNK) // 8) + (k % 8) // 4)


def word_order(values: Tensor) -> Tensor:
    """``values [..., K]`` reordered by :func:`word_order_index` (``K`` padded with zeros to a
    multiple of 128)."""
    k = values.shape[-1]
    width = -(-k // WORD_ORDER_CHUNK) * WORD_ORDER_CHUNK
    out = values.new_zeros(*values.shape[:-1], width)
    out[..., word_order_index(torch.arange(k, device=values.device))] = values
    return out


def e2m1_half_bits(codes: Tensor, dtype: torch.dtype) -> Tensor:
    """E2M1 codes (0..15, sign in bit 3) as the 16-bit floats whose exponent's low two bits and
    mantissa's top bit are the code: ``q * 2^-14`` in fp16, ``q * 2^-126`` in bf16.  A 16-bit
    float with exponent field ``e`` and top mantissa bit ``m`` is ``2^(e - bias) (1 + m/2)``,
    or ``2^(1 - bias) m/2`` when ``e = 0``: E2M1's own rule with the bias moved (15 or 127
    against 1)."""
    c = codes.to(torch.int32)
    low = 9 if dtype == torch.float16 else 6
    bits = ((c & 8) << 12) | ((c & 7) << low)
    return bits.to(torch.int16).view(dtype)


def e4m3_fp16(scale_bytes: Tensor) -> Tensor:
    """E4M3 scale bytes as fp16 values (exact: E4M3 has 4 significant bits and lies in
    [2^-9, 448]; 0x7F / 0xFF are NaN)."""
    return scale_bytes.view(torch.float8_e4m3fn).to(torch.float16)


def mx_shift(exponents: Tensor) -> int:
    """The power of two ``shift`` of an MX weight's decode (biased exponents ``E = e + 127``,
    255 NaN ignored): ``max(0, E_max - 128)``, which keeps every bf16 multiplier
    ``2^(e - shift + 126)`` at most bf16's largest power of two.  The decoded weights are then
    ``q * 2^(e - shift)``, exact in bf16 while ``e - shift >= -132`` (0.5 * 2^-132 is bf16's
    smallest subnormal), and ``2^shift`` goes in the epilogue.  Raises where a block is too
    small for that (exponents spanning more than 133 binades, with some block scale above 2)."""
    e = exponents.view(torch.uint8).to(torch.int32)
    e = e[e != E8M0_NAN]
    if e.numel() == 0:
        return 0
    high, low = int(e.max()), int(e.min())
    shift = max(0, high - 128)
    if low - 127 - shift < -132:
        raise ValueError(f"MX block exponents from {low - 127} to {high - 127}: no shift keeps "
                         "every decoded weight exact in bf16")
    return shift


def mx_multiplier_bits(exponents: Tensor, shift: int) -> Tensor:
    """bf16 bit patterns of the MX decode multipliers ``2^(e - shift + 126)`` (int16; NaN for
    the NaN exponent)."""
    e = exponents.view(torch.uint8).to(torch.int32)
    bits = (e + MX_MULTIPLIER_BIAS - shift) << 7
    return torch.where(e == E8M0_NAN, torch.full_like(bits, 0x7FC0), bits).to(torch.int16)


def bf16_exact_scale(scale_kind: str, scale_byte: int) -> bool:
    """Whether ``q * s`` is exact in bf16 for every E2M1 value ``q`` with this scale byte: for
    every E4M3 byte but NaN; for E8M0 up to the exponent 125 (byte 252).  Above it ``4 * 2^126``
    and ``6 * 2^126`` overflow bf16, and FP32 too (both end at ``(2 - 2^-k) 2^127``): a value
    with two significant bits is finite in FP32 exactly when it is finite in bf16."""
    if scale_kind == "e4m3":
        return scale_byte & 0x7F != 0x7F
    return scale_byte <= 125 + 127


def decoded_weight_bytes(n: int, k: int, block: int) -> int:
    """Bytes a decode reads and writes for an ``[n, k]`` FP4 weight to bf16: packed codes and
    one scale byte per block read, two bytes per element written."""
    return n * k // 2 + n * (k // block) + 2 * n * k


def split_bf16x3(t: Tensor) -> Tensor:
    """FP32 ``t`` as three bf16 parts, ``[3, *t.shape]``, whose sum is ``t`` exactly: each part
    the remainder after the ones before rounded to bf16 (8 significant bits each, 24 in all,
    FP32's), from the largest.  A bf16 operand times a part is exact in FP32, so three bf16
    tensor-core products give ``x t`` up to their accumulation.  ValueError where the sum is not
    ``t`` (a remainder under bf16's subnormals: ``|t|`` below about ``2^-110``)."""
    high = t.to(torch.bfloat16)
    rest = t - high.float()
    middle = rest.to(torch.bfloat16)
    low = (rest - middle.float()).to(torch.bfloat16)
    parts = torch.stack([high, middle, low])
    if not torch.equal(high.float() + middle.float() + low.float(), t.float()):
        raise ValueError(f"{tuple(t.shape)} on {t.device}: not the sum of three bf16 parts "
                         f"(smallest nonzero magnitude {t[t != 0].abs().min().item():.3g})")
    return parts


# --------------------------------------------------------------------- MX on FP8 tensor cores

FP8_CHUNK = 128
"""Elements along K that share one FP32 scale in the FP8 product (cuBLAS's 1 x 128 block
scaling on Hopper): four MX blocks."""
FP8_HEADROOM = 6
"""A chunk's scale is ``2^(e_max - 6)``: its largest block then decodes to at most
``6 * 2^6 = 384``, within E4M3's 448."""
FP8_FLOOR = -8
"""The lowest block exponent, relative to the chunk's scale, whose values are all E4M3 values:
``0.5 * 2^-8`` is E4M3's smallest subnormal ``2^-9``, ``1.5 * 2^-8 = 3 * 2^-9``; every other
E2M1 value times ``2^d`` with ``-8 <= d <= 6`` is an E4M3 normal or subnormal too."""


def fold_mx_to_e4m3(codes: Tensor, exponents: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """MXFP4 ``q * 2^e`` (packed codes ``[R, K/2]``, biased exponents ``[R, K/32]``) as E4M3
    values times one power of two per chunk of :data:`FP8_CHUNK`: ``(values float8_e4m3fn
    [R, K], scales fp32 [R, ceil(K/128)], inexact bool [R, ceil(K/128)])``.

    E2M1 values are exact in E4M3 (2 significant bits against 4; the formats of the paper's
    App. "Format Constants"), and so is ``q * 2^d`` for ``FP8_FLOOR <= d <= FP8_HEADROOM``.
    A chunk's scale is ``2^(e_max - FP8_HEADROOM)``, ``e_max`` the largest exponent among its
    blocks that hold a nonzero code (a NaN block is NaN throughout and does not count; a chunk
    with none has scale 1), so ``values * scale`` is ``q * 2^e`` exactly wherever the chunk is not
    ``inexact``: a nonzero code in a block more than ``FP8_HEADROOM - FP8_FLOOR = 14`` binades
    under the chunk's largest.  The product of two folded operands is then the W4A4 product up
    to its accumulation, with one scale multiply per chunk (the promotion of DeepGEMM's
    two-level accumulation)."""
    rows, half = codes.shape
    k = 2 * half
    e = exponents.view(torch.uint8).to(torch.int32)
    blocks = e.shape[1]
    d = k // blocks
    per_chunk = FP8_CHUNK // d
    chunks = -(-blocks // per_chunk)
    nibbles = unpack_nibbles(codes).to(torch.int32)
    mag = nibbles & 7
    nan_block = e == E8M0_NAN
    counted = (mag.reshape(rows, blocks, d) != 0).any(dim=-1) & ~nan_block
    none = -(1 << 20)  # below every exponent: a chunk of no counted block

    def by_chunk(t: Tensor, fill) -> Tensor:  # [R, blocks] -> [R, chunks, per_chunk]
        return F.pad(t, (0, chunks * per_chunk - blocks), value=fill).reshape(rows, chunks,
                                                                              per_chunk)

    e_max = by_chunk(torch.where(counted, e - 127, none), none).amax(dim=-1)
    exponent = torch.where(e_max > none, e_max - FP8_HEADROOM, 0)  # [R, chunks]
    shift = (e - 127) - exponent.repeat_interleave(per_chunk, dim=1)[:, :blocks]
    inexact = by_chunk(counted & (shift < FP8_FLOOR), False).any(dim=-1)
    q = e2m1_code_magnitude(mag)
    q = torch.where(nibbles >= 8, -q, q)
    shift = shift.clamp(FP8_FLOOR, FP8_HEADROOM).repeat_interleave(d, dim=1)
    values = torch.ldexp(q, shift.to(torch.float32))
    values = torch.where(nan_block.repeat_interleave(d, dim=1), float("nan"), values)
    scales = torch.ldexp(torch.ones(exponent.shape, device=codes.device),
                         exponent.to(torch.float32))
    return values.to(torch.float8_e4m3fn), scales, inexact
