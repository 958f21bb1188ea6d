"""The quantization report's files: ``report.json`` (everything) and ``report.md`` (for people),
rendered from :class:`~kbbq_pl.quant.report.QuantizationReport`, and the markdown tables of
``kbbq-pl compare``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..io.fileio import json_text
from ..quant.autobrake import choice_histogram
from ..quant.config import QuantizationConfig
from ..quant.report import QuantizationReport


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


def _structure_line(key: str, value: dict | list) -> str:
    """One line for a structure of the model section (the whole of it is in report.json)."""
    if key == "gptq" and isinstance(value, dict) and value:
        damping = [float(v["damping"]) for v in value.values()
                   if math.isfinite(float(v.get("damping", float("nan"))))]
        fallbacks = [f"`{name}`" for name, v in value.items() if v.get("fallback")]
        line = f"- GPTQ: {len(value)} layers"
        if damping:
            line += f", Hessian damping {min(damping):g} to {max(damping):g}"
        line += f", {len(fallbacks)} RTN fallbacks"
        if fallbacks:
            line += f" ({', '.join(fallbacks[:5])}{', ...' if len(fallbacks) > 5 else ''})"
        return line + "; per layer in report.json"
    return f"- `{key}`: {len(value)} entries, in report.json"


def report_markdown(report: QuantizationReport, title: str = "kbbq-pl quantization report") -> str:
    """The report as Markdown: recipe, model-level fidelity, summary and one row per layer.
    Structures of the model section (e.g. GPTQ's per-layer damping) get one line each; they
    are whole in ``report.json``."""
    config = report.config
    recipe = QuantizationConfig.from_dict(config)
    details = ""
    if recipe.auto:
        details = (f" (chosen per layer from {list(recipe.autobrake.grid)} on "
                   f"{recipe.autobrake.holdout:.0%} held-out calibration sequences)")
    if recipe.weights.quantizer == "gptq":
        details += (f"; GPTQ damping {recipe.weights.damping:g}, act-order "
                    f"{'on' if recipe.gptq_act_order else 'off'}, "
                    f"{recipe.weights.scale_search} scales"
                    + (", transform refit in the loop" if recipe.refits_in_loop else ""))
    parts = [f"# {title}", "",
             f"**{recipe.label}**{details}, activations: "
             + ("static per-tensor scale" if recipe.effective_act_scale == "static" else
                "dynamic per-tensor scale" if recipe.fmt.global_scale else
                "block scales only (no per-tensor scale)"), ""]
    scalars = {k: v for k, v in report.model.items() if not isinstance(v, (dict, list))}
    structures = {k: v for k, v in report.model.items() if isinstance(v, (dict, list))}
    if scalars:
        parts += ["## Model", "", markdown_table(["metric", "value"],
                                                 [[k, v] for k, v in scalars.items()], 4), ""]
    if structures:
        parts += ([] if scalars else ["## Model", ""])
        parts += [_structure_line(k, v) for k, v in structures.items()] + [""]
    summary = report.summary()
    parts += ["## Summary", "", markdown_table(["statistic", "value"],
                                               [[k, v] for k, v in summary.items()]), ""]
    if report.skipped:
        parts += ["## Left in full precision", ""]
        parts += [f"- `{name}`: {reason}" for name, reason in report.skipped.items()] + [""]
    if report.autobrake:
        grid = list(recipe.autobrake.grid)
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


def report_files(report: QuantizationReport) -> dict[str, str]:
    """``report.json`` and ``report.md``: file name -> text, written beside the checkpoint."""
    return {"report.json": json_text(report.to_dict()),
            "report.md": report_markdown(report)}
