"""Why the auto-brake loses to lambda = 1 on SmolLM2, and two end-to-end criteria (issue 23).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python bench/autobrake_e2e.py [--format nvfp4]
        [--seeds 0,1,2] [--tokens 4096] [--out bench-out/autobrake_e2e] [--validate]
        [--diagnose] [--margins 0.05,0.1,0.2] [--kfolds 4,8]

One calibration pass per (format, seed) with :class:`CachingRTN`, a subclass of the package's
RTN weight quantizer run through the unchanged ``quantize_model`` with the packaged
``rtn_kbbq_<fmt>_auto`` recipe (``--tokens`` calibration tokens, the calibration seed as
``kbbq-pl compare`` sets it).  Per layer it keeps, for every lambda of the auto grid:

* the held-out error the auto-brake scores (:func:`~kbbq_pl.transforms.autobrake.select_lambda`
  on the package's 512-token held-out sample), and the same on every held-out token;
* the transform refitted on all calibration tokens (what a fixed-lambda recipe and auto with
  ``refit`` deploy) and the transform of the fitting half only (to score candidates honestly on
  the held-out sequences), each with its static NVFP4 activation scale from the same tokens
  (all, or the fitting half).

Any per-layer assignment of lambdas is then built from the cache in seconds
(:func:`build_model`: ``QuantizedLinear.from_linear`` per layer, as the pipeline does) and
scored by KL / perplexity on the first 2,048 tokens of WikiText-2 test (context 512, stride 256,
``kbbq-pl compare``'s settings), and, for the candidates, by KL to the FP model on the held-out
*calibration* sequences (the selection signal; never the evaluation text).

Candidates (chosen from calibration data only):

* ``cand_B`` (final check): score the per-layer auto assignment and every global lambda of the
  grid, all with fitting-half transforms, by KL to the FP model on the held-out calibration
  sequences; deploy the best (refitted on all tokens).
* ``cand_A`` (margin toward the global best): ``g`` = the global lambda of best held-out
  calibration KL; per layer keep ``g`` unless another lambda's held-out output error is lower by
  more than ``--margin-a`` dB.

* ``kfold<K>`` (``--kfolds 4,8``): K-fold cross-fitting over whole sequences, emulated from
  every calibration token kept: fold ``j`` (the sequences ``s`` with ``s % K == j``) is scored
  on all its tokens with candidates fitted on the other folds, errors pooled over the folds,
  the chosen lambda refitted on all tokens (what ``autobrake.folds: K`` does in the package);
  ``kfold<K>_global``: one lambda for every layer, the smallest mean fold-pooled error (dB)
  over the layers; ``kfold<K>_sig<t>``: that global lambda, a layer leaving it only when its
  own best wins by a paired t above ``--t-move`` over the folds.

Rows are appended to ``OUT/rows.jsonl`` (resumable: a row already there is not recomputed);
per-layer errors go to ``OUT/layers-<fmt>-seed<k>.json``, the folds' errors to
``OUT/folds<K>-<fmt>-seed<k>.json``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch

from kbbq_pl.cli.compare import load_recipe
from kbbq_pl.eval.lm_metrics import lm_metrics, reference_log_probs
from kbbq_pl.formats.padding import pad_features
from kbbq_pl.io.models import load_model
from kbbq_pl.quant import pipeline
from kbbq_pl.quant import quantize_model
from kbbq_pl.quant.layers import QuantizedLinear, swap_module
from kbbq_pl.quant.modules import linear_weight
from kbbq_pl.quant.rtn.quantizer import RTN, RTNCalibration
from kbbq_pl.quant.stats import StatisticsCollector, spread_sample, transformed_amax
from kbbq_pl.quant.stats import act_scales_from_amax
from kbbq_pl.quant.w4a4 import cache_decoded_weights
from kbbq_pl.quant.weight_quantizer import LayerPlan
from kbbq_pl.transforms.autobrake import best_lambda, select_lambda, split_sequences
from kbbq_pl.formats import fake_quantize
from kbbq_pl.transforms.autobrake import quantized_output_error
from kbbq_pl.transforms.fit import kbbq_basis, transform_weight
from torch import Tensor

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def layer_type(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def layer_block(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def db(e: float) -> float:
    return 10 * math.log10(e) if e > 0 else float("-inf")


class CachingRTN(RTN):
    """RTN with ``lam="auto"`` that also keeps, per layer, every lambda's transforms and held-out
    errors (module docstring).  Deploys the package's auto choice."""

    def __init__(self, config, kfolds=(), seq_len=256):
        super().__init__(config)
        self.cache: dict[str, dict] = {}
        self.fit_batches = 0
        self.kfolds = tuple(kfolds)
        self.seq_len = seq_len

    def calibrate(self, block, keep_outputs):
        config, split, step = self.config, block.split, block.step
        keep = config.keep_samples
        if self.kfolds:  # every fitting token too (the folds' second moments)
            fit = StatisticsCollector(block.linears, config.block, split.part_tokens[0], 1)
        else:
            fit = StatisticsCollector(block.linears, config.block, keep, split.stride(keep, 0))
        with fit.hooks():
            outputs = step.run(keep_outputs, subset=split.fit_part)
        fit.check_nonempty()
        # every held-out token (stride 1); the package's 512-token sample is a subset of it
        held_out = StatisticsCollector(block.linears, config.block, split.part_tokens[1], 1)
        with held_out.hooks():
            rest = step.run(keep_outputs, subset=split.held_out_part)
        if outputs is not None and rest is not None:
            outputs += rest
        self.package_stride = split.stride(config.autobrake.tokens, 1)
        self.fit_batches = split.fit
        return RTNCalibration(fit, held_out), outputs

    def quantize(self, block, calibration):
        config = self.config
        grid = [float(g) for g in config.autobrake.grid]
        plans = {}
        for name, module in block.linears.items():
            weight = pad_features(linear_weight(module).detach(), config.fmt)
            fit, held = calibration.fit.stats[name], calibration.held_out.stats[name]
            basis_fit = kbbq_basis(weight, fit.sigma_blocks(), config.transform.damping,
                                   name=name)
            every = pad_features(held.sample(), config.fmt)
            mask = spread_sample(0, len(every), self.package_stride)
            package = every[mask][: config.autobrake.tokens]
            choice = select_lambda(weight, basis_fit, package, config.fmt, grid,
                                   config.effective_act_scale)
            errors_all = select_lambda(weight, basis_fit, every, config.fmt, grid,
                                       config.effective_act_scale).errors
            # two disjoint halves of the held-out tokens (split-half agreement)
            half = len(every) // 2
            h1 = select_lambda(weight, basis_fit, every[:half], config.fmt, grid,
                               config.effective_act_scale).errors
            h2 = select_lambda(weight, basis_fit, every[half:], config.fmt, grid,
                               config.effective_act_scale).errors
            pooled = (fit.sigma_sum + held.sigma_sum) / (fit.tokens + held.tokens)
            basis_all = kbbq_basis(weight, pooled, config.transform.damping, name=name)
            self.cache[name] = {
                "choice": choice.lam, "errors": choice.errors, "errors_all": errors_all,
                "errors_h1": h1, "errors_h2": h2, "package_tokens": len(package),
                "held_tokens": len(every),
                "T_all": {lam: basis_all.transform(lam) for lam in grid},
                "T_fit": {lam: basis_fit.transform(lam) for lam in grid},
            }
            if self.kfolds:
                x_all = pad_features(torch.cat([fit.sample(), held.sample()]), config.fmt)
                for k in self.kfolds:
                    self.cache[name][f"folds_k{k}"] = kfold_errors(
                        weight, x_all, k, self.seq_len, config, grid)
            t = self.cache[name]["T_all"][choice.lam]
            fit.samples = fit.samples[:1]  # the report's kept inputs only (memory)
            plans[name] = LayerPlan(transform=t, online=t, stats=fit, choice=choice)
        return plans


