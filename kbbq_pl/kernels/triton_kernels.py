"""Triton kernels for W4A4 on GPUs without FP4 units (Hopper), and under Triton's interpreter.

Imported lazily by :mod:`kbbq_pl.kernels` (this module needs triton).  Whether the kernels run
interpreted is fixed when this module is first imported (``TRITON_INTERPRET=1``, as Triton
decides when ``triton.jit`` decorates), and changes two things, both on purpose:

* the GEMM multiplies FP32 copies of the decoded operands (the interpreter cannot multiply
  bf16: it stores bf16 as integers); the values are the same, being exact in bf16;
* autotuning is off: one small configuration, or the one a caller pins.

Every FP32 division is ``tl.div_rn`` (correctly rounded; Triton's ``/`` is the approximate
``div.full.f32`` on NVIDIA GPUs).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch.utils.weak import WeakIdKeyDictionary

from ..formats.rounding import NVFP4_MIN_GLOBAL_SCALE, NVFP4_SCALE_DIVISOR
from .direct_launch import launch
from .exact import FP8_FLOOR, FP8_HEADROOM, split_bf16x3
from .host import cdiv, next_power_of_2, triton_version
from .interpret import interpreting

_PTS_DIVISOR = tl.constexpr(NVFP4_SCALE_DIVISOR)  # NVFP4's per-tensor scale: amax / (448 * 6)
_MIN_PTS = tl.constexpr(NVFP4_MIN_GLOBAL_SCALE)
_FP8_HEADROOM = tl.constexpr(FP8_HEADROOM)  # the E4M3 fold's rule (kbbq_pl.kernels.exact)
_FP8_FLOOR = tl.constexpr(FP8_FLOOR)
_NO_BLOCK = tl.constexpr(-(1 << 20))  # below every block exponent: a chunk of no counted block

INTERPRET = interpreting()
_DOT_FP32: tl.constexpr = tl.constexpr(INTERPRET)
"""Tensor-core products of bf16 operands multiply FP32 copies under the interpreter (which
stores bf16 as integers); bf16 times bf16 is exact in FP32, so the terms are the same."""
COMPILE_OPTIONS = {"enable_fp_fusion": True}
"""Triton's compile options of every kernel launch: FP fusion on (``a * b + c`` one FMA), as
every kernel's bits, tests and compile reports were made; Triton 3.10 turns its default off
(3.9 warns at each launch that leaves it unset)."""
_TRITON_3_7 = triton_version() >= (3, 7)
_TRITON_3_8 = (3, 8) <= triton_version() < (3, 9)
PARTS_FIRST = _TRITON_3_7
"""Where the activation kernel puts a block's parts (:func:`_transformed_blocks`): Triton's
coalescing ranks the dimensions of equal contiguity by index, ascending after the contiguous
one in 3.6 and descending in 3.9 (the compile reports of both), so the parts go last in 3.6 and
first in 3.9 (3.7 and 3.8 taken as 3.9, unchecked).  Either way the results are the same; only
the speed depends on it."""

# Python-side names of the integer constexprs the kernels compare against (jit code reads only
# tl.constexpr globals, so the kernels spell the numbers and name them in a comment).
SCALE_E4M3 = 0
SCALE_E8M0 = 1
PRODUCT_FMA_CHAIN = 0
PRODUCT_FMA_DOT = 1
PRODUCT_BF16X3 = 2
ROUNDING_CODES = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3, "no_clip": 0}


# --------------------------------------------------------------------------- element helpers


@triton.jit
def _e2m1_codes(y):
    """E2M1 codes (int32 0..15, sign in bit 3) of FP32 values ``y``, round-to-nearest-even.

    The grid steps are 1/2 on [0, 2), 1 on [2, 4) and 2 on [4, 6]: adding ``magic = 2^22``,
    ``2^23`` or ``2^24`` (by the binade of ``|y|``), whose FP32 ulp is that step, rounds
    ``|y|`` to the grid, ties to even, in one FP32 add (the rounding of
    :func:`kbbq_pl.formats.rounding.round_e2m1`); the sum's bits minus the magic's count the
    steps, and the code is that count plus 0, 2 or 4.  Values above 6 saturate (code 7).
    """
    a = tl.minimum(tl.abs(y), 6.0)
    binade = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)  # >= 1.0's
    magic = binade + (22 << 23)
    steps = (a + magic.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) - magic
    mag = steps + (((binade >> 23) - 127) << 1)
    return mag | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _e2m1_round(y):
    """FP32 ``y`` rounded to the E2M1 grid, to nearest even, as an FP32 value (sign kept, -0
    included): the magic-number add of :func:`_e2m1_codes` and its subtraction, exact, with no
    code formed (the values the codes decode to, in fewer operations)."""
    a = tl.minimum(tl.abs(y), 6.0)
    binade = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000)  # >= 1.0's
    magic = (binade + (22 << 23)).to(tl.float32, bitcast=True)
    rounded = (a + magic) - magic
    sign = y.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _max_keeping_nan(a, b):
    """The larger of ``a`` and ``b``, NaN if either is (a reduction that sees a NaN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _e2m1_values(codes):
    """The FP32 values of E2M1 codes (int32 0..15), exactly.

    Codes ``0eem`` laid into the FP32 exponent and top mantissa bits are the value times
    2^-126 for every code (the subnormal 0.5 included); one exact multiply rescales them.
    """
    bits = ((codes & 7) << 22) | ((codes & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _e4m3_round(s):
    """``s`` in [2^-6, 448] (FP32) rounded to E4M3, to nearest even: (code byte, FP32 value)."""
    bits = s.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    value = bits.to(tl.float32, bitcast=True)
    code = ((((bits >> 23) & 0xFF) - 120) << 3) | ((bits >> 20) & 7)
    return code, value


@triton.jit
def _pow2(e):
    """Exact ``2^e`` in FP32 for int32 ``e`` in [-149, 127] (below -126 an FP32 subnormal)."""
    bits = tl.where(e < -126, 1 << tl.maximum(e + 149, 0), tl.maximum(e + 127, 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e8m0_exponent(amax, ROUNDING: tl.constexpr):
    """:func:`kbbq_pl.formats.rounding.e8m0_exponent` on FP32 ``amax >= 0`` (int32)."""
    if ROUNDING == 3:  # rceil: ceil(log2(amax / 6))
        descale = tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
        bits = descale.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        e = field - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        subnormal = tl.where(bits <= 0x400000, -127, -126)  # descale <= 2^-127
        e = tl.where(field == 0, subnormal, e)
    else:
        bits = amax.to(tl.int32, bitcast=True)
        if ROUNDING == 2:  # even: amax rounded to one mantissa bit first
            bits = (bits + (1 << 21)) & 0x7F800000
        e = ((bits >> 23) & 0xFF) - 129
        if ROUNDING == 1:  # ceil
            e = e + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _block_scale_values(code, SCALE_KIND: tl.constexpr):
    """FP32 values of stored block scales (uint8: E4M3 bits or biased E8M0 exponents)."""
    b = code.to(tl.int32)
    if SCALE_KIND == 0:  # SCALE_E4M3
        exp = (b >> 3) & 15
        man = b & 7
        normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        v = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man 2^-9
        v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
        v = tl.where((b & 0x80) != 0, -v, v)
    else:
        v = tl.where(b == 0, _pow2(b - 127), (b << 23).to(tl.float32, bitcast=True))
        v = tl.where(b == 255, float("nan"), v)
    return v


@triton.jit
def _decode_tile(packed, scales, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr,
                 SCALE_KIND: tl.constexpr):
    """Packed codes ``[ROWS, BLOCK_K/2]`` and their scales ``[ROWS, BLOCK_K/D]`` decoded to the
    FP32 values ``q * s`` (exact in bf16: see :mod:`kbbq_pl.kernels`), ``[ROWS, BLOCK_K]``."""
    p = packed.to(tl.int32)
    codes = tl.reshape(tl.join(p & 15, p >> 4), [ROWS, BLOCK_K])
    q = tl.reshape(_e2m1_values(codes), [ROWS, BLOCK_K // D, D])
    s = _block_scale_values(scales, SCALE_KIND)
    return tl.reshape(q * s[:, :, None], [ROWS, BLOCK_K])


@triton.jit
def _fold_shifts(e, counted, e_max):
    """The E4M3 fold of :func:`kbbq_pl.kernels.exact.fold_mx_to_e4m3` for blocks of exponent
    ``e`` (int32) in chunks whose largest counted exponent is ``e_max`` (``_NO_BLOCK`` for a
    chunk of none; broadcast against ``e``): ``(multiplier 2^shift of each block, inexact
    int32 of each block, the chunk's exponent)``.  ``counted``: the block holds a nonzero
    code and is not NaN."""
    exponent = tl.where(e_max > _NO_BLOCK, e_max - _FP8_HEADROOM, 0)
    shift = e - exponent
    low = (counted & (shift < _FP8_FLOOR)).to(tl.int32)
    return _pow2(tl.minimum(tl.maximum(shift, _FP8_FLOOR), _FP8_HEADROOM)), low, exponent


# --------------------------------------------------------------------------- activations


@triton.jit
def _block_parts(rows, blocks, D: tl.constexpr, PARTS_FIRST: tl.constexpr):
    """Element offsets within the blocks ``part``, and ``blocks`` and ``rows`` broadcast to
    the shape of a tile of parts (:func:`_load_blocks`)."""
    if PARTS_FIRST:  # [D/4, NB, BLOCK_M, 4]
        part = tl.arange(0, D // 4)[:, None, None, None] * 4 + tl.arange(0, 4)[None, None, None, :]
        return part, blocks[None, :, None, None], rows[None, None, :, None]
    else:  # [NB, BLOCK_M, D/4, 4]
        part = tl.arange(0, D // 4)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
        return part, blocks[:, None, None, None], rows[None, :, None, None]


@triton.jit
def _load_blocks(x_ptr, tile, M, n_blocks, blocks, stride_xm, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, PARTS_FIRST: tl.constexpr, WHOLE: tl.constexpr):
    """The activations of row tile ``tile`` in ``blocks``, as stored (zeros outside ``M`` rows
    and ``n_blocks`` blocks).  A row's block is loaded as ``D / 4`` parts of 4 elements, the
    parts on the dimension to which Triton's coalescing gives lanes last (:data:`PARTS_FIRST`),
    so that one thread holds the whole block: the chain, the block's amax and its scale then
    stay in the thread (a ``[.., D]`` load would share each block between two or four threads,
    16 bytes each).  ``WHOLE`` (a tensor-core product, which lays the block out itself) loads
    ``[NB, BLOCK_M, D]`` instead."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    if WHOLE:
        offs = tl.arange(0, D)[None, None, :]
        b3 = blocks[:, None, None]
        r3 = rows[None, :, None]
        x = tl.load(x_ptr + r3 * stride_xm + b3 * D + offs, mask=(b3 < n_blocks) & (r3 < M),
                    other=0.0)
    else:
        part, b4, r4 = _block_parts(rows, blocks, D, PARTS_FIRST)
        x = tl.load(x_ptr + r4 * stride_xm + b4 * D + part, mask=(b4 < n_blocks) & (r4 < M),
                    other=0.0)
    return x


@triton.jit
def _transformed_blocks(x4, t_ptr, rows, blocks, n_blocks, D: tl.constexpr, NB: tl.constexpr,
                        BLOCK_M: tl.constexpr, HAS_T: tl.constexpr, PRODUCT: tl.constexpr,
                        PARTS_FIRST: tl.constexpr):
    """``h = T_b x_b`` in FP32 for ``NB`` blocks of ``BLOCK_M`` rows, ``[NB, BLOCK_M, D]``, from
    their activations ``x4`` (:func:`_load_blocks`).

    ``t_ptr`` holds each block's transform transposed, ``t[b, j, i] = T_b[i, j]``
    (:func:`transform_columns`).

    ``PRODUCT``: ``PRODUCT_FMA_CHAIN`` (the default, on GPUs and under the interpreter): for
    ``j`` in increasing order, ``h = fma(x_j, T[:, j], h)``, the order of
    :func:`kbbq_pl.kernels.reference.reference_transform`, ``x_j`` picked from the thread's
    registers and column ``j`` of ``T`` loaded once for all the thread's rows of the block;
    ``PRODUCT_FMA_DOT`` (Triton's FP32 FMA dot: the same chain, operands staged in shared
    memory) and ``PRODUCT_BF16X3`` (:func:`_bf16x3_blocks`, tensor cores, not exact) are kept
    for benchmarks."""
    if HAS_T and PRODUCT == 2:  # PRODUCT_BF16X3
        h = _bf16x3_blocks(x4, t_ptr, blocks, n_blocks, D, NB, BLOCK_M)
    else:
        part, b4, r4 = _block_parts(rows, blocks, D, PARTS_FIRST)
        h4 = x4.to(tl.float32)
        if HAS_T and PRODUCT == 0:  # PRODUCT_FMA_CHAIN
            bits = h4.to(tl.int32, bitcast=True)
            # column 0 of T (its block kept in bounds: a masked block's x is 0) for every row, in
            # x's shape and hence x's layout
            t_col = t_ptr + tl.minimum(b4, n_blocks - 1) * (D * D) + r4 * 0 + part
            h4 = tl.zeros(h4.shape, tl.float32)
            for j in tl.static_range(D):
                # x[..., j]: a sum of one element and zeros within a thread, which compiles away;
                # kept as a dimension of size 1 so that it broadcasts over the block
                xj = tl.sum(tl.sum(tl.where(part == j, bits, 0), axis=3, keep_dims=True),
                            axis=0 if PARTS_FIRST else 2, keep_dims=True)
                h4 = tl.fma(xj.to(tl.float32, bitcast=True), tl.load(t_col + j * D), h4)
        if PARTS_FIRST:
            h4 = tl.permute(h4, (1, 2, 0, 3))
        h = tl.reshape(h4, [NB, BLOCK_M, D])
        if HAS_T and PRODUCT != 0:
            offs_d = tl.arange(0, D)
            t_t = tl.load(t_ptr + tl.minimum(blocks, n_blocks - 1)[:, None, None] * (D * D)
                          + offs_d[None, :, None] * D + offs_d[None, None, :])  # [NB, j, i]
            acc = tl.zeros([NB, BLOCK_M, D], tl.float32)
            h = tl.dot(h, t_t, acc, input_precision="ieee")  # PRODUCT_FMA_DOT
    return h


@triton.jit
def _bf16x3_blocks(x4, t_ptr, blocks, n_blocks, D: tl.constexpr, NB: tl.constexpr,
                   BLOCK_M: tl.constexpr):
    """``h = T_b x_b`` in FP32 on tensor cores, ``[NB, BLOCK_M, D]``, from bf16 activations
    ``x4 [NB, BLOCK_M, D]`` (:func:`_load_blocks`, ``WHOLE``) and each block's transposed
    transform as three bf16 parts (``t_ptr``: :func:`transform_columns_bf16x3`, part ``p`` at
    ``p * n_blocks * D^2``): three products of exact terms, accumulated in FP32 from the
    smallest part up.  Not the chain's rounding: a code may differ from the chain's where
    ``T x`` lies within the two sums' rounding errors of a rounding boundary (``bench/gpu.py``'s
    ``act`` section prints the rate)."""
    xb = x4
    offs = tl.arange(0, D)
    t_at = (t_ptr + tl.minimum(blocks, n_blocks - 1)[:, None, None] * (D * D)
            + offs[None, :, None] * D + offs[None, None, :])  # [NB, j, i] = T_b[i, j]
    part = n_blocks * (D * D)
    if _DOT_FP32:
        xb = xb.to(tl.float32)
    if NB == 1:  # a 2-D product: Triton 3.6 gives each warp the whole of a batched one
        xb = tl.reshape(xb, [BLOCK_M, D])
        t_at = tl.reshape(t_at, [D, D])
    h = tl.zeros(xb.shape, tl.float32)
    for p in tl.static_range(2, -1, -1):
        t = tl.load(t_at + p * part)
        if _DOT_FP32:
            t = t.to(tl.float32)
        h = tl.dot(xb, t, h)
    return tl.reshape(h, [NB, BLOCK_M, D])


@triton.jit
def _transformed_from_memory(x_ptr, t_ptr, rows, blocks, M, n_blocks, stride_xm,
                             D: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr,
                             HAS_T: tl.constexpr):
    """``h = T_b x_b`` in FP32 for ``NB`` blocks of ``BLOCK_M`` rows, ``[NB, BLOCK_M, D]``, its
    operands loaded from memory column by column: for ``j`` in increasing order,
    ``h = fma(x_j, T[:, j], h)`` (the chain of :func:`_transformed_blocks`, the same bits),
    ``x_j`` loaded for every lane and column ``j`` of ``T`` spread over the lanes, one output
    of a block a lane.  A decode step's tile: no load waits for the chain, so the ``2 D``
    loads can be in flight at once and a thread runs ``D`` multiply-adds a row, where the
    register tile's thread runs ``D^2`` (MX) or ``D^2 / 2`` (NVFP4: half a block row) of them,
    each column waiting for its load."""
    offs = tl.arange(0, D)[None, None, :]
    r3 = rows[None, :, None]
    b3 = blocks[:, None, None]
    inside = (r3 < M) & (b3 < n_blocks)
    x_block = x_ptr + r3 * stride_xm + b3 * D
    if HAS_T:
        # column j of T_b at t[b, j, :] (transform_columns); a masked block's x is 0
        t_col = t_ptr + tl.minimum(b3, n_blocks - 1) * (D * D) + offs
        h = tl.zeros([NB, BLOCK_M, D], tl.float32)
        for j in tl.static_range(D):
            xj = tl.load(x_block + j, mask=inside, other=0.0).to(tl.float32)
            h = tl.fma(xj, tl.load(t_col + j * D), h)
    else:
        h = tl.load(x_block + offs, mask=inside, other=0.0).to(tl.float32)
    return h


@triton.jit
def _quantize_activations_kernel(
    x_ptr, t_ptr, codes_ptr, scales_ptr, global_ptr, amax_ptr, pts_ptr, values_ptr, inexact_ptr,
    t1_ptr, t2_ptr, global1_ptr, global2_ptr,
    M, n_blocks, stride_xm, stride_cm, stride_sm, stride_vm, stride_vg, m_bucket,
    D: tl.constexpr, SCALE_KIND: tl.constexpr, ROUNDING: tl.constexpr, GAIN: tl.constexpr,
    HAS_T: tl.constexpr, STATIC: tl.constexpr, AMAX_ONLY: tl.constexpr,
    PRODUCT: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
    WRITE_CODES: tl.constexpr = True, WRITE_VALUES: tl.constexpr = False,
    WORD_ORDER: tl.constexpr = False, PARTS_FIRST: tl.constexpr = False,
    WRITE_E4M3: tl.constexpr = False, TILES: tl.constexpr = 1,
    FROM_MEMORY: tl.constexpr = False, GROUPS: tl.constexpr = 1,
):
    """``TILES`` tiles of ``BLOCK_M`` rows by ``NB`` blocks, one after the other: transform,
    block amax, scales, E2M1 codes, packing.  ``AMAX_ONLY`` (the first pass of dynamic NVFP4)
    only folds the amax of ``T x`` into ``amax_ptr``; the second pass reads it back.

    ``WRITE_CODES`` stores the packed codes and the scale bytes; ``WRITE_VALUES`` stores the
    decoded values ``q * s`` (without the per-tensor scale; NaN in a non-finite block) in
    ``values_ptr``'s dtype, where they are exact (:mod:`kbbq_pl.kernels.exact`), in the natural
    order or (``WORD_ORDER``) in :func:`~kbbq_pl.kernels.exact.word_order_index` order; an
    int8 ``values_ptr`` takes ``2q`` instead (the integers the decode GEMM's DP4A product
    multiplies; 0 in a non-finite block) and ``scales_ptr`` the FP32 block scales ``s`` (NaN
    in a non-finite block).
    ``WRITE_E4M3`` (MX, a program holding whole chunks of 128: ``NB * D == 128``) stores the
    values folded to E4M3 as :func:`kbbq_pl.kernels.exact.fold_mx_to_e4m3` folds the codes
    (bytes in ``codes_ptr``, row stride ``stride_cm``), the chunk's FP32 scale in
    ``scales_ptr`` (chunk major: ``[chunk * M + row]``) and adds its inexact chunks to
    ``inexact_ptr``.

    ``TILES``: the row tiles a program takes one after the other (program ``i`` of the first
    grid axis takes tiles ``i TILES`` to ``(i + 1) TILES - 1``), each tile's activations
    loaded into registers while the one before is transformed and rounded, so that loads are
    in flight while the chain runs (with one load, one chain and one store per program, the
    memory waited for the chain).  Every row is computed as with one tile a program: the same
    bits.

    ``GROUPS`` (2 or 3: sibling layers that read the same input, q/k/v or gate/up): program
    ``g`` of the third grid axis rounds ``x`` for sibling ``g``, its transform at ``t_ptr``,
    ``t1_ptr`` or ``t2_ptr`` and its static scale at ``global_ptr``, ``global1_ptr`` or
    ``global2_ptr``, into ``values_ptr + g stride_vg`` (values only; int8 values' block scales
    at ``scales_ptr + g M stride_sm``), its amax and per-tensor scale at ``amax_ptr + g`` and
    ``pts_ptr + g``: one launch for the siblings, each with the bits of its own."""
    if GROUPS > 1:
        tl.static_assert((WRITE_VALUES == 1) & (WRITE_CODES == 0) & (WRITE_E4M3 == 0)
                         & (GROUPS <= 3))
        g = tl.program_id(2)
        if g == 1:
            t_ptr = t1_ptr
            global_ptr = global1_ptr
        elif g == 2:
            t_ptr = t2_ptr
            global_ptr = global2_ptr
        values_ptr += g * stride_vg
        scales_ptr += g * M * stride_sm  # int8 values' FP32 block scales, [G, M, n_blocks]
        amax_ptr += g
        pts_ptr += g
    pid_b = tl.program_id(1)
    blocks = pid_b * NB + tl.arange(0, NB)
    if FROM_MEMORY:  # a decode step's few rows: one tile a program
        tl.static_assert((TILES == 1) & (PRODUCT == 0))
        pid_m = tl.program_id(0)
        h = _transformed_from_memory(x_ptr, t_ptr, pid_m * BLOCK_M + tl.arange(0, BLOCK_M),
                                     blocks, M, n_blocks, stride_xm, D, NB, BLOCK_M, HAS_T)
        _activation_tile(
            h, codes_ptr, scales_ptr, global_ptr, amax_ptr, pts_ptr, values_ptr,
            inexact_ptr, M, n_blocks, stride_cm, stride_sm, stride_vm, pid_m, pid_b,
            D, SCALE_KIND, ROUNDING, GAIN, STATIC, AMAX_ONLY, BLOCK_M, NB,
            WRITE_CODES, WRITE_VALUES, WORD_ORDER, WRITE_E4M3)
    else:
        first = tl.program_id(0) * TILES
        last = tl.minimum(first + TILES, tl.cdiv(M, BLOCK_M))
        x4 = _load_blocks(x_ptr, first, M, n_blocks, blocks, stride_xm, D, BLOCK_M,
                          PARTS_FIRST, HAS_T and PRODUCT == 2)
        for tile in range(first, last):
            x_tile = x4
            if TILES > 1:  # the next tile's loads in flight while this one is computed
                x4 = _load_blocks(x_ptr, tile + 1, tl.minimum(M, last * BLOCK_M), n_blocks,
                                  blocks, stride_xm, D, BLOCK_M, PARTS_FIRST,
                                  HAS_T and PRODUCT == 2)
            h = _transformed_blocks(x_tile, t_ptr, tile * BLOCK_M + tl.arange(0, BLOCK_M),
                                    blocks, n_blocks, D, NB, BLOCK_M, HAS_T, PRODUCT,
                                    PARTS_FIRST)
            _activation_tile(
                h, codes_ptr, scales_ptr, global_ptr, amax_ptr, pts_ptr, values_ptr,
                inexact_ptr, M, n_blocks, stride_cm, stride_sm, stride_vm, tile, pid_b,
                D, SCALE_KIND, ROUNDING, GAIN, STATIC, AMAX_ONLY, BLOCK_M, NB,
                WRITE_CODES, WRITE_VALUES, WORD_ORDER, WRITE_E4M3)


@triton.jit
def _activation_tile(
    h, codes_ptr, scales_ptr, global_ptr, amax_ptr, pts_ptr, values_ptr, inexact_ptr,
    M, n_blocks, stride_cm, stride_sm, stride_vm, pid_m, pid_b,
    D: tl.constexpr, SCALE_KIND: tl.constexpr, ROUNDING: tl.constexpr, GAIN: tl.constexpr,
    STATIC: tl.constexpr, AMAX_ONLY: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, WORD_ORDER: tl.constexpr,
    WRITE_E4M3: tl.constexpr,
):
    """Row tile ``pid_m`` of block tile ``pid_b``, its transformed activations ``h [NB,
    BLOCK_M, D]`` in FP32: :func:`_quantize_activations_kernel`."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = pid_b * NB + tl.arange(0, NB)
    row_mask = rows < M
    block_mask = blocks < n_blocks
    if WRITE_CODES or AMAX_ONLY:  # non-finite elements count as zeros (codes and amax)
        finite = tl.abs(h) < float("inf")
        h = tl.where(finite, h, 0.0)
        amax = tl.max(tl.abs(h), axis=2)  # [NB, BLOCK_M]
        bad = tl.max((~finite).to(tl.int32), axis=2) > 0
    else:  # values only: a non-finite block is NaN throughout, whatever its amax
        amax = tl.reduce(tl.abs(h), 2, _max_keeping_nan)
        bad = ~(amax < float("inf"))
    if AMAX_ONLY:
        tl.atomic_max(amax_ptr, tl.max(tl.max(amax, axis=1), axis=0))
    else:
        if SCALE_KIND == 0:  # SCALE_E4M3
            if STATIC:
                pts = tl.load(global_ptr)
            else:
                pts = tl.div_rn(tl.load(amax_ptr), _PTS_DIVISOR)
            usable = pts >= _MIN_PTS
            pts = tl.where(usable, pts, 1.0)
            pts_b = tl.full(amax.shape, 0.0, tl.float32) + pts
            s = tl.div_rn(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)), pts_b)
            s = tl.minimum(tl.maximum(s, 0.015625), 448.0)  # [2^-6, 448]
            code, block = _e4m3_round(s)
            inverse = tl.div_rn(1.0, pts)  # one scalar division per program
            reciprocal = tl.where(usable, tl.div_rn(tl.full(amax.shape, 0.0, tl.float32) + inverse,
                                                    block), 0.0)
            code = tl.where(bad, 0x7F, code)
            scale_value = block
            if (pid_m == 0) & (pid_b == 0):
                tl.store(pts_ptr, pts)
        else:
            e = _e8m0_exponent(amax, ROUNDING)
            scale_value = _pow2(e)
            reciprocal = tl.div_rn(tl.full(amax.shape, GAIN, tl.float32), scale_value)
            code = tl.where(bad, 255, e + 127)
        y = h * reciprocal[:, :, None]
        mask = block_mask[:, None, None] & row_mask[None, :, None]
        if WRITE_CODES:
            codes = _e2m1_codes(y)
            low, high = tl.split(tl.reshape(codes, [NB, BLOCK_M, D // 2, 2]))
            packed = (low | (high << 4)).to(tl.uint8)
            offs_p = tl.arange(0, D // 2)
            c_ptrs = (codes_ptr + rows[None, :, None] * stride_cm
                      + blocks[:, None, None] * (D // 2) + offs_p[None, None, :])
            tl.store(c_ptrs, packed, mask=mask)
            s_ptrs = scales_ptr + rows[None, :] * stride_sm + blocks[:, None]
            tl.store(s_ptrs, code.to(tl.uint8), mask=block_mask[:, None] & row_mask[None, :])
        if WRITE_E4M3:  # MX: e is the blocks' exponent; one chunk of 128 a program
            tl.static_assert((SCALE_KIND == 1) & (NB * D == 128))
            q = _e2m1_round(y)
            counted = (tl.max(tl.abs(q), axis=2) > 0) & ~bad  # [NB, BLOCK_M]
            e_max = tl.max(tl.where(counted, e, _NO_BLOCK), axis=0)
            step, low, exponent = _fold_shifts(e, counted, e_max[None, :])
            inexact = tl.max(low, axis=0) & row_mask.to(tl.int32)
            tl.atomic_add(inexact_ptr, tl.sum(inexact, axis=0))
            byte = (q * step[:, :, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            byte = tl.where(bad[:, :, None], 0x7F, byte)
            k = blocks[:, None, None] * D + tl.arange(0, D)[None, None, :]
            tl.store(codes_ptr + rows[None, :, None] * stride_cm + k, byte, mask=mask)
            tl.store(scales_ptr + pid_b * M + rows, _pow2(tl.reshape(exponent, [BLOCK_M])),
                     mask=row_mask)
        if WRITE_VALUES:
            scale_value = tl.where(bad, float("nan"), scale_value)
            k = blocks[:, None, None] * D + tl.arange(0, D)[None, None, :]
            if values_ptr.dtype.element_ty == tl.int8:
                # the decode GEMM's one-row product: 2q (exact), the block scales apart
                values = tl.where(bad[:, :, None], 0.0, _e2m1_round(y) * 2.0)
                tl.store(scales_ptr + rows[None, :] * stride_sm + blocks[:, None], scale_value,
                         mask=block_mask[:, None] & row_mask[None, :])
            else:
                values = _e2m1_round(y) * scale_value[:, :, None]
                if WORD_ORDER:  # kbbq_pl.kernels.exact.word_order_index
                    k = (k // 128) * 128 + 32 * (k % 4) + 2 * ((k % 128) // 8) + (k % 8) // 4
            v_ptrs = values_ptr + rows[None, :, None] * stride_vm + k
            tl.store(v_ptrs, values.to(values_ptr.dtype.element_ty), mask=mask)


def _act_configs():
    """Tiles of ``BLOCK_M`` rows by ``NB`` blocks (at most 64 elements per thread, pruned per
    block size below), autotuned only on request (``config="autotune"``): each costs a
    compile in a GPU session, for a memory-bound kernel whose tile :data:`ACT_TILES` picks by
    the compile report."""
    return [triton.Config({"BLOCK_M": block_m, "NB": nb}, num_warps=warps)
            for block_m, nb, warps in ((256, 1, 4), (128, 1, 4), (512, 1, 8), (64, 2, 4))]


ACT_TILES = {16: {"BLOCK_M": 128 if _TRITON_3_8 else 256, "NB": 1, "TILES": 4, "num_warps": 4},
             32: {"BLOCK_M": 128 if _TRITON_3_7 else 256, "NB": 1, "TILES": 4,
                  "num_warps": 4}}
"""The activation kernel's tile per block size, one block per program (every thread reads
the same ``T``): of the tiles compiled by ``bench/gpu_compile.py``, the fewest SASS per
element without spills in the values kernel: two rows a thread (each column of ``T`` loaded
once for both), except where two rows spill and one row runs instead: MX on Triton 3.7 and
later (on 3.6: 54 SASS an element with two rows, 60 with one), and NVFP4 on Triton 3.8 (the
values kernel: 8 bytes a thread with two rows, none with one, as few SASS an element; 3.6 and
3.9 do not spill it).
Up to four row tiles a program (:func:`tiles_per_program`), the next one's activations loaded
while one is computed (``TILES``: one tile a program ran at 0.11 to 0.19 of a device copy on an
H200, its memory idle while the chain ran; the same bits either way)."""
FEW_ROWS = 16
"""Up to this many rows (a decode step) the activation kernel runs :data:`FEW_ROWS_TILES`."""
FEW_ROWS_TILES = {16: {"BLOCK_M": 4, "NB": 2, "num_warps": 1, "FROM_MEMORY": True},
                  32: {"BLOCK_M": 4, "NB": 1, "num_warps": 1, "FROM_MEMORY": True}}
"""A decode step's tile: one warp a program, one output of a block a lane (two NVFP4 blocks or
one MX block a program: ``K / 32`` programs), ``T``'s columns and ``x`` loaded from memory
column by column (:func:`_transformed_from_memory`), as many rows as their next power of two,
at most ``BLOCK_M``.  The tile it replaced (16 rows a program, the chain in registers:
:data:`REGISTER_FEW_ROWS_TILES`, still what a product other than the FMA chain runs) ran
``D^2`` (MX) or ``D^2 / 2`` (NVFP4) multiply-adds a thread, its column loads in turn behind
them; the same bits either way."""
REGISTER_FEW_ROWS_TILES = {16: {"BLOCK_M": 16, "NB": 1, "num_warps": 1},
                           32: {"BLOCK_M": 16, "NB": 2, "num_warps": 1}}
INTERPRETER_FEW_ROWS_CONFIG = {"BLOCK_M": 4, "NB": 8, "FROM_MEMORY": True}
""":data:`FEW_ROWS_TILES` under the interpreter (more blocks a program: fewer programs to
interpret)."""


def few_rows_tile(tile: dict, m: int) -> dict:
    """``tile`` (:data:`FEW_ROWS_TILES`) for ``m`` rows: ``BLOCK_M`` no taller than the rows'
    next power of two (a one-row decode step computes no masked rows)."""
    if not tile.get("FROM_MEMORY"):
        return tile
    return dict(tile, BLOCK_M=min(tile["BLOCK_M"], next_power_of_2(max(m, 1))))


def _prune_act_configs(configs, named_args, **kwargs):
    d = kwargs.get("D", named_args.get("D"))
    if d is None:  # a Triton that passes no constexprs to the pruner: keep them all
        return configs
    return [c for c in configs
            if c.kwargs["BLOCK_M"] * c.kwargs["NB"] * d <= 64 * 32 * c.num_warps]


_quantize_activations_tuned = triton.autotune(
    configs=_act_configs(),
    key=["n_blocks", "m_bucket", "D", "HAS_T", "AMAX_ONLY", "SCALE_KIND", "PRODUCT",
         "WRITE_CODES", "WRITE_VALUES", "WORD_ORDER", "PARTS_FIRST", "GROUPS"],
    prune_configs_by={"early_config_prune": _prune_act_configs},
)(_quantize_activations_kernel)

INTERPRETER_ACT_CONFIG = {"BLOCK_M": 16, "NB": 2}
E4M3_TILE = {"BLOCK_M": 32 if _TRITON_3_7 else 64, "NB": 4, "num_warps": 4}
"""The activation kernel's tile when it folds MX values to E4M3 (a whole chunk of 128 a
program: four blocks; as many block rows a thread as :data:`ACT_TILES`' MX tile)."""
INTERPRETER_E4M3_CONFIG = {"BLOCK_M": 16, "NB": 4}
PREFILL_PRODUCT = PRODUCT_FMA_CHAIN
"""The product of ``T x`` where the activation kernel writes the bf16 values of more than
:data:`FEW_ROWS` rows of bf16 activations alone (the prefill path's operand): the exact chain.
``PRODUCT_BF16X3`` is opt-in (``bench/gpu.py``'s ``gemm`` section times the prefill path on
it): faster by its compile counts, but a code may differ from the CPU reference's."""
BF16X3_TILE = {"BLOCK_M": 256, "NB": 1, "num_warps": 8}
"""The ``PRODUCT_BF16X3`` tile: one block a program, as a 2-D ``wgmma`` product (a batched one
gives each warp the whole product on Triton 3.6); on sm_90 with Triton 3.6, 17.8 SASS an element
for MX and 31.9 for NVFP4, 80 and 64 registers, no spills (``bench/gpu_compile.py``)."""


PROGRAMS_PER_SM = 4
"""The fewest activation-kernel programs per SM that :func:`tiles_per_program` leaves (about
as many as reside at once), so that taking tiles in turn never idles SMs."""


def tiles_per_program(tiles: int, most: int, sms: int) -> int:
    """Row tiles each program takes in turn: up to ``most``, while ``tiles`` tiles still give
    :data:`PROGRAMS_PER_SM` programs to each of ``sms`` SMs (at 1,024 rows, 8192 columns and
    NVFP4's 256-row tiles: 3 on 132 SMs; at 4,096 rows: 4)."""
    return max(1, min(most, tiles // (PROGRAMS_PER_SM * sms)))


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of CUDA ``device`` (4 under the interpreter)."""
    if INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


_COLUMNS = WeakIdKeyDictionary()
_BF16X3 = WeakIdKeyDictionary()


def _per_version(cache: WeakIdKeyDictionary, transform, make):
    """``make(transform)``, kept in ``cache`` while ``transform`` lives and made again after an
    in-place change of it (seen by its version counter)."""
    entry = cache.get(transform)
    if entry is None or entry[0] != transform._version:
        entry = cache[transform] = (transform._version, make(transform))
    return entry[1]


def transform_columns(transform):
    """``transform [K/d, d, d]`` with each block transposed (``[b, j, i] = T_b[i, j]``), as the
    activation kernel reads it: column ``j`` of a block in 16-byte loads.  Made once per
    transform tensor and version (a layer's transform is transposed at its first call)."""
    return _per_version(_COLUMNS, transform, lambda t: t.transpose(1, 2).contiguous())


def transform_columns_bf16x3(transform):
    """:func:`transform_columns` as three bf16 parts that sum to it exactly (``[3, K/d, d, d]``,
    :func:`~kbbq_pl.kernels.exact.split_bf16x3`): the operand of ``PRODUCT_BF16X3``, made once
    per transform tensor and version."""
    return _per_version(_BF16X3, transform, lambda t: split_bf16x3(transform_columns(t)))


def _m_bucket(m: int) -> int:
    return min(next_power_of_2(max(m, 1)), 8192)


def _act_grid(m: int, n_blocks: int, groups: int, tile: dict) -> tuple[int, int, int]:
    """(row tiles / tiles a program, block tiles, siblings) of an activation launch."""
    return (cdiv(cdiv(m, tile["BLOCK_M"]), tile.get("TILES", 1)), cdiv(n_blocks, tile["NB"]),
            groups)


def quantize_activations(x, transform, d: int, scale_kind: int, rounding: int, gain: float,
                         global_scale, config: dict | None = None, product: int | None = None,
                         values_dtype: torch.dtype | None = None, codes: bool = True,
                         word_order: bool = False, e4m3_inexact=None):
    """Launch the activation kernel(s); arguments already checked by :mod:`kbbq_pl.kernels`.

    Returns ``(codes uint8 [M, K/2], scales uint8 [M, K/d], pts fp32 [] or None, values)``:
    ``codes`` False skips the first two (None); ``values_dtype`` (fp16, bf16 or fp32) adds the
    decoded values ``[M, K]`` (else None), in ``word_order`` if asked; int8 (``codes`` False,
    natural order) gives ``2q`` as the values and the FP32 block scales ``[M, K/d]`` as the
    scales (the decode GEMM's DP4A product).  Dynamic NVFP4 runs
    the kernel twice (see :func:`kbbq_pl.kernels.quantize_activations`).  ``product``
    overrides how ``T x`` is multiplied (benchmarks: ``PRODUCT_FMA_DOT``; ``PRODUCT_BF16X3``,
    bf16 ``x`` only); None: the FMA chain, or :data:`PREFILL_PRODUCT` for the prefill path's
    operand.
    ``e4m3_inexact`` (MX, ``K`` a multiple of 128; an int32 ``[1]`` counter): instead of the
    codes, the values folded to E4M3 for the FP8 product (``codes``: float8_e4m3fn ``[M, K]``;
    ``scales``: FP32 ``[M, K/128]``, strides ``(1, M)``; the inexact chunks added to the
    counter), as :func:`fold_e4m3` folds the codes.

    A list of 2 or 3 transforms (all tensors or all None; ``global_scale`` then a list of as
    many static scales, or None) rounds ``x`` once for each, in one launch (values only): the
    values ``[G, M, K]`` (int8: with their block scales ``[G, M, K/d]``) and the per-tensor
    scales ``[G]``, each sibling's the bits of its own call.
    """
    m, k = x.shape
    n_blocks = k // d
    device = x.device
    nvfp4 = scale_kind == SCALE_E4M3
    groups = len(transform) if isinstance(transform, (list, tuple)) else 1
    transforms = list(transform) if groups > 1 else [transform]
    scales_in = (list(global_scale) if groups > 1 and global_scale is not None
                 else [global_scale])
    if groups > 1 and (codes or values_dtype is None or e4m3_inexact is not None
                       or len({t is None for t in transforms}) > 1
                       or (global_scale is not None and len(scales_in) != groups)):
        raise ValueError("sibling activations come as values alone, one transform (all or none "
                         "of them None) and one static scale (or none) each")
    transform, global_scale = transforms[0], scales_in[0]
    static = global_scale is not None
    # Nothing is filled on the device unless a kernel reads it first (a fill is one more
    # launch, one more node of a CUDA graph, per linear): the per-tensor scale is written by
    # the kernel's first program (an empty input, no program, keeps 1, as formats.quantize
    # does); the amax only accumulates for dynamic NVFP4, else it is an unread placeholder.
    pts = None
    lead = (groups,) if groups > 1 else ()
    if nvfp4:
        pts = (torch.empty(lead, dtype=torch.float32, device=device) if m and n_blocks
               else torch.ones(lead, dtype=torch.float32, device=device))
    amax = (torch.zeros(groups, dtype=torch.float32, device=device) if nvfp4 and not static
            else torch.empty(1, dtype=torch.float32, device=device))
    dummy = amax
    e4m3 = e4m3_inexact is not None
    if e4m3:
        codes = False
        codes_out = torch.empty(m, k, dtype=torch.uint8, device=device)
        scales_out = torch.empty(k // 128, m, dtype=torch.float32, device=device)
    else:
        codes_out = torch.empty(m, k // 2, dtype=torch.uint8, device=device) if codes else None
        scales_out = (torch.empty(m, n_blocks, dtype=torch.uint8, device=device) if codes
                      else None)
    values = None
    if values_dtype is not None:
        width = -(-k // 128) * 128 if word_order else k  # a partial chunk keeps its slots
        values = torch.empty(*lead, m, width, dtype=values_dtype, device=device)
    if product is None:  # the prefill path's operand: PREFILL_PRODUCT
        prefill = (values_dtype == torch.bfloat16 and not codes and not e4m3 and groups == 1
                   and m > FEW_ROWS and x.dtype == torch.bfloat16)
        product = PREFILL_PRODUCT if prefill else PRODUCT_FMA_CHAIN
    doubled = values_dtype == torch.int8  # 2q and the FP32 block scales
    if doubled:
        if codes or word_order or e4m3:
            raise ValueError("int8 activation values (2q) come alone, in the natural order")
        scales_out = torch.empty(*lead, m, n_blocks, dtype=torch.float32, device=device)
    meta = dict(D=d, SCALE_KIND=scale_kind, ROUNDING=rounding, GAIN=gain,
                HAS_T=transform is not None, STATIC=static, PRODUCT=product,
                WRITE_CODES=codes, WRITE_VALUES=values is not None, WORD_ORDER=word_order,
                PARTS_FIRST=PARTS_FIRST, WRITE_E4M3=e4m3,
                GROUPS=groups,
                **COMPILE_OPTIONS)
    codes_arg = codes_out if codes or e4m3 else dummy
    scales_arg = scales_out if codes or e4m3 or doubled else dummy
    if product == PRODUCT_BF16X3 and x.dtype != torch.bfloat16:
        raise ValueError(f"the bf16x3 product multiplies bf16 activations, not {x.dtype} "
                         f"({tuple(x.shape)} on {device})")
    operand = transform_columns_bf16x3 if product == PRODUCT_BF16X3 else transform_columns
    columns = [operand(t) if t is not None else dummy for t in transforms]
    statics = scales_in if static else [dummy] * groups
    columns += columns[-1:] * (3 - groups)  # the unused siblings' pointers: any tensor's
    statics += statics[-1:] * (3 - groups)
    args = [x, columns[0], codes_arg, scales_arg, statics[0], amax, pts if nvfp4 else dummy,
            values if values is not None else dummy, e4m3_inexact if e4m3 else dummy,
            columns[1], columns[2], statics[1], statics[2],
            m, n_blocks, x.stride(0), codes_arg.stride(0) if codes or e4m3 else 0,
            scales_arg.stride(-2) if codes or doubled else 0,
            values.stride(-2) if values is not None else 0,
            values.stride(0) if groups > 1 else 0, _m_bucket(m)]

    if e4m3:  # a program holds whole chunks of 128
        config = INTERPRETER_E4M3_CONFIG if INTERPRET else E4M3_TILE
    elif config is None and m <= FEW_ROWS and product == PRODUCT_FMA_CHAIN:
        config = INTERPRETER_FEW_ROWS_CONFIG if INTERPRET else FEW_ROWS_TILES[d]
    elif config is None and m <= FEW_ROWS and not INTERPRET:
        config = REGISTER_FEW_ROWS_TILES[d]
    elif config is None and not INTERPRET:
        config = BF16X3_TILE if product == PRODUCT_BF16X3 else ACT_TILES[d]
        if config.get("TILES", 1) > 1:
            config = dict(config, TILES=tiles_per_program(
                cdiv(m, config["BLOCK_M"]) * cdiv(n_blocks, config["NB"]) * groups,
                config["TILES"], sm_count(device)))
    elif config == "autotune":
        config = None

    def launch_pass(amax_only: bool) -> None:
        passes = dict(AMAX_ONLY=amax_only)
        if config is not None or INTERPRET:
            cfg = few_rows_tile(dict(config or INTERPRETER_ACT_CONFIG), m)
            warps = cfg.pop("num_warps", 4)
            launch(_quantize_activations_kernel, _act_grid(m, n_blocks, groups, cfg), args,
                   dict(meta, **passes, **cfg, num_warps=warps))
        else:
            launch(_quantize_activations_tuned, functools.partial(_act_grid, m, n_blocks, groups),
                   args, dict(meta, **passes))

    if nvfp4 and not static:
        launch_pass(True)
    launch_pass(False)
    if e4m3:
        return codes_out.view(torch.float8_e4m3fn), scales_out.t(), None, None
    return codes_out, scales_out, pts, values


# --------------------------------------------------------------------------- GEMM


@triton.jit
def _load_operand(ptr, scale_ptr, offs_r, n_rows, k0, K, stride_r, stride_sr,
                  ROWS: tl.constexpr, BLOCK_K: tl.constexpr, D: tl.constexpr,
                  SCALE_KIND: tl.constexpr, PACKED: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A ``[ROWS, BLOCK_K]`` operand tile from K offset ``k0``: packed codes decoded in registers,
    or (``PACKED`` False) already-decoded bf16 values."""
    row_mask = offs_r < n_rows
    if PACKED:
        offs_p = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        offs_s = k0 // D + tl.arange(0, BLOCK_K // D)
        packed = tl.load(ptr + offs_r[:, None] * stride_r + offs_p[None, :],
                         mask=row_mask[:, None] & (offs_p[None, :] < K // 2), other=0)
        scales = tl.load(scale_ptr + offs_r[:, None] * stride_sr + offs_s[None, :],
                         mask=row_mask[:, None] & (offs_s[None, :] < K // D), other=0)
        return _decode_tile(packed, scales, ROWS, BLOCK_K, D, SCALE_KIND).to(DOT_DTYPE)
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        values = tl.load(ptr + offs_r[:, None] * stride_r + offs_k[None, :],
                         mask=row_mask[:, None] & (offs_k[None, :] < K), other=0.0)
        return values.to(DOT_DTYPE)


@triton.jit
def _bf16_rne(x):
    """FP32 to bf16, round to nearest even, in integer arithmetic (the interpreter's own cast
    truncates; on GPUs ``.to(tl.bfloat16)`` is ``cvt.rn``, the same rounding)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _epilogue(acc, offs_m, offs_n, M, N, a_global_ptr, w_global_ptr, bias_ptr, out_ptr, stride_om,
              GAIN2: tl.constexpr, HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr,
              EXPLICIT_BF16: tl.constexpr):
    """Per-tensor scales, the MX ``no_clip`` gain, bias; store in the output dtype."""
    if HAS_GLOBAL:
        # the smaller scale first: |acc| <= 2688^2 K, so no product overflows FP32 where the
        # result does not (activations ~1e35 against weights ~0.1 did, the larger one first)
        a_global = tl.load(a_global_ptr)
        w_global = tl.load(w_global_ptr)
        acc = acc * tl.minimum(a_global, w_global) * tl.maximum(a_global, w_global)
    if GAIN2 != 1.0:
        acc = tl.div_rn(acc, tl.full(acc.shape, GAIN2, tl.float32))
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    if EXPLICIT_BF16:
        tl.store(out, _bf16_rne(acc), mask=mask)
    else:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w4a4_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, a_global_ptr, w_global_ptr, bias_ptr, out_ptr,
    partial_ptr, M, N, K, split_k, stride_am, stride_asm, stride_wn, stride_wsn, stride_om,
    m_bucket,
    D: tl.constexpr, SCALE_KIND: tl.constexpr, GAIN2: tl.constexpr, A_PACKED: tl.constexpr,
    HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    EXPLICIT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, W_PACKED: tl.constexpr = True,
):
    """``out = (A W^T) * scales + bias`` with both operands decoded from packed FP4 in registers,
    bf16 tensor cores, FP32 accumulation.  Program (tile, split): with ``split_k > 1`` each split
    of K writes its FP32 partial to ``partial_ptr [split_k, M, N]`` for :func:`_split_k_sum`.
    ``A_PACKED`` / ``W_PACKED`` False: that operand is already decoded (bf16 ``q * s``)."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n  # grouped ordering: GROUP_M row tiles share the weight tiles in L2
    group = pid // width
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(tl.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K):
        a = _load_operand(a_ptr, a_scale_ptr, offs_m, M, k0, K, stride_am, stride_asm,
                          BLOCK_M, BLOCK_K, D, SCALE_KIND, A_PACKED, DOT_DTYPE)
        w = _load_operand(w_ptr, w_scale_ptr, offs_n, N, k0, K, stride_wn, stride_wsn,
                          BLOCK_N, BLOCK_K, D, SCALE_KIND, W_PACKED, DOT_DTYPE)
        acc = tl.dot(a, tl.trans(w), acc)
    if split_k == 1:
        _epilogue(acc, offs_m, offs_n, M, N, a_global_ptr, w_global_ptr, bias_ptr, out_ptr,
                  stride_om, GAIN2, HAS_GLOBAL, HAS_BIAS, EXPLICIT_BF16)
    else:
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        part = partial_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part, acc, mask=mask)


@triton.jit
def _split_k_sum(partial_ptr, a_global_ptr, w_global_ptr, bias_ptr, out_ptr, M, N, stride_om,
                 SPLIT_K: tl.constexpr, GAIN2: tl.constexpr, HAS_GLOBAL: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EXPLICIT_BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Sum the split-K partials in a fixed order (deterministic) and apply the epilogue."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = partial_ptr + offs_m[:, None] * N + offs_n[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + s * M * N, mask=mask, other=0.0)
    _epilogue(acc, offs_m, offs_n, M, N, a_global_ptr, w_global_ptr, bias_ptr, out_ptr,
              stride_om, GAIN2, HAS_GLOBAL, HAS_BIAS, EXPLICIT_BF16)


@triton.jit
def _decode_kernel(codes_ptr, scales_ptr, out_ptr, R, K, stride_cr, stride_sr, stride_or,
                   D: tl.constexpr, SCALE_KIND: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr = False):
    """Packed codes and block scales to bf16 values ``q * s`` (exact), ``[R, K]``.  With
    ``EVEN_K`` (``K`` a multiple of ``BLOCK_K``) no mask runs along K, so the codes are read
    in 16-byte loads and the values written in 16-byte stores."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.program_id(1) * BLOCK_K
    offs_p = tl.arange(0, BLOCK_K // 2)
    offs_s = tl.arange(0, BLOCK_K // D)
    row_mask = offs_r < R
    if EVEN_K:
        p_mask = row_mask[:, None]
        s_mask = row_mask[:, None]
    else:
        p_mask = row_mask[:, None] & (k0 // 2 + offs_p < K // 2)[None, :]
        s_mask = row_mask[:, None] & (k0 // D + offs_s < K // D)[None, :]
    packed = tl.load(codes_ptr + offs_r[:, None] * stride_cr + k0 // 2 + offs_p[None, :],
                     mask=p_mask, other=0)
    scales = tl.load(scales_ptr + offs_r[:, None] * stride_sr + k0 // D + offs_s[None, :],
                     mask=s_mask, other=0)
    values = _decode_tile(packed, scales, BLOCK_R, BLOCK_K, D, SCALE_KIND)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (offs_k < K)[None, :]
    tl.store(out_ptr + offs_r[:, None] * stride_or + offs_k[None, :], values.to(tl.bfloat16),
             mask=mask)


def _gemm_configs(small: bool):
    configs = []
    if small:  # M <= 16: stream the packed weights, few rows of activations
        for block_n, block_k, warps, stages in ((32, 256, 4, 4), (64, 128, 4, 5), (128, 128, 4, 4),
                                                (128, 256, 8, 3), (64, 256, 8, 4)):
            configs.append(triton.Config({"BLOCK_M": 16, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                          "GROUP_M": 1}, num_warps=warps, num_stages=stages))
    else:  # three: each costs a compile per format in a GPU session
        for block_m, block_n, block_k, warps, stages in (
            (128, 128, 64, 8, 3), (256, 128, 64, 8, 3), (64, 256, 64, 8, 3),
        ):
            configs.append(triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n,
                                          "BLOCK_K": block_k, "GROUP_M": 8},
                                         num_warps=warps, num_stages=stages))
    return configs


_KEY = ["N", "K", "m_bucket", "split_k", "D", "SCALE_KIND", "A_PACKED", "W_PACKED", "HAS_BIAS"]
_w4a4_small = triton.autotune(configs=_gemm_configs(True), key=_KEY)(_w4a4_kernel)
_w4a4_large = triton.autotune(configs=_gemm_configs(False), key=_KEY)(_w4a4_kernel)

INTERPRETER_GEMM_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 64, "GROUP_M": 2}
SMALL_M = 16
"""Up to this many rows the GEMM streams the packed weights with the activations decoded in the
loop (the decode variant); above it the activations are decoded to bf16 once (they would be
decoded again by every column tile) and the weights in the loop."""


def _split_k(m: int, n: int, k: int, device: torch.device) -> int:
    """Splits of K for the small-M GEMM: enough (tile, split) programs to fill the GPU twice over
    with 64-wide column tiles, each split at least 1024 deep, at most 8 (a power of two)."""
    if m > SMALL_M or INTERPRET:
        return 1
    sms = sm_count(device)
    tiles = cdiv(n, 64)
    split = 1
    while split < 8 and tiles * split < 2 * sms and k // (2 * split) >= 1024:
        split *= 2
    return split


def decode(codes, scales, d: int, scale_kind: int):
    """bf16 values ``q * s`` of packed codes ``[R, K/2]`` with block scales ``[R, K/d]``."""
    rows, k = codes.shape[0], codes.shape[1] * 2
    out = torch.empty(rows, k, dtype=torch.bfloat16, device=codes.device)
    block_r, block_k, warps = (16, 64, 4) if INTERPRET else DECODE_TILE
    grid = (cdiv(rows, block_r), cdiv(k, block_k))
    _decode_kernel[grid](codes, scales, out, rows, k, codes.stride(0), scales.stride(0),
                         out.stride(0), D=d, SCALE_KIND=scale_kind, BLOCK_R=block_r,
                         BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps,
                         **COMPILE_OPTIONS)
    return out


DECODE_TILE = (32, 256, 4)
"""Rows, columns and warps of one program of the weight decode (``bench/gpu_compile.py``)."""


def w4a4_matmul(a_codes, a_scales, a_global, w_codes, w_scales, w_global, d: int,
                scale_kind: int, gain: float, bias, out_dtype, config: dict | None = None,
                split_k: int | None = None):
    """Launch the GEMM; arguments already checked by :mod:`kbbq_pl.kernels`."""
    m, n, k = a_codes.shape[0], w_codes.shape[0], w_codes.shape[1] * 2
    device = w_codes.device
    out = torch.empty(m, n, dtype=out_dtype, device=device)
    small = m <= SMALL_M
    if small:
        a, a_s = a_codes, a_scales
    else:
        a, a_s = decode(a_codes, a_scales, d, scale_kind), a_scales
    split = split_k if split_k is not None else _split_k(m, n, k, device)
    partial = (torch.empty(split, m, n, dtype=torch.float32, device=device) if split > 1
               else out)
    has_global = scale_kind == SCALE_E4M3
    dummy = out
    meta = dict(D=d, SCALE_KIND=scale_kind, GAIN2=gain * gain, A_PACKED=small, W_PACKED=True,
                HAS_GLOBAL=has_global, HAS_BIAS=bias is not None,
                DOT_DTYPE=tl.float32 if INTERPRET else tl.bfloat16,
                EXPLICIT_BF16=INTERPRET and out_dtype == torch.bfloat16, **COMPILE_OPTIONS)
    globals_ = (a_global if has_global else dummy, w_global if has_global else dummy)
    args = [a, a_s, w_codes, w_scales, *globals_, bias if bias is not None else dummy, out,
            partial, m, n, k, split, a.stride(0), a_s.stride(0), w_codes.stride(0),
            w_scales.stride(0), out.stride(0), _m_bucket(m)]
    if config is not None or INTERPRET:
        cfg = dict(config or INTERPRETER_GEMM_CONFIG)
        warps = cfg.pop("num_warps", 4)
        stages = cfg.pop("num_stages", 3)
        grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), split)
        _w4a4_kernel[grid](*args, **meta, **cfg, num_warps=warps, num_stages=stages)
    else:
        kernel = _w4a4_small if small else _w4a4_large

        def grid(meta):
            return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), split)
        kernel[grid](*args, **meta)
    if split > 1:
        block_m, block_n = 16, 64
        grid = (cdiv(m, block_m), cdiv(n, block_n))
        _split_k_sum[grid](partial, *globals_, bias if bias is not None else dummy, out, m, n,
                           out.stride(0), SPLIT_K=split, GAIN2=gain * gain,
                           HAS_GLOBAL=has_global, HAS_BIAS=bias is not None,
                           EXPLICIT_BF16=meta["EXPLICIT_BF16"], BLOCK_M=block_m,
                           BLOCK_N=block_n, **COMPILE_OPTIONS)
    return out


def decoded_matmul(a_values, w_values, a_global, w_global, scale_kind: int, gain: float,
                   bias, out_dtype, config: dict | None = None):
    """``(A W^T) * scales + bias`` of already-decoded bf16 operands ``A [M, K]``, ``W [N, K]``
    (the prefill path's Triton product: the epilogue reads the per-tensor scales on the
    device, so dynamic NVFP4 needs no host copy of its scale)."""
    m, k = a_values.shape
    n = w_values.shape[0]
    device = w_values.device
    out = torch.empty(m, n, dtype=out_dtype, device=device)
    if m == 0 or n == 0:
        return out
    has_global = scale_kind == SCALE_E4M3
    dummy = out
    meta = dict(D=16, SCALE_KIND=scale_kind, GAIN2=gain * gain, A_PACKED=False, W_PACKED=False,
                HAS_GLOBAL=has_global, HAS_BIAS=bias is not None,
                DOT_DTYPE=tl.float32 if INTERPRET else tl.bfloat16,
                EXPLICIT_BF16=INTERPRET and out_dtype == torch.bfloat16, **COMPILE_OPTIONS)
    args = [a_values, dummy, w_values, dummy, a_global if has_global else dummy,
            w_global if has_global else dummy, bias if bias is not None else dummy, out, out,
            m, n, k, 1, a_values.stride(0), 0, w_values.stride(0), 0, out.stride(0),
            _m_bucket(m)]
    if config is not None or INTERPRET:
        cfg = dict(config or INTERPRETER_GEMM_CONFIG)
        warps = cfg.pop("num_warps", 4)
        stages = cfg.pop("num_stages", 3)
        grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), 1)
        _w4a4_kernel[grid](*args, **meta, **cfg, num_warps=warps, num_stages=stages)
    else:
        def grid(meta):
            return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]), 1)
        _w4a4_large[grid](*args, **meta)
    return out


# --------------------------------------------------------------------------- MX on FP8


@triton.jit
def _e4m3_word(words, step, nan_block, FIRST: tl.constexpr):
    """Four codes of each word (from bit ``FIRST``) times ``step`` as E4M3 bytes in one int32
    (NaN bytes in a NaN block)."""
    out = tl.zeros_like(words)
    for j in tl.static_range(4):
        q = _e2m1_values((words >> (FIRST + 4 * j)) & 15)
        byte = (q * step).to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        out = out | (byte << (8 * j))
    return tl.where(nan_block, 0x7F7F7F7F, out)


@triton.jit
def _fold_e4m3_kernel(words_ptr, exps_ptr, values_ptr, scales_ptr, inexact_ptr, R,
                      stride_wr, stride_er, stride_vr, multiplier,
                      D: tl.constexpr, BLOCK_R: tl.constexpr):
    """:func:`kbbq_pl.kernels.exact.fold_mx_to_e4m3` of one chunk of 128 for ``BLOCK_R`` rows
    (program axis 1 the chunk): E4M3 bytes ``[R, K]`` (stored as int32 words, four bytes
    each), the chunk's scale ``2^exponent * multiplier`` (FP32, chunk-major: ``scales_ptr[c *
    R + r]``, the layout of cuBLAS's 1 x 128 scales), and the number of inexact chunks added
    to ``inexact_ptr``.

    The codes are read as int32 words of 8, ``[BLOCK_R, blocks, words a block]`` (a thread
    holds a block's words, 16 bytes), each block with its exponent, so that the chunk's
    largest exponent is a reduction along the row and no value changes thread.  Each code
    becomes ``q * 2^shift`` in FP32 (exact) and is converted to E4M3 (exact: every value the
    fold allows is an E4M3 value)."""
    tl.static_assert(D == 32)  # MX: a chunk's four exponent bytes are one int32
    PB: tl.constexpr = 128 // D  # blocks a chunk
    WB: tl.constexpr = D // 8  # words a block
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    chunk = tl.program_id(1)
    row_mask = (rows < R)[:, None, None]
    b = tl.arange(0, PB)[None, :, None]
    words = tl.load(words_ptr + rows[:, None, None] * stride_wr + chunk * 16 + b * WB
                    + tl.arange(0, WB)[None, None, :], mask=row_mask, other=0)  # [R, PB, WB]
    # the chunk's four exponent bytes as one word: unpacked where the codes' words are
    e4 = tl.load(exps_ptr + rows * stride_er + chunk, mask=rows < R, other=0)
    e = (e4[:, None, None] >> (8 * b)) & 255  # [R, PB, 1]
    nan_block = e == 255
    counted = ((words & 0x77777777) != 0) & ~nan_block  # a nonzero code in the word
    e_max = tl.max(tl.max(tl.where(counted, e - 127, _NO_BLOCK), axis=2), axis=1)
    step, low, exponent = _fold_shifts(e - 127, counted, e_max[:, None, None])
    inexact = tl.max(tl.max(low, axis=2), axis=1)
    tl.atomic_add(inexact_ptr, tl.sum(inexact, axis=0))
    values = tl.reshape(tl.join(_e4m3_word(words, step, nan_block, 0),
                                _e4m3_word(words, step, nan_block, 16)), [BLOCK_R, 32])
    v = chunk * 32 + tl.arange(0, 32)
    tl.store(values_ptr + rows[:, None] * stride_vr + v[None, :], values,
             mask=(rows < R)[:, None])
    scale = _pow2(tl.reshape(exponent, [BLOCK_R])) * multiplier  # one a row
    tl.store(scales_ptr + chunk * R + rows, scale, mask=rows < R)


FOLD_TILE = (64, 4)
"""Rows and warps of one program of the E4M3 fold (one chunk of 128 a program: 8 KB of
values)."""


def fold_e4m3(codes, exponents, d: int, inexact, multiplier: float = 1.0):
    """Launch the fold (:func:`_fold_e4m3_kernel`) of MX codes ``[R, K/2]`` with biased
    exponents ``[R, K/d]`` (``K`` a multiple of 128): ``(values float8_e4m3fn [R, K], scales
    fp32 [R, K/128] with strides (1, R))``; the inexact chunks are added to ``inexact``
    (int32 ``[1]`` on the device)."""
    rows, k = codes.shape[0], codes.shape[1] * 2
    chunks = k // 128
    # read as int32 words (four exponents a chunk, block 0 in the low byte): a view that does
    # not start on a word is copied first
    words, exponent_words = (
        (t if t.storage_offset() % 4 == 0 else t.clone()).view(torch.int32)
        for t in (codes, exponents))
    values = torch.empty(rows, k // 4, dtype=torch.int32, device=codes.device)
    scales = torch.empty(chunks, rows, dtype=torch.float32, device=codes.device)
    block_r, warps = (4, 4) if INTERPRET else FOLD_TILE
    grid = (cdiv(rows, block_r), chunks)
    _fold_e4m3_kernel[grid](words, exponent_words, values, scales, inexact, rows,
                            words.stride(0), exponent_words.stride(0), values.stride(0),
                            multiplier, D=d,
                            BLOCK_R=block_r, num_warps=warps, **COMPILE_OPTIONS)
    return values.view(torch.float8_e4m3fn), scales.t()
