"""``kbbq-pl compare``: one model, several recipes, the paper's Table w4a4.

:func:`run_compare` loads the full-precision model once, scores it (the FP row), then for each
recipe (a packaged name such as ``rtn_kbbq_nvfp4_lam0.75`` or a YAML file) calibrates and
quantizes a copy, and scores that on the same text and tasks:

* ``ppl``: rolling-window perplexity on ``text`` (``context`` tokens read, ``stride`` scored
  per window, the first ``max_tokens`` tokens), and ``kl``: the mean KL divergence of the
  quantized model's next-token distributions from the FP model's on the same windows
  (:mod:`kbbq_pl.eval.lm_metrics`; the FP log-probabilities are computed once);
* lm-eval tasks (:mod:`kbbq_pl.eval.benchmarks`) at ``limit`` documents each.

The table has one row per recipe: format, method, perplexity, KL, each task (percent),
``Average`` (the mean of the tasks) and ``Recovery`` (Average as a percentage of the FP row's),
as the paper's Table w4a4.  ``output_dir`` gets ``rows/<name>.json`` as each row finishes (a
resumed run, ``resume=True``, reuses every row whose settings are unchanged and computes the
rest), then ``compare.json``, ``compare.md`` and ``compare.png`` (recovery and KL per method,
one bar per format).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..eval.report_files import markdown_table
from ..io.fileio import add_resumable_file, open_resumable_folder

log = logging.getLogger(__name__)

TABLE_METHODS = ("i_{f}", "haar_{f}", "rtn_wush_{f}", "rtn_kbbq_{f}_lam0.75", "rtn_kbbq_{f}_auto",
                 "gptq_{f}", "mr_gptq_{f}", "gptq_wush_{f}", "gptq_kbbq_{f}")
"""The packaged recipes of the paper's table, per format ``{f}``."""
LM_TASKS = ("ppl", "kl")
FP_ROW = "fp"


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
    from .quantize import _parser, check_recipe_shape, resolve_recipes

    argv = resolve_recipes(["--config", name])  # an unknown name: the closest packaged ones
    check_recipe_shape(argv)
    argv += ["--model", model]
    for key, value in calibration.items():
        argv += [f"--data.init_args.{key}", str(value)]
    parser = _parser("kbbq-pl compare")
    args = parser.instantiate(parser.parse_args(argv))
    return args.data, args.recipe, Path(argv[1]).stem


class Scorer:
    """Scores a causal LM on the comparison's text and tasks; holds the FP log-probabilities."""

    def __init__(self, fp_model: torch.nn.Module, tokenizer: Any, *, tasks: Sequence[str],
                 text: Path, context: int, stride: int, max_tokens: int | None,
                 limit: int | float | None, data_dir: str | Path, batch_size: int,
                 cache_dir: str | Path | None) -> None:
        from ..eval.lm_metrics import reference_log_probs

        self.tokenizer = tokenizer
        self.tasks = list(tasks)
        self.benchmarks = [t for t in self.tasks if t not in LM_TASKS]
        self.window = dict(context=context, stride=stride, max_tokens=max_tokens)
        self.text = text
        self.limit, self.data_dir = limit, data_dir
        self.batch_size, self.cache_dir = batch_size, cache_dir
        self.reference = None
        if "kl" in self.tasks:
            self.reference = reference_log_probs(fp_model, tokenizer, text, **self.window,
                                                 batch_size=batch_size)

    def settings(self) -> dict[str, Any]:
        return {"tasks": self.tasks, "text": str(self.text), **self.window,
                "limit": self.limit, "data_dir": str(self.data_dir)}

    def score(self, model: torch.nn.Module) -> dict[str, Any]:
        from ..eval.benchmarks import run_benchmarks
        from ..eval.lm_metrics import lm_metrics
        from ..quant.w4a4 import cache_decoded_weights

        row: dict[str, Any] = {}
        with cache_decoded_weights():
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
    """The paper's Table w4a4 shape: Format, Method, perplexity, KL, tasks, Average,
    Recovery."""
    benchmarks = [t for t in tasks if t not in LM_TASKS]
    header = ["Format", "Method", *(["PPL"] if "ppl" in tasks else []),
              *(["KL"] if "kl" in tasks else []), *benchmarks, "Average", "Recovery"]
    body = []
    for row in rows:
        body.append([row["format"], row["method"],
                     *([row.get("perplexity")] if "ppl" in tasks else []),
                     *([row.get("kl")] if "kl" in tasks else []),
                     *[row.get("tasks", {}).get(t) for t in benchmarks],
                     row.get("average"),
                     None if row.get("recovery") is None else f"{row['recovery']:.1f}%"])
    return markdown_table(header, body, 3)


