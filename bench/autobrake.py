"""Auto-brake against every global lambda, on all-MiniLM-L6-v2 (the auto-brake acceptance).

    python bench/autobrake.py [--formats nvfp4,mxfp4] [--data ../shared/data/wikitext2]

Calibrates on WikiText-2 ``valid.txt`` (16 x 256 tokens), measures embedding fidelity (mean
cosine of mean-pooled embeddings to the FP model) on 512 sentences of ``test.txt``, for RTN-KBBQ
at every lambda of the grid and for ``lam="auto"`` in three variants: the chosen lambda refitted
on all tokens (default), the transform fitted on the fitting half kept, and selection on the
fitting tokens instead of held-out ones (what the split is for).  Prints one table with the
quantize time of each run and the ratio of auto's time to a fixed-lambda run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from kbbq_pl.autobrake import DEFAULT_GRID
from kbbq_pl.data import token_blocks
from kbbq_pl.evaluation import cosine_summary, mean_pooled_embeddings, wikitext_sentences
from kbbq_pl.models import load_model
from kbbq_pl.quantize import QuantizationConfig, quantize_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent
                                              / "shared" / "data" / "wikitext2"))
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    data = Path(args.data)
    model, tokenizer = load_model("minilm")
    blocks = token_blocks(data / "valid.txt", tokenizer, n_tokens=args.tokens, seq_len=256)
    batches = [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in blocks.split(4)]
    sentences = wikitext_sentences(data / "test.txt", args.sentences)
    reference = mean_pooled_embeddings(model, tokenizer, sentences)
    runs = [(f"lambda {lam:g}", {"lam": lam}) for lam in DEFAULT_GRID]
    runs += [("auto (refit)", {"lam": "auto"}),
             ("auto (keep fit-half T)", {"lam": "auto", "auto_refit": False}),
             ("auto, selected on fit tokens", {"lam": "auto", "auto_select_on": "fit"})]
    print(f"all-MiniLM-L6-v2, calibration {args.tokens} tokens of valid.txt, fidelity on "
          f"{len(sentences)} test.txt sentences, RTN-KBBQ")
    for fmt in args.formats.split(","):
        rows = []
        for name, overrides in runs:
            candidate = copy.deepcopy(model)
            config = QuantizationConfig(format=fmt, transform="kbbq", **overrides)
            start = time.perf_counter()
            report = quantize_model(candidate, batches, config, expected_tokens=args.tokens,
                                    progress=False)
            seconds = time.perf_counter() - start
            fidelity = cosine_summary(mean_pooled_embeddings(candidate, tokenizer, sentences),
                                      reference)["mean_cosine"]
            chosen = [r.lam for r in report.layers]
            rows.append((name, fidelity, seconds, chosen))
        fixed_time = statistics.median(s for n, _, s, _ in rows if n.startswith("lambda"))
        best_fixed = max(f for n, f, _, _ in rows if n.startswith("lambda"))
        print(f"\n{fmt}: best global lambda fidelity {best_fixed:.5f}; "
              f"median fixed-lambda quantize time {fixed_time:.1f} s")
        print(f"{'run':<30}{'fidelity':>10}{'vs best':>10}{'time s':>8}{'time ratio':>11}"
              f"{'median lambda':>15}")
        for name, fidelity, seconds, chosen in rows:
            print(f"{name:<30}{fidelity:10.5f}{fidelity - best_fixed:+10.5f}{seconds:8.1f}"
                  f"{seconds / fixed_time:11.2f}{statistics.median(chosen):15.3f}")


if __name__ == "__main__":
    main()
