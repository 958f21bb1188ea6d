"""The ``kbbq-pl`` command."""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch


def _formats_demo(args: argparse.Namespace) -> int:
    """Round Gaussian and heavy-tailed tensors onto every format and print what it costs."""
    from kbbq_pl import formats as F

    torch.manual_seed(args.seed)
    gaussian = torch.randn(args.size, args.size)
    heavy = torch.distributions.StudentT(3.0).sample((args.size, args.size))
    names = args.formats.split(",") if args.formats else [
        "fp8_e4m3", "nvfp4", "mxfp4", "mxfp4_no_clip", "mxfp4_rceil", "int8", "int4",
    ]
    print(f"kbbq-pl formats: {args.size}x{args.size} tensors, seed {args.seed}, "
          f"compiled kernels: {F.compile_enabled(gaussian.device)}")
    print(f"{'format':<15}{'bits/elem':>10}{'sigma2 pred':>12}{'sigma2 gauss':>13}"
          f"{'SNR gauss dB':>13}{'SNR t3 dB':>11}{'ms':>8}")
    for name in names:
        fmt = F.get_format(name)
        predicted = f"{F.sigma2_fmt(fmt):12.2e}" if fmt.is_float else f"{'-':>12}"
        start = time.perf_counter()
        F.fake_quantize(gaussian, fmt)
        elapsed = (time.perf_counter() - start) * 1e3
        measured = F.measure_sigma2(gaussian, fmt)
        snr_g = -10 * math.log10(F.measure_sigma2(gaussian, fmt, weighting="energy"))
        snr_t = -10 * math.log10(F.measure_sigma2(heavy, fmt, weighting="energy"))
        print(f"{name:<15}{fmt.bits_per_element():10.2f}{predicted}{measured:13.2e}"
              f"{snr_g:13.2f}{snr_t:11.2f}{elapsed:8.1f}")
    print("sigma2 pred: paper Eq. sigmafmt (log-uniform mantissas); SNR: tensor energy over "
          "rounding-error energy; ms: first call (includes compilation when compiled)")
    return 0


def _law(args: argparse.Namespace) -> int:
    """Measure the noise law per GEMM cell and write law.json, law.md, law.png, kappa.md."""
    from kbbq_pl.law_report import run_law

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    try:
        paths, summary = run_law(
            args.model, args.data, args.out, formats=formats, tokens=args.tokens,
            seq_len=args.seq_len, rows=args.rows, seed=args.seed, batch_size=args.batch_size,
            block_size=args.block_size, targets=args.targets, ignore=args.ignore,
            progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError, ImportError, OSError) as error:
        print(f"kbbq-pl law: error: {error}", file=sys.stderr)
        return 2
    print(f"{'format':<12}{'records':>8}{'slope/dec':>10}{'intercept':>10}{'median r':>9}"
          f"{'RMS r':>7}{'C_fmt':>7}")
    for name, fit in summary["formats"].items():
        def show(value, width):
            return f"{value:{width}.2f}" if value is not None else f"{'n/a':>{width}}"
        print(f"{name:<12}{fit['records']:8d}{show(fit['slope_per_decade'], 10)}"
              f"{show(fit['intercept'], 10)}{show(fit['median_r'], 9)}{show(fit['rms_r'], 7)}"
              f"{show(fit['predicted_c_fmt'], 7)}")
    for spacing in summary["spacing"]:
        median, predicted = spacing["median_db"], spacing["predicted_db"]
        print(f"spacing {' - '.join(spacing['formats'])}: median "
              f"{'n/a' if median is None else f'{median:.2f}'} dB, predicted "
              f"{'n/a' if predicted is None else f'{predicted:.2f}'} dB")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kbbq-pl", description="FP4 W4A4 quantization with KBBQ (see README.md)"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    formats = sub.add_parser("formats", help="round test tensors onto every format, print a table")
    formats.add_argument("--size", type=int, default=1024)
    formats.add_argument("--seed", type=int, default=0)
    formats.add_argument("--formats", default="", help="comma-separated names (default: a set)")
    formats.set_defaults(run=_formats_demo)
    law = sub.add_parser(
        "law", help="measure the noise law per GEMM cell (kappa, SNR per format), write a report"
    )
    law.add_argument("--model", required=True, help="local model folder, or 'minilm'")
    law.add_argument("--data", required=True,
                     help="calibration text: a .txt/.jsonl file, hf:<dataset>, or 'random' "
                          "(the paper's random-token corpus)")
    law.add_argument("--formats", default="fp8_e4m3,nvfp4,mxfp4",
                     help="comma-separated format names")
    law.add_argument("--tokens", type=int, default=4096, help="calibration tokens in all")
    law.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    law.add_argument("--batch-size", type=int, default=4,
                     help="sequences per forward call (one activation scale per call)")
    law.add_argument("--rows", type=int, default=8, help="sampled weight rows per cell")
    law.add_argument("--block-size", type=int, default=16, help="block of the kappa_b* ceiling")
    law.add_argument("--seed", type=int, default=0)
    law.add_argument("--targets", nargs="+", action="extend", metavar="REGEX",
                     help="linear layers to measure (default: all in the blocks)")
    law.add_argument("--ignore", nargs="+", action="extend", metavar="REGEX",
                     help="linear layers to skip (default: lm_head, embeddings, pooler)")
    law.add_argument("--out", required=True, help="output folder")
    law.add_argument("--no-progress", action="store_true", help="no progress bar")
    law.set_defaults(run=_law)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
