"""Auto-brake against every global lambda, on all-MiniLM-L6-v2 (the auto-brake acceptance).

    python bench/autobrake.py [--formats nvfp4,mxfp4] [--quantizer rtn|gptq] [--seeds 0,1,2]
                              [--lams 0,0.25,...]
                              [--variants refit,keep,fit,folds4,model,best,finalistsN,bestN]
                              [--calibration blocks|sentences|mixed|mixed-records]
                              [--data ../shared/data/wikitext2]

Calibrates on WikiText-2 ``valid.txt`` (16 x 256 tokens, or with ``--calibration sentences``
whole sentences of about as many tokens, each its own sequence, unpadded; ``mixed`` /
``mixed-records``: the shipped corpus as the recipes draw it, packed into 256-token blocks or one
record per sequence, ``--data.init_args.packing false``), measures embedding
fidelity (mean cosine of mean-pooled embeddings to the FP model) on 512 sentences of
``test.txt``, for RTN-KBBQ (or GPTQ-KBBQ) at every lambda of the grid and for ``lam="auto"`` in
three variants: the chosen lambda refitted on all tokens (default), the transform fitted on the
fitting half kept, and selection on the fitting tokens instead of held-out ones (what the split
is for).  Each seed's calibration batches are built once and shared by every run.  Prints one
table with
each run's paired gap to the best global lambda (mean over seeds, and its standard error), the
quantize time of each run and the ratio of auto's time to a fixed-lambda run.  With
``--fresh-tokens N`` (``mixed-records`` only) every model is also scored on N tokens of fresh
records of the shipped corpus (the records of the seed's draw after those calibrated on: text
of the calibration's kind never calibrated on), in a second table.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kbbq_pl.eval.evaluation import cosine_summary, mean_pooled_embeddings, wikitext_sentences
from kbbq_pl.io.data import (
    MIXED,
    CalibrationDataModule,
    batches_by_length,
    token_blocks,
    token_records,
)
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import (
    AutoBrakeConfig,
    FormatConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from kbbq_pl.transforms.autobrake import DEFAULT_GRID


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--quantizer", choices=["rtn", "gptq"], default="rtn",
                        help="weight rounding: RTN-KBBQ or GPTQ-KBBQ")
    parser.add_argument("--seeds", default="0",
                        help="calibration seeds (which 16 x 256-token blocks, and the split)")
    parser.add_argument("--variants", default="refit,keep,fit",
                        help="auto variants: refit (one held-out split), keep (fit-half T), fit "
                             "(selection on the fitting tokens), folds4 (4-fold cross-fitting on "
                             "4,096 scored tokens), model (one lambda for the model, "
                             "autobrake.scope: model), best (scope best), finalistsN / bestN "
                             "(scope model / best with autobrake.finalists: N, 2 to the grid's "
                             "size)")
    parser.add_argument("--lams", default=",".join(f"{lam:g}" for lam in DEFAULT_GRID),
                        help="the global lambdas to compare with (default: the whole grid)")
    parser.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent
                                              / "shared" / "data" / "wikitext2"))
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq-len", type=int, default=256,
                        help="calibration block length (with the tokenizer's [CLS]/[SEP])")
    parser.add_argument("--calibration", default="blocks",
                        choices=["blocks", "sentences", "mixed", "mixed-records"],
                        help="blocks: --tokens of valid.txt in blocks of --seq-len; sentences: "
                             "whole valid.txt sentences (as the test embeds), one per sequence, "
                             "to --tokens; mixed / mixed-records: the shipped corpus, drawn by "
                             "CalibrationDataModule as a recipe draws it (batches of 8), packed "
                             "or one record per sequence")
    parser.add_argument("--fresh-tokens", type=int, default=0,
                        help="with mixed-records: also score every model on this many tokens "
                             "of fresh records of the corpus (0: the test sentences only)")
    args = parser.parse_args()
    if args.fresh_tokens and args.calibration != "mixed-records":
        parser.error("--fresh-tokens scores fresh records of the corpus: it needs "
                     "--calibration mixed-records")
    data = Path(args.data)
    seeds = [int(s) for s in args.seeds.split(",")]
    # (name, lambda, auto-brake settings)
    variants = {"refit": ("auto (refit)", "auto", AutoBrakeConfig()),
                "keep": ("auto (keep fit-half T)", "auto", AutoBrakeConfig(refit=False)),
                "fit": ("auto, selected on fit tokens", "auto", AutoBrakeConfig(select_on="fit")),
                "folds4": ("auto, 4-fold cross-fitting", "auto",
                           AutoBrakeConfig(folds=4, tokens=4096)),
                "model": ("auto, one lambda (scope model)", "auto",
                          AutoBrakeConfig(scope="model")),
                "best": ("auto, per layer or one (best)", "auto",
                         AutoBrakeConfig(scope="best"))}
    for count in range(2, len(DEFAULT_GRID) + 1):  # finalistsN / bestN: N finalists
        variants[f"finalists{count}"] = (f"auto, one lambda of {count} finalists", "auto",
                                         AutoBrakeConfig(scope="model", finalists=count))
        variants[f"best{count}"] = (f"auto, best with {count} finalists", "auto",
                                    AutoBrakeConfig(scope="best", finalists=count))
    runs = [(f"lambda {float(lam):g}", float(lam), AutoBrakeConfig())
            for lam in args.lams.split(",")]
    chosen_variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in chosen_variants if v not in variants]
    if unknown:
        parser.error(f"unknown --variants {unknown}; choose from {', '.join(variants)}")
    runs += [variants[v] for v in chosen_variants]
    model, tokenizer = load_model("minilm")
    sentences = wikitext_sentences(data / "test.txt", args.sentences)
    reference = mean_pooled_embeddings(model, tokenizer, sentences)
    method = "RTN-KBBQ" if args.quantizer == "rtn" else "GPTQ-KBBQ"
    shape = {"blocks": f"of valid.txt in blocks of {args.seq_len}",
             "sentences": "of valid.txt in whole sentences",
             "mixed": f"of the shipped corpus in blocks of {args.seq_len}",
             "mixed-records": "of the shipped corpus in whole records"}[args.calibration]
    print(f"all-MiniLM-L6-v2, calibration {args.tokens} tokens {shape} "
          f"(seeds {seeds}), "
          f"fidelity on {len(sentences)} test.txt sentences"
          + (f" and on {args.fresh_tokens} tokens of fresh corpus records" if args.fresh_tokens
             else "") + f", {method}")
    calibrations = {seed: calibration(data, tokenizer, args, seed) for seed in {0, *seeds}}
    fresh = {seed: fresh_records(tokenizer, calibrations[seed], seed, tokens=args.tokens,
                                 fresh_tokens=args.fresh_tokens, max_len=args.seq_len)
             for seed in seeds} if args.fresh_tokens else {}
    fresh_reference = {seed: pooled_states(model, batches) for seed, batches in fresh.items()}
    targets = ["test"] + (["fresh"] if fresh else [])
    for fmt in args.formats.split(","):
        # untimed: the first calls of a process compile the rounding kernels of each shape
        warm = calibrations[0]
        for lam in (0.75, "auto"):
            config = QuantizationConfig(format=FormatConfig(fmt),
                                        transform=TransformConfig("kbbq", lam=lam),
                                        weights=WeightsConfig(args.quantizer))
            quantize_model(copy.deepcopy(model), warm, config, progress=False)
        rows: dict[str, list] = {target: [] for target in targets}
        compared = {}
        for name, lam, autobrake in runs:
            fidelities: dict[str, list[float]] = {target: [] for target in targets}
            times, chosen, kept, trials = [], [], [], []
            for seed in seeds:
                batches = calibrations[seed]
                candidate = copy.deepcopy(model)
                config = QuantizationConfig(format=FormatConfig(fmt),
                                            transform=TransformConfig("kbbq", lam, seed=seed),
                                            weights=WeightsConfig(args.quantizer),
                                            autobrake=autobrake)
                start = time.perf_counter()
                report = quantize_model(candidate, batches, config, progress=False)
                times.append(time.perf_counter() - start)
                fidelities["test"].append(cosine_summary(
                    mean_pooled_embeddings(candidate, tokenizer, sentences),
                    reference)["mean_cosine"])
                if fresh:
                    fidelities["fresh"].append(
                        fresh_fidelity(candidate, fresh[seed], fresh_reference[seed]))
                chosen += [r.lam for r in report.layers]
                if "autobrake_model" in report.model:  # scope model / best: the model kept
                    best_kept = report.model.get("autobrake_best", {}).get("kept", "model")
                    kept.append("layer" if best_kept == "layer"
                                else f"{report.model['autobrake_model']['lam']:g}")
                    trials.append(held_out_trials(report.model))
            for target in targets:
                rows[target].append((name, [f"{f:.5f}" + (f" ({k})" if k else "") for f, k in
                                            zip(fidelities[target], kept or [""] * len(seeds))],
                                     fidelities[target], statistics.mean(times), chosen))
            if any(trials):
                compared[name] = trials
        for target in targets:
            print_table(f"{fmt}, fidelity on {TARGETS[target]}", rows[target], len(seeds))
        for name, trials in compared.items():
            print(f"{name}: held-out calibration divergence of each trial (fitted on the other "
                  "sequences; smaller is closer)")
            for seed, line in zip(seeds, trials):
                print(f"  seed {seed}: {line}")


TARGETS = {"test": "the test.txt sentences",
           "fresh": "fresh records of the shipped corpus (--fresh-tokens)"}


def print_table(title: str, rows: list[tuple], n_seeds: int) -> None:
    """One table: each run's fidelity and paired gap to the best global lambda."""
    fixed = [r for r in rows if r[0].startswith("lambda")]
    fixed_time = statistics.median(t for _, _, _, t, _ in fixed)
    best_name, _, best_fid, _, _ = max(fixed, key=lambda r: statistics.mean(r[2]))
    best = statistics.mean(best_fid)
    print(f"\n{title}: best global lambda {best_name} ({best:.5f}, mean over seeds); "
          f"median fixed-lambda quantize time {fixed_time:.1f} s")
    print(f"{'run':<30}{'fidelity':>10}{'sd':>9}{'vs best':>10}{'se':>9}{'wins':>6}"
          f"{'time s':>8}{'time ratio':>11}{'median lambda':>15}  per seed")
    for name, per_seed, fidelities, seconds, chosen in rows:
        mean = statistics.mean(fidelities)
        sd = statistics.stdev(fidelities) if len(fidelities) > 1 else float("nan")
        gaps = [f - b for f, b in zip(fidelities, best_fid)]
        se = statistics.stdev(gaps) / len(gaps) ** 0.5 if len(gaps) > 1 else float("nan")
        wins = sum(gap >= 0 for gap in gaps)
        print(f"{name:<30}{mean:10.5f}{sd:9.5f}{mean - best:+10.5f}{se:9.5f}"
              f"{wins:>4}/{n_seeds}{seconds:8.1f}{seconds / fixed_time:11.2f}"
              f"{statistics.median(chosen):15.3f}  " + ", ".join(per_seed))
    print("(fidelity: mean over seeds; sd: across seeds; vs best: the mean of the per-seed "
          "gaps to the best global lambda, se: their standard error (paired, same seeds); "
          "wins: seeds where the run is at least the best global lambda's fidelity on the "
          "same seed)")


