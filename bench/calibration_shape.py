"""Packed blocks or whole records: the worst sentences of all-MiniLM-L6-v2 under each.

    python bench/calibration_shape.py [--formats nvfp4,mxfp4] [--lam 0.75] [--seeds 0,...,9]
                                      [--data ../shared/data/wikitext2]
    python bench/calibration_shape.py --tiny     # NVFP4, one seed, a tiny random BERT

Calibrates RTN-KBBQ at one lambda on the shipped corpus as a recipe draws it
(``CalibrationDataModule(source="mixed", n_tokens=4096, seq_len=256, batch_size=8)``), packed
and as whole records (``packing=False``), and prints, per format and shape, the mean over seeds
of the fidelity (mean cosine of mean-pooled embeddings to the FP model on 512 sentences of
WikiText-2 ``test.txt``), of its minimum and of its 1st percentile, and the worst minimum of any
seed.  research/2026-11-27-packing-default.md compares the means at every lambda; this says
whether the worst sentences follow.  ``--tiny`` only checks that the script runs
(tests/bench/test_tiny_modes.py): 128 tokens of the same corpus, 8 sentences of the WikiText-2
excerpt kbbq-pl ships, eager kernels.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from pathlib import Path

import _tiny
import torch

from kbbq_pl.eval.evaluation import mean_pooled_embeddings, wikitext_sentences
from kbbq_pl.io.data import MIXED, CalibrationDataModule
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import FormatConfig, QuantizationConfig, TransformConfig, quantize_model

CALIBRATION = {"n_tokens": 4096, "seq_len": 256, "batch_size": 8}
"""How the shipped recipes draw the corpus."""
SENTENCES = 512
TINY = {"formats": "nvfp4", "seeds": "0"}
TINY_CALIBRATION = {"n_tokens": 128, "seq_len": 32, "batch_size": 2}
TINY_SENTENCES = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--lam", type=float, default=0.75)
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent
                                              / "shared" / "data" / "wikitext2"))
    parser.add_argument("--tiny", action="store_true",
                        help="a tiny random BERT, NVFP4, one seed, 128 tokens, in seconds")
    args = parser.parse_args()
    if not args.tiny:
        return shape_table(args, "minilm", CALIBRATION, Path(args.data) / "test.txt", SENTENCES)
    vars(args).update(TINY)
    _tiny.eager()
    with tempfile.TemporaryDirectory(prefix="kbbq-calibration-shape-") as tmp:
        model = _tiny.save_tiny_model(Path(tmp) / "tiny", "bert")
        shape_table(args, str(model), TINY_CALIBRATION, _tiny.wikitext_file(), TINY_SENTENCES)


def shape_table(args: argparse.Namespace, model_name: str, calibration: dict[str, int],
                test_file: Path, n_sentences: int) -> None:
    """Quantize ``model_name`` per format, shape and seed of ``args`` with ``calibration``
    drawn from the shipped corpus; print the fidelity on ``n_sentences`` of ``test_file``."""
    seeds = [int(s) for s in args.seeds.split(",")]
    model, tokenizer = load_model(model_name)
    sentences = wikitext_sentences(test_file, n_sentences)
    reference = mean_pooled_embeddings(model, tokenizer, sentences)
    label = "tiny random BERT" if args.tiny else "all-MiniLM-L6-v2"
    print(f"{label}, RTN-KBBQ lambda {args.lam:g}, {calibration['n_tokens']:,} tokens of "
          f"the shipped corpus, seeds {seeds}, cosine to FP on {len(sentences)} sentences of "
          f"{test_file} (means over seeds)")
    print(f"{'format':<8}{'calibration':<16}{'mean':>9}{'min':>9}{'worst min':>11}{'1st pct':>9}")
    for fmt in args.formats.split(","):
        for packing in (True, False):
            means, minima, percentiles = [], [], []
            for seed in seeds:
                data = CalibrationDataModule(MIXED, tokenizer, **calibration, seed=seed,
                                             packing=packing)
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
