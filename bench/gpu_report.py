"""Where a GPU session's time went, read on any machine from what ``bench/gpu.py`` wrote.

    python bench/gpu_report.py bench.json [trace_*.json.gz ...] [--top 12]
    python bench/gpu_report.py --tiny      # a small record and trace written and read back

Two readings, one per kind of file:

* ``bench.json`` (``--json`` of ``bench/gpu.py``): the decode path's time at M = 1 and 16 fitted
  over the ``gemm`` section's shapes as ``seconds = fixed + bytes / rate`` (least squares), for
  the decode GEMM alone, the whole linear (activation kernel and GEMM, no transform) and bf16
  ``torch.matmul`` beside them: what a launch costs whatever its size, and how fast it streams
  once it runs, against the device copy.  A ratio to bf16 is then bounded by the two fits: at
  small shapes by the fixed costs, at large ones by the rates;
* a ``torch.profiler`` Chrome trace (the model section's ``trace_{format}_{decode,prefill}``):
  the kernels (``cat == "kernel"``) summed by name *and* launch shape (grid, block, registers a
  thread, shared memory), so that decode GEMMs of different launch shapes get their own rows
  (weight shapes launched alike share one: in the Llama of ``bench/gpu.py``, q / o and down):
  launches, total, mean, min and max microseconds, and its share of the step's kernel time;
  then the step's kernel time, launches and wall span (an eager step's span is mostly host
  time).  Device time only: gaps between kernels are in no row.  Where the trace holds the
  spans ``bench/gpu.py`` opens around each module's forward (``module_spans``), the same
  kernels again by the innermost module whose forward launched them (``LlamaRMSNorm``,
  ``Linear W4A4``, ``LlamaAttention`` for its own operators: rotary, cache, attention): which
  of the model's own kernels a fusion would remove.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Launch:
    """One kernel's name and launch shape."""

    name: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    registers: int | None
    shared_bytes: int | None


@dataclass
class Summary:
    """The kernels of one trace: durations (microseconds) by launch shape, and the wall span."""

    durations: dict[Launch, list[float]]
    span_us: float

    @property
    def total_us(self) -> float:
        return sum(sum(d) for d in self.durations.values())

    @property
    def launches(self) -> int:
        return sum(len(d) for d in self.durations.values())


