"""``kbbq-pl compare``: one model, several recipes side by side (the paper's Table w4a4), and
sweeps of the brake.

:func:`run_compare` loads the full-precision model once, scores it (the FP row), then for each
recipe (a packaged name such as ``rtn_kbbq_nvfp4_lam0.75`` or a YAML file; with ``lams``, every
fixed-lambda KBBQ recipe once per lambda) calibrates and quantizes a copy, and scores that on
the same text and tasks:

* ``ppl``: rolling-window perplexity on ``text`` (``context`` tokens read, ``stride`` scored
  per window, the first ``max_tokens`` tokens), and ``kl``: the mean KL divergence of the
  quantized model's next-token distributions from the FP model's on the same windows
  (:mod:`kbbq_pl.eval.lm_metrics`; the FP log-probabilities are computed once): causal LMs;
* ``fidelity``: the mean cosine of the mean-pooled last hidden states to the FP model's on
  sentences (any model; an encoder's sentence embeddings);
* lm-eval tasks (:mod:`kbbq_pl.eval.tasks`) at ``limit`` documents each.

The table has one row per recipe: format, method, perplexity, KL, fidelity, each task
(percent), ``Average`` (the mean of the tasks) and ``Recovery`` (Average as a percentage of the
FP row's), as the paper's Table w4a4.  ``output_dir`` gets ``rows/<name>.json`` as each row
finishes (a resumed run, ``resume=True``, reuses every row whose settings are unchanged and
computes the rest), then ``compare.json``, ``compare.md`` and ``compare.png``.  With
``save_closest`` the quantized model closest to full precision (smallest KL, else highest
fidelity, else lowest perplexity) is written there as a checkpoint: choosing one lambda for a
whole model is such a sweep, scored on text held out from the calibration.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..eval.report_files import markdown_table, report_files
from ..io.fileio import add_resumable_file, check_output, json_text, open_resumable_folder

log = logging.getLogger(__name__)

TABLE_METHODS = ("i_{f}", "haar_{f}", "rtn_wush_{f}", "rtn_kbbq_{f}_lam0.75", "rtn_kbbq_{f}_auto",
                 "gptq_{f}", "mr_gptq_{f}", "gptq_wush_{f}", "gptq_kbbq_{f}")
"""The packaged recipes of the paper's table, per format ``{f}``."""
LM_TASKS = ("ppl", "kl")
FIDELITY = "fidelity"
FP_ROW = "fp"


def default_tasks(model_name: str, trust_remote_code: bool = False) -> list[str]:
    """``ppl,kl`` for a causal LM, ``fidelity`` for any other model (an encoder)."""
    from ..io.checkpoint import is_causal_lm_config, model_config
    from ..io.models import resolve_model_path

    config = model_config(resolve_model_path(model_name), trust_remote_code)
    return list(LM_TASKS) if is_causal_lm_config(config) else [FIDELITY]


def lambda_variants(name: str, config: Any, lams: Sequence[float]) -> list[tuple[str, Any]]:
    """``(name, recipe)`` of ``config`` once per lambda of ``lams`` where it is a KBBQ recipe
    with a fixed lambda (``rtn_kbbq_nvfp4_lam0.75`` -> ``rtn_kbbq_nvfp4_lam0.5``, ...), else
    ``config`` itself."""
    if not lams or config.transform.name != "kbbq" or config.auto:
        return [(name, config)]
    stem = re.sub(r"_lam[0-9.]+$", "", name)
    return [(f"{stem}_lam{lam:g}", replace(config, transform=replace(config.transform, lam=lam)))
            for lam in lams]


def closeness(row: dict[str, Any]) -> tuple[float, float, float]:
    """A row's distance from full precision, smaller is closer: its KL, else its negated
    fidelity, else its perplexity (whichever was scored first in that order)."""
    inf = float("inf")
    kl, fidelity, ppl = row.get("kl"), row.get("fidelity"), row.get("perplexity")
    return (inf if kl is None else kl, inf if fidelity is None else -fidelity,
            inf if ppl is None else ppl)