def block_moments(x: Tensor, block: int) -> Tensor:
    """``sum_t x_t x_t^T`` per diagonal block, float64 ``[D / d, d, d]``."""
    g = x.double().reshape(len(x), -1, block).transpose(0, 1)
    return g.transpose(-1, -2) @ g


def kfold_errors(weight, x_all, k, seq_len, config, grid) -> list[dict]:
    """K-fold cross-fitting over whole sequences: fold ``j`` holds the sequences ``s`` with
    ``s % k == j``; its candidates are fitted on the other folds' second moments and scored on
    its tokens.  Per fold and lambda: the squared output error and the output energy."""
    seq = torch.arange(len(x_all)) // seq_len
    total = block_moments(x_all, config.block)
    folds = []
    w = weight.float()
    for j in range(k):
        mask = seq % k == j
        xj = x_all[mask]
        rest = len(x_all) - len(xj)
        sigma = (total - block_moments(xj, config.block)) / rest
        basis = kbbq_basis(weight, sigma, config.transform.damping)
        y = xj.float() @ w.T
        energy = float(y.double().square().sum())
        row = {}
        for lam in grid:
            tr = basis.transform(lam)
            w_hat = fake_quantize(transform_weight(w, tr), config.fmt)
            rel = quantized_output_error(weight, w_hat, xj, tr, config.fmt,
                                         config.effective_act_scale, y=y)
            row[lam] = (rel * energy, energy)
        folds.append(row)
    return folds