def streaming_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``seconds = fixed + bytes / rate`` over ``(bytes, seconds)`` points:
    ``(fixed seconds, rate in bytes per second)``; NaN for both without two distinct sizes
    (or a slope that is not positive: no rate)."""
    if len({b for b, _ in points}) < 2:
        return math.nan, math.nan
    mean_b = statistics.fmean(b for b, _ in points)
    mean_s = statistics.fmean(s for _, s in points)
    slope = (sum((b - mean_b) * (s - mean_s) for b, s in points)
             / sum((b - mean_b) ** 2 for b, _ in points))
    if slope <= 0:
        return math.nan, math.nan
    return mean_s - slope * mean_b, 1.0 / slope


def fit_rows(records: list[dict], copy_rate: float) -> list[list]:
    """The ``gemm`` records of the decode path without a transform, fitted per (M, format) by
    :func:`streaming_fit`: rows ``[M, format, what, shapes, fixed us, rate GB/s, rate / copy,
    the fixed cost's share of the largest shape's time]`` for the decode GEMM alone (its bytes:
    codes, scales, activations, output), the whole linear (the same bytes) and bf16
    ``torch.matmul`` (weights, input and output in bf16)."""
    rows = []
    gemm = [r for r in records if r.get("section") == "gemm" and r["path"] == "decode"
            and r["transform"] == "none"]
    for m, name in dict.fromkeys((r["m"], r["fmt"]) for r in gemm):
        mine = [r for r in gemm if (r["m"], r["fmt"]) == (m, name)
                and r["copy_fraction"] == r["copy_fraction"]]
        ours = [(r["copy_fraction"] * copy_rate * r["product_ms"] / 1e3, r) for r in mine]
        series = (
            ("decode GEMM", [(b, r["product_ms"] / 1e3) for b, r in ours]),
            ("linear (activations + GEMM)", [(b, r["ours_ms"] / 1e3) for b, r in ours]),
            ("bf16 torch.matmul", [(2.0 * r["k"] * r["n"] + 2.0 * m * (r["k"] + r["n"]),
                                    r["bf16_ms"] / 1e3) for r in mine]))
        for what, points in series:
            fixed, rate = streaming_fit(points)
            largest = max(points, default=(math.nan, math.nan))
            rows.append([m, name, what, len(points), fixed * 1e6, rate / 1e9, rate / copy_rate,
                         fixed / largest[1]])
    return rows


def fit_table(records: list[dict], copy_rate: float) -> list[str]:
    """Markdown of :func:`fit_rows`."""
    lines = ["| M | format | what | shapes | fixed us | rate GB/s | rate / copy | "
             "fixed / time, largest shape |", "|---|---|---|---|---|---|---|---|"]
    for m, name, what, shapes, fixed, rate, fraction, share in fit_rows(records, copy_rate):
        lines.append(f"| {m} | {name} | {what} | {shapes} | {fixed:.3g} | {rate:.4g} | "
                     f"{fraction:.3g} | {share:.3g} |")
    return lines


PROBE_HEADER = ["programs", "SMs", "most on a SM", "span us", "last start us", "clock GHz",
                "to loop end us", "loop end to arrival us", "arrival to end us (summing)",
                "last to end: start us + us"]
"""The columns of :func:`probe_cells`."""


def probe_summary(rows: list[list[int]]) -> dict[str, float]:
    """Where one decode GEMM launch's time went, from what its programs wrote with ``probe``
    (``kbbq_pl.kernels.skinny.PROBE_SLOTS``: the global timer at its start, ``%clock64`` at
    its start, after its loop, at its split's arrival and at its end, its SM, whether it summed
    the splits, the global timer at its end; rows of zeros are programs that did not run):
    programs, SMs used and the most programs one SM ran; the launch's span on the global timer
    and when its last program started; the SM clock (cycles over nanoseconds, summed over the
    programs); the median program's microseconds from its start to the end of its loop
    (prologue included), from there to its split's arrival (partial stored, atomic answered),
    and, over the programs that summed the splits, from the arrival to the end (the partials
    read and summed, the epilogue); the program that ended last: when it started and how long
    it ran."""
    rows = [r for r in rows if any(r)]
    start = min(r[0] for r in rows)
    ghz = sum(r[4] - r[1] for r in rows) / max(sum(r[7] - r[0] for r in rows), 1)
    per_sm = collections.Counter(r[5] for r in rows)
    summed = [r for r in rows if r[6]]
    last = max(rows, key=lambda r: r[7])

    def us(cycles: list[int]) -> float:
        return statistics.median(cycles) / ghz / 1e3 if cycles and ghz > 0 else math.nan

    return dict(programs=len(rows), sms=len(per_sm), most_on_sm=max(per_sm.values()),
                span_us=(max(r[7] for r in rows) - start) / 1e3,
                last_start_us=(max(r[0] for r in rows) - start) / 1e3, clock_ghz=ghz,
                loop_us=us([r[2] - r[1] for r in rows]),
                arrive_us=us([r[3] - r[2] for r in rows]),
                sum_us=us([r[4] - r[3] for r in summed]),
                last_start_offset_us=(last[0] - start) / 1e3,
                last_duration_us=(last[7] - last[0]) / 1e3)


def probe_cells(summary: dict[str, float]) -> list[str]:
    """:data:`PROBE_HEADER`'s cells of a :func:`probe_summary`."""
    return [str(summary["programs"]), str(summary["sms"]), str(summary["most_on_sm"]),
            *(f"{summary[key]:.3g}" for key in ("span_us", "last_start_us", "clock_ghz",
                                                  "loop_us", "arrive_us", "sum_us")),
            f"{summary['last_start_offset_us']:.3g} + {summary['last_duration_us']:.3g}"]


def probe_table(records: list[dict]) -> list[str]:
    """Markdown of the ``probe`` records (``bench/gpu.py --sections probe``)."""
    header = ["K->N", "format", "product", "splits", "us a call", "probed us a call",
              *PROBE_HEADER]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        if r.get("section") == "probe":
            lines.append("| " + " | ".join(
                [r["shape"], r["fmt"], r["product"], str(r["splits"]), f"{r['us']:.3g}",
                 f"{r['probed_us']:.3g}", *probe_cells(r)]) + " |")
    return lines


def read_trace(path: Path) -> dict:
    """A Chrome trace as ``torch.profiler``'s ``export_chrome_trace`` writes it (gzip or not)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def summarize(trace: dict) -> Summary:
    """The trace's complete kernel events grouped by :class:`Launch`."""
    kernels = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") == "kernel"]
    durations: dict[Launch, list[float]] = {}
    for event in kernels:
        args = event.get("args", {})
        launch = Launch(event["name"], tuple(args.get("grid", ())), tuple(args.get("block", ())),
                        args.get("registers per thread"), args.get("shared memory"))
        durations.setdefault(launch, []).append(float(event["dur"]))
    span = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
            if kernels else 0.0)
    return Summary(durations, span)


SPAN = "user_annotation"
"""The category of a ``torch.profiler.record_function`` span in a Chrome trace."""
LAUNCHES = ("cuda_runtime", "cuda_driver")
"""The categories of the host's launch calls (``cudaLaunchKernel``, ``cuLaunchKernelEx``:
Triton's), each with the ``correlation`` of the kernel it launched."""
NO_MODULE = "(no module)"
NO_LAUNCH = "(launch not in the trace)"