def table_recipes(formats: Sequence[str] = ("nvfp4", "mxfp4")) -> list[str]:
    """The packaged recipe names of the paper's table for ``formats``, format by format."""
    return [name.format(f=fmt) for fmt in formats for name in TABLE_METHODS]


def recovery(average: float | None, fp_average: float | None) -> float | None:
    """The paper's Recovery: a row's task average as a percentage of the FP row's."""
    if average is None or not fp_average:
        return None
    return 100.0 * average / fp_average


def task_average(scores: dict[str, float]) -> float | None:
    """The mean of the task scores (percent); None without tasks."""
    return sum(scores.values()) / len(scores) if scores else None


def _digest(document: Any) -> str:
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


def load_recipe(name: str, model: str, calibration: dict[str, Any]) -> tuple[Any, Any, str]:
    """``(data module, QuantizationConfig, recipe name)`` of a packaged recipe name or YAML
    file, with the calibration fields of ``calibration`` (``source``, ``n_tokens``, ...)
    overriding the recipe's."""
    from .quantize import _parser, resolve_recipes

    argv = resolve_recipes(["--config", name])  # an unknown name: the closest packaged ones
    argv += ["--model", model]
    for key, value in calibration.items():
        argv += [f"--data.init_args.{key}", str(value)]
    parser = _parser("kbbq-pl compare")
    args = parser.instantiate(parser.parse_args(argv))
    return args.data, args.recipe, Path(argv[1]).stem


class Scorer:
    """Scores a model on the comparison's text and tasks; holds the FP model's log-probabilities
    (``kl``) and embeddings (``fidelity``)."""

    def __init__(self, fp_model: torch.nn.Module, tokenizer: Any, *, tasks: Sequence[str],
                 text: Path, context: int, stride: int, max_tokens: int | None,
                 limit: int | float | None, data_dir: str | Path, batch_size: int,
                 cache_dir: str | Path | None) -> None:
        from ..eval.lm_metrics import reference_log_probs
        from .quantize import FidelityProbe

        self.tokenizer = tokenizer
        self.tasks = list(tasks)
        self.benchmarks = [t for t in self.tasks if t not in (*LM_TASKS, FIDELITY)]
        self.fidelity = (FidelityProbe(fp_model, tokenizer, None, None) if FIDELITY in self.tasks
                         else None)
        self.window = dict(context=context, stride=stride, max_tokens=max_tokens)
        self.text = text
        self.limit, self.data_dir = limit, data_dir
        self.batch_size, self.cache_dir = batch_size, cache_dir
        self.reference = None
        if "kl" in self.tasks:
            self.reference = reference_log_probs(fp_model, tokenizer, text, **self.window,
                                                 batch_size=batch_size)

    def settings(self) -> dict[str, Any]:
        """What a row's scores depend on (``--resume`` reuses a row only under the same): the
        text by its content too, since a file of the same name may have changed."""
        text = {"text": str(self.text)}
        if any(task in LM_TASKS for task in self.tasks) and self.text.is_file():
            text["text_sha256"] = hashlib.sha256(self.text.read_bytes()).hexdigest()
        return {"tasks": self.tasks, **text, **self.window,
                "limit": self.limit, "data_dir": str(self.data_dir)}

    def score(self, model: torch.nn.Module) -> dict[str, Any]:
        from ..eval.lm_metrics import lm_metrics
        from ..eval.tasks import run_benchmarks
        from ..quant.w4a4 import cache_decoded_weights

        row: dict[str, Any] = {}
        with cache_decoded_weights():
            if self.fidelity is not None:
                measured = self.fidelity.measure(model)
                row["fidelity"] = measured["fidelity_mean_cosine"]
                row["fidelity_min"] = measured["fidelity_min_cosine"]
            if any(t in LM_TASKS for t in self.tasks):
                metrics = lm_metrics(model, self.tokenizer, self.text, reference=self.reference,
                                     **self.window, batch_size=self.batch_size)
                row["perplexity"] = metrics["perplexity"] if "ppl" in self.tasks else None
                row["kl"] = metrics["kl"]
                row["kl_max"] = metrics["kl_max"]  # the worst position: outliers show here
                row["scored_tokens"] = metrics["n_tokens"]
            if self.benchmarks:
                results = run_benchmarks(model, self.tokenizer, self.benchmarks,
                                         limit=self.limit, data_dir=self.data_dir,
                                         batch_size=self.batch_size, cache_dir=self.cache_dir)
                row["tasks"] = {t: 100.0 * results[t]["score"] for t in self.benchmarks}
                row["task_metrics"] = {t: results[t]["metric"] for t in self.benchmarks}
                row["task_docs"] = {t: results[t]["n_docs"] for t in self.benchmarks}
        row["average"] = task_average(row.get("tasks", {}))
        return row