def fold_choice(folds: list[dict], grid) -> float:
    """The lambda of the smallest pooled error over the folds (first in grid order on ties)."""
    pooled = {lam: sum(f[lam][0] for f in folds) / sum(f[lam][1] for f in folds) for lam in grid}
    return best_of(pooled)


def fold_db(folds: list[dict], lam: float) -> list[float]:
    return [db(f[lam][0] / f[lam][1]) for f in folds]


def patched_scales(quantizer: CachingRTN):
    """``pipeline._static_act_scales`` that also computes every cached lambda's scales, from
    all kept inputs and from the fitting half's."""
    original = pipeline._static_act_scales

    def scales(inputs, linears, plans, config, device, reduce_max):
        result = original(inputs, linears, plans, config, device, reduce_max)
        grid = [float(g) for g in config.autobrake.grid]
        fit_inputs = {n: v[: quantizer.fit_batches] for n, v in inputs.items()}
        for lam in grid:
            for version, kept in (("all", inputs), ("fit", fit_inputs)):
                tr = {n: quantizer.cache[n][f"T_{version}"][lam] for n in linears}
                amax = transformed_amax(kept, linears, tr, config.fmt, device)
                s = act_scales_from_amax(amax, reduce_max)
                for n in linears:
                    quantizer.cache[n].setdefault(f"S_{version}", {})[lam] = s[n]
        return result

    return original, scales


def build_model(fp_model, cache, assign: dict[str, float], version: str, fmt):
    """The FP model with every cached layer swapped for its quantized version at
    ``assign[name]`` (``version``: transforms and scales of ``all`` tokens or the ``fit``
    half)."""
    model = copy.deepcopy(fp_model)
    for name, lam in assign.items():
        module = model.get_submodule(name)
        entry = cache[name]
        layer = QuantizedLinear.from_linear(
            module, fmt, entry[f"T_{version}"][lam], act_scale="static",
            act_global_scale=entry[f"S_{version}"][lam], name=name)
        swap_module(model, name, layer)
    model.eval()
    return model


@torch.no_grad()
def heldout_kl(model, batches, fp_logprobs) -> float:
    """Mean per-token KL(FP || quantized) on the held-out calibration sequences."""
    total, count = 0.0, 0
    with cache_decoded_weights():
        for batch, ref in zip(batches, fp_logprobs):
            logits = model(**batch).logits.float()
            lp = torch.log_softmax(logits, dim=-1)
            kl = (ref.exp() * (ref - lp)).sum(-1)
            mask = batch["attention_mask"].bool()
            total += float(kl[mask].sum())
            count += int(mask.sum())
    return total / count


def best_of(errors: dict) -> float:
    keys = list(errors)
    return min(keys, key=lambda k: (errors[k], keys.index(k)))


