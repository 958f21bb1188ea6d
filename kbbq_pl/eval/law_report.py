"""The ``kbbq-pl law`` report: fits of the noise law per format, kappa margins per cell, files.

:func:`summarize` turns a :class:`~kbbq_pl.eval.law_cells.LawMeasurement` into plain numbers (the
fits of Eq. kappalaw per format, the cross-format spacings of Eq. fmtgap, the kappa margins of
Table kappamargins); :func:`write_report` writes them as ``law.json``, ``law.md``, ``law.png``
and ``kappa.md`` into one folder, atomically (a temporary folder, then a rename); :func:`run_law`
is the whole command: load, tokenize, measure, write.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..formats import get_format
from ..io.fileio import check_output, json_text, write_folder
from ..law import noise_law as law
from .law_cells import CellReport, LawMeasurement, measure_law

SCHEMA = "kbbq-pl/law/1"

DEFINITIONS = {
    "record": "one sampled row of the fused weight of one cell (rows per cell: --rows)",
    "kappa": "participation factor of the row's dot product, Def. kappa: "
             "w^T Sigma w / w^T diag(Sigma) w, Sigma the second moment of the cell's inputs",
    "snr_db": "10 log10(sum S^2 / sum dS^2) over the calibration tokens, dS the error of the "
              "dot product with both operands quantized (weight: whole fused matrix; input: "
              "each forward call's [tokens, D] tensor)",
    "r_db": "residual of the law, Eq. residual: r = SNR_dB - 10 log10 kappa",
    "slope_per_decade": "least-squares slope of SNR_dB on log10 kappa, dB per decade of kappa "
                        "(the law says 10)",
    "intercept": "least-squares intercept of SNR_dB on 10 log10 kappa: the fitted SNR at "
                 "kappa = 1 (the law says C_fmt)",
    "median_r": "median of r over the records: the law's level at unit slope",
    "rms_r": "RMS of r about its mean: the scatter the law leaves",
    "predicted_c_fmt": "parameter-free C_fmt = -10 log10(2 sigma^2_fmt), Eqs. kappalaw and "
                       "sigmafmt (log-uniform mantissas); null for integer formats",
    "spacing": "median over records of SNR_a - SNR_b; predicted: 6.02 (p_a - p_b) dB, "
               "Prop. interceptgap (null unless both formats are floating point)",
    "kappa_identity": "kappa_I: aggregate participation of the untransformed cell over its real "
                      "rows, kappa_bar(Sigma, T=I, G=W^T W / out) (Thm. GL ceiling)",
    "kappa_rotation": "Haar attractor: kappa_bar after a uniformly random rotation, closed form "
                      "(D + 2) tr(G Sigma) / (tr G tr Sigma + 2 tr(G Sigma)) with the real Gram",
    "kappa_star": "layer ceiling, Eq. glceiling: D tr(Sigma^2) / (tr Sigma)^2",
    "block_kappa_star": "block ceiling, Eq. blockceiling, at --block-size: per cell the median "
                        "over the cell's input blocks (blocks with no energy excluded)",
}


# ---------------------------------------------------------------- numbers


def _predicted_c(fmt: str) -> float | None:
    return law.c_fmt(fmt) if get_format(fmt).is_float else None


def format_fits(measurement: LawMeasurement) -> dict[str, dict[str, Any]]:
    """Per format: :func:`kbbq_pl.law.law_fit` of the records, and the predicted C_fmt."""
    kappa = torch.tensor([r.kappa for r in measurement.records], dtype=torch.float64)
    fits = {}
    for fmt in measurement.formats:
        snr = torch.tensor([r.snr_db[fmt] for r in measurement.records], dtype=torch.float64)
        fit = law.law_fit(kappa, snr)
        predicted = _predicted_c(fmt)
        fit["predicted_c_fmt"] = predicted
        median = fit["median_r"]
        fit["median_r_minus_predicted"] = (
            median - predicted if median is not None and predicted is not None else None
        )
        fits[fmt] = fit
    return fits


def format_spacings(measurement: LawMeasurement) -> list[dict[str, Any]]:
    """Median cross-format spacing (Eq. fmtgap) for every pair of formats, in the given order,
    with the mantissa-arithmetic prediction of Prop. interceptgap."""
    spacings = []
    formats = measurement.formats
    for i, first in enumerate(formats):
        for second in formats[i + 1:]:
            differences = [r.snr_db[first] - r.snr_db[second] for r in measurement.records]
            both_float = get_format(first).is_float and get_format(second).is_float
            spacings.append({
                "formats": [first, second],
                "median_db": statistics.median(differences) if differences else None,
                "predicted_db": law.intercept_gap(second, first) if both_float else None,
            })
    return spacings


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(present) if present else None


def kappa_rows(cells: Sequence[CellReport]) -> list[dict[str, Any]]:
    """Table kappamargins per cell: kappa_I, the Haar attractor, their ratio and its dex, the
    layer ceiling and the block ceiling."""
    rows = []
    for cell in cells:
        ratio = (
            cell.kappa_rotation / cell.kappa_identity
            if cell.kappa_identity and cell.kappa_rotation is not None else None
        )
        rows.append({
            "cell": cell.cell, "kind": cell.kind, "in_features": cell.in_features,
            "out_features": cell.out_features, "kappa_identity": cell.kappa_identity,
            "kappa_rotation": cell.kappa_rotation, "ratio": ratio,
            "dex": math.log10(ratio) if ratio else None, "kappa_star": cell.kappa_star,
            "block_kappa_star": cell.block_kappa_star,
        })
    return rows


def kappa_medians(rows: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Medians over cells of each column; the ratio is the median of the per-cell ratios and
    dex its log10 (as in Table kappamargins)."""
    medians = {key: _median([row[key] for row in rows]) for key in (
        "kappa_identity", "kappa_rotation", "ratio", "kappa_star", "block_kappa_star")}
    medians["dex"] = math.log10(medians["ratio"]) if medians["ratio"] else None
    return medians