@torch.no_grad()
def pooled_states(model: torch.nn.Module, batches: list[dict]) -> torch.Tensor:
    """Each unpadded record's mean-pooled last hidden state, ``[records, hidden]``."""
    return torch.cat([model(**b)[0].double().mean(1) for b in batches])


def fresh_records(tokenizer, batches: list[dict[str, torch.Tensor]], seed: int, *,
                  tokens: int, fresh_tokens: int, max_len: int) -> list[dict[str, torch.Tensor]]:
    """``fresh_tokens`` of records of the shipped corpus that ``seed``'s calibration
    (``batches``: ``tokens`` of whole records cut at ``max_len``) did not draw:
    :func:`token_records` takes a seeded permutation's prefix, so the records after the
    calibrated ones are fresh."""
    drawn = token_records(MIXED, tokenizer, n_tokens=tokens + fresh_tokens, max_len=max_len,
                          seed=seed)
    calibrated = sum(len(b["input_ids"]) for b in batches)
    if sorted(map(tuple, drawn[:calibrated])) != sorted(
            tuple(ids) for b in batches for ids in b["input_ids"].tolist()):
        raise RuntimeError(f"seed {seed}: the calibration is not the draw's first "
                           f"{calibrated} records; the fresh records would overlap it")
    return batches_by_length(drawn[calibrated:], 8)


