"""Wall time of the whole ``kbbq-pl quantize`` main job on all-MiniLM-L6-v2.

    python bench/quantize.py [--runs cold,warm,eager] [-- extra kbbq-pl quantize args]
    python bench/quantize.py --tiny     # one eager run on a tiny random BERT, 64 tokens

Each run is a fresh process running the embedded default (NVFP4, RTN-KBBQ lambda 0.75,
calibrated on 4096 tokens of the shipped mixed-domain corpus; fidelity on the embedded
sentences; checkpoint written): ``cold`` with an empty torch.compile cache (a first run on a
new machine), ``warm`` with the cache the cold run filled, ``eager`` with KBBQ_PL_COMPILE=0.
Prints the wall time of the process and the stages from report.json, side by side.
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

TINY_QUANTIZE = ["--data.init_args.n_tokens", "64", "--data.init_args.seq_len", "32",
                 "--eval_sentences", "8"]
"""The tiny run's arguments to ``kbbq-pl quantize``, beside its tiny model."""


def run(extra: list[str], env: dict[str, str], out: Path) -> tuple[float, dict]:
    """Wall time and ``report.json`` of one ``kbbq-pl quantize`` process writing ``out``."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kbbq_pl.cli", "quantize", "--output_dir", str(out),
                    *extra], env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    return wall, json.loads((out / "report.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="cold,warm,eager")
    parser.add_argument("extra", nargs="*", help="arguments passed to kbbq-pl quantize")
    parser.add_argument("--tiny", action="store_true",
                        help="one eager run on a tiny random BERT, in seconds")
    args = parser.parse_args()
    model = "all-MiniLM-L6-v2"
    rows = []
    with tempfile.TemporaryDirectory(prefix="kbbq-bench-") as tmp:
        work = Path(tmp)
        if args.tiny:
            args.runs = "eager"
            args.extra = ["--model", str(_tiny.save_tiny_model(work / "tiny", "bert")),
                          *TINY_QUANTIZE, *args.extra]
            model = "tiny random BERT"
        cache = work / "inductor-cache"
        for i, name in enumerate(args.runs.split(",")):
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
            if name == "eager":
                env["KBBQ_PL_COMPILE"] = "0"
            wall, report = run(args.extra, env, work / f"{i}-{name}")
            rows.append((name, wall, report["seconds"], report["model"]["fidelity_mean_cosine"]))
    stages = ["calibration", "fit_transforms", "activation_scales", "quantize", "total"]
    print(f"threads per process: {os.cpu_count()} cores; {model}, default recipe")
    print(f"{'run':<7}{'wall s':>8}" + "".join(f"{s:>19}" for s in stages) + f"{'fidelity':>10}")
    for name, wall, seconds, fidelity in rows:
        print(f"{name:<7}{wall:8.1f}" + "".join(f"{seconds.get(s, float('nan')):19.1f}"
                                            for s in stages) + f"{fidelity:10.5f}")
    print("(wall s: the whole process: imports, model load, calibration, quantization, "
          "fidelity, checkpoint, report)")


if __name__ == "__main__":
    main()