def compare_plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Recovery (or, without tasks, KL) per method, one bar per format."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quantized = [r for r in rows if r["name"] != FP_ROW]
    key, label = (("recovery", "Recovery (% of FP task average)")
                  if any(r.get("recovery") is not None for r in quantized)
                  else ("kl", "mean KL to FP (nats/token)"))
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
    tasks: Sequence[str] = ("ppl", "kl"), text: str | Path | None = None,
    context: int = 512, stride: int = 256, max_tokens: int | None = 2048,
    limit: int | float | None = None, data_dir: str | Path = "../shared/data",
    calibration: dict[str, Any] | None = None, batch_size: int = 4,
    cache_dir: str | Path | None = None, device: str = "cpu", resume: bool = False,
    overwrite: bool = False, progress: bool = True,
) -> tuple[Path, list[dict[str, Any]]]:
    """Quantize ``model_name`` with every recipe, score each (and the FP model), and write the
    table; see the module documentation.  ``text`` defaults to
    :func:`kbbq_pl.eval.lm_metrics.default_text` of ``data_dir``; it and the benchmark data
    are checked before anything is loaded.  Returns the output folder and the rows."""
    from tqdm.auto import tqdm

    from ..eval.benchmarks import check_data
    from ..eval.lm_metrics import default_text
    from ..io.models import load_model, parse_device, resolve_model_path
    from ..quant import quantize_model

    device_ = parse_device(device)
    text = default_text(data_dir) if text is None else Path(text)
    if any(t in LM_TASKS for t in tasks) and not text.is_file():
        raise FileNotFoundError(f"--tasks ppl/kl score the text file {text}, which does not "
                                "exist; pass --text FILE")
    check_data([t for t in tasks if t not in LM_TASKS], data_dir, option="--data-dir")
    if not recipes:
        raise ValueError("no recipes to compare")
    calibration = dict(calibration or {})
    loaded = [load_recipe(name, model_name, calibration) for name in recipes]  # fail early
    names = [stem for _, _, stem in loaded]
    if len(set(names)) != len(names):
        raise ValueError(f"recipes named twice: {names}")
    source = resolve_model_path(model_name)
    out = open_resumable_folder(output_dir, kind="compare", resume=resume, overwrite=overwrite,
                                sources=[source])
    model, tokenizer = load_model(model_name, causal=True, device=device_, quantized="refuse")
    if tokenizer is None:
        raise ValueError(f"{model_name}: no tokenizer in the model folder")
    start = time.perf_counter()
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
                           json.dumps(row, indent=2, default=str) + "\n")
        return row

    fp = cached(FP_ROW, common)
    if fp is None:
        begin = time.perf_counter()
        fp = {"name": FP_ROW, "format": "fp32", "method": "FP", "label": "full precision",
              **scorer.score(model)}
        fp["seconds"] = {"eval": time.perf_counter() - begin}
        store(fp, common)
    rows = [fp]
    durations: list[float] = []
    bar = tqdm(list(zip(recipes, loaded)), desc="compare", disable=not progress, unit="recipe")
    for index, (name, (data, config, stem)) in enumerate(bar):
        data.tokenizer = tokenizer
        data.for_model(model)
        settings = {**common, "recipe": config.to_dict(),
                    "calibration": {"source": str(data.source), "n_tokens": data.n_tokens,
                                    "seq_len": data.seq_len, "seed": data.seed,
                                    "packing": data.packing}}
        row = cached(stem, settings)
        if row is None:
            begin = time.perf_counter()
            batches = [{k: v.to(device_) if isinstance(v, torch.Tensor) else v
                        for k, v in batch.items()} for batch in data.calibration_dataloader()]
            candidate = copy.deepcopy(model)
            report = quantize_model(candidate, batches, config, progress=False)
            quantized_at = time.perf_counter()
            lam = config.transform.lam
            row = {"name": stem, "format": config.format.name, "method": config.method
                   + (" auto" if config.auto else (f" ({float(lam):g})"
                                                    if config.transform.name == "kbbq" else "")),
                   "label": config.label, **scorer.score(candidate),
                   "summary": report.summary(), "calibration": settings["calibration"]}
            if report.autobrake:  # how many layers chose each lambda
                lams = [choice.lam for choice in report.autobrake.values()]
                row["auto_lambdas"] = {f"{lam:g}": lams.count(lam) for lam in sorted(set(lams))}
            if "autobrake_model" in report.model:  # scope model / best: the lambda, the
                # trials' held-out divergences, which model best kept, and the runs' times
                row["autobrake_model"] = {k: v for k, v in report.model["autobrake_model"].items()
                                          if k != "layer_choices"}
                row["autobrake_seconds"] = {k: v for k, v in report.seconds.items()
                                            if k.startswith("autobrake_")}
            if "autobrake_best" in report.model:
                row["autobrake_best"] = report.model["autobrake_best"]
            row["seconds"] = {"quantize": quantized_at - begin,
                              "eval": time.perf_counter() - quantized_at}
            store(row, settings)
            del candidate
            durations.append(sum(row["seconds"].values()))
            remaining = len(recipes) - index - 1
            eta = remaining * sum(durations) / len(durations)
            bar.set_postfix_str(f"about {eta / 60:.0f} min left")
        rows.append(row)
        shown = " ".join(f"{k} {row[k]:.4g}" for k in ("perplexity", "kl", "average")
                         if row.get(k) is not None)
        bar.write(f"{row['label']:<32} {shown}  ({sum(row['seconds'].values()):.0f} s)")
    for row in rows:
        row["recovery"] = recovery(row.get("average"), fp.get("average"))
    table = compare_markdown(rows, tasks)
    window = (f"perplexity and KL: {text}, first {max_tokens or 'all'} tokens, context "
              f"{context}, stride {stride}" if any(t in LM_TASKS for t in tasks) else "")
    header = (f"# kbbq-pl compare: {model_name}\n\n{window}"
              f"{'; ' if window and scorer.benchmarks else ''}"
              + (f"tasks at --limit {limit}" if scorer.benchmarks else "") + "\n\n")
    seconds = time.perf_counter() - start
    document = {"model": str(model_name), "settings": common, "rows": rows,
                "seconds": seconds}
    add_resumable_file(out, "compare.json", json.dumps(document, indent=2, default=str) + "\n")
    add_resumable_file(out, "compare.md", header + table + "\n")
    add_resumable_file(out, "compare.png", lambda path: compare_plot(rows, path))
    return out, rows
