"""Calibration budget: how RTN-KBBQ (0.75), RTN-KBBQ auto and GPTQ-KBBQ move with the number of
calibration tokens, scored on held-out text (the paper's Table calib, on a causal LM).

    python bench/calibration_budget.py [--model smollm2] [--budgets 1024,4096,16384]
        [--recipes rtn_kbbq_nvfp4_lam0.75,rtn_kbbq_nvfp4_auto,gptq_kbbq_nvfp4]
        [--seeds 0,1,2] [--source mixed] [--max-tokens 2048] [--out bench-out/calibration_budget]
    python bench/calibration_budget.py --tiny     # a tiny random Llama, budgets 512 and 1024

Each (budget, calibration seed) is one ``kbbq-pl compare`` run
(:func:`kbbq_pl.cli.compare.run_compare`) into ``OUT/<source>-<budget>/`` (seed 0) or
``OUT/<source>-<budget>-seed<k>/`` with every recipe's calibration ``n_tokens`` set to the
budget and its ``seed`` (which calibration blocks are drawn) to the seed:
perplexity and mean KL to the FP model on the first ``--max-tokens`` tokens of WikiText-2 test
(context 512, stride 256).  The runs are resumable (a finished recipe is not recomputed), so a
grid can be extended budget by budget.  Prints KL and perplexity per recipe and budget, with
each budget's KL as a ratio to the smallest budget's, and the quantize time: one row per recipe
and seed, and with several seeds the mean over them and the spread (max - min) of the KL.
``--tiny`` only checks that the script runs (tests/bench/test_tiny_modes.py): the same recipes
on a tiny random Llama, calibrated and scored on the WikiText-2 excerpt kbbq-pl ships, eager
kernels, into a temporary folder.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from statistics import mean

import _tiny

from kbbq_pl.cli.compare import run_compare

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TINY = {"budgets": "512,1024", "seeds": "0", "max_tokens": 128}


def run_folder(out: str | Path, source: str, budget: int, seed: int) -> Path:
    """The compare folder of one (budget, seed); seed 0 keeps the name of single-seed runs."""
    return Path(out) / (f"{Path(source).stem}-{budget}" + (f"-seed{seed}" if seed else ""))


def parse_ints(text: str, name: str) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]``; a clear error naming the option otherwise."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--{name} takes comma-separated integers, got {text!r}") from None
    if not values or len(set(values)) != len(values) or min(values) < 0:
        raise SystemExit(f"--{name} takes distinct non-negative integers, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budgets", default="1024,4096,16384",
                        help="calibration tokens, comma-separated")
    parser.add_argument("--seeds", default="0",
                        help="calibration seeds (the data module's seed), comma-separated")
    parser.add_argument("--recipes",
                        default="rtn_kbbq_nvfp4_lam0.75,rtn_kbbq_nvfp4_auto,gptq_kbbq_nvfp4")
    parser.add_argument("--source", default="mixed", help="calibration source of every run")
    parser.add_argument("--text", default=str(DATA / "wikitext2" / "test.txt"))
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--out", default="bench-out/calibration_budget")
    parser.add_argument("--tiny", action="store_true",
                        help=f"a tiny random Llama, {TINY}, in seconds")
    args = parser.parse_args()
    if not args.tiny:
        return budget_table(args)
    vars(args).update(TINY)
    _tiny.eager()
    with tempfile.TemporaryDirectory(prefix="kbbq-calibration-budget-") as tmp:
        vars(args).update(model=str(_tiny.save_tiny_model(Path(tmp) / "tiny")),
                          source=str(_tiny.wikitext_file()), text=str(_tiny.wikitext_file()),
                          out=str(Path(tmp) / "out"))
        budget_table(args)


def budget_table(args: argparse.Namespace) -> None:
    """Run (or resume) the compare runs of ``args``, print the table."""
    budgets = parse_ints(args.budgets, "budgets")
    seeds = parse_ints(args.seeds, "seeds")
    recipes = [r for r in args.recipes.split(",") if r]
    table: dict[tuple[str, int], dict[int, dict]] = {}
    for budget in budgets:
        for seed in seeds:
            _, rows = run_compare(
                args.model, recipes, run_folder(args.out, args.source, budget, seed),
                tasks=["ppl", "kl"], text=args.text, max_tokens=args.max_tokens,
                calibration={"source": args.source, "n_tokens": budget, "seed": seed},
                resume=True, progress=False)
            for row in rows[1:]:
                table.setdefault((row["label"], seed), {})[budget] = row
    print(f"\n{args.model}, calibration source {args.source}; KL (nats/token) and perplexity "
          f"on the first {args.max_tokens} tokens of {args.text}; FP perplexity "
          f"{rows[0]['perplexity']:.3f}")
    head = "".join(f"{f'KL@{b}':>11}" for b in budgets)
    ratios = "".join(f"{f'x{b}/{budgets[0]}':>12}" for b in budgets[1:])
    ppl = "".join(f"{f'PPL@{b}':>11}" for b in budgets)
    secs = "".join(f"{f's@{b}':>8}" for b in budgets)
    print(f"{'recipe':<30}{'seed':>6}{head}{ratios}{ppl}{secs}")

    def line(label: str, seed: str, kl: list[float], ppls: list[float], times: list[float]) -> str:
        return (f"{label:<30}{seed:>6}" + "".join(f"{v:11.4f}" for v in kl)
                + "".join(f"{v / kl[0]:12.3f}" for v in kl[1:])
                + "".join(f"{v:11.3f}" for v in ppls) + "".join(f"{v:8.0f}" for v in times))

    for label in dict.fromkeys(label for label, _ in table):
        per_seed = [table[(label, seed)] for seed in seeds]
        for seed, cells in zip(seeds, per_seed, strict=True):
            print(line(label, str(seed), [cells[b]["kl"] for b in budgets],
                       [cells[b]["perplexity"] for b in budgets],
                       [cells[b]["seconds"]["quantize"] for b in budgets]))
        if len(seeds) > 1:
            kls = [[cells[b]["kl"] for cells in per_seed] for b in budgets]
            print(line(label, "mean", [mean(v) for v in kls],
                       [mean(cells[b]["perplexity"] for cells in per_seed) for b in budgets],
                       [mean(cells[b]["seconds"]["quantize"] for cells in per_seed)
                        for b in budgets]))
            print(f"{'':<30}{'spread':>6}" + "".join(f"{max(v) - min(v):11.4f}" for v in kls))


if __name__ == "__main__":
    main()