def exclusions(measurement: LawMeasurement) -> dict[str, list[dict[str, Any]]]:
    """What was left out of the tables and why: rows, coordinates, blocks, linears."""
    rows, coordinates, blocks = [], [], []
    for cell in measurement.cells:
        rows += [{"cell": cell.cell, **row} for row in cell.excluded_rows]
        if cell.dead_coordinates or cell.constant_coordinates:
            coordinates.append({
                "cell": cell.cell,
                "zero_second_moment": cell.dead_coordinates,
                "constant_nonzero": cell.constant_coordinates,
            })
        if cell.excluded_blocks:
            blocks.append({"cell": cell.cell, "block_size": cell.block_size,
                           "blocks": cell.excluded_blocks,
                           "reason": "no input energy in the block: kappa_b* is undefined"})
        if cell.uncovered_features:
            first = cell.in_features - cell.uncovered_features
            blocks.append({"cell": cell.cell, "block_size": cell.block_size,
                           "features": [first, cell.in_features - 1],
                           "reason": f"the last {cell.uncovered_features} of "
                                     f"{cell.in_features} input features fill no whole block "
                                     f"of {cell.block_size}: kappa_b* leaves them out"})
    return {"rows": rows, "zero_variance_coordinates": coordinates, "blocks": blocks,
            "linears": list(measurement.skipped_linears)}


def summarize(measurement: LawMeasurement) -> dict[str, Any]:
    """All numbers of the report (JSON-ready, no NaN: undefined values are None)."""
    rows = kappa_rows(measurement.cells)
    return {
        "formats": format_fits(measurement),
        "spacing": format_spacings(measurement),
        "kappa": {"cells": rows, "medians": kappa_medians(rows)},
        "excluded": exclusions(measurement),
    }


# ---------------------------------------------------------------- files


