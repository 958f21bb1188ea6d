"""Calibration budget: how RTN-KBBQ (0.75), RTN-KBBQ auto and GPTQ-KBBQ move with the number of
calibration tokens, scored on held-out text (the paper's Table calib, on a causal LM).

    python bench/calibration_budget.py [--model smollm2] [--budgets 1024,4096,16384]
        [--recipes rtn_kbbq_nvfp4_lam0.75,rtn_kbbq_nvfp4_auto,gptq_kbbq_nvfp4]
        [--source mixed] [--max-tokens 2048] [--out bench-out/calibration_budget]

Each budget is one ``kbbq-pl compare`` run (:func:`kbbq_pl.cli.compare.run_compare`) into
``OUT/<source>-<budget>/`` with every recipe's calibration ``n_tokens`` set to the budget:
perplexity and mean KL to the FP model on the first ``--max-tokens`` tokens of WikiText-2 test
(context 512, stride 256).  The runs are resumable (a finished recipe is not recomputed), so a
grid can be extended budget by budget.  Prints KL and perplexity per recipe and budget, with
each budget's KL as a ratio to the smallest budget's, and the quantize time.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kbbq_pl.cli.compare import run_compare

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budgets", default="1024,4096,16384",
                        help="calibration tokens, comma-separated")
    parser.add_argument("--recipes",
                        default="rtn_kbbq_nvfp4_lam0.75,rtn_kbbq_nvfp4_auto,gptq_kbbq_nvfp4")
    parser.add_argument("--source", default="mixed", help="calibration source of every run")
    parser.add_argument("--text", default=str(DATA / "wikitext2" / "test.txt"))
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--out", default="bench-out/calibration_budget")
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    recipes = [r for r in args.recipes.split(",") if r]
    table: dict[str, dict[int, dict]] = {}
    for budget in budgets:
        _, rows = run_compare(
            args.model, recipes, Path(args.out) / f"{Path(args.source).stem}-{budget}",
            tasks=["ppl", "kl"], text=args.text, max_tokens=args.max_tokens,
            calibration={"source": args.source, "n_tokens": budget}, resume=True,
            progress=False)
        for row in rows[1:]:
            table.setdefault(row["label"], {})[budget] = row
    print(f"\n{args.model}, calibration source {args.source}; KL (nats/token) and perplexity "
          f"on the first {args.max_tokens} tokens of {args.text}; FP perplexity "
          f"{rows[0]['perplexity']:.3f}")
    head = "".join(f"{f'KL@{b}':>11}" for b in budgets)
    ratios = "".join(f"{f'x{b}/{budgets[0]}':>12}" for b in budgets[1:])
    ppl = "".join(f"{f'PPL@{b}':>11}" for b in budgets)
    secs = "".join(f"{f's@{b}':>8}" for b in budgets)
    print(f"{'recipe':<30}{head}{ratios}{ppl}{secs}")
    for label, cells in table.items():
        kl = [cells[b]["kl"] for b in budgets]
        print(f"{label:<30}" + "".join(f"{v:11.4f}" for v in kl)
              + "".join(f"{v / kl[0]:12.3f}" for v in kl[1:])
              + "".join(f"{cells[b]['perplexity']:11.3f}" for b in budgets)
              + "".join(f"{cells[b]['seconds']['quantize']:8.0f}" for b in budgets))


if __name__ == "__main__":
    main()