def launching_modules(trace: dict) -> list[tuple[dict, str]]:
    """Each kernel event of the trace with the innermost span around its launch: the launch
    call (the host event of the same ``correlation``) placed in the shortest span of its host
    thread that holds it; :data:`NO_MODULE` outside every span, :data:`NO_LAUNCH` where the
    trace has no launch call for the kernel.  Empty when the trace has no span."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    spans: dict[tuple, list[dict]] = {}
    for event in events:
        if event.get("cat") == SPAN:
            spans.setdefault((event.get("pid"), event.get("tid")), []).append(event)
    if not spans:
        return []
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {})}
    found = []
    for kernel in (e for e in events if e.get("cat") == "kernel"):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            found.append((kernel, NO_LAUNCH))
            continue
        around = [s for s in spans.get((launch.get("pid"), launch.get("tid")), [])
                  if s["ts"] <= launch["ts"] <= s["ts"] + s["dur"]]
        found.append((kernel, min(around, key=lambda s: s["dur"])["name"] if around
                       else NO_MODULE))
    return found


def by_module(trace: dict) -> dict[str, list[float]]:
    """The trace's kernel durations by the module that launched them
    (:func:`launching_modules`)."""
    durations: dict[str, list[float]] = {}
    for kernel, name in launching_modules(trace):
        durations.setdefault(name, []).append(float(kernel["dur"]))
    return durations


def module_table(durations: dict[str, list[float]]) -> list[str]:
    """Markdown rows of :func:`by_module`, the longest total first."""
    total = sum(sum(d) for d in durations.values()) or 1.0
    lines = ["| module | launches | total us | mean us | share |", "|---|---|---|---|---|"]
    for name, times in sorted(durations.items(), key=lambda item: -sum(item[1])):
        lines.append(f"| {name} | {len(times)} | {sum(times):.1f} | "
                     f"{statistics.fmean(times):.2f} | {sum(times) / total:.3f} |")
    return lines


def module_shares(durations: dict[str, list[float]], top: int = 4) -> str:
    """One line of the ``top`` modules' shares of the kernel time and launches, the longest
    first (``Linear W4A4 52% (112), LlamaRMSNorm 17% (136), ...``)."""
    total = sum(sum(d) for d in durations.values()) or 1.0
    ranked = sorted(durations.items(), key=lambda item: -sum(item[1]))
    return ", ".join(f"{name} {100 * sum(times) / total:.0f}% ({len(times)})"
                     for name, times in ranked[:top])


def table(summary: Summary, top: int) -> list[str]:
    """Markdown rows of the ``top`` launch shapes by total time, longest first."""
    total = summary.total_us or 1.0
    lines = ["| kernel | grid | block | regs | smem KiB | launches | total us | mean us | min us "
             "| max us | share |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ranked = sorted(summary.durations.items(), key=lambda item: -sum(item[1]))
    for launch, durations in ranked[:top]:
        name = launch.name if len(launch.name) <= 60 else launch.name[:57] + "..."
        smem = "-" if launch.shared_bytes is None else f"{launch.shared_bytes / 1024:.1f}"
        lines.append(
            f"| {name} | {'x'.join(map(str, launch.grid)) or '-'} | "
            f"{'x'.join(map(str, launch.block)) or '-'} | {launch.registers or '-'} | {smem} | "
            f"{len(durations)} | {sum(durations):.1f} | {statistics.fmean(durations):.2f} | "
            f"{min(durations):.2f} | {max(durations):.2f} | {sum(durations) / total:.3f} |")
    return lines


def tiny_trace(directory: Path) -> Path:
    """A trace with two launch shapes of one kernel and one other kernel, their launch calls and
    the spans of a decoder layer, a norm and a linear (the tiny mode's)."""
    def kernel(name, ts, dur, grid, correlation):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0,
                "tid": 7, "args": {"grid": grid, "block": [128, 1, 1],
                                   "registers per thread": 96, "shared memory": 43008,
                                   "correlation": correlation}}

    def host(cat, name, ts, dur, correlation=None):
        args = {} if correlation is None else {"correlation": correlation}
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1,
                "args": args}
    # a decoder layer's span holds a norm's and a linear's: three GEMMs launched by the
    # linear, one kernel by the norm, one by the layer itself, one outside every span and one
    # whose launch the trace lacks
    events = [kernel("_skinny_kernel", 0.0, 6.0, [16, 8, 1], 1),
              kernel("_skinny_kernel", 10.0, 10.0, [64, 8, 1], 2),
              kernel("_skinny_kernel", 30.0, 10.0, [64, 8, 1], 3),
              kernel("elementwise", 45.0, 2.0, [4, 1, 1], 4),
              kernel("elementwise", 60.0, 1.0, [4, 1, 1], 5),
              kernel("elementwise", 65.0, 1.0, [4, 1, 1], 6),
              kernel("elementwise", 70.0, 1.0, [4, 1, 1], 7),
              host(SPAN, "LlamaDecoderLayer", -10.0, 40.0),
              host(SPAN, "LlamaRMSNorm", -9.0, 3.0), host(SPAN, "Linear W4A4", -5.0, 20.0),
              host("cuda_runtime", "cudaLaunchKernel", -8.0, 1.0, 4),
              host("cuda_driver", "cuLaunchKernelEx", -4.0, 1.0, 1),
              host("cuda_driver", "cuLaunchKernelEx", 0.0, 1.0, 2),
              host("cuda_driver", "cuLaunchKernelEx", 10.0, 1.0, 3),
              host("cuda_runtime", "cudaLaunchKernel", 20.0, 1.0, 6),
              host("cuda_runtime", "cudaLaunchKernel", 40.0, 1.0, 5),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0}]
    path = directory / "trace_tiny_decode.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def tiny_record(directory: Path) -> Path:
    """A ``bench.json`` with two shapes of the decode path at M = 1 (the tiny mode's): every
    time 2 us plus the bytes at 1 GB/s (bf16 at 2 GB/s)."""
    copy_gb_s = 4.0
    rows = [{"section": "copy", "gb_s": copy_gb_s}]
    for k, n in ((64, 64), (128, 256)):
        ours = k * n * 0.5625 + 2 * (k + n)
        product_ms = 2e-3 + ours * 1e-6
        rows.append({"section": "gemm", "k": k, "n": n, "m": 1, "fmt": "nvfp4",
                     "transform": "none", "path": "decode", "product_ms": product_ms,
                     "ours_ms": 3e-3 + ours * 1e-6,
                     "copy_fraction": ours / (product_ms / 1e3) / (copy_gb_s * 1e9),
                     "bf16_ms": 2e-3 + (2 * k * n + 2 * (k + n)) * 0.5e-6})
    # four programs of two K splits on two SMs at 2 GHz, started 100 ns apart: 2 us to their
    # loops' end, 0.5 us to arrive, the two summing ones 1 us more
    probe = [[1000 + 100 * i, 10000 * i, 10000 * i + 4000, 10000 * i + 5000,
              10000 * i + 5000 + 2000 * (i % 2), i % 2, i % 2,
              1000 + 100 * i + 2500 + 1000 * (i % 2)] for i in range(4)]
    rows.append({"section": "probe", "shape": "64->64", "fmt": "nvfp4", "product": "shipped",
                 "splits": 2, "us": 4.0, "probed_us": 4.2, **probe_summary(probe)})
    path = directory / "bench.json"
    path.write_text(json.dumps({"device": "tiny", "commit": "-", "rows": rows}))
    return path