def _number(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def law_markdown(summary: dict[str, Any], config: dict[str, Any], records: int) -> str:
    formats = list(summary["formats"])
    lines = [
        "# Noise law per GEMM cell (Eq. kappalaw)",
        "",
        f"Model `{config['model']}`, data `{config['data']}`, {config['sequences']} sequences of "
        f"{config['seq_len']} tokens ({config['tokens_measured']} tokens), {config['rows']} rows "
        f"per cell, seed {config['seed']}, batches of {config['batch_size']} sequences (one "
        "dynamic per-tensor activation scale per batch). Both operands quantized; each cell in "
        "isolation (inputs from the full-precision forward).",
        "",
        "Per-format fits (Table lawfits):",
        "",
        "| records | " + " | ".join(f"{f} slope | {f} intercept | {f} RMS" for f in formats) + " |",
        "|---:|" + "---:|---:|---:|" * len(formats),
        f"| {records} | " + " | ".join(
            f"{_number(summary['formats'][f]['slope_per_decade'])} | "
            f"{_number(summary['formats'][f]['intercept'])} | "
            f"{_number(summary['formats'][f]['rms_r'])}" for f in formats) + " |",
        "",
        "| format | records | slope (dB/decade) | intercept (dB) | median r (dB) | mean r (dB) "
        "| RMS of r (dB) | predicted C_fmt (dB) | median r - C_fmt (dB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fmt, fit in summary["formats"].items():
        lines.append(
            f"| {fmt} | {fit['records']} | {_number(fit['slope_per_decade'])} | "
            f"{_number(fit['intercept'])} | {_number(fit['median_r'])} | {_number(fit['mean_r'])} "
            f"| {_number(fit['rms_r'])} | {_number(fit['predicted_c_fmt'])} | "
            f"{_number(fit['median_r_minus_predicted'])} |"
        )
    if summary["spacing"]:
        lines += ["", "Cross-format spacing (Eq. fmtgap):", "",
                  "| formats | median SNR_a - SNR_b (dB) | predicted, Prop. interceptgap (dB) |",
                  "|---|---:|---:|"]
        for spacing in summary["spacing"]:
            a, b = spacing["formats"]
            lines.append(f"| {a} - {b} | {_number(spacing['median_db'])} | "
                         f"{_number(spacing['predicted_db'])} |")
    lines += ["", "Definitions:", ""]
    lines += [f"* **{key}**: {text}" for key, text in DEFINITIONS.items()
              if key in ("record", "kappa", "snr_db", "r_db", "slope_per_decade", "intercept",
                         "median_r", "rms_r", "predicted_c_fmt", "spacing")]
    lines += ["", *_exclusion_lines(summary["excluded"])]
    return "\n".join(lines) + "\n"


def _exclusion_lines(excluded: dict[str, list]) -> list[str]:
    lines = ["Excluded:", ""]
    if not any(excluded.values()):
        return lines + ["* nothing: every sampled row, coordinate and block is in the tables."]
    for row in excluded["rows"]:
        lines.append(f"* row {row['row']} of `{row['cell']}`: {row['reason']}")
    for item in excluded["zero_variance_coordinates"]:
        lines.append(
            f"* `{item['cell']}`: input coordinates with zero variance: "
            f"{_indices(item['zero_second_moment'])} always zero (they add nothing to kappa or "
            f"the SNR), {_indices(item['constant_nonzero'])} constant and nonzero (kept: the law "
            "uses second moments)"
        )
    for item in excluded["blocks"]:
        if "features" in item:
            first, last = item["features"]
            lines.append(f"* `{item['cell']}`: input features {first}..{last}: {item['reason']}")
        else:
            lines.append(f"* `{item['cell']}`: blocks {_indices(item['blocks'])} of "
                         f"{item['block_size']} coordinates left out of kappa_b*: "
                         f"{item['reason']}")
    for item in excluded["linears"]:
        lines.append(f"* linear `{item['linear']}`: {item['reason']}")
    return lines


def _indices(values: Sequence[int], limit: int = 24) -> str:
    if not values:
        return "none"
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}] ({len(values)})"


