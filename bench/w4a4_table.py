"""W4A4 fidelity of every method on all-MiniLM-L6-v2, in the shape of the paper's Table w4a4.

    python bench/w4a4_table.py [--formats nvfp4,mxfp4] [--methods I,HAAR,...] [--extra]
    python bench/w4a4_table.py --tiny     # NVFP4, every method and --extra, a tiny random BERT

Calibration: WikiText-2 ``valid.txt`` (``--calib-tokens`` tokens in blocks of ``--seq-len``);
evaluation: ``--sentences`` sentences of WikiText-2 ``test.txt``
(:func:`kbbq_pl.eval.evaluation.wikitext_sentences`); metric: the mean cosine similarity of
mean-pooled sentence embeddings to the full-precision model's (1.0 = identical),
with the median per-layer output SNR (each layer in isolation, W4A4, on the inputs it saw
during calibration) beside it.  ``--extra`` adds GPTQ-WUSH / GPTQ-KBBQ with the transform
fitted once (``transform_refit="fixed"``; the default refits it in the loop), GPTQ without
act-order and with dynamic block scales, and RTN-KBBQ / GPTQ-KBBQ with ``lam="auto"``.
``--tiny`` only checks that the script runs (tests/bench/test_tiny_modes.py): a tiny random
BERT, calibrated and scored on the WikiText-2 excerpt kbbq-pl ships, eager kernels.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import _tiny
import torch

from kbbq_pl.eval.evaluation import cosine_to_reference, mean_pooled_embeddings, wikitext_sentences
from kbbq_pl.io.data import token_blocks
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import QuantizationConfig, TransformConfig, quantize_model

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2"
TINY = {"formats": "nvfp4", "calib_tokens": 128, "seq_len": 32, "batch_size": 2, "sentences": 8,
        "extra": True}

METHODS: dict[str, dict] = {
    "I": {"transform": {"name": "identity"}},
    "HAAR": {"transform": {"name": "haar"}},
    "RTN-WUSH": {"transform": {"name": "wush"}},
    "RTN-KBBQ": {"transform": {"name": "kbbq"}},
    "GPTQ": {"transform": {"name": "identity"}, "weights": {"quantizer": "gptq"}},
    "MR-GPTQ": {"transform": {"name": "hadamard"},
                "weights": {"quantizer": "gptq", "scale_search": "mse"}},
    "GPTQ-WUSH": {"transform": {"name": "wush"}, "weights": {"quantizer": "gptq"}},
    "GPTQ-KBBQ": {"transform": {"name": "kbbq"}, "weights": {"quantizer": "gptq"}},
}
"""Each method's recipe groups (:meth:`QuantizationConfig.from_dict`), beside the format, the
lambda and the seed of the run."""


def extra_methods() -> dict[str, dict]:
    """Variants beside the default configurations of the table's methods."""
    extra = {}
    for kind in ("wush", "kbbq"):
        extra[f"GPTQ-{kind.upper()} (fixed T)"] = {
            "transform": {"name": kind},
            "weights": {"quantizer": "gptq", "transform_refit": "fixed"}}
    extra["GPTQ (no act-order)"] = {"transform": {"name": "identity"},
                                    "weights": {"quantizer": "gptq", "act_order": False}}
    extra["GPTQ (dynamic scales)"] = {"transform": {"name": "identity"},
                                      "weights": {"quantizer": "gptq", "group_scales": "dynamic"}}
    extra["RTN-KBBQ (auto)"] = {"transform": {"name": "kbbq", "lam": "auto"}}
    extra["GPTQ-KBBQ (auto)"] = {"transform": {"name": "kbbq", "lam": "auto"},
                                 "weights": {"quantizer": "gptq"}}
    return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--extra", action="store_true")
    parser.add_argument("--lam", type=float, default=TransformConfig.lam)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--tiny", action="store_true",
                        help=f"a tiny random BERT on the shipped text, {TINY}, in seconds")
    args = parser.parse_args()
    if not args.tiny:
        return table(args, "minilm", args.data / "valid.txt", args.data / "test.txt")
    vars(args).update(TINY)
    _tiny.eager()
    with tempfile.TemporaryDirectory(prefix="kbbq-w4a4-table-") as tmp:
        model = _tiny.save_tiny_model(Path(tmp) / "tiny", "bert")
        table(args, str(model), _tiny.wikitext_file(), _tiny.wikitext_file())


def table(args: argparse.Namespace, model_name: str, calib_text: Path, eval_text: Path) -> None:
    """Quantize ``model_name`` with every method of ``args``, print the table: calibration on
    ``calib_text``, fidelity on the sentences of ``eval_text`` (WikiText-2 files)."""
    torch.manual_seed(args.seed)
    model, tokenizer = load_model(model_name)
    calib = token_blocks(calib_text, tokenizer, n_tokens=args.calib_tokens,
                         seq_len=args.seq_len, seed=args.seed)
    batches = [{"input_ids": calib[i:i + args.batch_size],
                "attention_mask": torch.ones_like(calib[i:i + args.batch_size])}
               for i in range(0, len(calib), args.batch_size)]
    texts = wikitext_sentences(eval_text, n=args.sentences, seed=args.seed)
    reference = mean_pooled_embeddings(model, tokenizer, texts)
    methods = {name: METHODS[name] for name in args.methods.split(",")}
    if args.extra:
        methods.update(extra_methods())
    formats = args.formats.split(",")
    label = "tiny random BERT" if args.tiny else "all-MiniLM-L6-v2"
    print(f"{label} W4A4: calibration {len(calib)} x {args.seq_len} tokens of "
          f"{calib_text}; {len(texts)} sentences of {eval_text}; lambda {args.lam}; "
          f"cosine = mean cosine similarity of mean-pooled embeddings to FP; "
          f"SNR = median per-layer output SNR (dB)")
    results: dict[tuple[str, str], tuple[float, float, float]] = {}
    for fmt in formats:
        for name, options in methods.items():
            transform = {"lam": args.lam, "seed": args.seed, **options["transform"]}
            config = QuantizationConfig.from_dict({**options, "format": {"name": fmt},
                                                   "transform": transform})
            quantized = copy.deepcopy(model)
            start = time.perf_counter()
            report = quantize_model(quantized, batches, config, progress=False)
            seconds = time.perf_counter() - start
            cosine = cosine_to_reference(quantized, tokenizer, texts, reference)["mean_cosine"]
            results[(fmt, name)] = (float(cosine), report.summary()["median_output_snr_db"],
                                    seconds)
            print(f"  {fmt:6s} {name:28s} cosine {float(cosine):.5f}  "
                  f"SNR {results[(fmt, name)][1]:6.2f}  {seconds:6.1f}s", flush=True)
    width = max(len(n) for n in methods) + 2
    header = "".join(f"{f + ' cosine':>16}{f + ' SNR':>11}" for f in formats)
    print(f"\n{'method':<{width}}{header}")
    for name in methods:
        row = "".join(f"{results[(f, name)][0]:16.5f}{results[(f, name)][1]:11.2f}"
                      for f in formats)
        print(f"{name:<{width}}{row}")
    print("\nconfigs:")
    for name, options in methods.items():
        print(f"  {name}: {options}")


if __name__ == "__main__":
    main()
