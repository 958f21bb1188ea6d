"""Wall time and figures of ``kbbq-pl law`` on all-MiniLM-L6-v2 over WikiText-2.

    python bench/law.py [--data ../shared/data/wikitext2/valid.txt] [--tokens 4096]
                        [--seq-len 256] [--out DIR] [--formats fp8_e4m3,nvfp4,mxfp4]
    python bench/law.py --tiny     # a tiny random BERT on 64 random tokens, eager kernels

Runs the command in a fresh process (imports, model loading and kernel compilation included),
times it, then prints from its ``law.json``: per format the records, slope per decade,
intercept, median r, RMS of r and the predicted C_fmt; the cross-format spacings against
Prop. interceptgap; the kappa.md medians; and the targets of the resolving note (E4M3 median r
within 0.4 dB of 28.51 dB, RMS of r under 1.5 dB, the command under 2 minutes on two cores).
The load average is printed too: on a shared machine it explains a slow wall time.
``--tiny`` only checks that the script runs (tests/bench/test_tiny_modes.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _tiny

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "wikitext2" / "valid.txt"
TINY = {"data": "random", "tokens": 64, "seq_len": 32}


def show(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--formats", default="fp8_e4m3,nvfp4,mxfp4")
    parser.add_argument("--out", default=None, help="report folder (default: a temporary one)")
    parser.add_argument("--tiny", action="store_true",
                        help=f"a tiny random BERT on {TINY}, eager kernels, in seconds")
    args = parser.parse_args()
    if not args.tiny:
        return measure(args)
    with tempfile.TemporaryDirectory(prefix="kbbq-law-") as tmp:
        vars(args).update(TINY, model=str(_tiny.save_tiny_model(Path(tmp) / "tiny", "bert")),
                          out=args.out or str(Path(tmp) / "report"))
        _tiny.eager()
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    """Run ``kbbq-pl law`` as ``args`` say, print its figures; the command's exit code."""
    out = Path(args.out or tempfile.mkdtemp(prefix="kbbq-law-"))
    command = [sys.executable, "-m", "kbbq_pl.cli", "law", "--model", args.model, "--data",
               args.data, "--formats", args.formats, "--tokens", str(args.tokens), "--seq-len",
               str(args.seq_len), "--out", str(out), "--no-progress"]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        print(result.stdout + result.stderr)
        print(f"kbbq-pl law failed with exit code {result.returncode}")
        return result.returncode
    document = json.loads((out / "law.json").read_text())
    config = document["config"]
    print(f"kbbq-pl law: model {config['model']}, data {Path(config['data']).name}, "
          f"{config['sequences']} x {config['seq_len']} tokens, {config['rows']} rows per cell")
    print(f"wall time {wall:.1f} s (measurement {config['measure_seconds']:.1f} s), "
          f"load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after, "
          f"{os.cpu_count()} CPUs")
    print()
    print(f"{'format':<10}{'records':>8}{'slope/dec':>10}{'intercept':>10}{'median r':>9}"
          f"{'RMS r':>7}{'C_fmt':>7}{'med r - C':>10}")
    for name, fit in document["formats"].items():
        print(f"{name:<10}{fit['records']:>8}{show(fit['slope_per_decade']):>10}"
              f"{show(fit['intercept']):>10}{show(fit['median_r']):>9}{show(fit['rms_r']):>7}"
              f"{show(fit['predicted_c_fmt']):>7}{show(fit['median_r_minus_predicted']):>10}")
    print()
    for spacing in document["spacing"]:
        print(f"spacing {' - '.join(spacing['formats']):<20} median {show(spacing['median_db'])} "
              f"dB, Prop. interceptgap {show(spacing['predicted_db'])} dB")
    medians = document["kappa"]["medians"]
    print()
    print(f"kappa.md medians over {len(document['kappa']['cells'])} cells: kappa_I "
          f"{show(medians['kappa_identity'], 3)}, kappa_bar_rot "
          f"{show(medians['kappa_rotation'], 3)}, rot/I {show(medians['ratio'], 3)} "
          f"({show(medians['dex'], 3)} dex), kappa* "
          f"{show(medians['kappa_star'])}, kappa_b* {show(medians['block_kappa_star'], 3)} "
          f"(b={config['block_size']})")
    print()
    targets = []
    e4m3 = document["formats"].get("fp8_e4m3")
    if e4m3 and e4m3["median_r"] is not None:
        gap = e4m3["median_r"] - e4m3["predicted_c_fmt"]
        targets.append((f"E4M3 median r within 0.4 dB of {e4m3['predicted_c_fmt']:.2f} dB",
                        f"{gap:+.2f} dB", abs(gap) <= 0.4))
    for name, fit in document["formats"].items():
        if fit["rms_r"] is not None:
            targets.append((f"{name} RMS of r under 1.5 dB", f"{fit['rms_r']:.2f} dB",
                            fit["rms_r"] < 1.5))
    targets.append(("command under 120 s", f"{wall:.1f} s", wall < 120))
    for label, value, met in targets:
        print(f"{'met' if met else 'NOT MET':<8}{label:<45}{value}")
    print(f"\nreport: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