def kappa_markdown(summary: dict[str, Any], config: dict[str, Any]) -> str:
    block = config["block_size"]
    lines = [
        "# Kappa margins per cell (Table kappamargins)",
        "",
        f"Model `{config['model']}`, data `{config['data']}`, {config['tokens_measured']} tokens.",
        "",
        "| cell | D | out | kappa_I | kappa_bar_rot | rot / I (dex) | kappa* "
        f"| kappa_b* (b={block}) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary["kappa"]["cells"]:
        lines.append(
            f"| {row['cell']} | {row['in_features']} | {row['out_features']} | "
            f"{_number(row['kappa_identity'], 3)} | {_number(row['kappa_rotation'], 3)} | "
            f"{_number(row['ratio'], 3)} ({_number(row['dex'], 3)}) | "
            f"{_number(row['kappa_star'], 2)} | {_number(row['block_kappa_star'], 3)} |"
        )
    medians = summary["kappa"]["medians"]
    lines += [
        f"| **median** | | | {_number(medians['kappa_identity'], 3)} | "
        f"{_number(medians['kappa_rotation'], 3)} | {_number(medians['ratio'], 3)} "
        f"({_number(medians['dex'], 3)}) | {_number(medians['kappa_star'], 2)} | "
        f"{_number(medians['block_kappa_star'], 3)} |",
        "",
        "* **kappa_I**: " + DEFINITIONS["kappa_identity"] + ".",
        "* **kappa_bar_rot**: " + DEFINITIONS["kappa_rotation"] + ".",
        "* **rot / I (dex)**: per cell kappa_bar_rot / kappa_I and its log10; negative dex puts "
        "the native cell above the attractor. The median row gives the median over cells of "
        "the per-cell ratio, and its log10.",
        "* **kappa***: " + DEFINITIONS["kappa_star"] + "; the ceiling bounds the matched "
        "ensemble's aggregate, a real cell's kappa_I may exceed it.",
        f"* **kappa_b***: block ceiling, Eq. blockceiling, over blocks of {block} input "
        "coordinates: each cell's entry is the median over its D / b blocks (blocks with no "
        "input energy left out); the median row is the median over cells of those medians.",
        "* Medians ignore undefined (n/a) entries.",
        "",
        *_exclusion_lines(summary["excluded"]),
    ]
    return "\n".join(lines) + "\n"


KIND_COLORS = {"qkv": "tab:blue", "out": "tab:orange", "up": "tab:green", "down": "tab:red",
               "other": "tab:gray"}


def law_figure(measurement: LawMeasurement, summary: dict[str, Any], path: Path) -> None:
    """Figure 1 style: SNR against 10 log10 kappa per format with the law's predicted line and
    a line at the measured median r, and a panel with the RMS of r per format."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    formats = measurement.formats
    fig, axes = plt.subplots(1, len(formats) + 1, figsize=(4.2 * (len(formats) + 1), 4.0),
                             squeeze=False)
    axes = axes[0]
    x = [10.0 * math.log10(r.kappa) for r in measurement.records]
    kinds = [r.kind for r in measurement.records]
    span = (min(x) - 1.0, max(x) + 1.0) if x else (-5.0, 5.0)
    for ax, fmt in zip(axes, formats):
        fit = summary["formats"][fmt]
        for kind in dict.fromkeys(kinds):
            points = [(xi, r.snr_db[fmt]) for xi, r, k in zip(x, measurement.records, kinds)
                      if k == kind]
            ax.scatter(*zip(*points), s=10, alpha=0.7, color=KIND_COLORS.get(kind, "black"),
                       label=kind)
        if fit["predicted_c_fmt"] is not None:
            c = fit["predicted_c_fmt"]
            ax.plot(span, [span[0] + c, span[1] + c], color="black", lw=1.2,
                    label=f"law, C_fmt = {c:.2f} dB")
        if fit["median_r"] is not None:
            m = fit["median_r"]
            ax.plot(span, [span[0] + m, span[1] + m], color="black", lw=1.2, ls="--",
                    label=f"median r = {m:.2f} dB")
        slope = fit["slope_per_decade"]
        ax.set_title(f"{fmt}: slope {_number(slope)} dB/decade")
        ax.set_xlabel("10 log10 kappa (dB)")
        ax.set_ylabel("SNR (dB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[-1]
    rms = [summary["formats"][f]["rms_r"] or 0.0 for f in formats]
    ax.bar(range(len(formats)), rms, color="tab:purple")
    ax.set_xticks(range(len(formats)), formats)
    ax.set_ylabel("RMS of r (dB)")
    ax.set_title("residual r = SNR - 10 log10 kappa")
    for i, value in enumerate(rms):
        ax.text(i, value, f"{value:.2f}", ha="center", va="bottom", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def record_dicts(measurement: LawMeasurement) -> list[dict[str, Any]]:
    return [asdict(r) for r in measurement.records]


def write_report(measurement: LawMeasurement, out: str | Path, config: dict[str, Any], *,
                 overwrite: bool = False, sources: Sequence[str | Path | None] = ()
                 ) -> dict[str, Path]:
    """Write law.json, law.md, law.png and kappa.md into the folder ``out``, atomically (an
    existing ``out`` as :func:`kbbq_pl.io.fileio.check_output` allows); returns their paths."""
    summary = summarize(measurement)
    document = {
        "schema": SCHEMA,
        "config": config,
        "definitions": DEFINITIONS,
        "formats": summary["formats"],
        "spacing": summary["spacing"],
        "kappa": summary["kappa"],
        "cells": [asdict(c) for c in measurement.cells],
        "excluded": summary["excluded"],
        "records": record_dicts(measurement),
    }
    names = ("law.json", "law.md", "law.png", "kappa.md")

    def write(folder: Path) -> None:
        (folder / "law.json").write_text(
            json_text(document, indent=1))
        (folder / "law.md").write_text(law_markdown(summary, config, len(measurement.records)))
        (folder / "kappa.md").write_text(kappa_markdown(summary, config))
        law_figure(measurement, summary, folder / "law.png")

    folder = write_folder(out, write, kind="law", overwrite=overwrite, sources=sources)
    return {name: folder / name for name in names}


# ---------------------------------------------------------------- the command


def run_law(
    model: str,
    data: str,
    out: str | Path,
    *,
    formats: Sequence[str] = ("fp8_e4m3", "nvfp4", "mxfp4"),
    tokens: int = 4096,
    seq_len: int = 256,
    rows: int = 8,
    seed: int = 0,
    batch_size: int = 4,
    block_size: int = 16,
    targets: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    progress: bool = True,
    overwrite: bool = False,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Load ``model`` (a local folder or ``"minilm"``), cut ``tokens`` calibration tokens from
    ``data`` (a .txt/.jsonl file, ``hf:<dataset>`` or ``random``), measure the law and write the
    report into the folder ``out`` (checked first: :func:`kbbq_pl.io.fileio.check_output`).  The
    model runs on ``device``.  A quantized folder (kbbq-pl's or compressed-tensors') is measured
    with its dequantized weights as the full-precision operands; ``trust_remote_code`` runs a
    folder's own model code.  Returns the paths and the summary."""
    from ..io.data import token_blocks
    from ..io.models import check_context, load_model, parse_device, resolve_model_path

    start = time.perf_counter()
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    if tokens < 1 or seq_len < 2:  # before the model loads
        raise ValueError(f"tokens (--tokens) must be at least 1 and seq_len (--seq-len) at "
                         f"least 2, got {tokens} and {seq_len}")
    formats = [get_format(f).name for f in formats]
    device = parse_device(device)
    sources = [resolve_model_path(model)]
    check_output(out, overwrite=overwrite, sources=sources)
    # a quantized folder (kbbq-pl's or compressed-tensors'): the law of its dequantized weights
    loaded, tokenizer = load_model(model, device=device, dequantize=True,
                                   trust_remote_code=trust_remote_code)
    check_context(loaded, seq_len, "a --seq-len")
    vocab = getattr(loaded.config.get_text_config(), "vocab_size", None)
    ids = token_blocks(data, tokenizer, n_tokens=tokens, seq_len=seq_len, seed=seed,
                       vocab_size=vocab).to(device)
    batches = [{"input_ids": ids[i:i + batch_size],
                "attention_mask": torch.ones_like(ids[i:i + batch_size])}
               for i in range(0, len(ids), batch_size)]
    measurement = measure_law(loaded, batches, formats, targets=targets, ignore=ignore,
                              rows=rows, seed=seed, block_size=block_size, progress=progress)
    config = {
        "model": str(model), "data": str(data), "formats": formats, "tokens": tokens,
        "seq_len": seq_len, "sequences": int(ids.shape[0]),
        "tokens_measured": int(ids.numel()), "rows": rows, "seed": seed,
        "batch_size": batch_size, "block_size": block_size, "device": str(device),
        "targets": list(targets) if targets else None, "ignore": list(ignore) if ignore else None,
        "measure_seconds": round(time.perf_counter() - start, 3),
    }
    paths = write_report(measurement, out, config, overwrite=overwrite, sources=sources)
    return paths, summarize(measurement)
