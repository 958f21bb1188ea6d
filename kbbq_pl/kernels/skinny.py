"""The decode GEMM: rows of activations against packed FP4 weights, decoded in registers (Triton).

Imported lazily by :mod:`kbbq_pl.kernels` (needs triton).  A decode step multiplies a few
tokens by every weight of the model once, so this kernel is built to read the weights at the
memory's speed and do little else per byte; with more rows (a batch of decode steps, a short
prompt) the same loop feeds wider tensor-core tiles, each decoded weight serving ``BLOCK_M``
rows (16 up to 16 rows, 32 to 128 above: :func:`_configs`):

* the weights are read as :func:`kbbq_pl.formats.quantize` stores them (codes ``[N, K/2]``,
  element ``2i`` in the low nibble, one scale byte per block): 16-byte loads of contiguous row
  segments, marked ``evict_first``.  Nothing is copied or repacked: the activations come in
  word order instead (:func:`kbbq_pl.kernels.exact.word_order_index`, written so by the
  activation kernel that runs just before);
* the codes are decoded as 32-bit words of 8, two nibbles per integer operation (as Marlin
  does): for each shift of the word, the sign bits of the two nibbles at the top of its
  16-bit halves stay and their exponent-and-mantissa bits move down, which makes the two
  halves 16-bit floats (:func:`~kbbq_pl.kernels.exact.e2m1_half_bits`); one packed multiply
  by the block's multiplier finishes the decode, exactly (:mod:`kbbq_pl.kernels.exact`):
  fp16 ``q * s * 2^-14`` for NVFP4, bf16 ``q * 2^(e - shift)`` for MX; the epilogue puts back
  ``2^14`` or ``2^shift`` with the per-tensor scales, the MX ``no_clip`` gain and the bias;
* the product runs on tensor cores with the weights as the wide operand (``W [BLOCK_N, K]``
  times ``A^T [K, 16]``), or
  (``PRODUCT_DP4A``, one row, opt-in: :data:`ONE_ROW_PRODUCT`) as exact integer dot products
  of ``2q_w`` and ``2q_a`` per block (:func:`_dp4a_block_asm`), then one FP32 multiply-add a
  block by the two block scales;
* K is split across programs so that the grid fills the GPU (132 SMs at N = 4096); each split
  writes an FP32 partial and the last program of a (row, column) tile to finish (an atomic counter,
  reset by that program, so the kernel can be replayed in a CUDA graph) sums the partials in
  split order 0, 1, ...: the result does not depend on which program finished last.

One launch computes the product; with the activation kernel before it a decode-path linear
is two launches (three for dynamic NVFP4, whose per-tensor scale needs the amax of the whole
input first).

No host synchronization, no allocation but the output and the partials.  The split-K
counters are one buffer per device: decode GEMMs on two streams of one device at the same
time would share them (run them on one stream, as a model's layers do).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .direct_launch import launch
from .exact import MX_MULTIPLIER_BIAS, NVFP4_DECODE_SHIFT, WORD_ORDER_CHUNK
from .host import cdiv, next_power_of_2
from .interpret import interpreting
from .triton_kernels import (
    COMPILE_OPTIONS,
    SCALE_E4M3,
    _block_scale_values,
    _e2m1_values,
    _epilogue,
    _pow2,
    sm_count,
)

INTERPRET = interpreting()

PRODUCT_DOT = 0
PRODUCT_DP4A = 2
ONE_ROW_PRODUCT = PRODUCT_DOT
"""The product of a one-row decode GEMM (a batch-1 decode step) in :func:`kbbq_pl.kernels.
linear_w4a4` and :func:`~kbbq_pl.kernels.linear_w4a4_siblings`: the tensor cores
(``PRODUCT_DOT``) or the integer dot products of ``PRODUCT_DP4A`` (:func:`_dp4a_block_sums`;
opt-in: a layer alone runs faster on it, within one rounding, but ``bench/gpu.py``'s model
sections have not yet timed a whole decode step on it)."""
VALUES_FP32 = 0
VALUES_FP16 = 1
VALUES_BF16 = 2
FEW_ROWS = 16
"""Up to this many rows the decode GEMM runs 16-row tiles (the tensor-core operand's narrow
side); above, 32 to 128."""
MAX_SPLITS = 16
ROW_GROUP: tl.constexpr = tl.constexpr(8)
"""Row tiles a column tile is taken down together (``tl.swizzle2d`` in the kernel)."""
_COUNTERS = 1 << 14
"""Output tiles a device's split-K counters cover (beyond them K is not split)."""


