"""The quantization report: ``report.json`` (everything) and ``report.md`` (for people)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .autobrake import choice_histogram
from .fileio import atomic_write_text
from .quantize import QuantizationReport


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "n/a"
        if abs(value) >= 10 ** -digits or value == 0:
            return f"{value:.{digits}f}"
        return f"{value:.2e}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(_number(v, digits) for v in row) + " |")
    return "\n".join(lines)


def report_markdown(report: QuantizationReport, title: str = "kbbq-pl quantization report") -> str:
    """The report as Markdown: recipe, model-level fidelity, summary and one row per layer."""
    config = report.config
    method = {"identity": "I", "haar": "HAAR", "hadamard": "RTN-HADAMARD", "wush": "RTN-WUSH",
              "kbbq": "RTN-KBBQ"}.get(config.get("transform"), config.get("transform"))
    brake = f", lambda = {config['lam']}" if config.get("transform") == "kbbq" else ""
    if config.get("lam") == "auto" and config.get("transform") == "kbbq":
        brake = (f", lambda chosen per layer from {config['auto_grid']} on "
                 f"{config['auto_holdout']:.0%} held-out calibration sequences")
    parts = [f"# {title}", "",
             f"**{method}**, {config.get('format')}{brake}, activations: "
             f"{config.get('act_scale')} per-tensor scale", ""]
    if report.model:
        parts += ["## Model", "", markdown_table(["metric", "value"],
                                                 [[k, v] for k, v in report.model.items()], 4), ""]
    summary = report.summary()
    parts += ["## Summary", "", markdown_table(["statistic", "value"],
                                               [[k, v] for k, v in summary.items()]), ""]
    if report.skipped:
        parts += ["## Skipped layers", ""]
        parts += [f"- `{name}`: {reason}" for name, reason in report.skipped.items()] + [""]
    if report.autobrake:
        grid = config["auto_grid"]
        parts += ["## Auto-brake", "", "Chosen lambda per layer (histogram):", "", "```",
                  choice_histogram(report.autobrake, grid), "```", "",
                  "Held-out relative output error (dB) at each lambda; the chosen one is bold:",
                  "", markdown_table(
                      ["layer", *[f"{lam:g}" for lam in grid]],
                      [[f"`{name}`", *[(f"**{choice.errors_db[lam]:.2f}**"
                                        if lam == choice.lam else f"{choice.errors_db[lam]:.2f}")
                                       for lam in choice.errors_db]]
                       for name, choice in report.autobrake.items()]), ""]
    rows = [[f"`{r.name}`", r.kind, f"{r.in_features}->{r.out_features}"
             + (f" (pad {r.padded_in})" if r.padded_in != r.in_features else ""),
             r.lam, r.kappa_before, r.kappa_after, r.utilization, r.block_ceiling,
             r.paired_ceiling, r.output_snr_db, r.act_global_scale] for r in report.layers]
    parts += ["## Layers", "",
              "kappa: aggregate participation factor with the layer's real weights (Thm. GL "
              "ceiling) before and after the transform; utilization: kappa_after over the paired "
              "ceiling that WUSH (lambda = 1) attains (Eq. wushratio); kappa_b*: mean block "
              "ceiling (Eq. blockceiling); SNR: the layer's output against full precision on "
              "calibration tokens, in isolation.", "",
              markdown_table(["layer", "cell", "shape", "lambda", "kappa before", "kappa after",
                              "utilization", "kappa_b*", "paired ceiling", "SNR dB",
                              "act scale"], rows),
              "", "## Time (s)", "",
              markdown_table(["stage", "seconds"], [[k, v] for k, v in report.seconds.items()], 2),
              ""]
    return "\n".join(parts)


def write_report(report: QuantizationReport, out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``report.json`` and ``report.md`` into ``out_dir`` (atomically)."""
    out = Path(out_dir)
    json_path, md_path = out / "report.json", out / "report.md"
    atomic_write_text(json_path, json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    atomic_write_text(md_path, report_markdown(report))
    return json_path, md_path


def sweep_markdown(rows: Sequence[dict[str, Any]], metric: str) -> str:
    """One table for a lambda sweep (paper Table lambda_grid): a row per method and format."""
    header = ["method", "format", "lambda", metric, "median utilization", "median kappa after",
              "median SNR dB", "seconds"]
    body = [[r["method"], r["format"], r.get("lam"), r.get(metric), r.get("median_utilization"),
             r.get("median_kappa_after"), r.get("median_output_snr_db"), r.get("seconds")]
            for r in rows]
    return markdown_table(header, body, 4)
