"""Bytes, FLOPs and predicted times of the W4A4 linear on Hopper, counted before a GPU run.

    python bench/kernel_budget.py [--copy-gbs 3000] [--bf16-tflops 697] [--gap-us 1.5]
                                  [--sass-per-weight 4.8] [--dynamic]
                                  [--keep-decoded] [--fp8-tflops 1200] [--sync-us 10]
    python bench/kernel_budget.py --tiny     # one shape (K = N = 8192), M = 1

For each shape (K = N = 8192 and the Llama-3-8B linears 4096 -> 4096, 4096 -> 6144,
4096 -> 14336, 14336 -> 4096), M = 1, 16, 64, 256, 1024, 4096 and NVFP4 / MXFP4 with a
per-block transform (KBBQ-shaped, as the layers run it), for each path that takes M rows
(decode: the decode GEMM, any M; prefill: weight decode + bf16 product, from 256 on; fp8,
MXFP4 from 256 on: the opt-in FP8 product, the activations folded to E4M3 by the activation
kernel, the weights by the fold kernel, cuBLAS's block-scaled FP8 product after one host read
of the fold check), the
fewest bytes each kernel must move through device memory (each input read once, each output
written once) and the FLOPs, and from them:

* ``floor``: per kernel, the longer of its bytes at the copy bandwidth and its FLOPs at the
  bf16 matrix rate (a kernel may overlap the two), the kernels one after another, no launch
  gaps: no version runs faster;
* ``predicted``: the decode GEMM at 70% of the copy bandwidth (the issue's goal), the
  activation kernel at 80% (its goal) or at its instructions' rate, whichever is slower
  (``ACT_SASS`` per element, from ``bench/gpu_compile.py`` on Triton 3.6, at 128 per SM clock),
  the weight decode at 80%, the product at the bf16 rate,
  the FP8 product at ``--fp8-tflops`` (an assumption: about 0.85 of twice the bf16 rate, for
  the promotion of every 128 along K; to be measured) after ``--sync-us`` for the host read
  of its fold check (an assumption), the activation kernel at ``ACT_E4M3_SASS`` and the
  weights' fold at ``FOLD_SASS`` per element or 80% of the copy, whichever is slower,
  and ``--gap-us`` per kernel boundary inside a CUDA graph (an assumption: to be measured).
  Above 16 rows the decode GEMM takes the longest of its bytes (70%), its FLOPs (the bf16
  rate) and its main loop's instructions (``--sass-per-weight`` for every weight of every
  128-row tile, at 128 per SM clock on 132 SMs at 1.98 GHz), as if they overlapped;
* bf16 ``torch.matmul``: at M <= 16 its weight bytes at 76% of the copy bandwidth (an H200
  run of 2026-11-26: 0.04458 ms for 8192 x 8192, M = 1, against a 3,967 GB/s copy), at
  M = 4096 the FLOPs at ``--bf16-tflops`` (the same run: 0.7883 ms for 8192 x 8192 x 4096,
  697 TFLOP/s).

The copy bandwidth defaults to the H100's, about 3.0 TB/s read + written (seen on one
``nvidia-h100-x1`` machine, 2026-11-13, /work/.library/device/KINDS.md); ``--copy-gbs 3967`` is
the H200 of the first GPU run.  Every figure printed is a prediction, not a measurement.
"""

from __future__ import annotations

import argparse
import math

SHAPES = ((8192, 8192), (4096, 4096), (4096, 6144), (4096, 14336), (14336, 4096))
ROWS = (1, 16, 64, 256, 1024, 4096)
FORMATS = {"nvfp4": 16, "mxfp4": 32}
TARGETS = {1: 2.5, 16: 2.2, 4096: 0.95}  # the FP8 product's stretch goal at 4096: 1.3
ISSUE_RATE = 132 * 128 * 1.98e9
"""Thread-instructions an H100/H200 issues per second (132 SMs, 128 a clock, 1.98 GHz)."""
ACT_SASS = {"nvfp4": 43.5, "mxfp4": 53.8}
"""SASS per element of the activation kernel with a per-block transform, writing values
(``bench/gpu_compile.py --kernels act_values``, Triton 3.6, sm_90: 256-row tiles)."""
ACT_E4M3_SASS = 59.5
"""The same kernel folding its MX values to E4M3 for the FP8 product (``--kernels fold``,
64 rows by 4 blocks, Triton 3.6)."""
FOLD_SASS = 13.0
"""SASS per element of the weights' fold to E4M3 (``--kernels fold``, Triton 3.6)."""
BF16_GEMV_FRACTION = 0.76
DECODE_FRACTION = 0.70
STREAM_FRACTION = 0.80


