"""The decode GEMM: up to 16 rows of activations against packed FP4 weights (Triton).

Imported lazily by :mod:`kbbq_pl.kernels` (needs triton).  A decode step multiplies a few
tokens by every weight of the model once, so this kernel is built to read the weights at the
memory's speed and do little else per byte:

* the weights are read as :func:`kbbq_pl.formats.quantize` stores them (codes ``[N, K/2]``,
  element ``2i`` in the low nibble, one scale byte per block): 16-byte loads of contiguous row
  segments, marked ``evict_first``.  Nothing is copied or repacked: the activations come in
  pair-split order instead (:func:`kbbq_pl.kernels.exact.pair_split_index`, written so by the
  activation kernel that runs just before), so the low nibbles of a tile multiply one
  contiguous activation slice and the high nibbles the next, and no nibble is ever
  interleaved in registers;
* each nibble becomes a 16-bit float by bit placement (:func:`~kbbq_pl.kernels.exact.e2m1_half_bits`)
  and one multiply by its block's multiplier finishes the decode, exactly
  (:mod:`kbbq_pl.kernels.exact`): fp16 ``q * s * 2^-14`` for NVFP4, bf16 ``q * 2^(e - shift)``
  for MX; the epilogue puts back ``2^14`` or ``2^shift`` with the per-tensor scales, the MX
  ``no_clip`` gain and the bias;
* the product runs on tensor cores with the weights as the wide operand (``W [BLOCK_N, K]``
  times ``A^T [K, 16]``), or (``PRODUCT_FMA``, one row only) as FP32 fused multiply-adds;
* K is split across programs so that the grid fills the GPU (132 SMs at N = 4096); each split
  writes an FP32 partial and the last program of a column tile to finish (an atomic counter,
  reset by that program, so the kernel can be replayed in a CUDA graph) sums the partials in
  split order 0, 1, ...: the result does not depend on which program finished last.

One launch computes the product; with the activation kernel before it a decode-path linear
is two launches (three for dynamic NVFP4, whose per-tensor scale needs the amax of the whole
input first).  No host synchronization, no allocation but the output and the partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .exact import MX_MULTIPLIER_BIAS, NVFP4_DECODE_SHIFT
from .interpret import interpreting
from .triton_kernels import SCALE_E4M3, _block_scale_values, _epilogue, _pow2

INTERPRET = interpreting()

PRODUCT_DOT = 0
PRODUCT_FMA = 1
VALUES_FP32 = 0
VALUES_FP16 = 1
VALUES_BF16 = 2
MAX_ROWS = 16
"""Rows the decode GEMM takes (the tensor-core operand's narrow side)."""
MAX_SPLITS = 16
_COUNTERS = 1 << 14
"""Column tiles a device's split-K counters cover (N up to 2^14 * BLOCK_N)."""


@triton.jit
def _nibble_values(c, mult, VALUES: tl.constexpr):
    """E2M1 codes ``c`` (int32, 0..15) decoded and multiplied by ``mult`` (same shape): fp16
    ``q * 2^-14 * mult``, bf16 ``q * 2^-126 * mult`` or FP32 ``q * 2^-126 * mult`` (the bits of
    :func:`kbbq_pl.kernels.exact.e2m1_half_bits`)."""
    if VALUES == 0:  # VALUES_FP32
        bits = ((c & 8) << 28) | ((c & 7) << 22)
        return bits.to(tl.float32, bitcast=True) * mult
    elif VALUES == 1:  # VALUES_FP16
        bits = (((c & 8) << 12) | ((c & 7) << 9)).to(tl.int16)
        return bits.to(tl.float16, bitcast=True) * mult
    else:
        bits = (((c & 8) << 12) | ((c & 7) << 6)).to(tl.int16)
        return bits.to(tl.bfloat16, bitcast=True) * mult


@triton.jit
def _block_multipliers(s, shift, SCALE_KIND: tl.constexpr, VALUES: tl.constexpr):
    """Each element's decode multiplier from its block's scale byte ``s`` (uint8): NVFP4 the
    E4M3 scale (fp16; FP32 times 2^112, so that FP32 values are ``q * s * 2^-14`` too), MX
    ``2^(e - shift + 126)`` (bf16 or FP32; NaN for the NaN exponent)."""
    if SCALE_KIND == 0:  # SCALE_E4M3
        if VALUES == 1:  # VALUES_FP16
            return s.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            return _block_scale_values(s, SCALE_KIND) * 5.192296858534828e33  # 2^112
    else:
        field = s.to(tl.int32) + (126 - shift)  # MX_MULTIPLIER_BIAS
        if VALUES == 2:  # VALUES_BF16
            bits = tl.where(s == 255, 0x7FC0, field << 7).to(tl.int16)
            return bits.to(tl.bfloat16, bitcast=True)
        else:
            bits = tl.where(s == 255, 0x7FC00000, field << 23)
            return bits.to(tl.float32, bitcast=True)


@triton.jit
def _skinny_kernel(
    a_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, a_global_ptr, w_global_ptr, bias_ptr,
    M, N, K, shift, stride_am, stride_wn, stride_wsn, stride_om, m_bucket,
    D: tl.constexpr, SCALE_KIND: tl.constexpr, GAIN2: tl.constexpr, HAS_GLOBAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, VALUES: tl.constexpr, EXPLICIT_BF16: tl.constexpr,
    PRODUCT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``out [M, N] = A W^T`` for pair-split activation values ``A [M, >=K]`` and packed weights
    ``W`` (codes ``[N, K/2]``, scale bytes ``[N, K/D]``); program (column tile, K split)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_j = tl.arange(0, BLOCK_K // 2)  # byte j of a tile row: elements 2j (low), 2j + 1
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    k_split = tl.cdiv(tl.cdiv(K, splits), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_j[None, :]
    s_ptrs = ws_ptr + offs_n[:, None] * stride_wsn + (offs_j // (D // 2))[None, :]
    a_low = 32 * (offs_j // 16) + offs_j % 16  # where element 2j sits in pair-split order
    if PRODUCT == 0:  # PRODUCT_DOT
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K):
        k_mask = k0 + 2 * offs_j < K
        w_mask = n_mask[:, None] & k_mask[None, :]
        packed = tl.load(w_ptrs + k0 // 2, mask=w_mask, other=0,
                         eviction_policy="evict_first").to(tl.int32)
        s = tl.load(s_ptrs + k0 // D, mask=w_mask, other=0, eviction_policy="evict_first")
        if PRODUCT == 0:
            mult = _block_multipliers(s, shift, SCALE_KIND, VALUES)
            w_low = _nibble_values(packed & 15, mult, VALUES)
            w_high = _nibble_values(packed >> 4, mult, VALUES)
            a_ptrs = a_ptr + offs_m[None, :] * stride_am + (k0 + a_low)[:, None]
            a_mask = k_mask[:, None] & m_mask[None, :]
            a_lo = tl.load(a_ptrs, mask=a_mask, other=0.0)
            a_hi = tl.load(a_ptrs + 16, mask=a_mask, other=0.0)
            acc = tl.dot(w_low, a_lo, acc)
            acc = tl.dot(w_high, a_hi, acc)
        else:  # FP32 values whatever VALUES says: no conversion before the multiply-adds
            mult = _block_multipliers(s, shift, SCALE_KIND, 0)
            w_low = _nibble_values(packed & 15, mult, 0)
            w_high = _nibble_values(packed >> 4, mult, 0)
            a_lo = tl.load(a_ptr + k0 + a_low, mask=k_mask, other=0.0).to(tl.float32)
            a_hi = tl.load(a_ptr + k0 + a_low + 16, mask=k_mask, other=0.0).to(tl.float32)
            acc += tl.sum(w_low * a_lo[None, :] + w_high * a_hi[None, :], axis=1)
    if PRODUCT == 0:
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        acc = acc[None, :]
    if splits == 1:
        _skinny_epilogue(acc, offs_m, offs_n, M, N, shift, a_global_ptr, w_global_ptr, bias_ptr,
                         out_ptr, stride_om, SCALE_KIND, GAIN2, HAS_GLOBAL, HAS_BIAS,
                         EXPLICIT_BF16)
    else:
        part = part_ptr + offs_m[:, None] * N + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        tl.store(part + pid_k * BLOCK_M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the counter moves
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == splits - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for split in range(splits):  # a fixed order, whoever finished last
                total += tl.load(part + split * BLOCK_M * N, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            _skinny_epilogue(total, offs_m, offs_n, M, N, shift, a_global_ptr, w_global_ptr,
                             bias_ptr, out_ptr, stride_om, SCALE_KIND, GAIN2, HAS_GLOBAL,
                             HAS_BIAS, EXPLICIT_BF16)
            tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch (graph replays)


@triton.jit
def _skinny_epilogue(acc, offs_m, offs_n, M, N, shift, a_global_ptr, w_global_ptr, bias_ptr,
                     out_ptr, stride_om, SCALE_KIND: tl.constexpr, GAIN2: tl.constexpr,
                     HAS_GLOBAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EXPLICIT_BF16: tl.constexpr):
    """The decode's power of two back (``2^14`` NVFP4, ``2^shift`` MX), then
    :func:`~kbbq_pl.kernels.triton_kernels._epilogue`."""
    if SCALE_KIND == 0:  # SCALE_E4M3: NVFP4_DECODE_SHIFT
        acc = acc * 16384.0
    else:
        acc = acc * _pow2(tl.full(acc.shape, 0, tl.int32) + shift)
    _epilogue(acc, offs_m, offs_n, M, N, a_global_ptr, w_global_ptr, bias_ptr, out_ptr,
              stride_om, GAIN2, HAS_GLOBAL, HAS_BIAS, EXPLICIT_BF16)


def _configs():
    """``bench/gpu_compile.py --kernels skinny`` prints registers and spills of each on sm_90."""
    configs = []
    for block_n, block_k, warps, stages in ((32, 256, 4, 4), (64, 256, 4, 3), (64, 128, 4, 4),
                                            (128, 256, 8, 3), (128, 128, 4, 3)):
        configs.append(triton.Config({"BLOCK_M": MAX_ROWS, "BLOCK_N": block_n,
                                      "BLOCK_K": block_k, "PRODUCT": PRODUCT_DOT},
                                     num_warps=warps, num_stages=stages))
    for block_n, block_k, warps, stages in ((32, 256, 4, 2), (64, 128, 4, 2), (16, 512, 4, 2)):
        configs.append(triton.Config({"BLOCK_M": 1, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                      "PRODUCT": PRODUCT_FMA},
                                     num_warps=warps, num_stages=stages))
    return configs


def _prune(configs, named_args, **kwargs):
    """One-row configurations (FMA) only for one row; the rest for any M <= 16."""
    m = named_args.get("M", kwargs.get("M"))
    return [c for c in configs if c.kwargs["PRODUCT"] == PRODUCT_DOT or m == 1]


_KEY = ["N", "K", "m_bucket", "D", "SCALE_KIND", "VALUES", "HAS_BIAS"]
_skinny_tuned = triton.autotune(configs=_configs(), key=_KEY,
                                prune_configs_by={"early_config_prune": _prune})(_skinny_kernel)

INTERPRETER_CONFIG = {"BLOCK_M": MAX_ROWS, "BLOCK_N": 16, "BLOCK_K": 64,
                      "PRODUCT": PRODUCT_DOT}

_counters: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The device's split-K arrival counters (int32 zeros; each launch leaves them zero)."""
    counter = _counters.get(device)
    if counter is None:
        counter = _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return counter


def split_count(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """K splits for ``[N, K]`` weights in ``block_n``-column tiles: doubled while the grid
    holds fewer than two programs per SM and each split keeps at least 512 of K (and a whole
    tile), at most :data:`MAX_SPLITS`."""
    tiles = triton.cdiv(n, block_n)
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


def skinny_matmul(a_values, m: int, w_codes, w_scales, a_global, w_global, d: int,
                  scale_kind: int, gain: float, shift: int, bias, out_dtype,
                  config: dict | None = None, split_k: int | None = None):
    """Launch the decode GEMM on pair-split activation values ``a_values [M, >=K]`` (from
    :func:`kbbq_pl.kernels.triton_kernels.quantize_activations` with ``pair_split``); arguments
    checked by :mod:`kbbq_pl.kernels`.  ``config`` pins the tile, ``split_k`` the splits."""
    n, k = w_codes.shape[0], w_codes.shape[1] * 2
    device = w_codes.device
    if m > MAX_ROWS:
        raise ValueError(f"the decode GEMM takes at most {MAX_ROWS} rows, got {m}")
    out = torch.empty(m, n, dtype=out_dtype, device=device)
    values = values_kind(scale_kind)
    has_global = scale_kind == SCALE_E4M3
    counter = _counter(device)
    dummy = out
    meta = dict(D=d, SCALE_KIND=scale_kind, GAIN2=gain * gain, HAS_GLOBAL=has_global,
                HAS_BIAS=bias is not None, VALUES=values,
                EXPLICIT_BF16=INTERPRET and out_dtype == torch.bfloat16)
    sms = 4 if INTERPRET else torch.cuda.get_device_properties(device).multi_processor_count

    def splits(block_n: int, block_k: int) -> int:
        split = split_k or split_count(n, k, block_n, block_k, sms)
        if triton.cdiv(n, block_n) > _COUNTERS:
            split = 1
        return max(1, min(split, triton.cdiv(k, block_k)))

    partial = torch.empty(MAX_SPLITS if split_k is None else max(split_k, 1),
                          MAX_ROWS, n, dtype=torch.float32, device=device)
    args = [a_values, w_codes, w_scales, out, partial, counter,
            a_global if has_global else dummy, w_global if has_global else dummy,
            bias if bias is not None else dummy, m, n, k, shift, a_values.stride(0),
            w_codes.stride(0), w_scales.stride(0), out.stride(0), 1 if m == 1 else MAX_ROWS]
    if config is not None or INTERPRET:
        cfg = dict(config or INTERPRETER_CONFIG)
        warps = cfg.pop("num_warps", 4)
        stages = cfg.pop("num_stages", 2)
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), splits(cfg["BLOCK_N"], cfg["BLOCK_K"]))
        _skinny_kernel[grid](*args, **meta, **cfg, num_warps=warps, num_stages=stages)
    else:
        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_N"]), splits(meta["BLOCK_N"], meta["BLOCK_K"]))
        _skinny_tuned[grid](*args, **meta)
    return out


__all__ = ["MAX_ROWS", "MX_MULTIPLIER_BIAS", "NVFP4_DECODE_SHIFT", "skinny_matmul",
           "split_count"]
