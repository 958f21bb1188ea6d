"""lm-eval request throughput of an emulated W4A4 causal LM, side by side with its FP model.

    python bench/eval_requests.py [--model smollm2] [--recipe rtn_kbbq_nvfp4_lam0.75]
        [--tasks arc_easy] [--limit 10] [--batch-size 8] [--calibration-tokens 1024]
    python bench/eval_requests.py --tiny     # a tiny random Llama, two ARC-Easy questions

Quantizes ``--model`` with ``--recipe`` in this process (``--calibration-tokens`` of its
calibration source), then runs the likelihood tasks through lm-eval (:func:`run_benchmarks`,
``HFLM``) on the FP model and on the quantized one in three settings: compiled rounding kernels
(``KBBQ_PL_COMPILE=1``; ``kbbq-pl eval`` and ``compare`` compile a kernel once it has run for
``kbbq_pl.formats.dispatch.COMPILE_AFTER_S`` eagerly) with the decoded weights cached for the
whole evaluation, as those commands cache them; eager kernels (``KBBQ_PL_COMPILE=0``); and
compiled kernels without the decoded-weight cache (every forward decodes every weight from its
FP4 codes).  Prints seconds, requests per second
and the time as a ratio to the FP model's, and checks that the three quantized settings return
the same log-likelihoods bit for bit (the settings change the speed, never a result).
``--tiny`` only checks that the script runs (tests/bench/test_tiny_modes.py): a tiny random
Llama, 256 calibration tokens, two ARC-Easy questions written to a temporary folder, and every
run with eager kernels (compiling them takes longer than the tiny run).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import tempfile
import time
from pathlib import Path

import _tiny
import torch

from kbbq_pl.cli.compare import load_recipe
from kbbq_pl.cli.quantize import calibration_batches
from kbbq_pl.eval.tasks import run_benchmarks
from kbbq_pl.formats import dispatch
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import quantize_model
from kbbq_pl.quant.w4a4 import cache_decoded_weights

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TINY = {"tasks": "arc_easy", "limit": 2, "batch_size": 2, "calibration_tokens": 256}


def timed_run(model, tokenizer, args: argparse.Namespace, *, compile_mode: str,
              cache: bool) -> tuple[float, int, list, dict[str, float]]:
    """(seconds, requests, log-likelihoods, scores) of one lm-eval run."""
    from lm_eval.models.huggingface import HFLM

    dispatch.set_compile(compile_mode)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=args.batch_size)
    answers: list = []
    loglikelihood = lm.loglikelihood

    def counted(requests, *rest, **kwargs):
        out = loglikelihood(requests, *rest, **kwargs)
        answers.extend(out)
        return out

    lm.loglikelihood = counted
    start = time.perf_counter()
    with cache_decoded_weights() if cache else contextlib.nullcontext():
        results = run_benchmarks(lm, None, args.tasks.split(","), limit=args.limit,
                                 data_dir=args.data_dir)
    seconds = time.perf_counter() - start
    scores = {t: results[t]["score"] for t in args.tasks.split(",")}
    return seconds, len(answers), answers, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--recipe", default="rtn_kbbq_nvfp4_lam0.75")
    parser.add_argument("--tasks", default="arc_easy", help="likelihood tasks, comma-separated")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--calibration-tokens", type=int, default=1024)
    parser.add_argument("--data-dir", default=str(DATA))
    parser.add_argument("--tiny", action="store_true",
                        help=f"a tiny random Llama, {TINY}, eager kernels, in seconds")
    args = parser.parse_args()
    if not args.tiny:
        return measure(args, compiled="1")
    vars(args).update(TINY)
    _tiny.eager()
    with tempfile.TemporaryDirectory(prefix="kbbq-eval-requests-") as tmp:
        os.environ["KBBQ_PL_CACHE"] = str(Path(tmp) / "cache")  # lm-eval's converted data
        vars(args).update(model=str(_tiny.save_tiny_model(Path(tmp) / "tiny")),
                          data_dir=str(_tiny.save_arc_easy(Path(tmp) / "data")))
        measure(args, compiled="0")


def measure(args: argparse.Namespace, compiled: str) -> None:
    """Quantize the model of ``args``, time the four lm-eval runs, print the table; the
    settings called compiled run with ``KBBQ_PL_COMPILE`` = ``compiled``."""
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, causal=True, quantized="refuse")
    data, config, _ = load_recipe(args.recipe, args.model,
                                  {"n_tokens": args.calibration_tokens})
    quantized = copy.deepcopy(model)
    batches = calibration_batches(data, model, tokenizer, torch.device("cpu"), args.model)
    quantize_model(quantized, batches, config, progress=False)
    runs = {
        "FP": timed_run(model, tokenizer, args, compile_mode=compiled, cache=True),
        "W4A4, compiled kernels (cached)":
            timed_run(quantized, tokenizer, args, compile_mode=compiled, cache=True),
        "W4A4, eager kernels (cached)":
            timed_run(quantized, tokenizer, args, compile_mode="0", cache=True),
        "W4A4, no decoded-weight cache (compiled)":
            timed_run(quantized, tokenizer, args, compile_mode=compiled, cache=False),
    }
    dispatch.set_compile("auto")
    fp_seconds = runs["FP"][0]
    print(f"\n{args.model}, {args.recipe}; {args.tasks} at --limit {args.limit}, batch size "
          f"{args.batch_size}; {torch.get_num_threads()} thread(s)")
    print(f"{'run':<44}{'s':>8}{'requests':>10}{'req/s':>8}{'x FP time':>11}  scores")
    for name, (seconds, requests, _, scores) in runs.items():
        print(f"{name:<44}{seconds:8.1f}{requests:10d}{requests / seconds:8.2f}"
              f"{seconds / fp_seconds:11.2f}  {scores}")
    reference = runs["W4A4, compiled kernels (cached)"][2]
    same = all(run[2] == reference for name, run in runs.items() if name.startswith("W4A4"))
    print(f"quantized log-likelihoods identical across the three W4A4 settings: {same}")


if __name__ == "__main__":
    main()