def activation_bytes(m: int, k: int, d: int, two_passes: bool) -> int:
    """The activation kernel's bytes: ``x`` read (twice for dynamic NVFP4: the amax pass and
    the rounding pass), the FP32 transform ``[K/d, d, d]`` read, the 16-bit values written."""
    reads = 2 if two_passes else 1
    return reads * 2 * m * k + 4 * k * d + 2 * m * k


def decode_gemm_bytes(m: int, k: int, n: int, d: int) -> int:
    """The decode GEMM's bytes: packed codes and one scale byte per block, the activations,
    the bf16 output (the split-K partials live in the L2 cache)."""
    return n * k // 2 + n * (k // d) + 2 * m * k + 2 * m * n


def weight_decode_bytes(k: int, n: int, d: int) -> int:
    """The prefill path's weight decode: codes and scales read, bf16 written."""
    return n * k // 2 + n * (k // d) + 2 * n * k


def bf16_bytes(m: int, k: int, n: int) -> int:
    return 2 * n * k + 2 * m * k + 2 * m * n


def kernels(path: str, two_passes: bool, keep_decoded: bool = False) -> int:
    """Launches of one linear: the activation kernel (two for dynamic NVFP4) and the GEMM
    (prefill: and the weight decode, unless the weights are kept decoded)."""
    return (2 if two_passes else 1) + (1 if path == "decode" or keep_decoded else 2)


def gaps(path: str, two_passes: bool, keep_decoded: bool = False) -> int:
    """Kernel boundaries of one linear: each costs a launch gap."""
    return kernels(path, two_passes, keep_decoded) - 1


def fold_bytes(rows: int, k: int, d: int) -> int:
    """The E4M3 fold of ``rows`` MX rows: codes and scale bytes read, E4M3 bytes and one FP32
    scale per 128 written."""
    return rows * k // 2 + rows * (k // d) + rows * k + 4 * rows * (k // 128)


def paths(m: int, fmt: str = "nvfp4") -> tuple[str, ...]:
    fp8 = ("fp8",) if fmt == "mxfp4" else ()
    return (("decode",) if m < 256 else ("decode", "prefill") + fp8 if m < 4096
            else ("prefill",) + fp8 + ("decode",))


