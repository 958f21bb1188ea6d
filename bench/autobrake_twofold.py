"""The auto-brake's finalist comparison: one held-out split against two folds (all-MiniLM-L6-v2).

    python bench/autobrake_twofold.py [--quantizer gptq|rtn] [--format mxfp4|nvfp4]
        [--seeds 0,...,9] [--lams 0.25,0.5,0.625,0.75,0.875,1] [--finalists 3]
        [--out bench-out/autobrake_twofold.json] [--data ../shared/data/wikitext2]

A diagnosis of ``autobrake.finalists``, not a recipe.  Per calibration seed (the shipped corpus
as a recipe draws it for an encoder: 4,096 tokens of whole records, batches of 8) the sequences
are split as the auto-brake splits them (:func:`~kbbq_pl.transforms.autobrake.split_sequences`,
half held out).  Per lambda, three models: one quantized on the fitting half and scored on the
held-out half (what the auto-brake compares today), one quantized on the held-out half and
scored on the fitting half (the second fold), and one quantized on every sequence (what it
ships), scored by embedding fidelity on 512 ``test.txt`` sentences and on fresh records of the
corpus.  A half model is scored on its last hidden state against full precision by each of
:data:`CRITERIA` (numerators and denominators kept apart, so that the two folds pool as one
ratio).  The finalists are the scoring run's (``autobrake.scope: layer`` on every sequence,
:func:`~kbbq_pl.transforms.autobrake.model_finalists`).

Each rule picks a lambda per seed; the table gives the test fidelity of the model of every
sequence at that lambda and the paired gap to the best fixed lambda.  Rows are saved to
``--out`` as they finish (resumable).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from autobrake import fresh_fidelity, fresh_records, pooled_states  # bench/autobrake.py

from kbbq_pl.eval.evaluation import cosine_summary, mean_pooled_embeddings, wikitext_sentences
from kbbq_pl.io.data import MIXED, CalibrationDataModule
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import (
    AutoBrakeConfig,
    FormatConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.transforms.autobrake import model_finalists, split_sequences

CRITERIA = ("relerr", "pooled", "tokcos")
"""``relerr``: the squared error over the reference's energy (the auto-brake's divergence for a
model without logits until 2026-11-27); ``pooled``: one minus the cosine of each sequence's
mean-pooled last hidden state (what the test's fidelity is, on calibration records);
``tokcos``: one minus each token's cosine (the auto-brake's divergence now,
:func:`~kbbq_pl.quant.divergence.held_out_divergence`)."""
TARGETS = {"test": "512 test.txt sentences (the study's measure)",
           "fresh": "fresh records of the shipped corpus (in-domain)"}
"""What the models of every sequence are scored on."""
FOLDS = {"a": "fitting half (today)", "b": "held-out half", "ab": "both halves (two folds)"}
"""Which half models are scored: ``a`` fitted on the fitting half and scored on the held-out
one (the auto-brake's comparison), ``b`` the other way round, ``ab`` both, pooled."""


@torch.no_grad()
def distances(model: torch.nn.Module, reference: list[torch.Tensor], batches: list[dict]
              ) -> dict[str, float]:
    """Sums over ``batches`` (records are unpadded: every position counts) of how far
    ``model``'s last hidden state is from ``reference``: ``error`` and ``energy`` (the squared
    error and the reference's energy: their ratio is the auto-brake's divergence), ``pooled``
    (one minus the cosine of each sequence's mean-pooled state, summed over ``sequences``) and
    ``tokcos`` (one minus each token's cosine, summed over ``tokens``)."""
    sums = dict.fromkeys(("error", "energy", "pooled", "sequences", "tokcos", "tokens"), 0.0)
    for batch, want in zip(batches, reference):
        got = model(**batch)[0].double()
        sums["error"] += float(((got - want) ** 2).sum())
        sums["energy"] += float((want ** 2).sum())
        sums["pooled"] += float((1 - F.cosine_similarity(got.mean(1), want.mean(1), -1)).sum())
        sums["sequences"] += want.shape[0]
        sums["tokcos"] += float((1 - F.cosine_similarity(got, want, -1)).sum())
        sums["tokens"] += want.shape[0] * want.shape[1]
    return sums


def measure(args: argparse.Namespace, rows: list[dict], out: Path) -> None:
    model, tokenizer = load_model("minilm")
    sentences = wikitext_sentences(Path(args.data) / "test.txt", 512)
    reference = mean_pooled_embeddings(model, tokenizer, sentences)
    done = {(r["seed"], r["lam"]) for r in rows}

    def config(lam: float | str, seed: int) -> QuantizationConfig:
        return QuantizationConfig(format=FormatConfig(args.format),
                                  transform=TransformConfig("kbbq", lam, seed=seed),
                                  weights=WeightsConfig(args.quantizer),
                                  autobrake=AutoBrakeConfig())

    for seed in args.seeds:
        module = CalibrationDataModule(MIXED, tokenizer, n_tokens=4096, seq_len=256,
                                       batch_size=8, seed=seed, packing=False)
        batches = list(module.calibration_dataloader())
        fitting, held_out = split_sequences(batches, 0.5, seed)
        fresh = fresh_records(tokenizer, batches, seed, tokens=4096,
                              fresh_tokens=args.fresh_tokens, max_len=256)
        fresh_reference = pooled_states(model, fresh)
        with torch.no_grad():
            want = {"held_out": [model(**b)[0].double() for b in held_out],
                    "fitting": [model(**b)[0].double() for b in fitting]}
        folds = (("a", fitting, held_out, want["held_out"]),
                 ("b", held_out, fitting, want["fitting"]))
        if (seed, "finalists") not in done:
            scoring = quantize_model(copy.deepcopy(model), batches, config("auto", seed),
                                     progress=False)
            ranked, means = model_finalists(scoring.autobrake, len(AutoBrakeConfig().grid))
            rows.append({"seed": seed, "lam": "finalists", "ranked": ranked,
                         "means": {f"{k:g}": v for k, v in means.items()}})
            out.write_text(json.dumps(rows))
        for lam in args.lams:
            if (seed, lam) in done:
                continue
            row: dict = {"seed": seed, "lam": lam}
            for name, fit_on, score_on, reference_states in folds:
                half = copy.deepcopy(model)
                quantize_model(half, fit_on, config(lam, seed), progress=False)
                row.update({f"{name}_{key}": value for key, value
                            in distances(half, reference_states, score_on).items()})
            full = copy.deepcopy(model)
            quantize_model(full, batches, config(lam, seed), progress=False)
            row["fresh"] = fresh_fidelity(full, fresh, fresh_reference)
            row["test"] = cosine_summary(mean_pooled_embeddings(full, tokenizer, sentences),
                                         reference)["mean_cosine"]
            rows.append(row)
            out.write_text(json.dumps(rows))
            print(row, flush=True)


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    table = {(r["seed"], r["lam"]): r for r in rows}
    seeds = [s for s in args.seeds if all((s, lam) in table for lam in args.lams)]
    if not seeds:
        raise SystemExit("no seed has every run")

    def score(s: int, lam: float, criterion: str, folds: str) -> float:
        row = table[s, lam]
        over = {"relerr": ("error", "energy"), "pooled": ("pooled", "sequences"),
                "tokcos": ("tokcos", "tokens")}[criterion]
        return (sum(row[f"{fold}_{over[0]}"] for fold in folds)
                / sum(row[f"{fold}_{over[1]}"] for fold in folds))

    def pool(s: int, count: int | None) -> list[float]:
        if not count:
            return list(args.lams)
        finalists = table[s, "finalists"]["ranked"][:count]
        if not set(finalists) <= set(args.lams):
            raise SystemExit(f"seed {s}: finalists {finalists} include a lambda not in --lams")
        return finalists

    print(f"\nall-MiniLM-L6-v2, {args.quantizer.upper()}-KBBQ {args.format}, whole records of "
          f"the shipped corpus, seeds {seeds}")
    for target, text in TARGETS.items():
        fidelity = {lam: [table[s, lam][target] for s in seeds] for lam in args.lams}
        best = max(args.lams, key=lambda lam: statistics.mean(fidelity[lam]))
        print(f"\n{text}: fidelity of the model of every sequence: " + ", ".join(
            f"{lam:g}: {statistics.mean(v):.5f}" for lam, v in fidelity.items())
            + f" (best {best:g})")
        print(f"{'candidates':<14}{'criterion':<10}{'half models scored':<24}{'fidelity':>9}"
              f"{'vs best':>10}{'se':>9}{'at/above':>10}  picks")
        for count in (args.finalists, None):
            for criterion in CRITERIA:
                for folds, scored in FOLDS.items():
                    picks = [min(pool(s, count),
                                 key=lambda lam, s=s: score(s, lam, criterion, folds))
                             for s in seeds]
                    got = [table[s, lam][target] for s, lam in zip(seeds, picks)]
                    gaps = [g - table[s, best][target] for s, g in zip(seeds, got)]
                    se = (statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1
                          else float("nan"))
                    candidates = f"{count} finalists" if count else "every lambda"
                    print(f"{candidates:<14}{criterion:<10}{scored:<24}"
                          f"{statistics.mean(got):9.5f}{statistics.mean(gaps):+10.5f}{se:9.5f}"
                          f"{sum(g >= 0 for g in gaps):>7}/{len(gaps)}  "
                          + ",".join(f"{lam:g}" for lam in picks))
    print("(fidelity: of the model of every sequence at the picked lambda, mean over seeds; "
          "vs best: the paired gap to the best fixed lambda, se its standard error)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantizer", choices=["rtn", "gptq"], default="gptq")
    parser.add_argument("--format", choices=["nvfp4", "mxfp4"], default="mxfp4")
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9")
    parser.add_argument("--lams", default="0.25,0.5,0.625,0.75,0.875,1")
    parser.add_argument("--finalists", type=int, default=3)
    parser.add_argument("--fresh-tokens", type=int, default=16384,
                        help="tokens of fresh corpus records (never calibrated on) that the "
                             "model of every sequence is also scored on (in-domain fidelity)")
    parser.add_argument("--out", default="bench-out/autobrake_twofold.json")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent
                                              / "shared" / "data" / "wikitext2"))
    args = parser.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.lams = [float(v) for v in args.lams.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(out.read_text()) if out.exists() else []
    measure(args, rows, out)
    report(args, rows)


if __name__ == "__main__":
    main()
