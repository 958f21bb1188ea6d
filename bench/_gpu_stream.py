"""How fast the decode GEMM's weight reads can stream, without the decode or the product.

A diagnostic for ``bench/gpu.py --sections stream`` (issue 45: the decode GEMM at M = 1 streams
at 0.2 to 0.6 of a device copy).  :func:`stream_words` reads packed FP4 codes ``[N, K/2]`` and,
where given, their scale bytes ``[N, K/D]`` with the decode GEMM's grid (column tiles of
``BLOCK_N`` rows, K split as :func:`kbbq_pl.kernels.skinny.split_count` splits it), its tile
(``BLOCK_N`` rows of ``BLOCK_K / 8`` 32-bit words and ``BLOCK_K / D`` scale bytes a trip,
marked ``evict_first``) and its pipeline depth (``num_stages``), and only XORs what it reads:
what is left of the GEMM's time is the memory's.  Two layouts of the same bytes:

* ``rows``: as stored, the decode GEMM's reads (each trip ``BLOCK_K / 2`` bytes of codes and
  ``BLOCK_K / D`` scale bytes from each of ``BLOCK_N`` rows);
* ``tiles``: copied so that each trip's codes lie together, and its scale bytes
  (:func:`kbbq_pl.kernels.skinny.tile_major`, which the decode GEMM also reads), a layout
  prepared once, as Marlin's is.

If ``rows`` streams near the copy and the GEMM does not, the time is the GEMM's own (decode,
product, split-K); if ``rows`` is slow and ``tiles`` fast, the layout is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_kernel(w_ptr, s_ptr, out_ptr, K_WORDS, stride_wn, stride_sn, TILED: tl.constexpr,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                   STAGES: tl.constexpr):
    """``out[split, n]``: the XOR of row ``n``'s words in this program's K slice (and of its
    scale bytes there, where ``D`` is not 0); program (column tile, K split).  ``TILED``: the
    operands in ``skinny.tile_major``'s layout.  The loop's ``num_stages`` is explicit: without a
    ``tl.dot`` in it Triton (3.6 to 3.9) would load into registers, not through ``cp.async``
    as the decode GEMM's loop does."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    splits = tl.num_programs(1)
    c_split = tl.cdiv(tl.cdiv(K_WORDS, splits), BLOCK_C) * BLOCK_C
    c_lo = pid_k * c_split
    c_hi = tl.minimum(c_lo + c_split, K_WORDS)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    words_ptr = w_ptr.to(tl.pointer_type(tl.int32))
    if TILED:  # [column tiles, K_WORDS / BLOCK_C, BLOCK_N, BLOCK_C]
        w_base = (words_ptr + pid_n * BLOCK_N * K_WORDS + offs_n[:, None] * BLOCK_C
                  + offs_c[None, :])
        w_trip = BLOCK_N * BLOCK_C
    else:
        w_base = (words_ptr + (pid_n * BLOCK_N + offs_n)[:, None] * stride_wn
                  + offs_c[None, :])
        w_trip = BLOCK_C
    acc = tl.zeros([BLOCK_N, BLOCK_C], tl.int32)
    if D > 0:
        NB: tl.constexpr = BLOCK_C * 8 // D  # scale bytes of a row a trip
        offs_b = tl.arange(0, NB)
        if TILED:  # [column tiles, K_WORDS / BLOCK_C, BLOCK_N, NB]
            s_base = (s_ptr + pid_n * BLOCK_N * (K_WORDS * 8 // D) + offs_n[:, None] * NB
                      + offs_b[None, :])
            s_trip = BLOCK_N * NB
        else:
            s_base = s_ptr + (pid_n * BLOCK_N + offs_n)[:, None] * stride_sn + offs_b[None, :]
            s_trip = NB
        acc_s = tl.zeros([BLOCK_N, NB], tl.int32)
    for c0 in tl.range(c_lo, c_hi, BLOCK_C, num_stages=STAGES):
        trip = c0 // BLOCK_C
        acc ^= tl.load(w_base + trip * w_trip, eviction_policy="evict_first")
        if D > 0:
            acc_s ^= tl.load(s_base + trip * s_trip, eviction_policy="evict_first").to(tl.int32)
    total = tl.xor_sum(acc, axis=1)
    if D > 0:
        total ^= tl.xor_sum(acc_s, axis=1)
    tl.store(out_ptr + pid_k * (tl.num_programs(0) * BLOCK_N) + pid_n * BLOCK_N + offs_n, total)


def stream_words(codes: torch.Tensor, splits: int, block_n: int, block_k: int,
                 scales: torch.Tensor | None = None, tiled: tuple | None = None,
                 num_stages: int = 3, num_warps: int = 4) -> torch.Tensor:
    """int32 ``[splits, N]``: each row's words (and scale bytes, where ``scales [N, K/D]`` is
    given) XORed over each K slice, read in ``block_n x block_k`` tiles from ``codes``
    (``[N, K/2]`` uint8, as stored) or, where given, from their ``skinny.tile_major`` copies
    ``tiled`` (codes and scales).  ``N`` a multiple of ``block_n``, ``K`` of ``block_k`` times
    ``splits``."""
    n, half_k = codes.shape
    k_words = half_k // 4
    if n % block_n or (2 * half_k) % (block_k * splits):
        raise ValueError(f"stream_words takes N a multiple of {block_n} and K of "
                         f"{block_k} x {splits} splits, got codes {tuple(codes.shape)}")
    d = 0 if scales is None else 2 * half_k // scales.shape[1]
    out = torch.empty(splits, n, dtype=torch.int32, device=codes.device)
    w, s = (codes, scales) if tiled is None else tiled
    s = w if scales is None else s.view(torch.uint8)  # D = 0: the kernel reads no scales
    _stream_kernel[(n // block_n, splits)](
        w, s, out, k_words, k_words, s.shape[-1] if tiled is None else 0,
        TILED=tiled is not None, D=d, BLOCK_N=block_n, BLOCK_C=block_k // 8,
        STAGES=num_stages, num_warps=num_warps)
    return out


def stream_reference(codes: torch.Tensor, splits: int,
                     scales: torch.Tensor | None = None) -> torch.Tensor:
    """What :func:`stream_words` computes, in torch."""
    n = codes.shape[0]
    parts = codes.contiguous().view(torch.int32).view(n, splits, -1)
    if scales is not None:
        parts = torch.cat([parts, scales.contiguous().view(torch.uint8).to(torch.int32)
                           .view(n, splits, -1)], dim=2)
    while parts.shape[2] > 1:  # XOR the halves together (an odd last one carried along)
        half = parts.shape[2] // 2
        parts = torch.cat([parts[:, :, :half] ^ parts[:, :, half:2 * half],
                           parts[:, :, 2 * half:]], dim=2)
    return parts[:, :, 0].T.contiguous()