def predict(m: int, k: int, n: int, fmt: str, copy: float, bf16_rate: float,
            gap: float, path: str = "decode", sass_per_weight: float = 4.8,
            dynamic: bool = False, keep_decoded: bool = False,
            fp8_rate: float = 1200e12, sync: float = 10e-6) -> dict:
    """The figures of one row (seconds, bytes, FLOPs) as the module docstring defines them."""
    d = FORMATS[fmt]
    two_passes = fmt == "nvfp4" and dynamic  # the amax pass first
    flops = 2 * m * n * k
    act = activation_bytes(m, k, d, two_passes)
    act_time = max(act / (STREAM_FRACTION * copy), m * k * ACT_SASS[fmt] / ISSUE_RATE)
    bf16 = max(bf16_bytes(m, k, n) / (BF16_GEMV_FRACTION * copy), flops / bf16_rate)
    if path == "decode":
        product = decode_gemm_bytes(m, k, n, d)
        ours_bytes = act + product
        floor = act / copy + max(product / copy, flops / bf16_rate)
        gemm = product / (DECODE_FRACTION * copy)
        if m > 16:
            issue = n * k * math.ceil(m / 128) * sass_per_weight / ISSUE_RATE
            gemm = max(gemm, flops / bf16_rate, issue)
        predicted = act_time + gemm + gap * gaps(path, two_passes)
        decode_fraction = product / copy
    elif path == "fp8":  # activations folded, the weights' fold, the FP8 product after a read
        act = 2 * m * k + 4 * k * d + m * k + 4 * m * (k // 128)
        act_time = max(act / (STREAM_FRACTION * copy), m * k * ACT_E4M3_SASS / ISSUE_RATE)
        folds = 0 if keep_decoded else fold_bytes(n, k, d)  # kept: folded once
        fold_time = 0 if keep_decoded else max(folds / (STREAM_FRACTION * copy),
                                               n * k * FOLD_SASS / ISSUE_RATE)
        operands = m * k + n * k + 4 * (m + n) * (k // 128) + 2 * m * n
        ours_bytes = act + folds + operands
        floor = (act + folds) / copy + max(flops / (2 * bf16_rate), operands / copy)
        predicted = (act_time + fold_time + max(flops / fp8_rate, operands / copy)
                     + sync + (1 if keep_decoded else 2) * gap)
        decode_fraction = float("nan")
    else:
        decode = 0 if keep_decoded else weight_decode_bytes(k, n, d)
        operands = 2 * m * k + 2 * n * k + 2 * m * n  # what the bf16 product reads and writes
        ours_bytes = act + decode + operands
        floor = (act + decode) / copy + max(flops / bf16_rate, operands / copy)
        predicted = (act_time + decode / (STREAM_FRACTION * copy)
                     + max(flops / bf16_rate, operands / (BF16_GEMV_FRACTION * copy))
                     + gap * gaps(path, two_passes, keep_decoded))
        decode_fraction = float("nan")
    return dict(k=k, n=n, m=m, fmt=fmt, path=path, ours_mb=ours_bytes / 1e6,
                bf16_mb=bf16_bytes(m, k, n) / 1e6, gflop=flops / 1e9, floor_us=floor * 1e6,
                predicted_us=predicted * 1e6, bf16_us=bf16 * 1e6, floor_x=bf16 / floor,
                predicted_x=bf16 / predicted, target=TARGETS.get(m, "-"),
                gemm_floor_us=decode_fraction * 1e6)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copy-gbs", type=float, default=3000.0,
                        help="device copy bandwidth, GB/s read + written (H100: 3000)")
    parser.add_argument("--bf16-tflops", type=float, default=697.0,
                        help="bf16 matrix rate at M = 4096 (H200, 8192 x 8192: 697)")
    parser.add_argument("--gap-us", type=float, default=1.5,
                        help="assumed microseconds per kernel boundary in a CUDA graph")
    parser.add_argument("--sass-per-weight", type=float, default=4.8,
                        help="the decode GEMM's main-loop SASS per weight at 128-row tiles "
                             "(bench/gpu_compile.py; Triton 3.6: 4.3 NVFP4, 4.8 MXFP4)")
    parser.add_argument("--dynamic", action="store_true",
                        help="dynamic NVFP4 activation scales (an amax pass first); default "
                             "static, as every recipe ships")
    parser.add_argument("--keep-decoded", action="store_true",
                        help="the prefill path with the weights kept decoded to bf16 "
                             "(kbbq_pl.quant.w4a4.KEEP_DECODED_WEIGHTS: no weight decode per "
                             "call, 2 bytes a weight held); the FP8 product's kept folded")
    parser.add_argument("--fp8-tflops", type=float, default=1200.0,
                        help="assumed rate of cuBLAS's 1x128 block-scaled FP8 product at large M")
    parser.add_argument("--sync-us", type=float, default=10.0,
                        help="assumed microseconds the FP8 product loses to its host read")
    parser.add_argument("--tiny", action="store_true", help="one shape (K = N = 8192), M = 1")
    args = parser.parse_args(argv)
    shapes, rows = (SHAPES[:1], ROWS[:1]) if args.tiny else (SHAPES, ROWS)
    copy, rate, gap = args.copy_gbs * 1e9, args.bf16_tflops * 1e12, args.gap_us * 1e-6
    print(f"predictions (not measurements): copy {args.copy_gbs:.0f} GB/s, bf16 "
          f"{args.bf16_tflops:.0f} TFLOP/s at M = 4096, {args.gap_us} us per kernel boundary; "
          f"per-block transforms on, {'dynamic' if args.dynamic else 'static'} NVFP4 "
          f"activation scales{'; prefill weights kept decoded' if args.keep_decoded else ''}\n")
    header = ["K->N", "M", "format", "path", "W4A4 MB", "bf16 MB", "GFLOP", "W4A4 floor us",
              "decode GEMM floor us", "W4A4 predicted us", "bf16 predicted us",
              "x bf16 at the floor", "x bf16 predicted", "target"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for k, n in shapes:
        for m in rows:
            for fmt in FORMATS:
                for path in paths(m, fmt):
                    r = predict(m, k, n, fmt, copy, rate, gap, path, args.sass_per_weight,
                                args.dynamic, args.keep_decoded,
                                args.fp8_tflops * 1e12, args.sync_us * 1e-6)
                    gemm_floor = r["gemm_floor_us"]
                    cells = [f"{k}->{n}", m, fmt, path, f"{r['ours_mb']:.1f}",
                             f"{r['bf16_mb']:.1f}", f"{r['gflop']:.3g}", f"{r['floor_us']:.1f}",
                             "-" if math.isnan(gemm_floor) else f"{gemm_floor:.1f}",
                             f"{r['predicted_us']:.1f}", f"{r['bf16_us']:.1f}",
                             f"{r['floor_x']:.2f}", f"{r['predicted_x']:.2f}", r["target"]]
                    print("| " + " | ".join(str(c) for c in cells) + " |")

if __name__ == "__main__":
    main()