def compare_markdown(rows: Sequence[dict[str, Any]], tasks: Sequence[str]) -> str:
    """The paper's Table w4a4 shape: Format, Method, perplexity, KL, fidelity, tasks, Average,
    Recovery."""
    benchmarks = [t for t in tasks if t not in (*LM_TASKS, FIDELITY)]
    header = ["Format", "Method", *(["PPL"] if "ppl" in tasks else []),
              *(["KL"] if "kl" in tasks else []), *(["Fidelity"] if FIDELITY in tasks else []),
              *benchmarks, "Average", "Recovery"]
    body = []
    for row in rows:
        body.append([row["format"], row["method"],
                     *([row.get("perplexity")] if "ppl" in tasks else []),
                     *([row.get("kl")] if "kl" in tasks else []),
                     *([row.get("fidelity")] if FIDELITY in tasks else []),
                     *[row.get("tasks", {}).get(t) for t in benchmarks],
                     row.get("average"),
                     None if row.get("recovery") is None else f"{row['recovery']:.1f}%"])
    return markdown_table(header, body, 4 if FIDELITY in tasks else 3)


def compare_plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Recovery (or, without tasks, KL) per method, one bar per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quantized = [r for r in rows if r["name"] != FP_ROW]
    if any(r.get("recovery") is not None for r in quantized):
        key, label = "recovery", "Recovery (% of FP task average)"
    elif any(r.get("kl") is not None for r in quantized):
        key, label = "kl", "mean KL to FP (nats/token)"
    elif any(r.get("fidelity") is not None for r in quantized):
        key, label = "fidelity", "fidelity (mean cosine to FP)"
    else:
        key, label = "perplexity", "perplexity"
    methods = list(dict.fromkeys(r["method"] for r in quantized))
    formats = list(dict.fromkeys(r["format"] for r in quantized))
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(methods) + 2), 4))
    width = 0.8 / max(1, len(formats))
    for index, fmt in enumerate(formats):
        values = [next((r.get(key) for r in quantized
                        if r["method"] == m and r["format"] == fmt), None) for m in methods]
        xs = [i + index * width for i, v in enumerate(values) if v is not None]
        axis.bar(xs, [v for v in values if v is not None], width, label=fmt)
    axis.set_xticks([i + width * (len(formats) - 1) / 2 for i in range(len(methods))])
    axis.set_xticklabels(methods, rotation=30, ha="right")
    axis.set_ylabel(label)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120, format="png")
    plt.close(figure)