def layers_summary(out: Path, fmt: str, seeds: list[int]) -> None:
    """Per layer type, pooled over seeds, from ``OUT/layers-<fmt>-seed<k>.json``: how many
    layers auto moves off lambda 1, by how many dB of held-out error (512 tokens, and the same
    choice re-scored on all held-out tokens), how often two disjoint halves of the held-out
    tokens pick the same lambda, and the mean held-out error of lambda 0.75 minus lambda 1."""
    from collections import defaultdict

    agg: dict = defaultdict(lambda: defaultdict(list))
    for seed in seeds:
        layers = json.loads((out / f"layers-{fmt}-seed{seed}.json").read_text())
        for name, d in layers.items():
            e, ea, h1, h2 = ({float(k): v for k, v in d[key].items()}
                             for key in ("errors", "errors_all", "errors_h1", "errors_h2"))
            c = d["choice"]
            for key in (layer_type(name), "all"):
                a = agg[key]
                a["not1"].append(c != 1.0)
                a["gain"].append(db(e[1.0]) - db(e[c]))
                a["gain_all"].append(db(ea[1.0]) - db(ea[c]))
                a["not1_all"].append(best_of(ea) != 1.0)
                a["agree"].append(best_of(h1) == best_of(h2))
                a["small"].append(c != 1.0 and db(e[1.0]) - db(e[c]) < 0.1)
                a["d075"].append(db(ea[0.75]) - db(ea[1.0]))
    print(f"{fmt}, seeds {seeds}: per layer type, pooled over seeds")
    print(f"{'type':<10}{'layers':>7}{'auto!=1':>8}{'gain dB':>9}{'same, 2048':>11}"
          f"{'!=1 @2048':>10}{'halves agree':>13}{'gain<0.1dB':>11}{'E.75-E1 dB':>11}")
    for t in (*TYPES, "all"):
        a = agg[t]
        n = len(a["not1"])
        moved = [g for g, x in zip(a["gain"], a["not1"]) if x]
        moved_all = [g for g, x in zip(a["gain_all"], a["not1"]) if x]
        print(f"{t:<10}{n:>7}{sum(a['not1']):>8}{statistics.mean(moved or [0]):9.3f}"
              f"{statistics.mean(moved_all or [0]):11.3f}{sum(a['not1_all']):>10}"
              f"{sum(a['agree']) / n:13.2f}{sum(a['small']):>11}"
              f"{statistics.mean(a['d075']):11.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--summary", action="store_true",
                        help="only print the table of OUT/rows.jsonl (no computation)")
    parser.add_argument("--layers-summary", action="store_true",
                        help="only print the per-type table of the cached per-layer errors")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--format", default="nvfp4")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--lams", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--margins", default="0.05,0.1,0.2",
                        help="diagnosis: keep lambda 1 unless another wins by more (dB)")
    parser.add_argument("--margin-a", type=float, default=0.1, help="cand_A's margin (dB)")
    parser.add_argument("--kfolds", default="",
                        help="K-fold cross-fitted selection for these K (comma-separated)")
    parser.add_argument("--t-move", type=float, default=2.0,
                        help="kfold<K>_sig: leave the global lambda only at this paired t")
    parser.add_argument("--diagnose", action="store_true",
                        help="also the per-type and per-depth substitutions")
    parser.add_argument("--validate", action="store_true",
                        help="seed 0: also run the package's own auto and lambda-1 recipes")
    parser.add_argument("--text", default=str(DATA / "wikitext2" / "test.txt"))
    parser.add_argument("--out", default="bench-out/autobrake_e2e")
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    if args.layers_summary:
        layers_summary(out, args.format, [int(s) for s in args.seeds.split(",")])
        return
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    done = {}
    if rows_path.is_file():
        for line in rows_path.read_text().splitlines():
            r = json.loads(line)
            done[(r["format"], r["seed"], r["variant"])] = r

    def record(row):
        done[(row["format"], row["seed"], row["variant"])] = row
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{row['format']} seed {row['seed']} {row['variant']:<28} "
              f"KL {row.get('kl', float('nan')):.4f} PPL {row.get('ppl', float('nan')):.3f} "
              f"heldKL {row.get('held_kl', float('nan')):.4f} "
              f"({row.get('seconds', 0):.1f} s)", flush=True)

    fmt = args.format
    window = dict(context=512, stride=256, max_tokens=2048, batch_size=4)
    if not args.summary:
        model, tokenizer = load_model(args.model, causal=True, device="cpu", quantized="refuse")
        model.eval()
        reference = reference_log_probs(model, tokenizer, args.text, **window)

    def score(m) -> dict:
        with cache_decoded_weights():
            metrics = lm_metrics(m, tokenizer, args.text, reference=reference, **window)
        return {"kl": metrics["kl"], "ppl": metrics["perplexity"]}

    for seed in [] if args.summary else [int(s) for s in args.seeds.split(",")]:
        calibration = {"n_tokens": args.tokens, "seed": seed}
        data, config, _ = load_recipe(f"rtn_kbbq_{fmt}_auto", args.model, calibration)
        # the single held-out split on 512 tokens this study diagnoses (the recipes before
        # cross-fitting); the K-fold variants are emulated from its cache
        config = dataclasses.replace(config, autobrake=dataclasses.replace(
            config.autobrake, folds=1, holdout=0.5, tokens=512))
        data.tokenizer = tokenizer
        batches = list(data.calibration_dataloader())
        if args.validate and seed == 0:
            for recipe in (f"rtn_kbbq_{fmt}_lam1", f"rtn_kbbq_{fmt}_auto"):
                variant = f"package:{recipe}"
                if (fmt, seed, variant) in done:
                    continue
                d, c, _ = load_recipe(recipe, args.model, calibration)
                d.tokenizer = tokenizer
                b = list(d.calibration_dataloader())
                cand = copy.deepcopy(model)
                start = time.perf_counter()
                report = quantize_model(cand, b, c, progress=False)
                seconds = time.perf_counter() - start
                row = {"format": fmt, "seed": seed, "variant": variant, "seconds": seconds,
                       **score(cand)}
                if report.autobrake:
                    row["choices"] = {n: ch.lam for n, ch in report.autobrake.items()}
                record(row)
                del cand

        # one calibration pass that caches everything
        kfolds = [int(k) for k in args.kfolds.split(",") if k]
        quantizer = CachingRTN(config, kfolds, seq_len=data.seq_len)
        original, patched = patched_scales(quantizer)
        auto_model = copy.deepcopy(model)
        pipeline._static_act_scales = patched
        try:
            start = time.perf_counter()
            quantize_model(auto_model, batches, config, weight_quantizer=quantizer, progress=False)
            cache_seconds = time.perf_counter() - start
        finally:
            pipeline._static_act_scales = original
        cache = quantizer.cache
        names = list(cache)
        grid = [float(g) for g in config.autobrake.grid]
        layers = {n: {k: cache[n][k] for k in ("choice", "errors", "errors_all", "errors_h1",
                                                 "errors_h2", "package_tokens", "held_tokens")}
                  for n in names}
        (out / f"layers-{fmt}-seed{seed}.json").write_text(json.dumps(layers, indent=1))
        print(f"seed {seed}: caching calibration pass {cache_seconds:.1f} s", flush=True)
        if (fmt, seed, "auto") not in done:
            record({"format": fmt, "seed": seed, "variant": "auto", "seconds": cache_seconds,
                    "choices": {n: cache[n]["choice"] for n in names}, **score(auto_model)})
        del auto_model

        # held-out calibration sequences and the FP model's log-probabilities on them
        _, held_batches = split_sequences(batches, config.autobrake.holdout,
                                          config.transform.seed)
        with torch.no_grad():
            fp_lp = [torch.log_softmax(model(**b).logits.float(), dim=-1) for b in held_batches]

        def run(variant, assign, *, version="all", test=True, held=False, extra=None):
            key = (fmt, seed, variant)
            if key in done:
                return done[key]
            start = time.perf_counter()
            row = {"format": fmt, "seed": seed, "variant": variant}
            if held:
                m = build_model(model, cache, assign, "fit", config.fmt)
                row["held_kl"] = heldout_kl(m, held_batches, fp_lp)
                del m
            row["held_seconds"] = time.perf_counter() - start
            if test:
                m = build_model(model, cache, assign, version, config.fmt)
                row.update(score(m))
                del m
            row["seconds"] = time.perf_counter() - start
            row["n_not_1"] = sum(1 for v in assign.values() if v != 1.0)
            if extra:
                row.update(extra)
            record(row)
            return row

        auto = {n: cache[n]["choice"] for n in names}
        lams = [float(x) for x in args.lams.split(",")]
        # the global lambdas: test KL (5-point table) and held-out calibration KL (whole grid)
        for lam in grid:
            run(f"lam{lam:g}", dict.fromkeys(names, lam), test=lam in lams, held=True)
        run("auto_rebuilt", auto, held=True)
        for k in kfolds:
            folds = {n: cache[n][f"folds_k{k}"] for n in names}
            (out / f"folds{k}-{fmt}-seed{seed}.json").write_text(json.dumps(folds))
            per_layer = {n: fold_choice(folds[n], grid) for n in names}
            run(f"kfold{k}", per_layer)
            mean_db = {lam: statistics.mean(statistics.mean(fold_db(folds[n], lam))
                                            for n in names) for lam in grid}
            g = best_of(mean_db)
            run(f"kfold{k}_global", dict.fromkeys(names, g), extra={"global": g})
            assign = {}
            for n in names:
                best = per_layer[n]
                gain = [a - b for a, b in zip(fold_db(folds[n], g), fold_db(folds[n], best))]
                se = statistics.stdev(gain) / math.sqrt(len(gain)) if len(gain) > 1 else 0.0
                t = statistics.mean(gain) / se if se > 0 else 0.0
                assign[n] = best if best != g and t > args.t_move else g
            run(f"kfold{k}_sig{args.t_move:g}", assign, extra={"global": g})
        auto_all = {n: best_lambda(cache[n]["errors_all"]).lam for n in names}
        run("auto_all_heldout_tokens", auto_all)
        for m in [float(x) for x in args.margins.split(",") if x]:
            assign = {}
            for n in names:
                e = cache[n]["errors"]
                assign[n] = cache[n]["choice"] if db(e[1.0]) - db(e[cache[n]["choice"]]) > m \
                    else 1.0
            run(f"margin_to_1_{m:g}dB", assign)
        if args.diagnose:
            for t in TYPES:
                run(f"lam1_but_{t}_auto", {n: auto[n] if layer_type(n) == t else 1.0
                                           for n in names})
            blocks = sorted({layer_block(n) for n in names})
            mid = blocks[len(blocks) // 2]
            run("lam1_but_blocks_lt_mid_auto",
                {n: auto[n] if layer_block(n) < mid else 1.0 for n in names})
            run("lam1_but_blocks_ge_mid_auto",
                {n: auto[n] if layer_block(n) >= mid else 1.0 for n in names})
            run("auto_fit_half_T", auto, version="fit")
            run("lam1_fit_half_T", dict.fromkeys(names, 1.0), version="fit")

        # the candidates, from calibration data only; cost = the held-out scoring of the grid
        # and of the auto assignment (the test scoring is not part of it)
        held = {lam: done[(fmt, seed, f"lam{lam:g}")]["held_kl"] for lam in grid}
        held_auto = done[(fmt, seed, "auto_rebuilt")]["held_kl"]
        cost = sum(done[(fmt, seed, f"lam{lam:g}")]["held_seconds"] for lam in grid) \
            + done[(fmt, seed, "auto_rebuilt")]["held_seconds"]
        g = min(grid, key=lambda lam: (held[lam], -lam))
        if held_auto < held[g]:
            run("cand_B", auto, extra={"picked": "auto", "held_kl_picked": held_auto,
                                       "select_seconds": cost})
        else:
            run("cand_B", dict.fromkeys(names, g),
                extra={"picked": f"lam{g:g}", "held_kl_picked": held[g], "select_seconds": cost})
        assign = {}
        for n in names:
            e = cache[n]["errors"]
            best = cache[n]["choice"]
            assign[n] = best if db(e[g]) - db(e[best]) > args.margin_a else g
        cost_a = sum(done[(fmt, seed, f"lam{lam:g}")]["held_seconds"] for lam in grid)
        run(f"cand_A_{args.margin_a:g}dB", assign,
            extra={"global": g, "select_seconds": cost_a})

    # summary
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = list(dict.fromkeys(v for (f, s, v) in done if f == fmt))
    print(f"\n{args.model} {fmt} RTN, {args.tokens} calibration tokens; KL / PPL on the first "
          f"2048 tokens of {args.text}")
    print(f"{'variant':<30}" + "".join(f"{'seed ' + str(s):>12}" for s in seeds)
          + f"{'mean KL':>10}{'mean PPL':>10}{'heldKL':>9}{'not 1':>7}")
    for v in variants:
        rows = [done.get((fmt, s, v)) for s in seeds]
        if any(r is None or "kl" not in r for r in rows):
            if all(r is not None for r in rows) and all("held_kl" in r for r in rows):
                print(f"{v:<30}" + "".join(f"{'':>12}" for _ in seeds) + f"{'':>20}"
                      f"{statistics.mean(r['held_kl'] for r in rows):9.4f}")
            continue
        held_kl = [r.get("held_kl") for r in rows]
        print(f"{v:<30}" + "".join(f"{r['kl']:12.4f}" for r in rows)
              + f"{statistics.mean(r['kl'] for r in rows):10.4f}"
              + f"{statistics.mean(r['ppl'] for r in rows):10.3f}"
              + (f"{statistics.mean(held_kl):9.4f}" if None not in held_kl else f"{'':>9}")
              + f"{statistics.mean(r.get('n_not_1', 0) for r in rows):7.0f}")


if __name__ == "__main__":
    main()