def fresh_fidelity(model: torch.nn.Module, fresh: list[dict], reference: torch.Tensor) -> float:
    """Mean cosine of each fresh record's mean-pooled state to the full-precision ``reference``
    (:func:`pooled_states` of the full-precision model)."""
    return float(torch.nn.functional.cosine_similarity(pooled_states(model, fresh), reference,
                                                       -1).mean())


def calibration(data: Path, tokenizer, args: argparse.Namespace, seed: int
                ) -> list[dict[str, torch.Tensor]]:
    """The calibration batches of ``seed``: ``--tokens`` of ``valid.txt`` in blocks of
    ``--seq-len`` (4 per batch), or whole sentences (``--calibration sentences``: the
    eligible sentences, chosen as the test's, one per line, drawn as
    ``CalibrationDataModule(packing=False)`` draws records, until ``--tokens``), or the
    shipped corpus as a recipe draws it (``mixed``, ``mixed-records``)."""
    if args.calibration.startswith("mixed"):
        module = CalibrationDataModule(MIXED, tokenizer, n_tokens=args.tokens,
                                       seq_len=args.seq_len, batch_size=8, seed=seed,
                                       packing=args.calibration == "mixed")
        return list(module.calibration_dataloader())
    if args.calibration == "blocks":
        blocks = token_blocks(data / "valid.txt", tokenizer, n_tokens=args.tokens,
                              seq_len=args.seq_len, seed=seed)
        return [{"input_ids": b, "attention_mask": torch.ones_like(b)} for b in blocks.split(4)]
    # one sentence per line: the records CalibrationDataModule(packing=False) calibrates on
    with tempfile.TemporaryDirectory() as folder:
        sentences = Path(folder) / "valid_sentences.txt"
        sentences.write_text("\n".join(wikitext_sentences(data / "valid.txt", None)) + "\n",
                             encoding="utf-8")
        records = token_records(sentences, tokenizer, n_tokens=args.tokens,
                                max_len=args.seq_len, seed=seed)
    return batches_by_length(records, 4)


def held_out_trials(model_report: dict) -> str:
    """The divergences ``scope`` ``model`` / ``best`` compared, as one line (empty where one
    finalist of ``scope: model`` was kept without a comparison)."""
    divergences = {f"{lam:g}": value for lam, value
                   in model_report["autobrake_model"].get("finalists", {}).items()}
    if "autobrake_best" in model_report:
        divergences["per layer"] = model_report["autobrake_best"]["divergence"]["layer"]
    return ", ".join(f"{name}: {value:.5f}" for name, value
                     in sorted(divergences.items(), key=lambda item: item[1]))


if __name__ == "__main__":
    main()
