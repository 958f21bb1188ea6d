"""lm-eval request throughput of an emulated W4A4 causal LM, side by side with its FP model.

    python bench/eval_requests.py [--model smollm2] [--recipe rtn_kbbq_nvfp4_lam0.75]
        [--tasks arc_easy] [--limit 10] [--batch-size 8] [--calibration-tokens 1024]

Quantizes ``--model`` with ``--recipe`` in this process (``--calibration-tokens`` of its
calibration source), then runs the likelihood tasks through lm-eval (:func:`run_benchmarks`,
``HFLM``) on the FP model and on the quantized one in three settings: as ``kbbq-pl eval`` and
``kbbq-pl compare`` run it (compiled rounding kernels, decoded weights cached for the whole
evaluation), with eager kernels (``KBBQ_PL_COMPILE=0``), and without the decoded-weight cache
(every forward decodes every weight from its FP4 codes).  Prints seconds, requests per second
and the time as a ratio to the FP model's, and checks that the three quantized settings return
the same log-likelihoods bit for bit (the settings change the speed, never a result).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from pathlib import Path

import torch

from kbbq_pl.cli.compare import load_recipe
from kbbq_pl.eval.benchmarks import run_benchmarks
from kbbq_pl.formats import dispatch
from kbbq_pl.io.models import load_model
from kbbq_pl.quant.w4a4 import cache_decoded_weights

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def timed_run(model, tokenizer, args, *, compile_mode: str, cache: bool):
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
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, causal=True, quantized="refuse")
    data, quantizer, _ = load_recipe(args.recipe, args.model,
                                     {"n_tokens": args.calibration_tokens})
    data.tokenizer = tokenizer
    quantized = copy.deepcopy(model)
    quantizer.quantize(quantized, list(data.calibration_dataloader()), progress=False)
    runs = {
        "FP": timed_run(model, tokenizer, args, compile_mode="auto", cache=True),
        "W4A4, as kbbq-pl eval (compiled, cached)":
            timed_run(quantized, tokenizer, args, compile_mode="auto", cache=True),
        "W4A4, eager kernels (cached)":
            timed_run(quantized, tokenizer, args, compile_mode="0", cache=True),
        "W4A4, no decoded-weight cache (compiled)":
            timed_run(quantized, tokenizer, args, compile_mode="auto", cache=False),
    }
    dispatch.set_compile("auto")
    fp_seconds = runs["FP"][0]
    print(f"\n{args.model}, {args.recipe}; {args.tasks} at --limit {args.limit}, batch size "
          f"{args.batch_size}; {torch.get_num_threads()} thread(s)")
    print(f"{'run':<44}{'s':>8}{'requests':>10}{'req/s':>8}{'x FP time':>11}  scores")
    for name, (seconds, requests, _, scores) in runs.items():
        print(f"{name:<44}{seconds:8.1f}{requests:10d}{requests / seconds:8.2f}"
              f"{seconds / fp_seconds:11.2f}  {scores}")
    reference = runs["W4A4, as kbbq-pl eval (compiled, cached)"][2]
    same = all(run[2] == reference for name, run in runs.items() if name.startswith("W4A4"))
    print(f"quantized log-likelihoods identical across the three W4A4 settings: {same}")


if __name__ == "__main__":
    main()
