"""Packed blocks or whole records: the worst sentences of all-MiniLM-L6-v2 under each.

    python bench/calibration_shape.py [--formats nvfp4,mxfp4] [--lam 0.75] [--seeds 0,...,9]
                                      [--data ../shared/data/wikitext2]

Calibrates RTN-KBBQ at one lambda on the shipped corpus as a recipe draws it
(``CalibrationDataModule(source="mixed", n_tokens=4096, seq_len=256, batch_size=8)``), packed
and as whole records (``packing=False``), and prints, per format and shape, the mean over seeds
of the fidelity (mean cosine of mean-pooled embeddings to the FP model on 512 sentences of
WikiText-2 ``test.txt``), of its minimum and of its 1st percentile, and the worst minimum of any
seed.  ``bench/autobrake.py --calibration mixed|mixed-records`` compares the means at every
lambda; this says whether the worst sentences follow.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from pathlib import Path

import torch

from kbbq_pl.eval.evaluation import mean_pooled_embeddings, wikitext_sentences
from kbbq_pl.io.data import MIXED, CalibrationDataModule
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import FormatConfig, QuantizationConfig, TransformConfig, quantize_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--lam", type=float, default=0.75)
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent
                                              / "shared" / "data" / "wikitext2"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    model, tokenizer = load_model("minilm")
    sentences = wikitext_sentences(Path(args.data) / "test.txt", 512)
    reference = mean_pooled_embeddings(model, tokenizer, sentences)
    print(f"all-MiniLM-L6-v2, RTN-KBBQ lambda {args.lam:g}, 4,096 tokens of the shipped corpus, "
          f"seeds {seeds}, cosine to FP on {len(sentences)} test.txt sentences (means over seeds)")
    print(f"{'format':<8}{'calibration':<16}{'mean':>9}{'min':>9}{'worst min':>11}{'1st pct':>9}")
    for fmt in args.formats.split(","):
        for packing in (True, False):
            means, minima, percentiles = [], [], []
            for seed in seeds:
                data = CalibrationDataModule(MIXED, tokenizer, n_tokens=4096, seq_len=256,
                                             batch_size=8, seed=seed, packing=packing)
                candidate = copy.deepcopy(model)
                config = QuantizationConfig(format=FormatConfig(fmt),
                                            transform=TransformConfig("kbbq", lam=args.lam))
                quantize_model(candidate, list(data.calibration_dataloader()), config,
                               progress=False)
                cosines = torch.nn.functional.cosine_similarity(
                    mean_pooled_embeddings(candidate, tokenizer, sentences), reference)
                means.append(cosines.mean().item())
                minima.append(cosines.min().item())
                percentiles.append(cosines.quantile(0.01).item())
            print(f"{fmt:<8}{'packed' if packing else 'whole records':<16}"
                  f"{statistics.mean(means):9.5f}{statistics.mean(minima):9.4f}"
                  f"{min(minima):11.4f}{statistics.mean(percentiles):9.4f}", flush=True)


if __name__ == "__main__":
    main()