@triton.jit
def _word_halves(words, mult, SHIFT: tl.constexpr, VALUES: tl.constexpr):
    """The two E2M1 values whose nibbles sit at bits 12-15 and 28-31 of ``words << SHIFT``
    (int32 words of codes), decoded and multiplied by their word's multiplier: the sign bit
    stays, the exponent-and-mantissa bits move down by 3 (fp16) or 6 (bf16), which makes each
    16-bit half the float ``q * 2^-14`` (fp16) or ``q * 2^-126`` (bf16;
    :func:`kbbq_pl.kernels.exact.e2m1_half_bits`), two values per integer operation.  bf16
    pairs are multiplied as pairs by one line of PTX (Triton multiplies bf16 one value at a
    time); VALUES_FP32 gives the same values in FP32 (the interpreter's path)."""
    x = words << SHIFT
    sign = x & -2147450880  # 0x80008000
    if VALUES == 1:  # VALUES_FP16
        pair = sign | ((x & 0x70007000) >> 3)
        low = pair.to(tl.int16).to(tl.float16, bitcast=True)
        high = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        return low * mult, high * mult
    elif VALUES == 2:  # VALUES_BF16 (GPU only: the interpreter runs no PTX)
        pair = sign | ((x & 0x70007000) >> 6)
        pair = tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [pair, mult],
                                         dtype=tl.int32, is_pure=True, pack=1)
        low = pair.to(tl.int16).to(tl.bfloat16, bitcast=True)
        high = (pair >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return low, high
    else:  # the bf16 patterns widened to FP32 (a bf16 is the top half of an FP32)
        pair = sign | ((x & 0x70007000) >> 6)
        low = (pair << 16).to(tl.float32, bitcast=True)
        high = (pair & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000
        return low * mult, high * mult


E2M1_DOUBLED_LOW = 0x03020100
"""``2|q|`` of the E2M1 magnitudes 0 to 3 (0, 0.5, 1, 1.5), one byte each: the low half of
the byte table the DP4A product permutes (``prmt``) codes through; the high half,
``0x0C080604``, holds 4 to 7 (2, 3, 4, 6)."""
E2M1_DOUBLED_HIGH: tl.constexpr = tl.constexpr(0x0C080604)
TABLE_COPIES: tl.constexpr = tl.constexpr(256)


def _dp4a_block_asm(words: int) -> str:
    """PTX of :func:`_dp4a_block_sums` for one block of ``words`` 32-bit words of codes
    (operands: the words, then two words of int8 activations per word (its elements 0-3 and
    4-7), then the byte table's two halves).  Per word: ``prmt`` (byte permute, PTX's default
    mode) takes the low four nibbles as selectors, each picking ``2|q|`` from the table by its
    three low bits, while a set high bit (a negative code's sign) replaces the byte by the
    picked byte's sign bit repeated, which is 0: the positive codes' ``2q``, zeros for the
    negative ones; the same on the word with every sign flipped gives the negative codes'
    ``2|q|`` and zeros for the positive ones; ``dp4a`` (four int8 products summed into
    an int32) takes each against the activations' ``2q`` bytes, and the block's sum is the
    positive part less the negative part: exact integers."""
    lines = ["{", ".reg .b32 w, n, p, t, u;", "mov.b32 t, 0;", "mov.b32 u, 0;"]
    table = f"${1 + 3 * words}, ${2 + 3 * words}"
    for i in range(words):
        low, high = f"${1 + words + 2 * i}", f"${2 + words + 2 * i}"
        lines += [f"xor.b32 n, ${1 + i}, 0x88888888;",
                  f"prmt.b32 p, {table}, ${1 + i};", f"dp4a.s32.s32 t, p, {low}, t;",
                  f"prmt.b32 p, {table}, n;", f"dp4a.s32.s32 u, p, {low}, u;",
                  f"shr.u32 w, ${1 + i}, 16;", "shr.u32 n, n, 16;",
                  f"prmt.b32 p, {table}, w;", f"dp4a.s32.s32 t, p, {high}, t;",
                  f"prmt.b32 p, {table}, n;", f"dp4a.s32.s32 u, p, {high}, u;"]
    lines += ["sub.s32 $0, t, u;", "}"]
    return "\n".join(lines)


_DP4A_ASM_2: tl.constexpr = tl.constexpr(_dp4a_block_asm(2))
_DP4A_ASM_4: tl.constexpr = tl.constexpr(_dp4a_block_asm(4))
_INTERPRET: tl.constexpr = tl.constexpr(INTERPRET)


@triton.jit
def _word_dot(word, a_low, a_high):
    """The interpreter's :func:`_dp4a_block_sums` of one word: ``sum 2q_w 2q_a`` over its eight
    codes against the int8 activations of ``a_low`` (elements 0-3) and ``a_high`` (4-7)."""
    total = tl.zeros(word.shape, tl.int32)
    for j in tl.static_range(4):
        low = (_e2m1_values((word >> (4 * j)) & 15) * 2.0).to(tl.int32)
        high = (_e2m1_values((word >> (16 + 4 * j)) & 15) * 2.0).to(tl.int32)
        total += low * ((a_low << (24 - 8 * j)) >> 24) + high * ((a_high << (24 - 8 * j)) >> 24)
    return total


@triton.jit
def _dp4a_block_sums(words, a_blocks, b_mask, table_low, BLOCK_N: tl.constexpr,
                     NB: tl.constexpr, D: tl.constexpr):
    """``sum 2q_w 2q_a`` over each block (int32 ``[BLOCK_N, NB]``, exact) of the codes ``words``
    (int32 ``[BLOCK_N, NB * D / 8]``) against the int8 activations at ``a_blocks`` (int32
    pointers ``[NB]``, each at its block's first four), by :func:`_dp4a_block_asm` on GPUs.
    ``table_low`` (:data:`E2M1_DOUBLED_LOW`, ``[BLOCK_N, 1]``) comes from memory: given as a
    constant, ptxas re-creates it before each ``prmt`` (compile reports: 15% more
    instructions)."""
    table = tl.full([BLOCK_N, NB], 0, tl.int32) + table_low
    table_high = tl.full([BLOCK_N, NB], E2M1_DOUBLED_HIGH, tl.int32)
    a0 = tl.load(a_blocks, mask=b_mask, other=0)[None, :]
    a1 = tl.load(a_blocks + 1, mask=b_mask, other=0)[None, :]
    a2 = tl.load(a_blocks + 2, mask=b_mask, other=0)[None, :]
    a3 = tl.load(a_blocks + 3, mask=b_mask, other=0)[None, :]
    if D == 16:
        w0, w1 = tl.split(tl.reshape(words, [BLOCK_N, NB, 2]))
        if _INTERPRET:
            return _word_dot(w0, a0, a1) + _word_dot(w1, a2, a3)
        return tl.inline_asm_elementwise(_DP4A_ASM_2, "=r" + ",r" * 8,
                                         [w0, w1, a0, a1, a2, a3, table, table_high],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        even, odd = tl.split(tl.reshape(words, [BLOCK_N, NB, 2, 2]))  # words 0, 2 and 1, 3
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
        a4 = tl.load(a_blocks + 4, mask=b_mask, other=0)[None, :]
        a5 = tl.load(a_blocks + 5, mask=b_mask, other=0)[None, :]
        a6 = tl.load(a_blocks + 6, mask=b_mask, other=0)[None, :]
        a7 = tl.load(a_blocks + 7, mask=b_mask, other=0)[None, :]
        if _INTERPRET:
            return (_word_dot(w0, a0, a1) + _word_dot(w1, a2, a3) + _word_dot(w2, a4, a5)
                    + _word_dot(w3, a6, a7))
        return tl.inline_asm_elementwise(
            _DP4A_ASM_4, "=r" + ",r" * 14,
            [w0, w1, w2, w3, a0, a1, a2, a3, a4, a5, a6, a7, table, table_high],
            dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _dp4a_weight_scales(s, shift, SCALE_KIND: tl.constexpr):
    """FP32 block scales of the weights' scale bytes ``s`` for the DP4A product: NVFP4 the E4M3
    value, MX ``2^(e - shift)`` (NaN for the NaN exponent; ``e - shift`` in [-132, 1]:
    :func:`kbbq_pl.kernels.exact.mx_shift`)."""
    if SCALE_KIND == 0:  # SCALE_E4M3
        return s.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return tl.where(s == 255, float("nan"), _pow2(s.to(tl.int32) - 127 - shift))


@triton.jit
def _word_dots(words, mult, a_ptrs, a_mask, acc, SHIFT: tl.constexpr, E_LOW: tl.constexpr,
               VALUES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               RAW: tl.constexpr = False):
    """Accumulate the products of the two nibbles of every word that ``SHIFT`` brings to the
    top of its halves, element ``E_LOW`` (low half) and ``E_LOW + 4`` (high half) of each
    8-element word, kept side by side (``[low_c, high_c]``, one 32-bit register), against
    their activations (:func:`~kbbq_pl.kernels.exact.word_order_index`).  ``RAW`` (a
    diagnostic): the words' two halves as they are, not decoded."""
    a = tl.load(a_ptrs + 32 * E_LOW, mask=a_mask, other=0.0)
    if RAW and VALUES == 0:  # VALUES_FP32 (the interpreter's MX values): as bf16 in FP32
        low = (words << 16).to(tl.float32, bitcast=True)
        high = (words & -65536).to(tl.float32, bitcast=True)  # 0xFFFF0000
    elif RAW:
        low = words.to(tl.int16).to(a.dtype, bitcast=True)
        high = (words >> 16).to(tl.int16).to(a.dtype, bitcast=True)
    else:
        low, high = _word_halves(words, mult, SHIFT, VALUES)  # [BLOCK_N, BLOCK_K / D, D / 8]
    w = tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K // 4])
    return tl.dot(w, a, acc)


@triton.jit
def _block_multipliers(s, shift, SCALE_KIND: tl.constexpr, VALUES: tl.constexpr):
    """The decode multiplier of each scale byte ``s`` (uint8): NVFP4 the E4M3 scale (fp16;
    FP32 times 2^112, so that FP32 values are ``q * s * 2^-14`` too), MX ``2^(e - shift + 126)``
    (bf16, its bit pattern in both halves of an int32; FP32; NaN for the NaN exponent)."""
    if SCALE_KIND == 0:  # SCALE_E4M3
        if VALUES == 1:  # VALUES_FP16
            return s.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            return _block_scale_values(s, SCALE_KIND) * 5.192296858534828e33  # 2^112
    else:
        field = s.to(tl.int32) + (126 - shift)  # MX_MULTIPLIER_BIAS
        if VALUES == 2:  # VALUES_BF16
            bits = tl.where(s == 255, 0x7FC0, field << 7)
            return bits | (bits << 16)
        else:
            bits = tl.where(s == 255, 0x7FC00000, field << 23)
            return bits.to(tl.float32, bitcast=True)


@triton.jit
def _timer(asm: tl.constexpr):
    """A special register (``%clock64``, ``%globaltimer``: ``asm`` moves it to ``$0``) read
    where it stands (0 under the interpreter, which has no clocks)."""
    if _INTERPRET:
        return tl.full([], 0, tl.int64)
    return tl.inline_asm_elementwise(asm, "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _timer_after(x, asm: tl.constexpr):
    """:func:`_timer` read once every element of ``x`` (int32 or FP32) is computed (each read
    depends on its element, so that ptxas cannot move it earlier), ``x``'s shape."""
    if x.dtype != tl.int32:
        x = x.to(tl.int32, bitcast=True)
    if _INTERPRET:
        return x.to(tl.int64) * 0
    return tl.inline_asm_elementwise(asm, "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _probe_store(probe, slot: tl.constexpr, values):
    """Element ``[0, 0]`` of ``values`` (a 2-D tile) into ``slot``."""
    rows = tl.arange(0, values.shape[0])[:, None]
    cols = tl.arange(0, values.shape[1])[None, :]
    tl.store(probe + slot + rows * 0 + cols * 0, values, mask=(rows == 0) & (cols == 0))


@triton.jit
def _probe_end(probe, x, summed: tl.constexpr):
    """A program's last slots once ``x`` is computed (a 2-D tile, or the split's arrival)."""
    if len(x.shape) == 2:
        _probe_store(probe, 4, _timer_after(x, CLOCK))
        _probe_store(probe, 7, _timer_after(x, GLOBAL_TIMER))
    else:
        tl.store(probe + 4, _timer_after(x, CLOCK))
        tl.store(probe + 7, _timer_after(x, GLOBAL_TIMER))
    if _INTERPRET:  # no SMs: the program's place in the grid, for the tests
        sm = (tl.program_id(0) + 256 * tl.program_id(1) + 65536 * tl.program_id(2)).to(tl.int64)
    else:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                       is_pure=True, pack=1).to(tl.int64)
    tl.store(probe + 5, sm)
    tl.store(probe + 6, tl.full([], summed, tl.int64))


CLOCK: tl.constexpr = tl.constexpr("mov.u64 $0, %clock64;")
GLOBAL_TIMER: tl.constexpr = tl.constexpr("mov.u64 $0, %globaltimer;")
PROBE_SLOTS = 8
"""int64 slots a program writes with ``probe`` (:func:`skinny_matmul`): its start on the GPU's
global timer (ns), ``%clock64`` at its start, after its loop, when its split arrived (the
atomic's answer; after the loop when K is not split) and at its end (the epilogue's output
computed; the split-K reduction's for the last split), the SM it ran on, 1 if it summed the
splits, the global timer at its end."""


@triton.jit
def _skinny_kernel(
    a_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, a_global_ptr, w_global_ptr, bias_ptr,
    a_scale_ptr, table_ptr, w1_ptr, w2_ptr, ws1_ptr, ws2_ptr, w_global1_ptr, w_global2_ptr,
    bias1_ptr, bias2_ptr, out1_ptr, out2_ptr, M, N, K, shift, stride_am, stride_wn, stride_wsn,
    stride_om, m_bucket, N1, N2, stride_ag, probe_ptr,
    D: tl.constexpr, SCALE_KIND: tl.constexpr, GAIN2: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, VALUES: tl.constexpr, EXPLICIT_BF16: tl.constexpr,
    PRODUCT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, SHIFTED: tl.constexpr,
    GROUPS: tl.constexpr = 1, PROBE: tl.constexpr = False, TILED: tl.constexpr = False,
    RAW: tl.constexpr = False,
):
    """``out [M, N] = A W^T`` for word-ordered activation values ``A [M, >=K]`` and packed weights
    ``W`` (codes ``[N, K/2]``, scale bytes ``[N, K/D]``); program (column tile, K split, row
    tile).  ``PRODUCT_DP4A`` (one row a tile) reads ``A`` as int8 ``2q`` in the natural order
    and the FP32 block scales ``[M, K/D]`` at ``a_scale_ptr`` instead, ``table_ptr`` holding
    :data:`E2M1_DOUBLED_LOW`.  ``SHIFTED``: the MX decode ``shift`` is not 0 (else the loop's
    multipliers take the constant 0: with a runtime shift in the tensor-core loop, Triton 3.6
    (not 3.9) staged the decoded MX weights through shared memory on their way to the tensor
    cores, 9 barriers a step instead of 2 at 16 x 64 x 256).

    ``GROUPS`` (2 or 3): sibling layers in one launch, each with its own activations
    (``a_ptr + g stride_ag``, per-tensor scale ``a_global_ptr + g``; the DP4A product's block
    scales at ``a_scale_ptr + g M K/D``) and
    weights ``[N, K/2]``, ``[N1, K/2]``, ``[N2, K/2]`` (codes at ``w_ptr``, ``w1_ptr``,
    ``w2_ptr``, and so the scale bytes, per-tensor scales, biases), the column tiles of one
    after those of the one before, each output ``[M, N_g]`` on its own (``out_ptr``,
    ``out1_ptr``, ``out2_ptr``, contiguous): every output with the bits of its layer's own
    launch at the same tile and splits.

    ``TILED`` (tensor-core product, whole tiles; a diagnostic of ``bench/gpu.py --sections
    stream``): the codes and scale bytes in :func:`tile_major`'s layout for this tile, each
    trip of a column tile one run of memory; the same products in the same order.  ``RAW``
    (tensor-core product; the same diagnostic): the code words' bits are the operand as they
    are, each XORed with its block's scale byte (so that the scales are still read), instead
    of the decoded weights: the loop's reads and products without the decode, whose result
    means nothing."""
    if PROBE:  # PROBE_SLOTS: where a launch's time goes
        program = ((tl.program_id(2) * tl.num_programs(1) + tl.program_id(1))
                   * tl.num_programs(0) + tl.program_id(0))
        probe = probe_ptr + program * 8
        tl.store(probe, _timer(GLOBAL_TIMER))
        tl.store(probe + 1, _timer(CLOCK))
    # consecutive programs take ROW_GROUP row tiles down one column tile before the next
    # column, so a column tile's weights are read once per group and the group's activations
    # stay in L2 (the grouping of Triton's matmul tutorial)
    pid_m, pid_n = tl.swizzle2d(tl.program_id(2), tl.program_id(0), tl.num_programs(2),
                                tl.num_programs(0), ROW_GROUP)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    tile = pid_m * tl.num_programs(0) + pid_n  # the split-K counter of this output tile
    part_n = N  # the partials' row: every sibling's columns, one after the other
    part_col = 0
    if GROUPS > 1:
        tl.static_assert(GROUPS <= 3)
        part_n = N + N1 + N2
        first1 = tl.cdiv(N, BLOCK_N)
        first2 = first1 + tl.cdiv(N1, BLOCK_N)
        g = tl.where(pid_n >= first2, 2, tl.where(pid_n >= first1, 1, 0))
        part_col = tl.where(g == 2, N + N1, tl.where(g == 1, N, 0))
        pid_n -= tl.where(g == 2, first2, tl.where(g == 1, first1, 0))
        if g == 2:
            N = N2
            w_ptr = w2_ptr
            ws_ptr = ws2_ptr
            w_global_ptr = w_global2_ptr
            bias_ptr = bias2_ptr
            out_ptr = out2_ptr
        elif g == 1:
            N = N1
            w_ptr = w1_ptr
            ws_ptr = ws1_ptr
            w_global_ptr = w_global1_ptr
            bias_ptr = bias1_ptr
            out_ptr = out1_ptr
        stride_om = N
        a_ptr += g * stride_ag
        a_scale_ptr += g * M * (K // D)  # the DP4A product's block scales [G, M, K/D]
        a_global_ptr += g
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    k_split = tl.cdiv(tl.cdiv(K, splits), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    decode_shift = shift if SHIFTED else 0  # the loops' MX shift: a constant where it is 0
    if PRODUCT == 0:  # PRODUCT_DOT: 32-bit words of 8 codes, two values per operation
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        offs_c = tl.arange(0, BLOCK_K // 8)  # word c of a tile row: elements 8c .. 8c + 7
        words_ptr = w_ptr.to(tl.pointer_type(tl.int32))
        offs_b = tl.arange(0, BLOCK_K // D)  # block b of a tile row: words b D/8 .. (b+1) D/8
        if TILED:  # [N / BLOCK_N, K / BLOCK_K, BLOCK_N, BLOCK_K / 8 (/ D)]
            rows = tl.arange(0, BLOCK_N)[:, None]
            w_ptrs = (words_ptr + pid_n * BLOCK_N * (K // 8) + rows * (BLOCK_K // 8)
                      + offs_c[None, :])
            s_ptrs = ws_ptr + pid_n * BLOCK_N * (K // D) + rows * (BLOCK_K // D) + offs_b[None, :]
            TRIP: tl.constexpr = BLOCK_N  # a trip's words and bytes: BLOCK_N rows of them
        else:
            w_ptrs = words_ptr + offs_n[:, None] * (stride_wn // 4) + offs_c[None, :]
            s_ptrs = ws_ptr + offs_n[:, None] * stride_wsn + offs_b[None, :]
            TRIP: tl.constexpr = 1
        offs_p = tl.arange(0, BLOCK_K // 4)  # (word, half) p = 2c + h of one shift's values
        a_col = 128 * (offs_p // 32) + offs_p % 32  # word_order_index, less 32 E_LOW
        a_base = a_ptr + offs_m[None, :] * stride_am + a_col[:, None]
        for k0 in tl.range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:  # no mask along K: 16-byte loads
                c_mask = tl.full([BLOCK_K // 8], 1, tl.int1)
            else:
                c_mask = k0 // 8 + offs_c < K // 8
            w_mask = n_mask[:, None] & c_mask[None, :]
            words = tl.load(w_ptrs + (k0 // 8) * TRIP, mask=w_mask, other=0,
                            eviction_policy="evict_first")
            words = tl.reshape(words, [BLOCK_N, BLOCK_K // D, D // 8])
            if EVEN_K:
                b_mask = tl.full([BLOCK_K // D], 1, tl.int1)
            else:
                b_mask = k0 // D + offs_b < K // D
            s = tl.load(s_ptrs + (k0 // D) * TRIP, mask=n_mask[:, None] & b_mask[None, :],
                        other=0, eviction_policy="evict_first")  # a scale byte a block
            if RAW:
                words = words ^ s.to(tl.int32)[:, :, None]
                mult = s
            else:
                mult = _block_multipliers(s, decode_shift, SCALE_KIND, VALUES)[:, :, None]
            a_ptrs = a_base + k0
            if EVEN_K:
                p_mask = tl.full([BLOCK_K // 4], 1, tl.int1)
            else:
                p_mask = k0 // 8 + offs_p // 2 < K // 8
            a_mask = p_mask[:, None] & m_mask[None, :]
            acc = _word_dots(words, mult, a_ptrs, a_mask, acc, 0, 3, VALUES, BLOCK_N,
                             BLOCK_K, RAW)
            acc = _word_dots(words, mult, a_ptrs, a_mask, acc, 4, 2, VALUES, BLOCK_N,
                             BLOCK_K, RAW)
            acc = _word_dots(words, mult, a_ptrs, a_mask, acc, 8, 1, VALUES, BLOCK_N,
                             BLOCK_K, RAW)
            acc = _word_dots(words, mult, a_ptrs, a_mask, acc, 12, 0, VALUES, BLOCK_N,
                             BLOCK_K, RAW)
    else:  # PRODUCT_DP4A, one row: exact integer sums per block, then FP32
        NB: tl.constexpr = BLOCK_K // D
        blocks = tl.zeros([BLOCK_N, NB], tl.float32)
        offs_c = tl.arange(0, BLOCK_K // 8)
        words_ptr = w_ptr.to(tl.pointer_type(tl.int32))
        w_ptrs = words_ptr + offs_n[:, None] * (stride_wn // 4) + offs_c[None, :]
        offs_b = tl.arange(0, NB)
        s_ptrs = ws_ptr + offs_n[:, None] * stride_wsn + offs_b[None, :]
        a_words = (a_ptr + pid_m * stride_am).to(tl.pointer_type(tl.int32))
        a_scales = a_scale_ptr + pid_m * (K // D)
        # one copy of the table a column: each thread loads its own, which ptxas keeps in a
        # register (one value every thread shares went to a uniform register, copied back
        # before each prmt: up to 87 more instructions a trip in the compile reports)
        table_low = tl.load(table_ptr + tl.arange(0, BLOCK_N) % TABLE_COPIES)[:, None]
        for k0 in tl.range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                c_mask = tl.full([BLOCK_K // 8], 1, tl.int1)
                b_mask = tl.full([NB], 1, tl.int1)
            else:
                c_mask = k0 // 8 + offs_c < K // 8
                b_mask = k0 // D + offs_b < K // D
            words = tl.load(w_ptrs + k0 // 8, mask=n_mask[:, None] & c_mask[None, :], other=0,
                            eviction_policy="evict_first")
            s = tl.load(s_ptrs + k0 // D, mask=n_mask[:, None] & b_mask[None, :], other=0,
                        eviction_policy="evict_first")
            sums = _dp4a_block_sums(words, a_words + k0 // 4 + (D // 4) * offs_b, b_mask,
                                    table_low, BLOCK_N, NB, D)
            a_s = tl.load(a_scales + k0 // D + offs_b, mask=b_mask, other=0.0)
            w_s = _dp4a_weight_scales(s, decode_shift, SCALE_KIND)
            blocks += sums.to(tl.float32) * (w_s * a_s[None, :])
        acc = tl.sum(blocks, axis=1)
    if PRODUCT == 0:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        acc = acc[None, :]
    if PROBE:
        loop_end = _timer_after(acc, CLOCK)
        _probe_store(probe, 2, loop_end)
    if splits == 1:
        _skinny_epilogue(acc, offs_m, offs_n, M, N, shift, a_global_ptr, w_global_ptr, bias_ptr,
                         out_ptr, stride_om, SCALE_KIND, GAIN2, HAS_GLOBAL, HAS_BIAS,
                         EXPLICIT_BF16, PRODUCT)
        if PROBE:
            _probe_store(probe, 3, loop_end)
            _probe_end(probe, acc, 0)
    else:
        part = part_ptr + offs_m[:, None] * part_n + (part_col + offs_n)[None, :]
        # partials [splits, row tiles * BLOCK_M, N (all siblings')]
        split_stride = tl.num_programs(2) * BLOCK_M * part_n
        mask = m_mask[:, None] & n_mask[None, :]
        tl.store(part + pid_k * split_stride, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if PROBE:
            tl.store(probe + 3, _timer_after(arrived, CLOCK))
        if arrived == splits - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for split in range(splits):  # a fixed order, whoever finished last
                total += tl.load(part + split * split_stride, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            _skinny_epilogue(total, offs_m, offs_n, M, N, shift, a_global_ptr, w_global_ptr,
                             bias_ptr, out_ptr, stride_om, SCALE_KIND, GAIN2, HAS_GLOBAL,
                             HAS_BIAS, EXPLICIT_BF16, PRODUCT)
            # ready for the next launch (graph replays); relaxed: the launch boundary orders
            # it before the next launch, so it need not wait for the output's stores
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed")
            if PROBE:
                _probe_end(probe, total, 1)
        elif PROBE:
            _probe_end(probe, arrived, 0)


@triton.jit
def _skinny_epilogue(acc, offs_m, offs_n, M, N, shift, a_global_ptr, w_global_ptr, bias_ptr,
                     out_ptr, stride_om, SCALE_KIND: tl.constexpr, GAIN2: tl.constexpr,
                     HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EXPLICIT_BF16: tl.constexpr, PRODUCT: tl.constexpr):
    """The decode's power of two back (``2^14`` NVFP4, ``2^shift`` MX; the DP4A product's
    ``1/4`` of ``2q_w 2q_a``), then :func:`~kbbq_pl.kernels.triton_kernels._epilogue`."""
    if PRODUCT == 2:  # PRODUCT_DP4A
        acc = acc * 0.25
    elif SCALE_KIND == 0:  # SCALE_E4M3: NVFP4_DECODE_SHIFT
        acc = acc * 16384.0
    if SCALE_KIND != 0:
        acc = acc * _pow2(tl.full(acc.shape, 0, tl.int32) + shift)
    _epilogue(acc, offs_m, offs_n, M, N, a_global_ptr, w_global_ptr, bias_ptr, out_ptr,
              stride_om, GAIN2, HAS_GLOBAL, HAS_BIAS, EXPLICIT_BF16)


def _configs():
    """The tensor-core tiles (BLOCK_K a multiple of the word order's 128): one 16-row tile for up
    to :data:`FEW_ROWS` rows, not autotuned, and 32 to 128 rows above, autotuned on GPUs
    (:func:`_prune_configs`).  ``bench/gpu_compile.py --kernels decode_gemm --explore`` printed
    the registers, spills and loop instructions per weight of a wider grid on sm_90, from which
    these were kept (no spills, at most 160 KiB of shared memory).  The 16-row tile, at the K
    splits :func:`split_count` gives it, came within 12% of the fastest of the ten tiles
    ``bench/gpu.py``'s ``tune`` section timed on an H200 at every shape and format (weights
    streamed from memory, a CUDA graph over copies; 5% on average, a tie with the narrower
    16 x 32 tile on ``mma.sync``); the autotuner, which times each tile alone, had picked among
    five tiles one up to 1.7 times slower, and not the same one in two runs (a tile's K splits
    set the order of the sums, and so the last bit)."""
    few = ((16, 64, 256, 4, 3),)
    more = ((32, 64, 256, 4, 3), (32, 128, 256, 8, 3), (64, 128, 128, 4, 3),
            (64, 128, 256, 8, 3), (128, 128, 128, 8, 2))
    return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                           "PRODUCT": PRODUCT_DOT}, num_warps=warps, num_stages=stages)
            for block_m, block_n, block_k, warps, stages in few + more]


def _prune_configs(configs, named_args, **kwargs):
    """16-row tiles for up to :data:`FEW_ROWS` rows; above, the wider tiles no taller than the
    rows' power of two (``m_bucket``)."""
    bucket = kwargs.get("m_bucket", named_args.get("m_bucket"))
    if bucket is None:  # a Triton that passes no arguments to the pruner: keep them all
        return configs
    return [c for c in configs
            if (c.kwargs["BLOCK_M"] == FEW_ROWS) == (bucket <= FEW_ROWS)
            and c.kwargs["BLOCK_M"] <= max(bucket, 32)]


def _even_k(args) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


def m_bucket(m: int) -> int:
    """The autotuning key of ``m`` rows: 1, 16, then powers of two up to 8192."""
    if m <= 1:
        return 1
    return FEW_ROWS if m <= FEW_ROWS else min(next_power_of_2(m), 8192)


def _dp4a_configs():
    """The DP4A product's one-row tile, not autotuned: of the eight ``bench/gpu.py``'s ``tune``
    section timed on an H200, the one within 11% of the fastest at every shape and format (the
    autotuner's pick among three: up to 1.3 times slower).  ``bench/gpu_compile.py --kernels
    decode_gemm`` printed no spills and 2.1 to 3.0 SASS a weight in the DP4A loops on Triton
    3.6 for sm_90 (3.3 to 4.2 for the tensor-core tiles)."""
    tiles = ((64, 512, 4, 3),)
    return [triton.Config({"BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k,
                           "PRODUCT": PRODUCT_DP4A}, num_warps=warps, num_stages=stages)
            for block_n, block_k, warps, stages in tiles]


def _tile_shapes(configs) -> tuple[tuple[int, int, int], ...]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)`` of each config."""
    return tuple((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"])
                 for c in configs)


_CONFIGS = _configs()
_DP4A_CONFIGS = _dp4a_configs()
_DP4A_TILES = _tile_shapes(_DP4A_CONFIGS)
_KEY = ["N", "K", "m_bucket", "D", "SCALE_KIND", "VALUES", "HAS_BIAS", "SHIFTED", "N1", "N2",
        "GROUPS"]
_skinny_tuned = triton.autotune(configs=_CONFIGS, key=_KEY,
                                prune_configs_by={"early_config_prune": _prune_configs})(
    triton.heuristics({"EVEN_K": _even_k})(_skinny_kernel))
_skinny_dp4a_tuned = triton.autotune(configs=_DP4A_CONFIGS, key=_KEY)(
    triton.heuristics({"EVEN_K": _even_k})(_skinny_kernel))

INTERPRETER_CONFIG = {"BLOCK_M": FEW_ROWS, "BLOCK_N": 16, "BLOCK_K": 128,
                      "PRODUCT": PRODUCT_DOT}
INTERPRETER_DP4A_CONFIG = {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 128, "PRODUCT": PRODUCT_DP4A}

_counters: dict[torch.device, torch.Tensor] = {}


_tables: dict[torch.device, torch.Tensor] = {}


def _table(device: torch.device) -> torch.Tensor:
    """The device's copies of :data:`E2M1_DOUBLED_LOW` (int32 ``[TABLE_COPIES]``), read by the
    DP4A product."""
    table = _tables.get(device)
    if table is None:
        table = _tables[device] = torch.full((TABLE_COPIES,), E2M1_DOUBLED_LOW,
                                             dtype=torch.int32, device=device)
    return table


def _counter(device: torch.device) -> torch.Tensor:
    """The device's split-K arrival counters (int32 zeros; each launch leaves them zero)."""
    counter = _counters.get(device)
    if counter is None:
        counter = _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counter


def decode_step_tile() -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_K)`` of a decode step's launch (up to :data:`FEW_ROWS` rows): the one
    tile of :func:`_configs` there, the interpreter's (:data:`INTERPRETER_CONFIG`) under it."""
    config = INTERPRETER_CONFIG if INTERPRET else _CONFIGS[0].kwargs
    return config["BLOCK_N"], config["BLOCK_K"]


def tile_major(codes: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[N, K/2]`` (uint8, as stored) and scale bytes ``[N, K/D]`` copied tile by tile
    for a ``block_n x block_k`` tile: int32 words ``[N / block_n, K / block_k, block_n,
    block_k / 8]`` and bytes ``[N / block_n, K / block_k, block_n, block_k / D]``, contiguous,
    so that each trip of a column tile reads one run of memory of each (a layout prepared once,
    as Marlin's is; :func:`skinny_matmul` takes it, a diagnostic: nothing stores weights so)."""
    n, half_k = codes.shape
    d = 2 * half_k // scales.shape[1]
    if n % block_n or (2 * half_k) % block_k or block_k % d:
        raise ValueError(f"tile_major takes whole {block_n} x {block_k} tiles, got codes "
                         f"{tuple(codes.shape)}, scales {tuple(scales.shape)}")
    words = codes.contiguous().view(torch.int32).view(n // block_n, block_n, -1, block_k // 8)
    blocks = scales.contiguous().view(torch.uint8).view(n // block_n, block_n, -1, block_k // d)
    return (words.permute(0, 2, 1, 3).contiguous(), blocks.permute(0, 2, 1, 3).contiguous())


def split_count(n: int, k: int, block_n: int, block_k: int, sms: int, m: int = 1,
                block_m: int = FEW_ROWS) -> int:
    """K splits for ``[N, K]`` weights in ``block_n``-column tiles (and ``m`` rows in
    ``block_m``-row tiles): doubled while the grid holds fewer than two programs per SM and each
    split keeps at least 512 of K (and a whole tile), at most :data:`MAX_SPLITS`."""
    tiles = cdiv(n, block_n) * cdiv(m, block_m)
    split = 1
    while (split < MAX_SPLITS and tiles * split < 2 * sms
           and k // (2 * split) >= max(512, block_k)):
        split *= 2
    return split


def values_kind(scale_kind: int) -> int:
    """The 16-bit type a format's decode path multiplies (FP32 where the interpreter cannot
    multiply bf16)."""
    if scale_kind == SCALE_E4M3:
        return VALUES_FP16
    return VALUES_FP32 if INTERPRET else VALUES_BF16


def activation_dtype(scale_kind: int) -> torch.dtype:
    """The dtype of the activation values the decode GEMM reads."""
    return {VALUES_FP16: torch.float16, VALUES_BF16: torch.bfloat16,
            VALUES_FP32: torch.float32}[values_kind(scale_kind)]


def _column_tiles(ns: tuple[int, ...], block_n: int) -> int:
    """Column tiles of one launch over the siblings' outputs ``ns`` (each its own tiles)."""
    return sum(cdiv(n, block_n) for n in ns)


@functools.lru_cache(maxsize=4096)
def _splits(ns: tuple[int, ...], k: int, m: int, sms: int, split_k: int | None, block_m: int,
            block_n: int, block_k: int) -> int:
    """The K splits of one tile shape (``split_k`` as asked, else :func:`split_count` of the
    launch's column tiles); 1 where the output tiles outnumber the split-K counters."""
    columns = _column_tiles(ns, block_n) * block_n
    split = split_k or split_count(columns, k, block_n, block_k, sms, m, block_m)
    if _column_tiles(ns, block_n) * cdiv(m, block_m) > _COUNTERS:
        split = 1
    return max(1, min(split, cdiv(k, block_k)))


def _grid(ns: tuple[int, ...], k: int, m: int, sms: int, split_k: int | None, cfg: dict
          ) -> tuple[int, int, int]:
    """(column tiles, K splits, row tiles) of a launch with the tile ``cfg``."""
    return (_column_tiles(ns, cfg["BLOCK_N"]),
            _splits(ns, k, m, sms, split_k, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]),
            cdiv(m, cfg["BLOCK_M"]))


def _candidate_tiles(m: int, tiles: tuple[tuple[int, int, int], ...] | None
                     ) -> tuple[tuple[int, int, int], ...]:
    """``tiles`` (``(BLOCK_M, BLOCK_N, BLOCK_K)``), or where None the tensor-core tiles the
    autotuner may pick for ``m`` rows."""
    if tiles is None:
        tiles = _tile_shapes(_prune_configs(_CONFIGS, {"m_bucket": m_bucket(m)}))
    return tiles


@functools.lru_cache(maxsize=4096)
def _partial_rows(ns: tuple[int, ...], k: int, m: int, sms: int, split_k: int | None,
                  tiles: tuple[tuple[int, int, int], ...] | None) -> int:
    """Rows of FP32 split-K partials (``[splits x row tiles x BLOCK_M, N]``) the largest of
    the candidate tiles (:func:`_candidate_tiles`) needs; worked out once per shape, not per
    call (a decode step is latency)."""
    splits = [(_splits(ns, k, m, sms, split_k, bm, bn, bk), bm)
              for bm, bn, bk in _candidate_tiles(m, tiles)]
    return max([split * cdiv(m, bm) * bm for split, bm in splits if split > 1],
               default=1)


def programs(ns: tuple[int, ...], k: int, m: int, sms: int, split_k: int | None = None,
             tiles: tuple[tuple[int, int, int], ...] | None = None) -> int:
    """Programs of the largest grid among the candidate tiles (:func:`_candidate_tiles`) of a
    launch over the siblings' outputs ``ns``."""
    return max(math.prod(_grid(ns, k, m, sms, split_k, {"BLOCK_M": bm, "BLOCK_N": bn,
                                                         "BLOCK_K": bk}))
               for bm, bn, bk in _candidate_tiles(m, tiles))


def skinny_matmul(a_values, m: int, w_codes, w_scales, a_global, w_global, d: int,
                  scale_kind: int, gain: float, shift: int, bias, out_dtype,
                  config: dict | None = None, split_k: int | None = None, a_scales=None,
                  probe=None, decode: bool = True):
    """Launch the decode GEMM on word-ordered activation values ``a_values [M, >=K]`` (from
    :func:`kbbq_pl.kernels.triton_kernels.quantize_activations` with ``word_order``); arguments
    checked by :mod:`kbbq_pl.kernels`.  ``config`` pins the tile, ``split_k`` the splits.
    With ``a_scales`` (FP32 ``[M, K/d]``) the product is ``PRODUCT_DP4A``: ``a_values`` are then
    the int8 ``2q`` of the activations in the natural order (``quantize_activations`` with an
    int8 ``values_dtype``), one row a tile.

    Sibling layers in one launch: ``w_codes``, ``w_scales``, ``w_global`` and ``bias`` lists
    of 2 or 3 (contiguous weights of one ``K``, all with a bias or none, one decode
    ``shift``), ``a_values [G, M, >=K]``, ``a_global`` (NVFP4) ``[G]`` and (DP4A)
    ``a_scales [G, M, K/d]`` from the siblings' activation launch; returns the list of
    outputs.

    ``probe`` (a diagnostic: ``bench/gpu.py --sections probe``): int64 ``[rows, PROBE_SLOTS]``
    with a row for each program (:func:`programs`), which each program fills with its
    :data:`PROBE_SLOTS` (row ``(row tile * splits + split) * column tiles + column tile``;
    under the interpreter the clocks read 0 and the SM is the program's place in the grid,
    ``column tile + 256 split + 65536 row tile``).

    Codes and scales in :func:`tile_major`'s layout (4-D; a diagnostic: ``bench/gpu.py
    --sections stream``) are read tile by tile: one layer, the tensor cores, at most
    :data:`FEW_ROWS` rows, in the tile they were copied for (``config``'s, else
    :func:`decode_step_tile`); the same products in the same order, so the same bits.
    ``decode=False`` (the same diagnostic; the tensor cores): the code words' bits go to the
    product undecoded (the kernel's ``RAW``): the loop's reads and products without its
    decode; the output means nothing, only the time."""
    groups = len(w_codes) if isinstance(w_codes, (list, tuple)) else 1
    if groups == 1:
        w_codes, w_scales, w_global, bias = [w_codes], [w_scales], [w_global], [bias]
    dp4a = a_scales is not None
    tiled = w_codes[0].dim() == 4
    if tiled:
        tile = (config["BLOCK_N"], config["BLOCK_K"]) if config else decode_step_tile()
        if (groups > 1 or dp4a or m > FEW_ROWS or tuple(w_codes[0].shape[2:]) != (
                tile[0], tile[1] // 8) or tuple(w_scales[0].shape[2:]) != (tile[0], tile[1] // d)):
            raise ValueError(f"tile-major weights (tile_major) take one layer on the tensor "
                             f"cores, at most {FEW_ROWS} rows, in the launch's tile "
                             f"{tile[0]} x {tile[1]}: got codes {tuple(w_codes[0].shape)}, "
                             f"scales {tuple(w_scales[0].shape)}, {m} rows"
                             f"{', the DP4A product' if dp4a else ''}")
    if not decode and dp4a:
        raise ValueError("decode=False (a diagnostic) runs the tensor-core product, not DP4A")
    if dp4a != (a_values.dtype == torch.int8):
        raise ValueError("the DP4A product takes int8 activations (2q) with their FP32 block "
                         f"scales, got {a_values.dtype} values and "
                         f"{'no' if a_scales is None else 'FP32'} scales")
    if config is not None and (config["PRODUCT"] == PRODUCT_DP4A) != dp4a:
        raise ValueError(f"the tile {config} does not take {a_values.dtype} activations")
    if groups > 1 and (groups > 3 or a_values.shape[0] != groups
                       or (dp4a and (a_scales.shape[0] != groups or not a_scales.is_contiguous()))
                       or len({b is None for b in bias}) > 1
                       or len({c.shape[1] for c in w_codes}) > 1
                       or not all(c.is_contiguous() and s.is_contiguous()
                                  for c, s in zip(w_codes, w_scales))):
        raise ValueError("sibling decode GEMMs take 2 or 3 contiguous weights of one K, their "
                         "activations [G, M, K] (DP4A: and contiguous block scales "
                         "[G, M, K/d]), all with a bias or none")
    if tiled:
        ns, k = (w_codes[0].shape[0] * tile[0],), w_codes[0].shape[1] * tile[1]
    else:
        ns, k = tuple(c.shape[0] for c in w_codes), w_codes[0].shape[1] * 2
    device = w_codes[0].device
    outs = [torch.empty(m, n, dtype=out_dtype, device=device) for n in ns]
    has_global = scale_kind == SCALE_E4M3
    has_bias = bias[0] is not None
    dummy = outs[0]
    meta = dict(D=d, SCALE_KIND=scale_kind, GAIN2=gain * gain, HAS_GLOBAL=has_global,
                HAS_BIAS=has_bias, VALUES=values_kind(scale_kind),
                EXPLICIT_BF16=INTERPRET and out_dtype == torch.bfloat16,
                PROBE=probe is not None,
                SHIFTED=shift != 0, GROUPS=groups, TILED=tiled, RAW=not decode,
                **COMPILE_OPTIONS)
    sms = sm_count(device)
    interpreter_config = INTERPRETER_DP4A_CONFIG if dp4a else INTERPRETER_CONFIG
    pinned = dict(config or interpreter_config) if config is not None or INTERPRET else None
    tiles = (((pinned["BLOCK_M"], pinned["BLOCK_N"], pinned["BLOCK_K"]),) if pinned
             else _DP4A_TILES if dp4a else None)
    partial = torch.empty(_partial_rows(ns, k, m, sms, split_k, tiles), sum(ns),
                          dtype=torch.float32, device=device)
    if probe is not None:
        needed = programs(ns, k, m, sms, split_k, tiles)
        if (probe.dtype != torch.int64 or probe.dim() != 2 or probe.shape[1] != PROBE_SLOTS
                or probe.shape[0] < needed or not probe.is_contiguous()):
            raise ValueError(f"the probe takes a contiguous int64 [>= {needed}, {PROBE_SLOTS}] "
                             f"tensor (a row a program), got {probe.dtype} "
                             f"{tuple(probe.shape)}")

    def sibling(values: list, i: int):  # sibling i's tensor (the first's where it has none)
        return values[min(i, groups - 1)]

    w_globals = w_global if has_global else [dummy] * groups
    biases = bias if has_bias else [dummy] * groups
    args = [a_values, w_codes[0], w_scales[0], outs[0], partial, _counter(device),
            a_global if has_global else dummy, w_globals[0], biases[0],
            a_scales if dp4a else dummy, _table(device) if dp4a else dummy,
            sibling(w_codes, 1), sibling(w_codes, 2), sibling(w_scales, 1),
            sibling(w_scales, 2), sibling(w_globals, 1), sibling(w_globals, 2),
            sibling(biases, 1), sibling(biases, 2), sibling(outs, 1), sibling(outs, 2),
            m, ns[0], k, shift, a_values.stride(-2), w_codes[0].stride(0),
            w_scales[0].stride(0), outs[0].stride(0), m_bucket(m),
            ns[1] if groups > 1 else 0, ns[2] if groups > 2 else 0,
            a_values.stride(0) if groups > 1 else 0, dummy if probe is None else probe]
    if pinned:
        if pinned["PRODUCT"] == PRODUCT_DP4A and pinned["BLOCK_M"] != 1:
            raise ValueError(f"the DP4A product takes one row a tile, got BLOCK_M = "
                             f"{pinned['BLOCK_M']}")
        if pinned["PRODUCT"] == PRODUCT_DP4A and pinned["BLOCK_K"] % d:
            raise ValueError(f"the DP4A product's tiles span whole blocks of {d}, got "
                             f"BLOCK_K = {pinned['BLOCK_K']}")
        if pinned["PRODUCT"] == PRODUCT_DOT and pinned["BLOCK_K"] % WORD_ORDER_CHUNK:
            raise ValueError(f"the decode GEMM's tensor-core tiles span whole chunks of "
                             f"{WORD_ORDER_CHUNK}, got BLOCK_K = {pinned['BLOCK_K']}")
        warps = pinned.pop("num_warps", 4)
        stages = pinned.pop("num_stages", 2)
        launch(_skinny_kernel, _grid(ns, k, m, sms, split_k, pinned), args,
               dict(meta, **pinned, EVEN_K=k % pinned["BLOCK_K"] == 0, num_warps=warps,
                    num_stages=stages))
    else:
        launch(_skinny_dp4a_tuned if dp4a else _skinny_tuned,
               functools.partial(_grid, ns, k, m, sms, split_k), args, meta)
    return outs if groups > 1 else outs[0]


__all__ = ["FEW_ROWS", "MX_MULTIPLIER_BIAS", "NVFP4_DECODE_SHIFT", "ONE_ROW_PRODUCT",
           "PRODUCT_DP4A", "skinny_matmul", "split_count"]