def run_compare(
    model_name: str, recipes: Sequence[str], output_dir: str | Path, *,
    tasks: Sequence[str] | None = None, text: str | Path | None = None,
    context: int | None = None, stride: int | None = None, max_tokens: int | None = 2048,
    limit: int | float | None = None, data_dir: str | Path = "../shared/data",
    calibration: dict[str, Any] | None = None, lams: Sequence[float] = (),
    batch_size: int = 4, cache_dir: str | Path | None = None, device: str = "cpu",
    resume: bool = False, overwrite: bool = False, progress: bool = True,
    save_closest: str | Path | None = None, trust_remote_code: bool = False,
) -> tuple[Path, list[dict[str, Any]]]:
    """Quantize ``model_name`` with every recipe (with ``lams``, every fixed-lambda KBBQ recipe
    once per lambda), score each (and the FP model), and write the table; with
    ``save_closest``, write the model closest to full precision there; see the module
    documentation.  ``tasks`` default to :func:`default_tasks`; ``text`` to
    :func:`kbbq_pl.eval.lm_metrics.default_text` of ``data_dir``; it, the benchmark data and the
    output folders are checked before anything is loaded; ``trust_remote_code`` runs a folder's
    own model code.  Returns the output folder and the rows."""
    from tqdm.auto import tqdm

    from ..eval.evaluation import default_window
    from ..eval.lm_metrics import default_text
    from ..eval.tasks import check_data
    from ..io.checkpoint import is_causal_model, save_quantized
    from ..io.models import load_model, parse_device, resolve_model_path
    from ..quant import quantize_model
    from .quantize import calibration_batches, settle_data

    device_ = parse_device(device)
    tasks = list(tasks) if tasks else default_tasks(model_name, trust_remote_code)
    text = default_text(data_dir) if text is None else Path(text)
    if any(t in LM_TASKS for t in tasks) and not text.is_file():
        raise FileNotFoundError(f"--tasks ppl/kl score the text file {text}, which does not "
                                "exist; pass --text FILE")
    benchmarks = [t for t in tasks if t not in (*LM_TASKS, FIDELITY)]
    check_data(benchmarks, data_dir, option="--data-dir")
    if not recipes:
        raise ValueError("no recipes to compare")
    if any(not 0.0 <= lam <= 1.0 for lam in lams):
        raise ValueError(f"--lams are lambdas in [0, 1], got {list(lams)}")
    calibration = dict(calibration or {})
    runs = [variant for name in recipes  # every recipe is read before any work: fail early
            for data, config, stem in [load_recipe(name, model_name, calibration)]
            for variant in [(variant_name, data, variant_config) for variant_name, variant_config
                            in lambda_variants(stem, config, lams)]]
    names = [name for name, _, _ in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"recipes named twice: {names}")
    source = resolve_model_path(model_name)
    closest_dir = None if save_closest is None else check_output(
        save_closest, overwrite=overwrite, sources=[source])
    out = open_resumable_folder(output_dir, kind="compare", resume=resume, overwrite=overwrite,
                                sources=[source])
    model, tokenizer = load_model(model_name, device=device_, quantized="refuse",
                                  trust_remote_code=trust_remote_code)
    scores_tokens = bool(benchmarks) or any(t in LM_TASKS for t in tasks)
    if scores_tokens and not is_causal_model(model):
        raise ValueError(f"{model_name} is not a causal language model: ppl, kl and the "
                         f"benchmarks score next tokens; compare it with --tasks {FIDELITY}")
    if scores_tokens and tokenizer is None:
        raise ValueError(f"{model_name}: no tokenizer in the model folder (ppl, kl and the "
                         f"benchmarks read text; --tasks {FIDELITY} runs on random tokens)")
    start = time.perf_counter()
    context, stride = default_window(model, context, stride)
    scorer = Scorer(model, tokenizer, tasks=tasks, text=text, context=context, stride=stride,
                    max_tokens=max_tokens, limit=limit, data_dir=data_dir,
                    batch_size=batch_size, cache_dir=cache_dir)
    common = {"model": str(model_name), **scorer.settings()}

    def cached(name: str, settings: dict[str, Any]) -> dict[str, Any] | None:
        path = out / "rows" / f"{name}.json"
        if not path.is_file():
            return None
        row = json.loads(path.read_text(encoding="utf-8"))
        return row if row.get("settings_digest") == _digest(settings) else None

    def store(row: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
        row["settings_digest"] = _digest(settings)
        add_resumable_file(out, f"rows/{row['name']}.json",
                           json_text(row))
        return row

    def quantized(data: Any, config: Any) -> tuple[torch.nn.Module, Any]:
        batches = calibration_batches(data, model, tokenizer, device_, model_name)
        candidate = copy.deepcopy(model)
        return candidate, quantize_model(candidate, batches, config, progress=False)

    fp = cached(FP_ROW, common)
    if fp is None:
        begin = time.perf_counter()
        fp = {"name": FP_ROW, "format": str(model.dtype).removeprefix("torch."),
              "method": "FP", "label": "full precision", **scorer.score(model)}
        fp["seconds"] = {"eval": time.perf_counter() - begin}
        store(fp, common)
    rows = [fp]
    durations: list[float] = []
    closest: tuple[str, torch.nn.Module, Any] | None = None  # the closest row computed here
    bar = tqdm(runs, desc="compare", disable=not progress, unit="recipe")
    for index, (stem, data, config) in enumerate(bar):
        settle_data(data, model, tokenizer, model_name)
        settings = {**common, "recipe": config.to_dict(),
                    "calibration": {"source": str(data.source), "n_tokens": data.n_tokens,
                                    "seq_len": data.seq_len, "seed": data.seed,
                                    "packing": data.packing, "text_key": data.text_key,
                                    **({"streaming": True} if data.streaming else {})}}
        row = cached(stem, settings)
        if row is None:
            begin = time.perf_counter()
            candidate, report = quantized(data, config)
            quantized_at = time.perf_counter()
            lam = config.transform.lam
            row = {"name": stem, "format": config.format.name, "method": config.method
                   + (" auto" if config.auto else (f" ({float(lam):g})"
                                                    if config.transform.name == "kbbq" else "")),
                   "label": config.label, **scorer.score(candidate),
                   "summary": report.summary(), "calibration": settings["calibration"]}
            if report.autobrake:  # how many layers chose each lambda
                lams_chosen = [choice.lam for choice in report.autobrake.values()]
                row["auto_lambdas"] = {f"{lam:g}": lams_chosen.count(lam)
                                       for lam in sorted(set(lams_chosen))}
            row["seconds"] = {"quantize": quantized_at - begin,
                              "eval": time.perf_counter() - quantized_at}
            store(row, settings)
            if closest_dir is not None and (closest is None or closeness(row) < closeness(
                    next(r for r in rows if r["name"] == closest[0]))):
                closest = (stem, candidate, report)
            del candidate
            durations.append(sum(row["seconds"].values()))
            remaining = len(runs) - index - 1
            eta = remaining * sum(durations) / len(durations)
            bar.set_postfix_str(f"about {eta / 60:.0f} min left")
        rows.append(row)
        shown = " ".join(f"{k} {row[k]:.4g}" for k in ("perplexity", "kl", "fidelity", "average")
                         if row.get(k) is not None)
        bar.write(f"{row['label']:<32} {shown}  ({sum(row['seconds'].values()):.0f} s)")
    for row in rows:
        row["recovery"] = recovery(row.get("average"), fp.get("average"))
    table = compare_markdown(rows, tasks)
    window = (f"perplexity and KL: {text}, first {max_tokens or 'all'} tokens, context "
              f"{context}, stride {stride}" if any(t in LM_TASKS for t in tasks) else "")
    scored = [window, f"tasks at --limit {limit}" if scorer.benchmarks else "",
              f"fidelity on {scorer.fidelity.source}" if scorer.fidelity is not None else ""]
    what = "; ".join(part for part in scored if part)
    header = f"# kbbq-pl compare: {model_name}\n\n" + (f"{what}\n\n" if what else "")
    document = {"model": str(model_name), "settings": common, "rows": rows}
    if closest_dir is not None:
        best = min(rows[1:], key=closeness)
        if closest is None or closest[0] != best["name"]:  # a resumed row: quantized again
            stem, data, config = next(run for run in runs if run[0] == best["name"])
            closest = (stem, *quantized(data, config))
        stem, candidate, report = closest
        _, data, config = next(run for run in runs if run[0] == stem)
        report.model.update({k: best[k] for k in ("perplexity", "kl", "fidelity")
                             if best.get(k) is not None}, model=str(model_name))
        save_quantized(candidate, closest_dir, tokenizer=tokenizer,
                       recipe={"config": config.to_dict(), "model": str(model_name)},
                       source_dir=source, overwrite=overwrite, extra_files=report_files(report))
        document["closest"] = {"name": stem, "folder": str(closest_dir)}
        header += f"Closest to full precision: **{best['label']}** (`{stem}`), written to " \
                  f"{closest_dir}\n\n"
    document["seconds"] = time.perf_counter() - start
    add_resumable_file(out, "compare.json", json_text(document))
    add_resumable_file(out, "compare.md", header + table + "\n")
    add_resumable_file(out, "compare.png", lambda path: compare_plot(rows, path))
    return out, rows
