"""Time to fit the block transforms of one large layer (a 4096 x 4096 linear by default).

    python bench/transforms.py [--size 4096] [--out 4096] [--tokens 4096] [--repeats 5]
    python bench/transforms.py --tiny     # a 64 x 64 layer, 64 tokens, one repeat

Prints, for block sizes 16 (NVFP4) and 32 (MXFP4): the batched fit of WUSH/KBBQ's shared basis
(Cholesky + eigendecomposition of every block), one KBBQ(lambda) from that basis, solving for
``W T^-1``, and the total; times are the median over repeats, in one run.  ``--tiny`` only
checks that the script runs (tests/bench/test_tiny_modes.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from kbbq_pl.law import noise_law as law
from kbbq_pl.transforms.fit import kbbq_basis, transform_weight

TINY = {"size": 64, "out": 64, "tokens": 64, "repeats": 1}


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="in_features")
    parser.add_argument("--out", type=int, default=4096, help="out_features")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help=f"run on {TINY}, in seconds")
    args = parser.parse_args()
    if args.tiny:
        vars(args).update(TINY)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.out, args.size, generator=g)
    scales = torch.exp(torch.randn(args.size, generator=g))
    x = torch.randn(args.tokens, args.size, generator=g) * scales
    print(f"threads={torch.get_num_threads()} layer {args.out}x{args.size}, "
          f"{args.tokens} calibration tokens, median of {args.repeats}")
    print(f"{'block':>6}{'basis s':>10}{'lambda s':>10}{'W T^-1 s':>10}{'total s':>9}")
    for block in (16, 32):
        grouped = x.reshape(args.tokens, -1, block).transpose(0, 1).double()
        sigma_blocks = grouped.transpose(-1, -2) @ grouped / args.tokens
        t_basis, basis = timed(partial(kbbq_basis, weight, sigma_blocks), args.repeats)
        t_lam, transform = timed(partial(basis.transform, 0.75), args.repeats)
        t_solve, _ = timed(partial(transform_weight, weight, transform), args.repeats)
        total = t_basis + t_lam + t_solve
        print(f"{block:>6}{t_basis:10.3f}{t_lam:10.3f}{t_solve:10.3f}{total:9.3f}")
        assert torch.isfinite(transform).all()
        gram = law.weight_gram(weight)
        full = torch.block_diag(*sigma_blocks)
        print(f"{'':>6}utilization at lambda 0.75: "
              f"{float(law.utilization(full, gram, transform, block)):.3f}")


if __name__ == "__main__":
    main()
