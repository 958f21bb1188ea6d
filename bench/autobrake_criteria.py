"""Which held-out criterion ranks the lambdas as the test sentences do (all-MiniLM-L6-v2).

    python bench/autobrake_criteria.py [--quantizer gptq|rtn] [--format mxfp4|nvfp4]
        [--seeds 0,...,9] [--lams 0.25,0.5,0.625,0.75,0.875] [--finalists 0.625,0.75,0.875]
        [--out bench-out/autobrake_criteria.json] [--data ../shared/data/wikitext2]

A diagnosis of the auto-brake's model comparison (``autobrake.finalists``), not a recipe.  Per
calibration seed (16 x 256 tokens of ``valid.txt``, split as the auto-brake splits them) and
lambda, two models: one quantized on the fitting half (what the auto-brake compares) and one on
every block (what it ships).  Each is scored by

* ``test``: embedding fidelity (mean cosine of mean-pooled embeddings) on 512 ``test.txt``
  sentences, the measure the auto-brake should agree with;
* ``valid``: the same fidelity on 512 ``valid.txt`` sentences (calibration-side text shaped as
  the test is);
* on 256-token blocks: ``relerr``, the relative squared error of the last hidden state (the
  auto-brake's divergence for a model without logits), ``tokcos`` (one minus the mean
  per-token cosine) and ``pooled`` (one minus the cosine of each block's mean-pooled state):
  on the held-out half for the fitting-half model, on 16 fresh blocks (never calibrated on) for
  the model of every block.

Each criterion picks a lambda per seed; the table gives the test fidelity of the model of every
block at that lambda, its paired gap to the best fixed lambda and the standard error, over all
lambdas and over the finalists only.  Rows are saved to ``--out`` as they finish (resumable).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from kbbq_pl.eval.evaluation import cosine_summary, mean_pooled_embeddings, wikitext_sentences
from kbbq_pl.io.data import token_blocks
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import (
    FormatConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.transforms.autobrake import split_sequences

BLOCK_CRITERIA = ("relerr", "tokcos", "pooled")


@torch.no_grad()
def last_hidden(model: torch.nn.Module, batches: list[dict]) -> list[torch.Tensor]:
    return [model(**batch)[0].double() for batch in batches]


def block_scores(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    """``relerr``, ``tokcos`` and ``pooled`` (smaller is closer) of hidden states ``got``."""
    error = sum(((g - w) ** 2).sum() for g, w in zip(got, want))
    energy = sum((w ** 2).sum() for w in want)
    tokcos = torch.cat([1 - F.cosine_similarity(g, w, dim=-1).flatten()
                        for g, w in zip(got, want)])
    pooled = torch.cat([1 - F.cosine_similarity(g.mean(1), w.mean(1), dim=-1)
                        for g, w in zip(got, want)])
    return {"relerr": float(error / energy), "tokcos": float(tokcos.mean()),
            "pooled": float(pooled.mean())}


def as_batches(blocks: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in blocks.split(4)]


def measure(args: argparse.Namespace, rows: list[dict], out: Path) -> None:
    data = Path(args.data)
    model, tokenizer = load_model("minilm")
    texts = {name: wikitext_sentences(data / f"{name}.txt", 512) for name in ("test", "valid")}
    reference = {name: mean_pooled_embeddings(model, tokenizer, sentences)
                 for name, sentences in texts.items()}
    done = {(r["seed"], r["lam"], r["part"]) for r in rows}
    for seed in args.seeds:
        blocks = token_blocks(data / "valid.txt", tokenizer, n_tokens=4096, seq_len=256,
                              seed=seed)
        batches = as_batches(blocks)
        fitting, held_out = split_sequences(batches, 0.5, seed)
        # token_blocks draws a seeded permutation's prefix: the next 16 blocks are fresh
        seen = {tuple(b.tolist()) for b in blocks}
        more = token_blocks(data / "valid.txt", tokenizer, n_tokens=8192, seq_len=256,
                            seed=seed)
        fresh = as_batches(torch.stack([b for b in more if tuple(b.tolist()) not in seen]))
        scored = {"half": (fitting, held_out), "full": (batches, fresh)}
        want = {part: last_hidden(model, scored[part][1]) for part in scored}
        for lam in args.lams:
            for part, (calibration, evaluation) in scored.items():
                if (seed, lam, part) in done:
                    continue
                candidate = copy.deepcopy(model)
                config = QuantizationConfig(format=FormatConfig(args.format),
                                            transform=TransformConfig("kbbq", lam, seed=seed),
                                            weights=WeightsConfig(args.quantizer))
                quantize_model(candidate, calibration, config, progress=False)
                row = {"seed": seed, "lam": lam, "part": part}
                for name, sentences in texts.items():
                    row[name] = cosine_summary(mean_pooled_embeddings(
                        candidate, tokenizer, sentences), reference[name])["mean_cosine"]
                row.update(block_scores(last_hidden(candidate, evaluation), want[part]))
                rows.append(row)
                out.write_text(json.dumps(rows))
                print(row, flush=True)


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    table = {(r["seed"], r["lam"], r["part"]): r for r in rows}
    seeds = [s for s in args.seeds
             if all((s, lam, p) in table for lam in args.lams for p in ("half", "full"))]
    if not seeds:
        raise SystemExit("no seed has every run")
    test = {lam: [table[s, lam, "full"]["test"] for s in seeds] for lam in args.lams}
    best = max(args.lams, key=lambda lam: statistics.mean(test[lam]))
    print(f"\nall-MiniLM-L6-v2, {args.quantizer.upper()}-KBBQ {args.format}, seeds {seeds}")
    print("test fidelity of the model of every block: " + ", ".join(
        f"{lam:g}: {statistics.mean(v):.5f}" for lam, v in test.items()) + f" (best {best:g})")
    criteria = ([(c, "half", -1, "held-out half") for c in BLOCK_CRITERIA]
                + [(c, "half", 1, "sentences") for c in ("valid", "test")]
                + [(c, "full", -1, "fresh blocks") for c in BLOCK_CRITERIA]
                + [("valid", "full", 1, "sentences")])
    for pool in (args.lams, args.finalists):
        print(f"\ncandidates {', '.join(f'{lam:g}' for lam in pool)}")
        print(f"{'criterion':<10}{'model scored':<14}{'on':<15}{'test':>9}{'vs best':>10}"
              f"{'se':>9}  picks")
        for criterion, part, sign, text in criteria:
            picks = [max(pool, key=lambda lam: sign * table[s, lam, part][criterion])
                     for s in seeds]
            gaps = [table[s, lam, "full"]["test"] - table[s, best, "full"]["test"]
                    for s, lam in zip(seeds, picks)]
            fidelity = statistics.mean(table[s, lam, "full"]["test"]
                                       for s, lam in zip(seeds, picks))
            se = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
            model = "fitting half" if part == "half" else "every block"
            print(f"{criterion:<10}{model:<14}{text:<15}{fidelity:9.5f}"
                  f"{statistics.mean(gaps):+10.5f}{se:9.5f}  "
                  + ",".join(f"{lam:g}" for lam in picks))
    print("(test: the test fidelity of the model of every block at the picked lambda, mean over "
          "seeds; vs best: the paired gap to the best fixed lambda, se its standard error)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantizer", choices=["rtn", "gptq"], default="gptq")
    parser.add_argument("--format", choices=["nvfp4", "mxfp4"], default="mxfp4")
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9")
    parser.add_argument("--lams", default="0.25,0.5,0.625,0.75,0.875")
    parser.add_argument("--finalists", default="0.625,0.75,0.875",
                        help="the auto-brake's finalists, a second candidate pool")
    parser.add_argument("--out", default="bench-out/autobrake_criteria.json")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent
                                              / "shared" / "data" / "wikitext2"))
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.lams = [float(v) for v in args.lams.split(",")]
    args.finalists = [float(v) for v in args.finalists.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(out.read_text()) if out.exists() else []
    measure(args, rows, out)
    report(args, rows)


if __name__ == "__main__":
    main()