def report_record(path: Path) -> None:
    """The fit table of a ``bench.json``."""
    record = json.loads(path.read_text())
    copy = [r["gb_s"] * 1e9 for r in record["rows"] if r.get("section") == "copy"]
    if not copy:
        print(f"{path}: no device copy measured, no rates to fit")
        return
    print(f"\n### {path.name} ({record.get('device')}, {record.get('commit')}): decode path, "
          "seconds = fixed + bytes / rate over the gemm section's shapes\n")
    print("\n".join(fit_table(record["rows"], copy[0])))
    if any(r.get("section") == "probe" for r in record["rows"]):
        print(f"\n### {path.name}: where a decode GEMM launch's time went (probe)\n")
        print("\n".join(probe_table(record["rows"])))


def report_trace(path: Path, top: int) -> Summary:
    """The launch-shape table of a trace, then its by-module table where it has the spans;
    returns the trace's summary."""
    trace = read_trace(path)
    summary = summarize(trace)
    print(f"\n### {path.name}: kernels by launch shape\n")
    print("\n".join(table(summary, top)))
    print(f"\nkernel time {summary.total_us:.1f} us in {summary.launches} launches; "
          f"span {summary.span_us:.1f} us")
    modules = by_module(trace)
    if modules:
        print(f"\n### {path.name}: kernels by the module that launched them\n")
        print("\n".join(module_table(modules)))
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path,
                        help="bench.json records (*.json) and traces (*.json.gz, trace_*.json)")
    parser.add_argument("--top", type=int, default=12, help="launch shapes printed per trace")
    parser.add_argument("--tiny", action="store_true",
                        help="read a small record and trace written here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [tiny_record(Path(tmp)), tiny_trace(Path(tmp))] if args.tiny else args.files
        if not paths:
            parser.error("give at least one bench.json or trace (or --tiny)")
        for path in paths:
            if path.name.endswith(".gz") or path.name.startswith("trace_"):
                report_trace(path, args.top)
            else:
                report_record(path)


if __name__ == "__main__":
    sys.exit(main())
