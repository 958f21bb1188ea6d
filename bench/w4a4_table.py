"""W4A4 fidelity of every method on all-MiniLM-L6-v2, in the shape of the paper's Table w4a4.

    python bench/w4a4_table.py [--formats nvfp4,mxfp4] [--methods I,HAAR,...] [--extra]

Calibration: WikiText-2 ``valid.txt`` (``--calib-tokens`` tokens in blocks of ``--seq-len``);
evaluation: ``--sentences`` sentences of WikiText-2 ``test.txt``; metric: the mean cosine
similarity of mean-pooled sentence embeddings to the full-precision model's (1.0 = identical),
with the median per-layer output SNR (each layer in isolation, W4A4, on the inputs it saw
during calibration) beside it.  ``--extra`` adds the GPTQ-WUSH / GPTQ-KBBQ transform variant
that is not the default (fixed fit vs in-loop refit) and GPTQ without act-order.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import random
import re
import time
from pathlib import Path

import torch

from kbbq_pl.data import token_blocks
from kbbq_pl.models import load_model
from kbbq_pl.quantize import QuantizationConfig, quantize_model

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2"

METHODS: dict[str, dict] = {
    "I": dict(transform="identity"),
    "HAAR": dict(transform="haar"),
    "RTN-WUSH": dict(transform="wush"),
    "RTN-KBBQ": dict(transform="kbbq"),
    "GPTQ": dict(transform="identity", weight_quantizer="gptq"),
    "MR-GPTQ": dict(transform="hadamard", weight_quantizer="gptq", scale_search="mse"),
    "GPTQ-WUSH": dict(transform="wush", weight_quantizer="gptq"),
    "GPTQ-KBBQ": dict(transform="kbbq", weight_quantizer="gptq"),
}


def extra_methods(default_refit: str) -> dict[str, dict]:
    other = "in_loop" if default_refit == "fixed" else "fixed"
    extra = {}
    for kind in ("wush", "kbbq"):
        options = dict(transform=kind, weight_quantizer="gptq", transform_refit=other)
        if other == "in_loop":
            options["act_order"] = False
        extra[f"GPTQ-{kind.upper()} ({other})"] = options
    extra["GPTQ (no act-order)"] = dict(transform="identity", weight_quantizer="gptq",
                                        act_order=False)
    return extra


def sentences(path: Path, n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of a WikiText-2 file (kbbq_pl.evaluation's when it is there)."""
    try:
        from kbbq_pl.evaluation import wikitext_sentences
    except ImportError:
        pass
    else:
        return wikitext_sentences(path, n=n, seed=seed)
    eligible = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("="):
            continue
        for part in re.split(r"(?<= [.!?]) ", line):
            words = part.split()
            if 5 <= len(words) <= 64 and "<unk>" not in words and part.endswith((".", "!", "?")):
                eligible.append(part.replace(" @-@ ", "-").replace(" @,@ ", ",")
                                .replace(" @.@ ", "."))
    picks = sorted(random.Random(seed).sample(range(len(eligible)), n))
    return [eligible[i] for i in picks]


@torch.no_grad()
def embeddings(model, tokenizer, texts: list[str], batch_size: int = 64) -> torch.Tensor:
    """Mean-pooled last hidden states (sentence-transformers pooling of all-MiniLM-L6-v2)."""
    out = []
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(texts[start:start + batch_size], padding=True, truncation=True,
                          max_length=256, return_tensors="pt")
        hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        out.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9))
    return torch.cat(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--extra", action="store_true")
    parser.add_argument("--lam", type=float, default=QuantizationConfig.lam)
    parser.add_argument("--calib-tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model, tokenizer = load_model("minilm")
    calib = token_blocks(args.data / "valid.txt", tokenizer, n_tokens=args.calib_tokens,
                         seq_len=args.seq_len, seed=args.seed)
    batches = [{"input_ids": calib[i:i + args.batch_size],
                "attention_mask": torch.ones_like(calib[i:i + args.batch_size])}
               for i in range(0, len(calib), args.batch_size)]
    texts = sentences(args.data / "test.txt", args.sentences, args.seed)
    reference = embeddings(model, tokenizer, texts)
    methods = {name: METHODS[name] for name in args.methods.split(",")}
    if args.extra:
        methods.update(extra_methods(QuantizationConfig.transform_refit))
    formats = args.formats.split(",")
    print(f"all-MiniLM-L6-v2 W4A4: calibration {len(calib)} x {args.seq_len} tokens of "
          f"WikiText-2 valid; {len(texts)} WikiText-2 test sentences; lambda {args.lam}; "
          f"cosine = mean cosine similarity of mean-pooled embeddings to FP; "
          f"SNR = median per-layer output SNR (dB)")
    results: dict[tuple[str, str], tuple[float, float, float]] = {}
    for fmt in formats:
        for name, options in methods.items():
            config = QuantizationConfig(format=fmt, lam=args.lam, seed=args.seed, **options)
            quantized = copy.deepcopy(model)
            start = time.perf_counter()
            report = quantize_model(quantized, batches, config, progress=False)
            seconds = time.perf_counter() - start
            cosine = torch.nn.functional.cosine_similarity(
                embeddings(quantized, tokenizer, texts).double(), reference.double()).mean()
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
