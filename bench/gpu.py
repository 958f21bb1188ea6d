"""W4A4 on one GPU against bf16, in one run: correctness, the GEMM paths, the activation kernel,
peers, a whole model; a short table of every row against its target printed last.

    python bench/gpu.py [--sections check,model,gemm,compiled,act_few,act,rows,peers,tune,probe,
                                    stream]
                        [--formats nvfp4,mxfp4]
                        [--budget-s 500] [--json PATH]
    python bench/gpu.py --tiny        # (or --dry-run) tiny shapes on the CPU under the interpreter

Sections (issue 45; each runs in its own guard: a failing section prints its traceback and
the run goes on, and the summary says what failed or was skipped for time):

* ``check``: the activation kernel's codes and scales bit for bit the CPU reference
  (``kbbq_pl.kernels.reference``) and its values the reference codes decoded, NVFP4 (dynamic)
  and MXFP4 with random 16 x 16 / 32 x 32 blocks at M = 1, 16, 256 and 2,304 (row tiles taken
  in turn by each program, the last group short); every path of ``linear_w4a4`` (decode M = 1,
  16, 64; at M = 1024 prefill through cuBLAS and Triton, and decode) within one bf16 rounding
  of the float64 product of the same codes; then the decode path launched directly after
  Triton's first launch (``kbbq_pl.kernels.direct_launch``), the same bits as through Triton,
  eagerly and in a CUDA graph (else turned off for the rest of the run); and the opt-in one-row
  DP4A product within one rounding.  The checks are the first to run what no GPU has run yet,
  so they run in a child process (:func:`check_in_child`), each launch path first in its own
  step: a fault there (an illegal address, a launch that never ends) does not leave this
  process's CUDA context unusable for the sections after.  A launch path that faults (the
  sibling launches, the DP4A product, the direct launches) is turned off for the run and the
  checks run again without it; a fault of the kernels themselves is noted.
* ``gemm``: ``linear_w4a4`` as a layer runs it (activation kernel + product, no transform and
  KBBQ-shaped random blocks; NVFP4 with a static activation scale, as every recipe ships, and
  beside it the dynamic scale's ratio: one launch more) against bf16 ``torch.matmul`` at
  K = N = 8192 and the Llama-3-8B shapes 4096 -> 4096, 4096 -> 6144, 4096 -> 14336, 14336 ->
  4096, M = 1, 16, 4096.  Targets: 2.5x at M = 1, 2.2x at M = 16, 0.95x at M = 4096.  Beside
  each: the product alone, its fraction of the copy bandwidth (packed codes, scales,
  activations and output, each once), whether the output is within one bf16 rounding of the
  exact product, on the prefill path the ratio with the weights kept decoded (the opt-in
  ``KEEP_DECODED_WEIGHTS``: no decode per call).  Timed as CUDA graphs replaying the call over
  enough copies of the weights to overflow the L2 cache (so weights come from memory, as in a
  model), the median of replays divided by the copies.  For MX, a table of the opt-in FP8
  product (``prefill_product="fp8"``) at the prefill rows: eager (it reads its fold check on
  the host), folding the weights per call and keeping them folded, and its kernels in a CUDA
  graph without the host read; its time over the default path's; whether it ran on FP8, within
  one rounding, and the fraction of its outputs whose bits differ from the default path's.
  Last, the decode path (M = 1, 16; no transform) fitted over the shapes as ``seconds = fixed +
  bytes / rate`` for the GEMM alone, the linear and bf16 (``bench/gpu_report.py``, which reads
  the same from a saved ``--json``), and the floors those fixed costs read against: an empty
  kernel, the decode path's kernels and bf16 at the smallest shape, in a CUDA graph.
* ``act``: a device-to-device copy of 8192 x 8192 bf16 (bytes read + written), the activation
  kernel's codes (the decode and tiled paths) and its bf16 values (what the prefill path
  reads), per byte moved against the copy.  Target 0.8.  Beside the default (the exact FMA
  chain, four row tiles a program), each output again at one tile a program, at the other row
  tile, with Triton's FMA dot and on tensor cores (bf16x3), each with its mismatch rate against
  the default.
* ``tune`` (opt-in, not in the default list): the decode GEMM alone at M = 1 on K = N = 8192,
  4096 x 4096, 4096 -> 14336 and 4096 -> 1024 at a grid of tiles and K splits (none, and around
  the ones it would take), each with its
  fraction of the copy bandwidth and against the launch as shipped (where the decode GEMM's
  bandwidth goes, and whether another tile reaches it).
* ``probe`` (opt-in, not in the default list; a diagnostic): the decode GEMM at M = 1 on
  ``tune``'s shapes reading the GPU's clocks inside it (:func:`probe_section`): when its
  programs started, how long their loops, arrivals and split-K sums took, beside its time
  with and without the probe.
* ``stream`` (opt-in, not in the default list; a diagnostic): at M = 1 on ``tune``'s shapes,
  the decode GEMM beside its weight reads alone (``bench/_gpu_stream.py``: codes and scales
  read at its grid, K splits, tile and pipeline depth and XORed, as stored and copied tile by
  tile, at its stages and twice them) and beside itself on the tile-by-tile copy
  (``skinny.tile_major``), each as a fraction of the copy bandwidth: whether the GEMM's reads
  or its own work hold its rate.
* ``act_few``: the activation kernel of a decode step (M = 1, 16; KBBQ-shaped blocks, the
  decode path's word-ordered values): the FMA chain from memory (the default) and in
  registers, and Triton's FMA dot (transforms loaded in one go through shared memory), at
  every K of the GEMM shapes, in microseconds, each variant's codes against the chain's.
* ``model``: a random-init Llama (hidden 4096, 8 layers, intermediate 14336) in bf16 and with
  every decoder linear a ``W4A4Weight`` (random per-block transforms, each layer its own;
  NVFP4's activation scales static, calibrated on one prefill sequence, as every recipe ships
  them; q/k/v and gate/up grouped as ``from_pretrained`` groups them, two launches a group):
  weight memory, batch-1 and batch-16 greedy decoding (CUDA graphs; batch 1 again with every
  linear launched on its own, the grouping's gain, and both models without a CUDA graph, as
  plain ``generate`` decodes: the host's time per launch counts), prefill of 4 x 2048, the
  first block's linears on the kernels against the emulation on the same GPU, and each path's
  logits against bf16's; for MX the prefill again with ``PREFILL_PRODUCT = "fp8"`` (its
  logits against the default path's, and both paths' prefill logits against the bf16
  model's: equally close, or the FP8 product loses more than the compounding of one-ulp
  changes); then a ``torch.profiler`` table of one eager decode step and one prefill per
  format and of the bf16 model (the Chrome traces beside ``--json``: where the time goes),
  and its kernels by launch shape (``bench/gpu_report.py``: the GEMMs of different launch
  shapes apart) and by the module whose forward launched them (each module's forward a span
  in the trace; the decode step's shares in the summary: what a fusion would remove).
  Targets: memory <= 0.35, decode 2.0x (batch 1) and 1.8x (batch 16), prefill 0.9x.
* ``rows``: where the prefill path starts paying: at K = N = 8192 and 4096 -> 14336, KBBQ-shaped
  blocks, M = 64, 128, 256, 1024, 4096, every path that can take M rows (decode; tiled up to
  256; prefill; for MX the FP8 product's kernels in a CUDA graph, without its host read)
  against bf16, each checked within one rounding, with its product alone (the decode GEMM; the
  weights' decode and the product) beside it; the summary names the fewest rows from which
  prefill (and the FP8 product) beat decode on both shapes (``K.PREFILL_MIN_M``: 1024 for
  NVFP4, 256 for MX).
* ``peers`` (last: they take what time is left): torch's int4 weight-only kernel
  (``aten._weight_int4pack_mm``, group 32) and, when importable, GemLite 0.6's ``A16W4_NVFP``,
  ``A16W4_MXFP``, ``A4W4_NVFP_dynamic`` and ``A4W4_MXFP_dynamic`` (built from our stored FP4
  weights, fed the bf16 input; its autotuning ``--gemlite-autotune``, by default its two
  default tiles: its shipped tunings cover no FP4 type, and its ``fast`` search compiles about
  25 tiles for every shape and layer; its NVFP4 layers skipped on sm_9x below Triton 3.8, which
  cannot compile them), at the same shapes and M, timed the same way; a row is
  not started with less than ``PEER_RESERVE_S`` of the budget left beyond what the sections
  after it need.  Then whether
  GemLite's kernel can replace ours: its weight-only layers fed our activation kernel's bf16
  values (KBBQ blocks), timed beside ``linear_w4a4`` on the same operands, checked within one
  bf16 rounding of the exact product and for the same bits call after call (GemLite's A4W4
  layers round the activations themselves, MX's scale exponent up where OCP's rounds down and
  NVFP4's ties to the smaller magnitude, and apply no transform: not our product).

* ``compiled`` (after the model section): the model section's batch-1 decoding with every step
  through ``torch.compile`` on both sides (a W4A4 linear is one custom operator to the
  compiler; q/k/v and gate/up one operator each, by the sibling pass the loaders install),
  replayed from a CUDA graph; then again with each linear its own operator (the pass off:
  the grouping's gain).  Each row's step once more under ``torch.profiler``: its kernels by
  launch shape, and in the summary its kernel time, launches and span against the step's
  time (whether a step's time is in its kernels or between them).  Target 2.0x, as eager.

Each section's note (under the summary) gives its seconds and, where it compiled, how many
Triton kernels in how many seconds and how many came from Triton's cache; the check's note the
same for each of its steps (``bench/_gpu_compiles.py``): the device time spent compiling, not
measuring.  With ``--specs`` the run compiles, in parallel processes beside the check, every
kernel specialization an earlier run recorded there, and records its own.

``--tiny`` runs every section's logic on tiny shapes on the CPU under Triton's interpreter
(timings meaningless; of the peers only the GemLite-on-ours rows, where a test stands in for
GemLite), which ``tests/kernels/test_kernels.py`` does so that this script
cannot rot.  Without CUDA and without ``--tiny`` the script exits with a message.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from unittest import mock

import torch
from torch import nn


def _bench_module(name: str):
    """``bench/{name}.py``, loaded by its path: the tests load this module by path, and
    ``bench/`` (whose scripts' names are generic: ``formats``, ``quantize``) stays off their
    ``sys.path``."""
    if name not in sys.modules:
        path = Path(__file__).with_name(f"{name}.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


gpu_report = _bench_module("gpu_report")
gpu_compiles = _bench_module("_gpu_compiles")

FULL = dict(act_shape=(8192, 8192), check_k=4096, check_n=4096, check_m=(1, 16, 256, 2304),
            gemm_shapes=((8192, 8192), (4096, 4096), (4096, 6144), (4096, 14336),
                         (14336, 4096)),
            gemm_m=(1, 16, 4096), path_m=(1, 16, 64, 1024), prefill_min_m=None,
            rows_shapes=((8192, 8192), (4096, 14336)), rows_m=(64, 128, 256, 1024, 4096),
            tune_shapes=((8192, 8192), (4096, 4096), (4096, 14336), (4096, 1024)),
            hidden=4096, intermediate=14336, heads=32, kv_heads=8, layers=8, vocab=32000,
            prefill=(4, 2048), prompt=32, decode_tokens=64, decode_batches=(1, 16),
            logits_tokens=16, rotate_bytes=150e6, replays=20)
TINY = dict(act_shape=(20, 64), check_k=128, check_n=32, check_m=(3,),
            gemm_shapes=((128, 48),), gemm_m=(1, 40), path_m=(1, 20, 40),
            rows_shapes=((128, 32),), rows_m=(20, 40), tune_shapes=((128, 32),),
            prefill_min_m=32, hidden=32, intermediate=64, heads=2, kv_heads=2, layers=1,
            vocab=64, prefill=(2, 8), prompt=3, decode_tokens=2, decode_batches=(1, 2),
            logits_tokens=3, rotate_bytes=0, replays=1)
TARGETS = {"act": 0.8, "decode_1": 2.5, "decode_16": 2.2, "prefill": 0.95, "prefill_fp8": 1.3,
           "copy_m1": 0.7, "memory": 0.35, "model_decode_1": 2.0, "model_decode_16": 1.8,
           "model_prefill": 0.9}


# --------------------------------------------------------------------------- infrastructure


@dataclass
class Run:
    """Shapes, device, time budget, and what every section found (rows for the JSON, lines
    for the summary)."""

    shapes: dict
    device: torch.device
    formats: list[str]
    budget_s: float
    rows: list[dict] = field(default_factory=list)
    summary: list[list] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    start: float = field(default_factory=time.perf_counter)
    copy_rate: float | None = None  # bytes/s of a device copy (read + written)
    trace_dir: Path | None = None  # where the model section's profiler traces go
    failed: set[str] = field(default_factory=set)  # opt-in rows that raised: not tried again
    gemlite_autotune: str = "default"  # GemLite's autotuning: "default" (2 tiles), "fast", "max"
    reserved_s: float = 0.0  # the needs of the sections after the running one (peers leave it)
    progress: Path | None = None  # the check's child process: where it names its step
    off: frozenset[str] = frozenset()  # the SWITCHES turned off: not checked, not run
    # Triton's compiles and the kernel specializations launched (main records both)
    compiles: gpu_compiles.Compiles = field(default_factory=gpu_compiles.Compiles)
    specializations: gpu_compiles.Specializations = field(
        default_factory=gpu_compiles.Specializations)
    step_began: tuple | None = None  # the check's running step: name, start, compiles then

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)

    def add(self, section: str, **row) -> None:
        self.rows.append(dict(section=section, **row))

    def line(self, what: str, measured, target="", met="") -> None:
        self.summary.append([what, measured, target, met])

    def compiled_since(self, step: str, began: float, compiles: gpu_compiles.Compiles
                       ) -> gpu_compiles.Compiles:
        """The compiles since ``compiles`` (taken at ``began``), as a ``compiles`` row for
        ``step`` (a section, or ``check: `` and a check step) with its seconds."""
        spent = self.compiles.since(compiles)
        self.add("compiles", step=step, wall_s=time.perf_counter() - began,
                 kernels=spent.kernels, hits=spent.hits, compile_s=spent.seconds)
        return spent

    def step(self, name: str) -> None:
        """The check's child begins step ``name`` (:func:`check_in_child`): the device's work so
        far finished first (a fault there is raised now, under the step that launched it).  The
        line it prints says when, in seconds since the child began, and the ending step's
        ``compiles`` row how much of its time went to compiling."""
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.step_began is not None:  # the step that ends here: its time and compiles
            last, began, compiles = self.step_began
            self.compiled_since(f"check: {last}", began, compiles)
        self.step_began = (name, now, replace(self.compiles))
        if self.progress is not None:
            self.progress.write_text(name)
            print(f"(check step: {name}, at {now - self.start:.0f} s)", flush=True)

    def goal(self, what: str, measured, values: list[float], target: float,
             higher: bool = True) -> None:
        """A summary row against a numeric target: how many of ``values`` meet it and, where
        one misses, by how much the worst does (its factor to the target)."""
        values = [v for v in values if v == v]
        met = [v >= target if higher else v <= target for v in values]
        verdict = f"{sum(met)}/{len(values)}"
        if not all(met):
            worst = min(values) if higher else max(values)
            factor = (target / worst if higher else worst / target) if worst else math.inf
            verdict += f"; worst {worst:.3g}, {factor:.3g}x from the target"
        self.line(what, measured, target, verdict)


@contextlib.contextmanager
def section(run: Run, name: str, needs_s: float = 0.0):
    """Run a section: skipped when less than ``needs_s`` of the budget is left; an exception is
    printed and noted, and the run goes on."""
    if run.left() < needs_s:
        run.notes.append(f"{name}: skipped, {run.left():.0f} s of the budget left "
                         f"(needs about {needs_s:.0f})")
        print(f"\n## {name}: skipped ({run.left():.0f} s left)")
        yield False
        return
    began, compiles = time.perf_counter(), replace(run.compiles)
    try:  # the heading inside: a signal right after it still notes the section as stopped
        print(f"\n## {name}", flush=True)
        yield True
    except Exception as error:  # report and go on: the other sections still run
        traceback.print_exc()
        run.notes.append(f"{name}: FAILED after {time.perf_counter() - began:.0f} s: "
                         f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
        if run.cuda:
            torch.cuda.synchronize()
    except SystemExit:  # the call's time limit (``stopped``): said, then the summary
        run.notes.append(f"{name}: STOPPED by the time limit after "
                         f"{time.perf_counter() - began:.0f} s")
        raise
    else:
        spent = run.compiled_since(name, began, compiles)
        run.notes.append(f"{name}: {time.perf_counter() - began:.0f} s"
                         + f" ({spent})" * bool(spent.kernels or spent.hits))


def attempt(run: Run, what: str, call, fallback, step: str | None = None):
    """``call()``, or ``fallback`` where it raises (printed, noted, and not tried again this
    run) or where its check ``step`` is off (:data:`SWITCHES`): an opt-in row (the FP8
    product) must not cost its section the other rows."""
    if what in run.failed or step in run.off:
        return fallback
    try:
        return call()
    except Exception as error:
        traceback.print_exc()
        run.failed.add(what)
        run.notes.append(f"{what}: FAILED ({type(error).__name__}: "
                         f"{str(error).splitlines()[0][:160]}); the run goes on without it")
        return fallback


FP8_ROWS = "MX on FP8 tensor cores"
BF16X3_ROWS = "prefill on tensor-core activations"


def bf16x3_prefill(run: Run, calls: list, t_bf16: float, name: str) -> list:
    """The prefill path's ``calls`` with the opt-in activation product ``PRODUCT_BF16X3``:
    ``[x bf16, the fraction of outputs whose bits differ from the default path's]``."""
    from kbbq_pl.kernels import triton_kernels as tk

    default = calls[0]()
    with mock.patch.object(tk, "PREFILL_PRODUCT", tk.PRODUCT_BF16X3):
        seconds = seconds_per_call(run, calls)
        got = calls[0]()
    differing = float((got.view(torch.int16) != default.view(torch.int16)).float().mean())
    run.add("prefill_bf16x3", fmt=name, m=default.shape[0], speedup=t_bf16 / seconds,
            differing=differing)
    return [t_bf16 / seconds, differing]


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(fmt(v) for v in row) + " |", flush=True)


def fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def seconds_per_call(run: Run, calls: list, replays: int | None = None) -> float:
    """Median seconds of one call: on a GPU the calls (one per copy of the weights, enough to
    overflow the L2 cache) captured in one CUDA graph and replayed; on the CPU one call timed by
    the host clock (tiny runs check logic, not speed)."""
    if not run.cuda:
        start = time.perf_counter()
        calls[0]()
        return time.perf_counter() - start
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up, autotuning and first-use preparation outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    seconds = median_seconds(run, graph.replay, len(calls), replays)
    del graph
    return seconds


def eager_seconds_per_call(run: Run, calls: list, replays: int | None = None) -> float:
    """Median seconds of one call launched eagerly (host time and any host read included): for
    what a CUDA graph cannot capture (the FP8 prefill product reads its fold check)."""
    if not run.cuda:
        return seconds_per_call(run, calls)
    def launch() -> None:
        for call in calls:
            call()

    launch()
    torch.cuda.synchronize()
    return median_seconds(run, launch, len(calls), replays)


def median_seconds(run: Run, launch, calls: int, replays: int | None) -> float:
    """Median over the replays of ``launch()``'s device time (CUDA events), per call of the
    ``calls`` it launches."""
    times = []
    for _ in range(replays or run.shapes["replays"]):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        launch()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def copies(run: Run, nbytes: int, most: int = 32) -> int:
    """How many copies of ``nbytes`` of weights overflow the L2 cache (at least one, at most
    ``most``)."""
    return max(1, min(most, math.ceil(run.shapes["rotate_bytes"] / max(nbytes, 1))))


def kbbq_blocks(k: int, d: int, device, seed: int = 0) -> torch.Tensor:
    """Random per-block transforms ``[K/d, d, d]``: the cost of KBBQ's (and block Hadamard's)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(k // d, d, d, generator=gen) / math.sqrt(d)).to(device)


def quantized(w: torch.Tensor, fmt: str):
    from kbbq_pl import formats as F

    return F.quantize(w, fmt)


def packed_copies(run: Run, w: torch.Tensor, fmt: str):
    """``w`` quantized to ``fmt``, with copies of its codes and scales (the calls cycle through
    them, so that no call finds the weights in L2) and each copy's prepared weight:
    ``(q, [(codes, scales)], [PreparedWeight])``."""
    from kbbq_pl import kernels as K

    q = quantized(w, fmt)
    nbytes = q.qdata.numel() + q.scale.numel()
    sets = [(q.qdata, q.scale)] + [(q.qdata.clone(), q.scale.clone())
                                    for _ in range(copies(run, nbytes) - 1)]
    return q, sets, [K.prepare_weight(c, s, q.global_scale, fmt) for c, s in sets]


def exact_product(x: torch.Tensor, t, q, fmt: str, scale=None) -> torch.Tensor:
    """The float64 product of ``x``'s activation codes (as the kernels round them) and ``q``."""
    from kbbq_pl import kernels as K

    a = K.quantize_activations(x, t, fmt, scale)
    return K.reference_w4a4_matmul(*a, q.qdata, q.scale, q.global_scale, fmt)


def within_one_rounding(y: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    """Whether every output is the exact value rounded once to bf16 (half an ulp, 2^-8 of the
    value, up to FP32 accumulation), and the worst excess over that, relative to max |ref|."""
    slack = 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()
    excess = float(((y.double() - ref).abs() - slack).max() / ref.abs().max().clamp_min(1e-30))
    return excess <= 0, max(excess, 0.0)


# --------------------------------------------------------------------------- check


def check_section(run: Run) -> None:
    """The checks (:func:`run_checks`), in a child process (:func:`check_in_child`)."""
    check_in_child(run, [sys.executable, "-u", str(Path(__file__).resolve()), "--sections",
                         "check", "--formats", ",".join(run.formats),
                         *([] if run.cuda else ["--tiny"])])


def run_checks(run: Run) -> None:
    """The ``check`` section, in steps (:meth:`Run.step`): ``codes``, ``paths`` and
    ``siblings`` (each format), ``dp4a``, ``direct``; a step among :data:`SWITCHES` in
    ``run.off`` is left out.  Each launch path runs first in its own step (a fault is named by
    it): the steps before ``direct`` launch through Triton, ``direct`` as shipped."""
    from kbbq_pl.kernels import direct_launch

    with mock.patch.object(direct_launch, "DIRECT", False):
        product_checks(run)
        for step in OPT_IN:
            if step not in run.off:
                run.step(step)
                opt_in_check(run, step)
    if "direct" not in run.off:
        run.step("direct")
        direct_launch_check(run)
    run.step("done")
    run.notes.append("check steps, s (compiling s; Triton kernels compiled, from the cache): "
                     + ", ".join(f"{r['step'].removeprefix('check: ')} {r['wall_s']:.0f} "
                                 f"({r['compile_s']:.0f}; {r['kernels']}, {r['hits']})"
                                 for r in run.rows if r["section"] == "compiles"
                                 and r["step"].startswith("check: ")))


def product_checks(run: Run) -> None:
    """The steps ``codes``, ``paths`` and ``siblings`` of :func:`run_checks`."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels.reference import reference_decoded_activations

    device, k, n = run.device, run.shapes["check_k"], run.shapes["check_n"]
    codes_ok = codes_all = paths_ok = paths_all = 0
    rows = []
    run.step("codes")
    for name in run.formats:
        d = get_format(name).block_size
        t = kbbq_blocks(k, d, device, seed=1)
        for m in run.shapes["check_m"]:
            x = (torch.randn(m, k) * 3).to(torch.bfloat16)
            want = K.reference_quantize_activations(x, t.cpu(), name)
            got = K.quantize_activations(x.to(device), t, name)
            bad = int((got[0].cpu() != want[0]).sum())
            bad += int((got[1].cpu().view(torch.uint8) != want[1].view(torch.uint8)).sum())
            values, _ = K.quantize_activation_values(x.to(device), t, name, dtype=torch.bfloat16)
            ref_values = reference_decoded_activations(*want[:2], name, torch.bfloat16)
            bad_values = int((values.cpu().view(torch.int16) != ref_values.view(torch.int16))
                             .sum())
            codes_all += 1
            codes_ok += bad == 0 and bad_values == 0
            rows.append([name, m, bad, got[0].numel() + got[1].numel(), bad_values])
            run.add("check", kind="codes", fmt=name, m=m, mismatched=bad,
                    mismatched_values=bad_values)
    table(f"activation codes and values against the CPU reference, K = {k}, random blocks",
          ["format", "M", "code/scale bytes differing", "of", "values differing"], rows)
    rows = []
    for name in run.formats:
        run.step("paths")
        d = get_format(name).block_size
        t = kbbq_blocks(k, d, device, seed=2)
        w = torch.randn(n, k, device=device) * 0.02
        q = quantized(w, name)
        prepared = K.prepare_weight(q.qdata, q.scale, q.global_scale, name)
        for m in run.shapes["path_m"]:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ref = exact_product(x, t, q, name)
            chosen = K.choose_path(m, name)
            more = [("prefill", "triton"), ("decode", "auto")]
            if get_format(name).scale_kind == "e8m0":
                more.append(("prefill", "fp8"))
            for path, product in [(chosen, "auto")] + more * (chosen == "prefill"):
                call = functools.partial(K.linear_w4a4, x, q.qdata, q.scale, q.global_scale,
                                         name, t, prepared=prepared, path=path,
                                         prefill_product=product)
                y = call() if product != "fp8" else attempt(run, FP8_ROWS, call, None)
                if y is None:
                    rows.append([name, m, path, product, "FAILED", float("nan")])
                    continue
                ok, excess = within_one_rounding(y, ref)
                paths_all += 1
                paths_ok += ok
                rows.append([name, m, path, product, "yes" if ok else "NO", excess])
                run.add("check", kind="product", fmt=name, m=m, path=path, product=product,
                        within_one_rounding=ok, excess=excess)
        if "siblings" in run.off:
            continue
        run.step("siblings")  # q/k/v-like (N, N/4, N/4), each its own transform, one launch pair
        siblings = [(q, t)] + [(quantized(torch.randn(n // 4, k, device=device) * 0.02, name),
                                kbbq_blocks(k, d, device, seed=3 + i)) for i in range(2)]
        layers = [K.SiblingLinear(s.qdata, s.scale, s.global_scale, st,
                                  prepared=K.prepare_weight(s.qdata, s.scale, s.global_scale,
                                                            name)) for s, st in siblings]
        for m in run.shapes["path_m"]:
            if K.choose_path(m, name) != "decode":
                continue
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            outputs = K.linear_w4a4_siblings(x, layers, name)
            fits = [within_one_rounding(y, exact_product(x, st, s, name))
                    for y, (s, st) in zip(outputs, siblings)]
            ok, excess = all(f[0] for f in fits), max(f[1] for f in fits)
            paths_all += 1
            paths_ok += ok
            rows.append([name, m, "decode, 3 siblings", "-", "yes" if ok else "NO", excess])
            run.add("check", kind="product", fmt=name, m=m, path="decode, 3 siblings",
                    product="-", within_one_rounding=ok, excess=excess)
    table(f"linear_w4a4 against the exact product of the same codes, K = {k}, N = {n}",
          ["format", "M", "path", "prefill product", "within one bf16 rounding",
           "worst excess / max|ref|"], rows)
    run.line("activation codes, scales, values bit for bit the CPU reference",
             f"{codes_ok}/{codes_all}", "all", "yes" if codes_ok == codes_all else "NO")
    run.line("every path within one bf16 rounding of the exact product",
             f"{paths_ok}/{paths_all}", "all", "yes" if paths_ok == paths_all else "NO")


OPT_IN = {
    "dp4a": ("ONE_ROW_PRODUCT", "PRODUCT_DP4A", (1,), "one-row DP4A product"),
}
"""The opt-in decode products, by check step: (the switch in :mod:`kbbq_pl.kernels.skinny`,
its value on (a name: that constant of the module), the rows it is checked at, its name)."""


def opt_in(step: str):
    """The switch of :data:`OPT_IN`'s ``step`` turned on (a context manager)."""
    from kbbq_pl.kernels import skinny

    attribute, value = OPT_IN[step][:2]
    return mock.patch.object(skinny, attribute,
                             getattr(skinny, value) if isinstance(value, str) else value)


def opt_in_check(run: Run, step: str) -> None:
    """The decode path with an opt-in product (:data:`OPT_IN`; the ``gemm``, ``model`` and
    ``tune`` sections time it) within one bf16 rounding of the exact product, every format,
    random blocks, a layer alone and three q/k/v-like siblings in one launch pair; where it
    fails, its rows are not run."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format

    rows, what = OPT_IN[step][2:4]
    k, n, ok = run.shapes["check_k"], run.shapes["check_n"], 0
    try:
        for name in run.formats:
            d = get_format(name).block_size
            layers = [(quantized(torch.randn(width, k, device=run.device) * 0.02, name),
                       kbbq_blocks(k, d, run.device, seed=4 + i))
                      for i, width in enumerate((n, n // 4, n // 4))]
            siblings = [K.SiblingLinear(q.qdata, q.scale, q.global_scale, t) for q, t in layers]
            q, t = layers[0]
            for m in rows:
                x = torch.randn(m, k, device=run.device, dtype=torch.bfloat16)
                with opt_in(step):
                    y = K.linear_w4a4(x, q.qdata, q.scale, q.global_scale, name, t,
                                      path="decode")
                    grouped = K.linear_w4a4_siblings(x, siblings, name)
                ok += within_one_rounding(y, exact_product(x, t, q, name))[0]
                ok += all(within_one_rounding(out, exact_product(x, st, sq, name))[0]
                          for out, (sq, st) in zip(grouped, layers))
    except Exception as error:
        switch_off(run, step)
        run.notes.append(f"{what}: FAILED ({type(error).__name__}: "
                         f"{str(error).splitlines()[0][:120]}); its rows are not run")
        run.line(f"{what} (opt-in): checked", "failed", "all", "NO")
        return
    every = 2 * len(run.formats) * len(rows)
    run.line(f"{what} (opt-in) within one bf16 rounding of the exact product, alone and as "
             "siblings", f"{ok}/{every}", "all", "yes" if ok == every else "NO")


def direct_launch_check(run: Run) -> None:
    """The decode path launched directly (:mod:`kbbq_pl.kernels.direct_launch`, as shipped) against
    through Triton every launch: the same bits, eagerly and replayed from a CUDA graph (M = 1,
    16, 64; a linear and three siblings; every format, random blocks).  Where it fails, the
    rest of the run launches through Triton (noted)."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import direct_launch

    if not run.cuda:
        run.notes.append("direct launch: not under the interpreter (every launch is Triton's)")
        return
    k, n, same, every = run.shapes["check_k"], run.shapes["check_n"], 0, 0
    through_triton = mock.patch.object(direct_launch, "DIRECT", False)
    try:
        for name in run.formats:
            d = get_format(name).block_size
            layers = []
            for i, rows in enumerate((n, n // 4, n // 4)):
                q = quantized(torch.randn(rows, k, device=run.device) * 0.02, name)
                layers.append(K.SiblingLinear(
                    q.qdata, q.scale, q.global_scale, kbbq_blocks(k, d, run.device, seed=5 + i),
                    prepared=K.prepare_weight(q.qdata, q.scale, q.global_scale, name)))
            for m in (1, 16, 64):
                x = torch.randn(m, k, device=run.device, dtype=torch.bfloat16)

                def call(x=x, layers=layers, name=name):
                    one = layers[0]
                    return [K.linear_w4a4(x, *one[:3], name, *one[3:6], prepared=one.prepared,
                                          path="decode"),
                            *K.linear_w4a4_siblings(x, layers, name)]

                with through_triton:
                    plain = call()
                call()  # the entries made
                eager = call()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = call()
                x.normal_()  # fresh rows, replayed and through Triton
                graph.replay()
                with through_triton:
                    fresh = call()
                torch.cuda.synchronize()
                for got, want in ((eager, plain), (captured, fresh)):
                    every += len(want)
                    same += sum(int(torch.equal(a, b)) for a, b in zip(got, want))
    except Exception as error:
        direct_launch.DIRECT = False
        run.notes.append(f"direct launch: FAILED ({type(error).__name__}: "
                         f"{str(error).splitlines()[0][:120]}); the run goes on through Triton")
        run.line("decode path launched directly: the same bits as through Triton", "failed",
                 "all", "NO")
        return
    if same < every:
        direct_launch.DIRECT = False
        run.notes.append("direct launch: results differ from Triton's; the run goes on "
                         "through Triton")
    run.line("decode path launched directly: the same bits as through Triton (eager, graph)",
             f"{same}/{every}", "all", "yes" if same == every else "NO")


SWITCHES = {
    "siblings": ("kbbq_pl.kernels", "MAX_SIBLINGS", 1, "sibling linears launched together"),
    "dp4a": (None, None, None, "the one-row DP4A product's rows (opt-in)"),
    "direct": ("kbbq_pl.kernels.direct_launch", "DIRECT", False, "direct launches"),
}
"""The check steps that can be turned off for the rest of the run (``Run.off``, and a module's
switch where there is one): step -> (module, attribute, its value when off, what it turns
off)."""
CHECK_STEP_S = 150.0
"""The most seconds a step of the check's child process may take: past them it is taken for a
launch that never ends."""


def switched_off(run: Run) -> list[str]:
    """The :data:`SWITCHES` that are off in this run."""
    return [step for step, (module, attribute, off, _) in SWITCHES.items()
            if step in run.off or module is not None
            and getattr(importlib.import_module(module), attribute) == off]


def switch_off(run: Run, step: str) -> None:
    """Turn off what check step ``step`` checks, for the rest of the run."""
    module, attribute, off, _ = SWITCHES[step]
    run.off |= {step}
    if module is not None:
        setattr(importlib.import_module(module), attribute, off)


def check_in_child(run: Run, command: list[str]) -> None:
    """The checks run by ``command`` (this script, in a child process) and merged into ``run``:
    they are the first to run the kernels and launch paths that no GPU has run yet, and a fault
    there (an illegal address) leaves the CUDA context of its process unusable, so that every
    later section would fail too.  The child names each step as it begins
    (:meth:`Run.step`; :func:`run_checks` runs each launch path first in its own step).  Where
    it exits with an error, or stays in one step longer than :data:`CHECK_STEP_S` (a launch that
    never ends), in a step of :data:`SWITCHES`, that switch is turned off for the run and the
    checks run again without it; in another step (the kernels themselves) the failure is noted
    and the run goes on; a child that never began a step (no second CUDA context on this GPU,
    say) is replaced by the checks in this process.  What the child turned off (a launch path
    whose bits differ) and the opt-in rows that failed there are off here too; a failed
    child's notes (its last, its rows and summary too) join the run's."""
    off: list[str] = []
    while True:
        with tempfile.TemporaryDirectory() as folder:
            result, progress = Path(folder) / "check.json", Path(folder) / "step"
            code, step, how = watch_child(run, [
                *command, "--budget-s", f"{run.left():.0f}", "--json", str(result),
                "--check-child", str(progress), "--off", ",".join(off)], progress)
            found = json.loads(result.read_text()) if result.exists() else None
        if code == 0 and found is not None:
            break
        if step == "start" and isinstance(code, int):
            run.notes.append(f"check: its child process began no step ({how}); the checks "
                             "run in this process")
            run_checks(run)
            return
        rerun = step in SWITCHES and step not in off and run.left() > 20  # time to run again
        if found is not None and rerun:
            run.notes += found["notes"]
        elif found is not None:
            merge_child(run, found)
        if not rerun:
            run.notes.append(f"check: its child process stopped in step {step!r} ({how}); the "
                             "run goes on")
            run.line("checks (a child process)", f"stopped in {step!r}", "all", "NO")
            return
        off.append(step)
        switch_off(run, step)
        run.notes.append(f"check: its child process stopped in step {step!r} ({how}); "
                         f"{SWITCHES[step][3]} off for the run, the checks again without")
    merge_child(run, found)
    for step in found["off"]:
        switch_off(run, step)


def merge_child(run: Run, found: dict) -> None:
    """The check child's JSON (rows, summary lines, notes, opt-in rows that failed) into
    ``run``."""
    run.rows += found["rows"]
    run.summary += found["summary"]
    run.notes += found["notes"]
    run.failed |= set(found["failed"])
    run.specializations.found.update(found.get("specializations", {}))


def watch_child(run: Run, command: list[str], progress: Path) -> tuple[int | str | None, str, str]:
    """Run ``command`` until it exits, stays in one step (``progress``) longer than
    :data:`CHECK_STEP_S`, or outlasts the run's budget: ``(exit code, else None for a step
    that never ended or "time", the step it was in or "start", how it ended)``."""
    process = subprocess.Popen(command)
    step, since = "start", time.perf_counter()
    try:
        while process.poll() is None:
            now = progress.read_text() if progress.exists() else "start"
            if now != step:
                step, since = now, time.perf_counter()
            if time.perf_counter() - since > CHECK_STEP_S:
                return None, step, f"no end in {CHECK_STEP_S:.0f} s"
            if run.left() <= 0:
                return "time", step, "out of the run's time"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    step = progress.read_text() if progress.exists() else "start"
    return process.returncode, step, f"exit code {process.returncode}"


# --------------------------------------------------------------------------- GEMM


def gemm_weights(run: Run, section: str, reserve: float, shapes: str = "gemm_shapes"
                 ) -> Iterator[tuple[int, int, torch.Tensor, list[torch.Tensor]]]:
    """Each GEMM shape ``K -> N`` of the run (``run.shapes[shapes]``) with a random bf16 weight
    ``[N, K]`` and its copies (the calls cycle through them, so that no call finds the weight
    in L2), while ``reserve`` seconds are left (else a note naming ``section``)."""
    for k, n in run.shapes[shapes]:
        if run.left() < reserve:
            run.notes.append(f"{section}: stopped before {k} -> {n} for time")
            return
        w = torch.randn(n, k, device=run.device, dtype=torch.bfloat16) * 0.02
        yield k, n, w, [w] + [w.clone() for _ in range(copies(run, w.numel() * 2) - 1)]


def bf16_seconds(run: Run, x: torch.Tensor, w_set: list[torch.Tensor]) -> float:
    """Seconds a call of bf16 ``torch.matmul(x, w.T)``, cycling through ``w_set``."""
    return seconds_per_call(run, [functools.partial(torch.matmul, x, wi.T) for wi in w_set])


def gemm_section(run: Run) -> None:
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import skinny
    from kbbq_pl.kernels import triton_kernels as tk

    device = run.device
    rows, ratios, fp8_rows, bf16x3_rows = [], {}, [], []
    for k, n, w, w_set in gemm_weights(run, "gemm", reserve=30):
        packed = {name: packed_copies(run, w, name) for name in run.formats}
        for m in run.shapes["gemm_m"]:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            t_bf16 = bf16_seconds(run, x, w_set)
            for name in run.formats:
                fmt_ = get_format(name)
                q, sets, preps = packed[name]
                for label, t in (("none", None), ("KBBQ blocks", kbbq_blocks(k, fmt_.block_size,
                                                                             device))):
                    # NVFP4: a static activation scale (what every recipe ships: here the
                    # amax of these rows, as calibration would find it) and the dynamic one
                    scales = ([K.quantize_activation_values(x, t, name)[1], None]
                              if fmt_.global_scale else [None])
                    seconds = {}
                    for scale in scales:
                        kept = preps if scale is None else [
                            K.prepare_weight(c, s, q.global_scale, name, scale) for c, s in sets]
                        calls = [functools.partial(K.linear_w4a4, x, c, s, q.global_scale, name,
                                                   t, scale, prepared=p)
                                 for (c, s), p in zip(sets, kept)]
                        seconds[scale is None] = seconds_per_call(run, calls)
                        if len(seconds) == 1:  # the row's own variant: checked
                            own_calls = calls
                            ok, excess = within_one_rounding(calls[0](),
                                                             exact_product(x, t, q, name, scale))
                    t_ours = seconds[scales[0] is None]
                    dynamic = t_bf16 / seconds[True] if len(scales) > 1 else float("nan")
                    path = K.choose_path(m, name)
                    kept_decoded = float("nan")
                    if path == "prefill":  # the opt-in: weights held decoded, no decode a call
                        decoded = [K.prepare_weight(c, s, q.global_scale, name, scales[0],
                                                    keep_decoded=True) for c, s in sets]
                        kept_decoded = t_bf16 / seconds_per_call(run, [
                            functools.partial(K.linear_w4a4, x, c, s, q.global_scale, name, t,
                                              scales[0], prepared=p)
                            for (c, s), p in zip(sets, decoded)])
                        del decoded
                    if path == "prefill" and t is not None:  # activations on tensor cores
                        bf16x3_rows.append([f"{k}->{n}", m, name, t_bf16 / t_ours] + attempt(
                            run, BF16X3_ROWS, functools.partial(bf16x3_prefill, run, own_calls,
                                                                t_bf16, name),
                            [float("nan"), "FAILED"]))
                    if path == "prefill" and fmt_.scale_kind == "e8m0":
                        fp8_rows.append([f"{k}->{n}", m, name, label, t_bf16 * 1e3,
                                         t_bf16 / t_ours] + attempt(
                            run, FP8_ROWS, functools.partial(
                                fp8_columns, run, K, x, t, q, name, sets, preps, own_calls,
                                t_bf16), [math.nan] * 5 + ["FAILED"]))
                    one_row, one_row_ok = float("nan"), ""
                    if m == 1:  # the opt-in one-row product, as it would run
                        one_row, one_row_ok = attempt(
                            run, f"one-row DP4A {name}",
                            functools.partial(opt_in_linear, run, "dp4a", own_calls,
                                              exact_product(x, t, q, name, scales[0]), t_bf16),
                            (float("nan"), "FAILED"), step="dp4a")
                        if one_row == one_row:
                            ratios.setdefault((m, name, "one-row DP4A"), []).append(one_row)
                    if label == "none":  # the product alone does not depend on the transform
                        t_product, copy_fraction = product_only(run, K, skinny, tk, x, t, name,
                                                                sets, preps, q.global_scale, path)
                    ratio = t_bf16 / t_ours
                    target = TARGETS["decode_1" if m == 1 else "decode_16" if m <= 16
                                     else "prefill"]
                    ratios.setdefault((m, name, label), []).append(ratio)
                    if dynamic == dynamic:
                        ratios.setdefault((m, name, "dynamic scale"), []).append(dynamic)
                    if kept_decoded == kept_decoded:
                        ratios.setdefault((m, name, "weights kept decoded"), []).append(
                            kept_decoded)
                    rows.append([f"{k}->{n}", m, name, label, path, t_bf16 * 1e3, t_ours * 1e3,
                                 ratio, target, dynamic, kept_decoded, one_row,
                                 one_row_ok, t_product * 1e3,
                                 copy_fraction, "yes" if ok else f"NO ({excess:.2g})"])
                    run.add("gemm", k=k, n=n, m=m, fmt=name, transform=label, path=path,
                            bf16_ms=t_bf16 * 1e3, ours_ms=t_ours * 1e3, speedup=ratio,
                            target=target, dynamic_speedup=dynamic,
                            kept_decoded_speedup=kept_decoded,
                            dp4a_speedup=one_row,
                            dp4a_within_one_rounding=(one_row_ok == "yes" if m == 1
                                                      else None),
                            product_ms=t_product * 1e3,
                            copy_fraction=copy_fraction, within_one_rounding=ok)
            print(f"  [{time.perf_counter() - run.start:.0f} s] {k}->{n} M={m} done", flush=True)
        del w_set, packed
    table("linear_w4a4 (activation kernel + product) against bf16 torch.matmul; product: the "
          "GEMM alone (decode: the decode GEMM; prefill: weight decode + product); weights "
          "kept decoded: the prefill path with no decode per call (opt-in); copy: its bytes "
          "over time against the device copy; one-row DP4A: the decode path with the opt-in "
          "integer product at M = 1, and whether it is within one bf16 rounding of the exact "
          "product",
          ["K->N", "M", "format", "transform", "path", "bf16 ms", "W4A4 ms", "x bf16", "target",
           "x bf16, dynamic NVFP4", "x bf16, weights kept decoded",
           "x bf16, one-row DP4A", "DP4A within one",
           "product ms", "copy fraction", "within one rounding"], rows)
    if fp8_rows:
        table("MX on FP8 tensor cores, the opt-in prefill product 'fp8', against bf16 "
              "torch.matmul: eager (it reads its fold check on the host, which a CUDA graph "
              "cannot capture), the weights folded per call and kept folded; in a CUDA graph "
              "without the host read (weights kept folded: what the product costs the GPU); "
              "its eager time over the default path's eager time; its check: ran on FP8 or "
              "fell back, within one bf16 rounding of the exact product, the fraction of "
              "outputs whose bits differ from the default path's",
              ["K->N", "M", "format", "transform", "bf16 ms", "default x bf16",
               "FP8 x bf16, eager", "FP8 x bf16, eager, weights kept folded",
               "FP8 x bf16, graph, no host read", "FP8 / default, eager",
               "FP8 ms, graph", "FP8 check"], fp8_rows)
    if bf16x3_rows:
        table("the prefill path with its activations' transform on tensor cores (opt-in: "
              "triton_kernels.PREFILL_PRODUCT = PRODUCT_BF16X3; x in bf16 times T as three "
              "bf16 parts, not the exact chain's rounding) against bf16 torch.matmul, beside "
              "the default path (the exact chain); the fraction of outputs whose bits differ "
              "from the default's", ["K->N", "M", "format", "default x bf16", "bf16x3 x bf16",
                                     "outputs differing"], bf16x3_rows)
        for name in run.formats:
            found = [r for r in run.rows if r.get("section") == "prefill_bf16x3"
                     and r["fmt"] == name]
            if found:
                run.line(f"linear M=4096 {name}, KBBQ blocks, activations on tensor cores "
                         "(opt-in): x bf16 min / median / max; outputs differing, most",
                         f"{spread([r['speedup'] for r in found])}; "
                         f"{max(r['differing'] for r in found):.2g}")
    for m, key in ((1, "decode_1"), (16, "decode_16"), (4096, "prefill")):
        for name in run.formats:
            found = {label: ratios[m, name, label] for label in (
                "none", "KBBQ blocks", "dynamic scale", "weights kept decoded", "one-row DP4A")
                if (m, name, label) in ratios}
            if found:
                every = [v for label, values in found.items() for v in values
                         if label in ("none", "KBBQ blocks")]  # the others beside, not counted
                run.goal(f"linear M={m} {name}: x bf16, min / median / max over shapes",
                         "; ".join(f"{label} {spread(v)}" for label, v in found.items()),
                         every, TARGETS[key])
    folded = [r for r in run.rows if r.get("section") == "fp8" and r["folded"]]
    if folded:
        on_fp8 = [r["speedup"] for r in folded]
        run.goal("linear M=4096 mxfp4 on FP8 tensor cores (opt-in, eager): x bf16, "
                 "min / median / max", f"folded per call {spread(on_fp8)}; weights kept "
                 f"folded {spread([r['kept_folded_speedup'] for r in folded])}; in a graph "
                 f"without the host read {spread([r['graph_speedup'] for r in folded])}",
                 on_fp8, TARGETS["prefill_fp8"])
    fractions = [r["copy_fraction"] for r in run.rows if r.get("section") == "gemm"
                 and r["m"] == 1 and r["transform"] == "none"
                 and r["copy_fraction"] == r["copy_fraction"]]
    if fractions:
        run.goal("M=1 decode GEMM: fraction of copy bandwidth min/median/max", spread(fractions),
                 fractions, TARGETS["copy_m1"])
    if run.copy_rate:
        print("\n### decode path, seconds = fixed + bytes / rate over the shapes (least "
              "squares): what a launch costs whatever its size, and how fast it streams\n")
        print("\n".join(gpu_report.fit_table(run.rows, run.copy_rate)), flush=True)
    attempt(run, "launch floors", functools.partial(launch_floors, run), None)


FLOOR_SHAPE = (512, 64)
"""``K -> N`` of :func:`launch_floors`: one column tile of the decode GEMM, one K split."""


def launch_floors(run: Run) -> None:
    """What a launch costs on this device whatever its work, against which the fitted fixed
    costs read: in a CUDA graph (as every timing here), one element zeroed (a kernel that does
    nothing, in effect), the decode path's activation kernel, its GEMM and the whole linear at
    M = 1 on the smallest shape (:data:`FLOOR_SHAPE`, NVFP4, static scale, no transform), and
    bf16 ``torch.matmul`` at that shape; microseconds a call."""
    from kbbq_pl import kernels as K
    from kbbq_pl.kernels import skinny
    from kbbq_pl.kernels import triton_kernels as tk

    k, n = FLOOR_SHAPE
    x = torch.randn(1, k, device=run.device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=run.device, dtype=torch.bfloat16) * 0.02
    q, sets, preps = packed_copies(run, w, "nvfp4")
    scale = K.quantize_activation_values(x, None, "nvfp4")[1]
    one = torch.zeros(1, device=run.device)
    floors = {
        "empty kernel": seconds_per_call(run, [one.zero_] * len(sets)),
        "activation kernel": seconds_per_call(run, [functools.partial(
            K.quantize_activation_values, x, None, "nvfp4", scale,
            dtype=skinny.activation_dtype(tk.SCALE_E4M3), word_order=True)] * len(sets)),
        "decode GEMM": product_only(run, K, skinny, tk, x, None, "nvfp4", sets, preps,
                                    q.global_scale, "decode")[0],
        "linear": seconds_per_call(run, [functools.partial(
            K.linear_w4a4, x, c, s, q.global_scale, "nvfp4", None, scale, prepared=p)
            for (c, s), p in zip(sets, preps)]),
        "bf16 torch.matmul": bf16_seconds(run, x, [w] * len(sets))}
    run.line(f"launch floors in a CUDA graph, us a call (M = 1, {k} -> {n}, nvfp4)",
             "; ".join(f"{what} {seconds * 1e6:.3g}" for what, seconds in floors.items()))
    run.add("floor", k=k, n=n, **{what.replace(" ", "_").replace(".", "_"): seconds * 1e6
                                  for what, seconds in floors.items()})


def fp8_columns(run: Run, K, x, t, q, name: str, sets, preps, default_calls,
                t_bf16: float) -> tuple[float, float, str]:
    """The opt-in FP8 prefill product of an MX layer (``prefill_product="fp8"``): its speed
    against bf16 (timed eagerly: its fold check is read on the host, which a CUDA graph cannot
    capture), the weights folded per call and kept folded (``keep_decoded``), its kernels in a
    CUDA graph without the host read (the weights kept folded), its eager time over the
    default path's eager time, and its check: within one
    bf16 rounding of the exact product, the fraction of outputs whose bits differ from the
    default path's (the FP8 tensor cores' accumulation against bf16's), and whether it ran on
    FP8 at all (a chunk that does not fold sends it to the bf16 product)."""
    calls = [functools.partial(K.linear_w4a4, x, c, s, q.global_scale, name, t,
                               prepared=p, prefill_product="fp8")
             for (c, s), p in zip(sets, preps)]
    with fp8_products(K) as ran:
        y = calls[0]()
    folded = ran == [True]
    ok, excess = within_one_rounding(y, exact_product(x, t, q, name))
    differ = float((y.view(torch.int16) != default_calls[0]().view(torch.int16)).float().mean())
    t_fp8 = eager_seconds_per_call(run, calls)
    t_default = eager_seconds_per_call(run, default_calls)
    kept = [K.prepare_weight(c, s, q.global_scale, name, keep_decoded=True,
                             prefill_product="fp8") for c, s in sets]  # the weights folded once
    t_kept = eager_seconds_per_call(run, [
        functools.partial(K.linear_w4a4, x, c, s, q.global_scale, name, t, prepared=p,
                          prefill_product="fp8") for (c, s), p in zip(sets, kept)])
    t_graph = math.nan
    graph_calls = fp8_kernel_calls(K, x, t, kept)
    if graph_calls:
        t_graph = seconds_per_call(run, graph_calls)
        if folded:
            assert torch.equal(graph_calls[0](), y), "the graph's product differs"
    del kept, graph_calls
    check = (f"{'ran' if folded else 'fell back'}; "
             f"{'yes' if ok else f'NO ({excess:.2g})'}; differ {differ:.3g}")
    run.add("fp8", k=x.shape[1], n=sets[0][0].shape[0], m=x.shape[0], fmt=name,
            speedup=t_bf16 / t_fp8, kept_folded_speedup=t_bf16 / t_kept,
            graph_speedup=t_bf16 / t_graph, graph_ms=t_graph * 1e3,
            over_default=t_fp8 / t_default, within_one_rounding=ok, excess=excess,
            bits_differ=differ, folded=folded)
    return [t_bf16 / t_fp8, t_bf16 / t_kept, t_bf16 / t_graph, t_fp8 / t_default,
            t_graph * 1e3, check]


@contextlib.contextmanager
def fp8_products(K) -> Iterator[list[bool]]:
    """Inside it, whether each FP8 product tried ran on FP8 (False: a chunk did not fold and
    the call fell back to the bf16 product), in the order of the calls."""
    ran, product = [], K._fp8_product

    def watched(*args):
        y = product(*args)
        ran.append(y is not None)
        return y

    with mock.patch.object(K, "_fp8_product", watched):
        yield ran


def fp8_kernel_calls(K, x, t, kept) -> list:
    """The FP8 product's kernels for ``x`` against each weight kept folded (``kept``, prepared
    with ``prefill_product="fp8"``), without the host read of the fold check, so that a CUDA
    graph can replay them: the activation kernel folding to E4M3, then cuBLAS's block-scaled
    product.  Empty where a weight did not fold."""
    if not all(p.folded is not None for p in kept):
        return []

    def call(p):
        inexact = torch.zeros(1, dtype=torch.int32, device=x.device)
        a8, a_scales, _, _ = K._activation_kernel(x, t, p.fmt, None, "fp8 bench", None,
                                                  e4m3_inexact=inexact)
        return K._block_scaled_fp8_mm(a8, a_scales, *p.folded)

    return [functools.partial(call, p) for p in kept]


def opt_in_linear(run: Run, step: str, calls: list, exact: torch.Tensor, t_bf16: float
                  ) -> tuple[float, str]:
    """bf16's time over the decode path's with the opt-in product of :data:`OPT_IN`'s ``step``
    (``calls``: the row's linear calls), and whether its first output is within one bf16
    rounding of ``exact``."""
    with opt_in(step):
        ok, excess = within_one_rounding(calls[0](), exact)
        return t_bf16 / seconds_per_call(run, calls), "yes" if ok else f"NO ({excess:.2g})"


def spread(values: list[float]) -> str:
    return f"{min(values):.3g} / {statistics.median(values):.3g} / {max(values):.3g}"


def product_only(run, K, skinny, tk, x, t, name, sets, preps, w_global,
                 path) -> tuple[float, float]:
    """Seconds of the product alone (activations already rounded) and, for the decode path,
    its bytes (codes, scales, activation values, output; each once) over time against the
    device copy."""
    from kbbq_pl.formats import get_format

    fmt_ = get_format(name)
    kind, _, gain = K._scale_meta(fmt_)
    m, k = x.shape
    n = sets[0][0].shape[0]
    if path == "decode":
        values, pts = K.quantize_activation_values(x, t, name, dtype=skinny.activation_dtype(kind),
                                                   word_order=True)
        calls = [functools.partial(skinny.skinny_matmul, values, m, c, s.view(torch.uint8), pts,
                                   w_global, fmt_.block_size, kind, gain,
                                   p.shift(s.view(torch.uint8)), None,
                                   torch.bfloat16) for (c, s), p in zip(sets, preps)]
        seconds = seconds_per_call(run, calls)
        nbytes = (sets[0][0].numel() + sets[0][1].numel() + values.numel() * values.element_size()
                  + m * n * 2)
        rate = nbytes / seconds
        return seconds, rate / run.copy_rate if run.copy_rate else float("nan")
    if path == "prefill":
        a, pts = K.quantize_activation_values(x, t, name, dtype=torch.bfloat16)

        def product(c, s, p):
            w = K.decode_weight(c, s, name)
            alpha = p.alpha(static=False)
            if alpha is not None:
                return torch.addmm(a.new_empty(()), a, w.T, beta=0, alpha=alpha)
            return tk.decoded_matmul(a, w, pts, w_global, kind, gain, None,
                                     torch.bfloat16)

        calls = [functools.partial(product, c, s, p) for (c, s), p in zip(sets, preps)]
        return seconds_per_call(run, calls), float("nan")
    return float("nan"), float("nan")


TUNE_TILES = ((16, 64, 256, 4, 3), (16, 64, 256, 4, 5), (16, 64, 128, 4, 6),
              (16, 64, 512, 4, 4), (16, 128, 256, 4, 4), (16, 128, 128, 4, 6),
              (16, 128, 256, 8, 3), (16, 128, 512, 8, 3), (16, 256, 256, 8, 3),
              (16, 32, 256, 2, 4))
"""Decode GEMM tiles (rows, columns, K, warps, stages) the ``tune`` section times: the
once-autotuned ones and their neighbours (deeper pipelines, longer K tiles, a narrow column tile
on ``mma.sync``); none spills on Triton 3.6 for sm_90 (``/tmp`` compile of each, 3.4 to 3.95
SASS a weight, 5.2 for MX at 16x32x256)."""
TUNE_DP4A_TILES = ((1, 32, 128, 4, 4), (1, 32, 128, 4, 6), (1, 64, 128, 8, 4),
                   (1, 128, 256, 8, 3), (1, 128, 256, 4, 3), (1, 256, 128, 8, 3),
                   (1, 64, 512, 4, 3), (1, 64, 256, 4, 4))
"""The one-row DP4A product's tiles the ``tune`` section times (its once-autotuned ones and
neighbours; ``/tmp`` compile of each on Triton 3.6 for sm_90: 2.1 to 3.0 SASS a weight, no
spills, 32 to 106 registers; the smallest without a barrier in its loop)."""


def one_row_gemms(run: Run, section: str, reserve: float) -> Iterator[tuple]:
    """At M = 1, each of ``tune``'s shapes and each format while ``reserve`` seconds are left
    (else a note naming ``section``): ``(k, n, name, x, q, sets, preps, values, pts)``, the
    activations rounded to the values the decode GEMM's tensor-core product reads."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import skinny

    for k, n, w, _ in gemm_weights(run, section, reserve=reserve, shapes="tune_shapes"):
        x = torch.randn(1, k, device=run.device, dtype=torch.bfloat16)
        for name in run.formats:
            kind = K._scale_meta(get_format(name))[0]
            q, sets, preps = packed_copies(run, w, name)
            values, pts = K.quantize_activation_values(x, None, name,
                                                       dtype=skinny.activation_dtype(kind),
                                                       word_order=True)
            yield k, n, name, x, q, sets, preps, values, pts


def decode_gemm_rate(run: Run, a, a_pts, name: str, q, sets, preps, nbytes: int,
                     same_as=None, **kwargs) -> tuple[float, float, bool]:
    """The decode GEMM's seconds a call over ``sets`` (:func:`decode_gemm_calls`, with
    ``kwargs``), ``nbytes`` over them as a fraction of the copy bandwidth, and whether its
    output's bits are those of the launch on ``same_as[0]`` (True where not given)."""
    calls = decode_gemm_calls(a, a_pts, name, q, sets, preps, **kwargs)
    same = same_as is None or torch.equal(
        calls[0]().view(torch.int16),
        decode_gemm_calls(a, a_pts, name, q, same_as[:1], preps[:1])[0]().view(torch.int16))
    seconds = seconds_per_call(run, calls)
    return seconds, nbytes / seconds / run.copy_rate if run.copy_rate else math.nan, same


def decode_gemm_calls(a, a_pts, name: str, q, sets, preps, probes=None, **kwargs) -> list:
    """The decode GEMM on activations ``a`` (per-tensor scale ``a_pts``) and each copy of the
    weights (``sets``, their prepared ``preps``), bf16 out, with ``kwargs`` (a tile, K splits,
    DP4A's block scales) and each call's ``probes`` buffer where given."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import skinny

    fmt_ = get_format(name)
    kind, _, gain = K._scale_meta(fmt_)
    return [functools.partial(skinny.skinny_matmul, a, a.shape[0], c, s.view(torch.uint8), a_pts,
                              q.global_scale, fmt_.block_size, kind, gain,
                              p.shift(s.view(torch.uint8)), None, torch.bfloat16,
                              probe=None if probes is None else probes[i], **kwargs)
            for i, ((c, s), p) in enumerate(zip(sets, preps))]


def tune_section(run: Run) -> None:
    """The decode GEMM alone at M = 1 on K = N = 8192, 4096 x 4096, 4096 -> 14336 and 4096 ->
    1024 (a Llama-3-8B layer's key and value projections), at every tile of
    :data:`TUNE_TILES` with K unsplit and at half, once and twice the K splits it would take
    (at small shapes a launch's fixed cost, the split-K reduction among it, weighs most:
    ``bench/gpu_report.py``), and the one-row
    DP4A product (as shipped and at each of :data:`TUNE_DP4A_TILES`), against the shipped
    launch (one tile for a decode step's rows): microseconds and the fraction of the copy
    bandwidth, each output within one bf16 rounding of the exact product.  Opt-in
    (``--sections tune``): it compiles every tile, what a GPU session spends to find where the
    decode GEMM's bandwidth goes."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import skinny
    from kbbq_pl.kernels import triton_kernels as tk

    rows = []
    sms = tk.sm_count(run.device)
    for k, n, name, x, q, sets, preps, values, pts in one_row_gemms(run, "tune", 20):
        fmt_ = get_format(name)
        exact = exact_product(x, None, q, name)
        weight_bytes = sets[0][0].numel() + sets[0][1].numel() + n * 2  # and the output
        operands = {  # activations, their per-tensor scale and block scales, bytes moved
            skinny.PRODUCT_DOT: (values, pts, None, weight_bytes + values.numel() * 2)}
        if "dp4a" not in run.off:
            _, a_scales, dp4a_pts, doubled = K._activation_kernel(
                x, None, fmt_, None, "tune", None, values_dtype=torch.int8, codes=False)
            operands[skinny.PRODUCT_DP4A] = (
                doubled, dp4a_pts, a_scales,
                weight_bytes + doubled.numel() + a_scales.numel() * 4)

        def timed(product, config, split):
            a, a_pts, block_scales, nbytes = operands[product]
            calls = decode_gemm_calls(a, a_pts, name, q, sets, preps, config=config,
                                      split_k=split, a_scales=block_scales)
            ok, _ = within_one_rounding(calls[0](), exact)
            seconds = seconds_per_call(run, calls)
            return seconds, nbytes / seconds / run.copy_rate if run.copy_rate else math.nan, ok

        tuned = timed(skinny.PRODUCT_DOT, None, None)
        rows.append([f"{k}->{n}", name, "as shipped", "auto", tuned[0] * 1e6, tuned[1],
                     1.0, "yes" if tuned[2] else "NO"])
        if "dp4a" not in run.off:
            got = attempt(run, f"tune {name} DP4A as shipped",
                          functools.partial(timed, skinny.PRODUCT_DP4A, None, None),
                          (math.nan, math.nan, False))
            rows.append([f"{k}->{n}", name, "DP4A as shipped", "auto", got[0] * 1e6,
                         got[1], tuned[0] / got[0], "yes" if got[2] else "NO"])
        tiles = [(tile, skinny.PRODUCT_DOT) for tile in TUNE_TILES]
        tiles += [(tile, skinny.PRODUCT_DP4A) for tile in TUNE_DP4A_TILES
                  if "dp4a" not in run.off]
        if not run.cuda:  # the CPU's tiny run: one tile of each product
            tiles = tiles[:1] + tiles[len(TUNE_TILES):len(TUNE_TILES) + 1]
        for (bm, bn, bk, warps, stages), product in tiles:
            if run.left() < 10:
                run.notes.append(f"tune: stopped at {k} -> {n} {name} for time")
                break
            base = skinny.split_count(n, k, bn, bk, sms, 1, bm)
            label = ("DP4A " if product == skinny.PRODUCT_DP4A else "") + (
                f"{bm}x{bn}x{bk} w={warps} s={stages}")
            for split in dict.fromkeys((1, max(1, base // 2), base, 2 * base)):
                config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "PRODUCT": product,
                          "num_warps": warps, "num_stages": stages}
                got = attempt(run, f"tune {name} {label}",
                              functools.partial(timed, product, config, split),
                              (math.nan, math.nan, False))
                rows.append([f"{k}->{n}", name, label, split, got[0] * 1e6, got[1],
                             tuned[0] / got[0], "yes" if got[2] else "NO"])
    rows.sort(key=lambda r: (r[0], r[1], -r[5] if r[5] == r[5] else 0))
    table("decode GEMM alone at M = 1, by tile and K splits (tune): microseconds, fraction of "
          "the copy bandwidth, speed against the launch as shipped",
          ["K->N", "format", "tile", "splits", "us", "copy fraction", "x as shipped",
           "within one rounding"], rows)
    for shape, name in dict.fromkeys((r[0], r[1]) for r in rows):
        found = [r for r in rows if (r[0], r[1]) == (shape, name) and r[5] == r[5]]
        if found:
            best = max(found, key=lambda r: r[5])
            run.line(f"tune {shape} {name}: best tile (copy fraction; x as shipped)",
                     f"{best[2]} splits {best[3]} ({best[5]:.3g}; {best[6]:.3g})")
    for row in rows:
        run.add("tune", shape=row[0], fmt=row[1], tile=row[2], splits=row[3], us=row[4],
                copy_fraction=row[5], x_shipped=row[6], within_one_rounding=row[7] == "yes")


def probe_section(run: Run) -> None:
    """Where a decode GEMM launch's time goes, read inside it: at M = 1 on ``tune``'s shapes,
    the shipped launch (the tensor cores, and the opt-in DP4A product) timed as shipped and
    again writing its programs' clocks
    (``skinny_matmul(probe=...)``), in CUDA graphs over copies of the weights as every timing
    here; the clocks of a call in the
    middle of the graph read by :func:`gpu_report.probe_summary` (the probed call's time is
    printed beside the shipped one's: a probe that moved it much tells less).  Opt-in
    (``--sections probe``); not under the interpreter (it reads the GPU's clocks)."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import skinny
    from kbbq_pl.kernels import triton_kernels as tk

    if not run.cuda:
        run.notes.append("probe: not under the interpreter (it reads the GPU's clocks)")
        return
    sms = tk.sm_count(run.device)
    for k, n, name, x, q, sets, preps, values, pts in one_row_gemms(run, "probe", 10):
        # product: (activations, their per-tensor scale, DP4A's block scales, its one tile)
        products = {"shipped": (values, pts, None, skinny._tile_shapes(skinny._CONFIGS)[:1])}
        if "dp4a" not in run.off:
            _, a_scales, dp4a_pts, doubled = K._activation_kernel(
                x, None, get_format(name), None, "probe", None, values_dtype=torch.int8,
                codes=False)
            products["DP4A"] = (doubled, dp4a_pts, a_scales, skinny._DP4A_TILES)
        for product, (a, a_pts, block_scales, tiles) in products.items():
            count = skinny.programs((n,), k, 1, sms, tiles=tiles)
            probes = [torch.zeros(count, skinny.PROBE_SLOTS, dtype=torch.int64,
                                  device=run.device) for _ in sets]

            def measured(a=a, a_pts=a_pts, block_scales=block_scales, probes=probes) -> dict:
                shipped = seconds_per_call(run, decode_gemm_calls(
                    a, a_pts, name, q, sets, preps, a_scales=block_scales))
                probed = seconds_per_call(run, decode_gemm_calls(
                    a, a_pts, name, q, sets, preps, probes, a_scales=block_scales))
                summary = gpu_report.probe_summary(probes[len(probes) // 2].tolist())
                return dict(us=shipped * 1e6, probed_us=probed * 1e6, **summary)

            got = attempt(run, f"probe {name} {product}", measured, None,
                          step="dp4a" if product == "DP4A" else None)
            if got is not None:
                run.add("probe", shape=f"{k}->{n}", fmt=name, product=product,
                        splits=skinny._splits((n,), k, 1, sms, None, *tiles[0]), **got)
    lines = gpu_report.probe_table(run.rows)
    print("\n### where a decode GEMM launch's time goes, M = 1 (probe): the launch's time in a "
          "CUDA graph, shipped and probed; its programs and SMs; its span and its last "
          "program's start on the global timer; the SM clock; medians of each program's "
          "phases; the program that ended last\n")
    print("\n".join(lines), flush=True)


def stream_section(run: Run) -> None:
    """How fast the decode GEMM's weight reads stream without its decode and product
    (``bench/_gpu_stream.py``): at M = 1 on ``tune``'s shapes, each format, the weights read at
    the grid, K splits, tile and pipeline depth of the shipped decode-step launch and XORed,
    each result checked against torch's: the codes alone as stored, then codes and scale bytes
    (what the GEMM reads) as stored (``rows``) and copied tile by tile (``tiles``), at its
    stages and at twice them; beside them the shipped decode GEMM on the same weights, as
    stored, tile by tile (``skinny_matmul`` reads ``tile_major``'s layout: the same bits) and
    without its decode (``decode=False``: the words' bits to the tensor cores; time only).
    Microseconds and the fraction of the copy bandwidth (the bytes read; for the GEMM codes,
    scales, activations and output).  Opt-in (``--sections stream``): it asks whether the
    GEMM's reads or its own work hold its rate."""
    from kbbq_pl.kernels import skinny
    from kbbq_pl.kernels import triton_kernels as tk

    stream = _bench_module("_gpu_stream")
    block_n, block_k = skinny.decode_step_tile()  # the interpreter's under it
    shipped = skinny._CONFIGS[0]
    warps, stages = (shipped.num_warps, shipped.num_stages) if run.cuda else (4, 2)
    variants = [("codes rows", False, False, stages), ("weights rows", True, False, stages),
                ("weights tiles", True, True, stages), ("weights rows", True, False, 2 * stages),
                ("weights tiles", True, True, 2 * stages)]
    sms = tk.sm_count(run.device)
    rows = []
    for k, n, name, _, q, sets, preps, values, pts in one_row_gemms(run, "stream", 10):
        splits = skinny._splits((n,), k, 1, sms, None, skinny.FEW_ROWS, block_n, block_k)
        weights = [(c, s.view(torch.uint8)) for c, s in sets]
        codes_bytes, scale_bytes = weights[0][0].numel(), weights[0][1].numel()
        gemm = functools.partial(decode_gemm_rate, run, values, pts, name, q,
                                 nbytes=codes_bytes + scale_bytes + values.numel() * 2 + n * 2)
        failed = (math.nan, math.nan, False)
        t_gemm, f_gemm, _ = attempt(run, f"stream: decode GEMM {name}",
                                    functools.partial(gemm, sets, preps), failed)
        rows.append([f"{k}->{n}", name, "decode GEMM", splits, t_gemm * 1e6, f_gemm, 1.0, "-"])
        if n % block_n or k % (block_k * splits):
            run.notes.append(f"stream: {k} -> {n} skipped (not whole {block_n} x {block_k} "
                             f"tiles at {splits} splits)")
            continue
        tiled = [skinny.tile_major(c, s, block_n, block_k) for c, s in weights]
        for what, with_scales, tiles, depth in variants:
            def timed(with_scales=with_scales, tiles=tiles, depth=depth):
                calls = [functools.partial(stream.stream_words, c, splits, block_n, block_k,
                                           s if with_scales else None, t if tiles else None,
                                           depth, warps)
                         for (c, s), t in zip(weights, tiled)]
                c, s = weights[0]
                same = torch.equal(calls[0](), stream.stream_reference(
                    c, splits, s if with_scales else None))
                seconds = seconds_per_call(run, calls)
                nbytes = codes_bytes + (scale_bytes if with_scales else 0)
                rate = nbytes / seconds / run.copy_rate if run.copy_rate else math.nan
                return seconds, rate, same

            got = attempt(run, f"stream {k}->{n} {name} {what} s={depth}", timed, failed)
            rows.append([f"{k}->{n}", name, f"{what}, s={depth}", splits, got[0] * 1e6, got[1],
                         t_gemm / got[0], "yes" if got[2] else "NO"])
        for what, operands, kwargs in (("decode GEMM tiles", tiled, {"same_as": sets}),
                                       ("decode GEMM, no decode", sets, {"decode": False})):
            got = attempt(run, f"stream: {what} {name}",
                          functools.partial(gemm, operands, preps, **kwargs), failed)
            check = "-" if "decode" in kwargs else "same bits" if got[2] else "NO"
            rows.append([f"{k}->{n}", name, what, splits, got[0] * 1e6, got[1], t_gemm / got[0],
                         check])
    table(f"the decode GEMM's weight reads alone at M = 1 (stream): {block_n} x {block_k} tiles, "
          f"{warps} warps; microseconds, fraction of the copy bandwidth, the decode GEMM's time "
          "over this row's", ["K->N", "format", "what", "splits", "us", "copy fraction",
                              "GEMM time / this", "checked"], rows)
    for shape, name in dict.fromkeys((r[0], r[1]) for r in rows):
        found = {r[2]: r[5] for r in rows if (r[0], r[1]) == (shape, name)}
        run.line(f"stream {shape} {name}: copy fraction of the weights read as stored / tile by "
                 f"tile (s={stages}); the codes alone as stored; the decode GEMM's as stored / "
                 "tile by tile / without its decode", "{} / {}; {}; {} / {} / {}".format(*(
                     fmt(found.get(what, math.nan)) for what in (
                         f"weights rows, s={stages}", f"weights tiles, s={stages}",
                         f"codes rows, s={stages}", "decode GEMM", "decode GEMM tiles",
                         "decode GEMM, no decode"))))
    for row in rows:
        run.add("stream", shape=row[0], fmt=row[1], what=row[2], splits=row[3], us=row[4],
                copy_fraction=row[5], gemm_over_this=row[6], same=row[7])


# --------------------------------------------------------------------------- activations


def act_section(run: Run) -> None:
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import triton_kernels as tk

    device = run.device
    m, k = run.shapes["act_shape"]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    rows, best = [], {}
    # each output's arguments: codes (the decode and tiled paths), bf16 values (what prefill reads)
    outputs = {"codes": {}, "bf16 values": {"values_dtype": torch.bfloat16, "codes": False}}
    for name in run.formats:
        fmt_ = get_format(name)
        d = fmt_.block_size
        written = {"codes": m * k // 2 + m * k // d, "bf16 values": 2 * m * k}
        t_blocks = kbbq_blocks(k, d, device)
        scales = [None, 0.01] if fmt_.global_scale else [None]
        kind, rounding, gain = K._scale_meta(fmt_)
        for transform, label in ((None, "none"), (t_blocks, f"{d}x{d} blocks")):
            t_read = 0 if transform is None else transform.numel() * 4
            for scale in scales:
                scale_label = ("static" if scale is not None else
                               "dynamic (2 passes)" if fmt_.global_scale else "-")
                gs = None if scale is None else torch.tensor(scale, device=device)
                for output, kwargs in outputs.items():
                    def call(transform=transform, gs=gs, kwargs=kwargs):
                        return tk.quantize_activations(x, transform, d, kind, rounding, gain, gs,
                                                       **kwargs)

                    seconds = act_seconds(run, call)
                    rate = (2 * m * k + t_read + written[output]) / seconds
                    ratio = rate / run.copy_rate if run.copy_rate else float("nan")
                    rows.append([name, label, scale_label, output, "fma chain (exact)",
                                 seconds * 1e3, rate / 1e9, ratio, TARGETS["act"], ""])
                    best[name, label, output] = max(best.get((name, label, output), 0.0), ratio)
                    run.add("act", fmt=name, transform=label, scale=scale_label, output=output,
                            product="fma", ms=seconds * 1e3, x_copy=ratio)
            # the other products of T x, beside the default FMA chain at its tile: the chain
            # at the other tile (one row a thread or two), Triton's FMA dot (the same chain,
            # operands through shared memory: the default before the register chain) at the
            # tile it ran at (64 rows by 64 elements)
            default = tk.ACT_TILES[d]
            others = [(tk.PRODUCT_FMA_CHAIN, "fma chain, one tile a program",
                       {**default, "TILES": 1})]
            others += [(tk.PRODUCT_FMA_CHAIN, f"fma chain {rows_}x1",
                        {**default, "BLOCK_M": rows_})
                       for rows_ in (128, 256) if rows_ != default["BLOCK_M"]]
            dot_tile = {"BLOCK_M": 64, "NB": 64 // d, "num_warps": 4}
            others += [(tk.PRODUCT_FMA_DOT, "fma dot", dot_tile),
                       (tk.PRODUCT_FMA_DOT, "fma dot, four tiles a program",
                        {**dot_tile, "TILES": 4})]
            # tensor cores: x (bf16) times T as three bf16 parts, not the chain's rounding
            others += [(tk.PRODUCT_BF16X3, "bf16x3 tensor cores", tk.BF16X3_TILE),
                       (tk.PRODUCT_BF16X3, "bf16x3 tensor cores, four tiles a program",
                        {**tk.BF16X3_TILE, "TILES": 4})]
            for (product, product_label, tile), output in itertools.product(
                    others if transform is not None else (), outputs):
                gs = None if not fmt_.global_scale else torch.tensor(0.01, device=device)
                kwargs = outputs[output]
                exact = tk.quantize_activations(x, transform, d, kind, rounding, gain, gs,
                                                **kwargs)

                def other(transform=transform, gs=gs, product=product, tile=tile,
                          kwargs=kwargs):
                    return tk.quantize_activations(x, transform, d, kind, rounding, gain, gs,
                                                   config=tile, product=product, **kwargs)

                seconds = act_seconds(run, other)
                got = other()
                first = 0 if output == "codes" else -1  # the codes, or the values
                mismatch = float((got[first] != exact[first]).float().mean())
                # bf16x3 reads T as three bf16 parts: 6 bytes an entry, not FP32's 4
                t_bytes = t_read * 3 // 2 if product == tk.PRODUCT_BF16X3 else t_read
                rate = (2 * m * k + t_bytes + written[output]) / seconds
                ratio = rate / run.copy_rate
                rows.append([name, label, "static" if gs is not None else "-", output,
                             product_label, seconds * 1e3, rate / 1e9, ratio, TARGETS["act"],
                             f"{mismatch:.2g}"])
                run.add("act", fmt=name, transform=label, output=output, product=product_label,
                        ms=seconds * 1e3, x_copy=ratio, code_mismatch=mismatch)
                run.goal(f"activation {name} {label} {product_label}, {output}: x copy "
                         "(mismatch rate)", f"{ratio:.3g} ({mismatch:.2g})", [ratio],
                         TARGETS["act"])
    table(f"activation kernel, {m} x {k} bf16: bytes read + written over time against the copy",
          ["format", "transform", "scale", "output", "product", "ms", "GB/s", "x copy",
           "target", "code mismatch"], rows)
    for name in run.formats:
        for label in dict.fromkeys(key[1] for key in best if key[0] == name):
            found = {output: best[name, label, output] for output in ("codes", "bf16 values")
                     if (name, label, output) in best}
            run.goal(f"activation {name} {label}, exact: x copy (codes; bf16 values)",
                     "; ".join(f"{ratio:.3g}" for ratio in found.values()),
                     list(found.values()), TARGETS["act"])


FEW_ROWS_VARIANTS = (
    ("from memory", None, None),
    ("from memory, one row a program", None, lambda tk, d: dict(tk.FEW_ROWS_TILES[d], BLOCK_M=1)),
    ("registers", None, lambda tk, d: tk.REGISTER_FEW_ROWS_TILES[d]),
    ("fma dot, 4 warps", 1, lambda tk, d: {"BLOCK_M": 16, "NB": 64 // d, "num_warps": 4}))
"""The decode step's activation kernels ``act_few`` times: (label, product (None: the chain),
the tile of ``triton_kernels`` ``tk`` for block size ``d`` (None: the default,
``FEW_ROWS_TILES``: one output of a block a lane, the operands loaded column by column; the
tile before it held a block row a thread, the chain in registers; the FMA dot takes 64 elements
of blocks a program, its MX kernel spills on Triton 3.6 with one warp, not with four))."""


def act_few_section(run: Run) -> None:
    """The activation kernel of a decode step (M = 1 and 16 rows) with KBBQ-shaped blocks, as
    the decode path runs it (word-ordered values for the decode GEMM; NVFP4 with a static
    scale): the FMA chain from memory, one output a lane (the default), the chain in
    registers, a block row a thread (the tile before it), and Triton's FMA dot (its operands
    staged in shared memory, the transforms loaded in one go), at every K of the GEMM shapes:
    microseconds a call in a CUDA graph cycling through copies of the transforms (they come
    from memory, as in a model, where every layer has its own), and whether each variant's
    codes are the default's."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import skinny
    from kbbq_pl.kernels import triton_kernels as tk

    rows = []
    for name in run.formats:
        fmt_ = get_format(name)
        d = fmt_.block_size
        kind, rounding, gain = K._scale_meta(fmt_)
        gs = torch.tensor(0.01, device=run.device) if fmt_.global_scale else None
        for k in sorted({k for k, _ in run.shapes["gemm_shapes"]}):
            first = kbbq_blocks(k, d, run.device)
            # enough copies to overflow L2 (a model's layers each read their own): a transform
            # is 0.25 to 1.75 MB, so more copies than weights take
            ts = [first] + [first.clone()
                            for _ in range(copies(run, first.numel() * 4, most=1024) - 1)]
            for m in (1, 16):
                x = torch.randn(m, k, device=run.device, dtype=torch.bfloat16)
                default = tk.quantize_activations(x, first, d, kind, rounding, gain, gs)[0]
                for label, product, tile in FEW_ROWS_VARIANTS:
                    config = None if tile is None else dict(tile(tk, d))
                    options = dict(config=config, product=product)
                    calls = [functools.partial(
                        tk.quantize_activations, x, t, d, kind, rounding, gain, gs,
                        values_dtype=skinny.activation_dtype(kind), codes=False,
                        word_order=True, **options) for t in ts]
                    seconds = attempt(run, f"act_few {label}", functools.partial(
                        seconds_per_call, run, calls), math.nan)
                    same = attempt(run, f"act_few {label} codes", lambda: torch.equal(
                        tk.quantize_activations(x, first, d, kind, rounding, gain, gs,
                                                **options)[0], default), False)
                    rows.append([name, k, m, label, seconds * 1e6, "yes" if same else "NO"])
                    run.add("act_few", fmt=name, k=k, m=m, variant=label, us=seconds * 1e6,
                            same_codes=same)
    table("activation kernel of a decode step, KBBQ-shaped blocks, word-ordered values (the "
          "decode path), in a CUDA graph over copies of the transforms: microseconds a call, "
          "and whether the codes are the default's (the chain from memory)",
          ["format", "K", "M", "variant", "us", "same codes"], rows)
    for name in run.formats:
        for label, *_ in FEW_ROWS_VARIANTS[1:]:
            gains = [other[4] / chain[4] for chain in rows for other in rows
                     if chain[0] == other[0] == name and chain[1:3] == other[1:3]
                     and chain[3] == FEW_ROWS_VARIANTS[0][0] and other[3] == label]
            if gains:
                run.line(f"decode-step activation kernel {name}: time of '{label}' / the "
                         "default's, min/median/max", spread(gains))


def act_seconds(run: Run, call) -> float:
    """Median seconds of ``call`` (do_bench: the L2 cache flushed between repeats; the input is
    larger than the cache anyway)."""
    if not run.cuda:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    from triton.testing import do_bench

    return do_bench(call, warmup=25, rep=100, return_mode="median") / 1e3


def copy_rate(run: Run) -> None:
    """The device copy's bytes (read + written) per second, 8192 x 8192 bf16 (the ceiling every
    bandwidth ratio is taken against)."""
    m, k = run.shapes["act_shape"]
    x = torch.randn(m, k, device=run.device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    seconds = act_seconds(run, lambda: y.copy_(x))
    run.copy_rate = 2 * x.numel() * 2 / seconds
    print(f"device-to-device copy of {m} x {k} bf16: {seconds * 1e3:.4g} ms, "
          f"{run.copy_rate / 1e9:.4g} GB/s (read + written)")
    run.add("copy", ms=seconds * 1e3, gb_s=run.copy_rate / 1e9)
    run.line("device copy, GB/s (read + written)", f"{run.copy_rate / 1e9:.4g}")


# --------------------------------------------------------------------------- rows


def rows_section(run: Run) -> None:
    """Where the prefill path starts paying: ``linear_w4a4`` on each path that can take ``M``
    rows (decode: the decode GEMM, any M; tiled: the GEMM of both packed operands, up to 256;
    prefill: weights decoded + cuBLAS, any M) against bf16, KBBQ-shaped blocks, at the
    shapes of ``rows_shapes``; for MX beside prefill the FP8 product's kernels in a CUDA graph
    (no host read, the weights kept folded); the summary gives the fewest rows from which
    prefill (and the FP8 product) beat decode on every shape (what ``K.PREFILL_MIN_M`` should
    be)."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format
    from kbbq_pl.kernels import skinny
    from kbbq_pl.kernels import triton_kernels as tk

    rows, prefill_wins, fp8_wins = [], {}, {}
    for k, n, w, w_set in gemm_weights(run, "rows", reserve=30, shapes="rows_shapes"):
        packed = {name: packed_copies(run, w, name) for name in run.formats}
        folded: dict[str, list] = {}
        small = min(run.shapes["rows_m"])
        for m in run.shapes["rows_m"]:
            x = torch.randn(m, k, device=run.device, dtype=torch.bfloat16)
            t_bf16 = bf16_seconds(run, x, w_set)
            for name in run.formats:
                q, sets, preps = packed[name]
                t = kbbq_blocks(k, get_format(name).block_size, run.device)
                ref = exact_product(x, t, q, name)
                seconds = {}
                for path in ("decode", "tiled", "prefill"):
                    if path == "tiled" and m > max(small, 256):
                        continue
                    calls = [functools.partial(K.linear_w4a4, x, c, s, q.global_scale, name, t,
                                               prepared=p, path=path)
                             for (c, s), p in zip(sets, preps)]
                    seconds[path] = seconds_per_call(run, calls)
                    ok, excess = within_one_rounding(calls[0](), ref)
                    product = attempt(run, f"rows {path} product", functools.partial(
                        product_only, run, K, skinny, tk, x, t, name, sets, preps,
                        q.global_scale, path), (math.nan, math.nan))[0]
                    rows.append([f"{k}->{n}", m, name, path, t_bf16 * 1e3,
                                 seconds[path] * 1e3, t_bf16 / seconds[path], product * 1e3,
                                 "yes" if ok else f"NO ({excess:.2g})"])
                    run.add("rows", k=k, n=n, m=m, fmt=name, path=path, bf16_ms=t_bf16 * 1e3,
                            ms=seconds[path] * 1e3, speedup=t_bf16 / seconds[path],
                            product_ms=product * 1e3, within_one_rounding=ok)
                if "prefill" in seconds and get_format(name).scale_kind == "e8m0":
                    if name not in folded:  # the weights folded once a shape
                        folded[name] = [K.prepare_weight(c, s, q.global_scale, name,
                                                         keep_decoded=True,
                                                         prefill_product="fp8")
                                        for c, s in sets]
                    seconds["fp8"] = attempt(run, FP8_ROWS, functools.partial(
                        fp8_rows_row, run, K, x, t, name, folded[name], ref, t_bf16, rows),
                        math.nan)
                    fp8_wins.setdefault(name, {}).setdefault(m, []).append(
                        seconds["fp8"] < seconds["decode"])
                if "prefill" in seconds:
                    prefill_wins.setdefault(name, {}).setdefault(m, []).append(
                        seconds["prefill"] < seconds["decode"])
        print(f"  [{time.perf_counter() - run.start:.0f} s] rows {k}->{n} done", flush=True)
        del w_set, packed, folded
    table("linear_w4a4 by path against bf16 torch.matmul, KBBQ-shaped blocks; product: the "
          "GEMM alone on rounded activations (decode: the decode GEMM; prefill: weight decode + "
          "product; the rest of the linear's time is its activation kernel)",
          ["K->N", "M", "format", "path", "bf16 ms", "W4A4 ms", "x bf16", "product ms",
           "within one rounding"], rows)
    for name, wins in prefill_wins.items():
        beaten = [m for m in sorted(wins) if all(wins[m])]
        run.line(f"rows from which prefill beats decode, {name} (PREFILL_MIN_M = "
                 f"{K.PREFILL_MIN_M[get_format(name).scale_kind]})",
                 beaten[0] if beaten else f"none up to {max(wins)}")
    for name, wins in fp8_wins.items():
        beaten = [m for m in sorted(wins) if all(wins[m])]
        run.line(f"rows from which the FP8 product (graph, no host read) beats decode, {name}",
                 beaten[0] if beaten else f"none up to {max(wins)}")


def fp8_rows_row(run: Run, K, x, t, name: str, kept, ref, t_bf16: float,
                 rows: list) -> float:
    """The rows section's FP8 row: the product's kernels in a CUDA graph (no host read; the
    weights ``kept`` folded) against bf16, checked within one rounding; its seconds."""
    calls = fp8_kernel_calls(K, x, t, kept)
    if not calls:
        return math.nan
    seconds = seconds_per_call(run, calls)
    ok, excess = within_one_rounding(calls[0](), ref)
    k, n, m = x.shape[1], kept[0].shape[0], x.shape[0]
    rows.append([f"{k}->{n}", m, name, "fp8 (graph, no host read)", t_bf16 * 1e3,
                 seconds * 1e3, t_bf16 / seconds, math.nan,
                 "yes" if ok else f"NO ({excess:.2g})"])
    run.add("rows", k=k, n=n, m=m, fmt=name, path="fp8", bf16_ms=t_bf16 * 1e3,
            ms=seconds * 1e3, speedup=t_bf16 / seconds, within_one_rounding=ok)
    return seconds



# --------------------------------------------------------------------------- peers


def peers_section(run: Run) -> None:
    import triton

    helper = gemlite_helper(run.gemlite_autotune)
    if not run.cuda and helper is None:
        print("peers: skipped (they run on CUDA only)")
        run.notes.append("peers: skipped on the CPU")
        return
    device = run.device
    gemlite_formats = [name for name in run.formats if name in GEMLITE_LAYERS] if helper else []
    capability = torch.cuda.get_device_capability(device)[0] if run.cuda else None
    for name in list(gemlite_formats):
        if not gemlite_compiles(name, triton.__version__, capability):
            gemlite_formats.remove(name)
            run.notes.append(f"peers: GemLite {name} skipped: Triton {triton.__version__} cannot "
                             f"compile its tl.dot_scaled with E4M3 scales for sm_9x (3.8 can)")
    rows, ours_rows = [], []
    best_m1: dict[str, list[float]] = {}
    for k, n, w, w_set in gemm_weights(run, "peers", reserve=40):
        packed = {name: packed_copies(run, w, name) for name in gemlite_formats}
        layers = {(name, cls): gemlite_layers(helper, cls, q, sets)
                  for name, (q, sets, _) in packed.items() for cls in GEMLITE_LAYERS[name]
                  if hasattr(helper, cls)}
        for m in run.shapes["gemm_m"]:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            t_bf16 = bf16_seconds(run, x, w_set)
            peers = [(f"GemLite {cls}", functools.partial(layer_calls, made, x))
                     for (_, cls), made in layers.items()]
            if run.cuda:
                peers.insert(0, ("int4 tinygemm g32", functools.partial(int4_calls, run, w, x)))
            for peer, make_calls in peers:
                if out_of_time(run, f"{peer} at {k}->{n} M={m}"):
                    break
                try:
                    seconds = seconds_per_call(run, make_calls())
                except Exception as error:  # a peer that does not run here is a row, not a crash
                    rows.append([f"{k}->{n}", m, peer, t_bf16 * 1e3, "-", "-", failure(error)])
                    continue
                rows.append([f"{k}->{n}", m, peer, t_bf16 * 1e3, seconds * 1e3,
                             t_bf16 / seconds, ""])
                run.add("peers", k=k, n=n, m=m, peer=peer, bf16_ms=t_bf16 * 1e3,
                        ms=seconds * 1e3, speedup=t_bf16 / seconds)
                if m == 1:
                    best_m1.setdefault(peer, []).append(t_bf16 / seconds)
            for name, (q, sets, _) in packed.items():
                weight_only = layers.get((name, GEMLITE_LAYERS[name][0]))
                if out_of_time(run, f"GemLite on our operands, {name} at {k}->{n} M={m}"):
                    break
                if weight_only is not None:
                    ours_rows.append(gemlite_on_ours_row(run, x, name, q, sets, weight_only,
                                                         t_bf16))
        del w, w_set, packed, layers
    table("peers against bf16 torch.matmul (same shapes, same timing): torch's int4 kernel on "
          "random codes; GemLite's layers on our stored FP4 weights, fed the bf16 input (its "
          "A4W4 layers round it themselves)",
          ["K->N", "M", "peer", "bf16 ms", "peer ms", "x bf16", "note"], rows)
    for peer, values in best_m1.items():
        run.line(f"peer {peer} M=1: x bf16 min/median/max", spread(values))
    if ours_rows:
        table("GemLite's weight-only FP4 GEMM on our operands (KBBQ blocks; NVFP4 with a static "
              "activation scale): our activation kernel's bf16 values, then GemLite's A16W4 "
              "layer built from the codes and block scales as kbbq-pl stores them (its split-K "
              "partial sums added in FP32, not its default bf16 atomics), against "
              "linear_w4a4 on the same operands; same product: within one bf16 rounding of "
              "the exact product of the same codes; deterministic: the same bits in four "
              "calls (ours: a fixed-order reduction)",
              ["K->N", "M", "format", "bf16 ms", "ours ms", "ours x bf16", "GemLite ms",
               "GemLite x bf16", "GemLite / ours, time", "same product", "deterministic"],
              ours_rows)
    found = [r for r in run.rows if r.get("section") == "gemlite on ours"]
    for name in run.formats:
        for m in (1, 16):
            mine = [r for r in found if r["fmt"] == name and r["m"] == m]
            if mine:
                times = [r["gemlite_ms"] / r["ours_ms"] for r in mine]
                same = sum(r["same_product"] for r in mine)
                repeats = sum(r["same_bits_repeated"] for r in mine)
                run.line(f"GemLite A16W4 on our operands, {name} M={m}: its time / ours, "
                         f"min/median/max (same product {same}/{len(mine)}, deterministic "
                         f"{repeats}/{len(mine)})", spread(times),
                         "ours faster", f"{sum(v >= 1 for v in times)}/{len(times)}")


PEER_RESERVE_S = 30.0
"""Seconds of the budget a peer row needs to start (GemLite compiles its tiles for each new
shape on first use)."""


def out_of_time(run: Run, row: str) -> bool:
    """Whether the peers' next row would overrun the budget (said once, naming the row)."""
    if run.left() - run.reserved_s >= PEER_RESERVE_S:
        return False
    said = "peers: stopped for time before "
    if not any(note.startswith(said) for note in run.notes):
        run.notes.append(said + row)
    return True


def failure(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"


def int4_calls(run: Run, w: torch.Tensor, x: torch.Tensor) -> list:
    """The int4 peer on enough copies of its weights to overflow the L2 cache."""
    return [int4_tinygemm(w, x) for _ in range(copies(run, w.numel() // 2))]


def int4_tinygemm(w: torch.Tensor, x: torch.Tensor):
    """torch's int4 weight-only product (``aten._weight_int4pack_mm``, tinygemm: the kernel of
    torchao's int4 weight-only config), group 32, on random codes of ``w``'s shape."""
    n, k = w.shape
    group = 32
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=w.device)
    packed = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    weight = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
    scales_zeros = torch.randn(k // group, n, 2, dtype=torch.bfloat16, device=w.device) * 0.01
    return functools.partial(torch.ops.aten._weight_int4pack_mm, x, weight, group, scales_zeros)


def gemlite_helper(autotune: str):
    """GemLite 0.6's ``gemlite.helper`` (carried to the GPU as a wheel) with its autotuning set
    to ``autotune``, or None (said once)."""
    try:
        import gemlite
        from gemlite import helper
    except Exception as error:  # noqa: BLE001 - absent or broken: say so and go on
        print(f"GemLite not importable ({type(error).__name__}: {error}); its rows are skipped")
        return None
    gemlite.set_autotune(autotune)
    print(f"GemLite {gemlite.__version__}, autotuning {autotune!r}")
    return helper


GEMLITE_LAYERS = {"nvfp4": ("A16W4_NVFP", "A4W4_NVFP_dynamic"),
                  "mxfp4": ("A16W4_MXFP", "A4W4_MXFP_dynamic")}
"""GemLite's layers of each format: weight-only first (bf16 activations times FP4 weights,
which on our activation kernel's values is the W4A4 product), then W4A4 with the activations
rounded by GemLite itself (its rule, no transform: not our product)."""
DOT_SCALED_E4M3_SM90_TRITON = (3, 8)
"""The first Triton that compiles ``tl.dot_scaled`` with E4M3 block scales (GemLite's NVFP4
layers) for sm_90: 3.6 and 3.7 fail in ``TritonGPUAccelerateMatmul`` (an assertion; a 64 x 64
x 128 kernel compiled on a CPU for sm_90, 2026-11-30), 3.8 and 3.9 compile it; the E8M0 (MX)
case compiles on all four.  The H200 run of 2026-11-30 (Triton 3.6) lost every GemLite NVFP4
row to it."""


def gemlite_compiles(name: str, triton_version: str, capability: int | None) -> bool:
    """Whether GemLite's layers of format ``name`` compile with this Triton for a GPU of
    compute capability ``capability`` (major; None: not a CUDA device):
    :data:`DOT_SCALED_E4M3_SM90_TRITON`."""
    release = tuple(int(part) for part in triton_version.split("+")[0].split(".")[:2])
    return not (name == "nvfp4" and capability == 9 and release < DOT_SCALED_E4M3_SM90_TRITON)


def gemlite_layer(helper, cls: str, codes: torch.Tensor, scales: torch.Tensor,
                  global_scale: torch.Tensor | None) -> nn.Module:
    """GemLite's layer ``cls`` on the weights as kbbq-pl stores them, through its
    ``from_packed_weights``: packed E2M1 codes ``[N, K/2]`` (element ``2i`` in the low nibble,
    GemLite's order and code table) and their block scales typed as float8 (its ``pack``
    converts them ``.to`` its scale dtype: uint8 exponent bytes would be converted by value);
    NVFP4's global scale in GemLite's convention, the reciprocal of ours.  Built from our
    weights, not from a bf16 one, GemLite's quantizer (compiled by ``torch.compile`` for each
    shape) never runs: its kernels are the same."""
    layer = getattr(helper, cls)(device=str(codes.device), dtype=torch.bfloat16)
    if global_scale is not None:  # NVFP4
        return layer.from_packed_weights(codes, scales=scales.view(torch.float8_e4m3fn),
                                         meta_scale=1.0 / global_scale)
    return layer.from_packed_weights(codes, scales=scales.view(torch.float8_e8m0fnu))


def gemlite_layers(helper, cls: str, q, sets) -> list[nn.Module] | Exception:
    """One GemLite layer per copy of the weights (the calls cycle through them, as ours do), or
    the error GemLite raised (a row says it)."""
    try:
        return [gemlite_layer(helper, cls, c, s, q.global_scale) for c, s in sets]
    except Exception as error:  # noqa: BLE001 - GemLite refusing our operands is a finding
        return error


def layer_calls(layers: list[nn.Module] | Exception, x: torch.Tensor) -> list:
    if isinstance(layers, Exception):
        raise layers
    return [functools.partial(layer, x) for layer in layers]


def set_gemlite_factor(layer: nn.Module, factor: torch.Tensor) -> None:
    """The FP32 factor GemLite's weight-only NVFP4 epilogue multiplies the sum by: here both
    per-tensor scales (activations' and weights'), as our epilogue applies them."""
    with torch.no_grad():
        layer.meta_scale.copy_(factor)


@contextlib.contextmanager
def fp32_partial_sums():
    """GemLite's split-K GEMM adding its partial sums in FP32 (``set_native_atomic_bfp16(False)``,
    its accuracy setting) instead of bf16 atomics (its default on sm_90), restored after: the
    setting under which its product can be ours."""
    try:
        from gemlite.core import set_native_atomic_bfp16
    except Exception:  # noqa: BLE001 - a stand-in (CPU test) or another GemLite: as it is
        yield
        return
    set_native_atomic_bfp16(False)
    try:
        yield
    finally:
        set_native_atomic_bfp16(True)


def gemlite_on_ours_row(run: Run, x: torch.Tensor, name: str, q, sets, layers,
                        t_bf16: float) -> list:
    """One row of GemLite's weight-only GEMM (``layers``, one per copy of the weights) on our
    operands against ``linear_w4a4``."""
    from kbbq_pl import kernels as K
    from kbbq_pl.formats import get_format

    m, k = x.shape
    n = q.qdata.shape[0]
    fmt_ = get_format(name)
    t = kbbq_blocks(k, fmt_.block_size, x.device)
    head = [f"{k}->{n}", m, name, t_bf16 * 1e3]
    scale = K.quantize_activation_values(x, t, name)[1] if fmt_.global_scale else None
    ours = [functools.partial(K.linear_w4a4, x, c, s, q.global_scale, name, t, scale,
                              prepared=K.prepare_weight(c, s, q.global_scale, name, scale))
            for c, s in sets]
    t_ours = seconds_per_call(run, ours)

    def theirs_call(layer):
        values, _ = K.quantize_activation_values(x, t, name, scale, dtype=torch.bfloat16)
        return layer(values)

    try:
        if isinstance(layers, Exception):
            raise layers
        with fp32_partial_sums():
            if scale is not None:
                for layer in layers:
                    set_gemlite_factor(layer, scale * q.global_scale)
            theirs = [functools.partial(theirs_call, layer) for layer in layers]
            y = theirs[0]()
            same, excess = within_one_rounding(y, exact_product(x, t, q, name, scale))
            # split-K partial sums added atomically come in any order: the bits may change
            repeats = all(torch.equal(y, theirs[0]()) for _ in range(3))
            t_theirs = seconds_per_call(run, theirs)
    except Exception as error:  # GemLite refusing our operands is a finding, not a crash
        return head + [t_ours * 1e3, t_bf16 / t_ours, "-", "-", "-", failure(error), "-"]
    run.add("gemlite on ours", k=k, n=n, m=m, fmt=name, bf16_ms=t_bf16 * 1e3,
            ours_ms=t_ours * 1e3, gemlite_ms=t_theirs * 1e3, same_product=same,
            same_bits_repeated=repeats)
    return head + [t_ours * 1e3, t_bf16 / t_ours, t_theirs * 1e3, t_bf16 / t_theirs,
                   t_theirs / t_ours, "yes" if same else f"NO ({excess:.2g})",
                   "yes" if repeats else "NO"]


# --------------------------------------------------------------------------- model


def llama(shapes: dict, device) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=shapes["hidden"], intermediate_size=shapes["intermediate"],
                         num_attention_heads=shapes["heads"],
                         num_key_value_heads=shapes["kv_heads"],
                         num_hidden_layers=shapes["layers"], vocab_size=shapes["vocab"],
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def quantize_for_kernels(model: nn.Module, fmt: str, calibration: torch.Tensor):
    """Every linear of the decoder layers quantized the library's way: its weight replaced by a
    :class:`~kbbq_pl.quant.w4a4.W4A4Weight` (``Q(W T^-1)`` with its own random matrix per
    block, the cost of KBBQ's transforms) that computes ``F.linear`` on the kernels where they
    run (``lm_head`` and embeddings stay bf16).  NVFP4 gets static activation scales, as every
    recipe ships: ``amax(T x) / (448 * 6)`` of each linear's inputs over one forward of the
    token ids ``calibration`` (MX has none).  The sibling linears (q/k/v, gate/up) are grouped
    as ``from_pretrained`` groups them (:func:`kbbq_pl.quant.siblings.group_sibling_linears`);
    returns those hooks."""
    from kbbq_pl.formats import get_format
    from kbbq_pl.quant.layers import w4a4_weight
    from kbbq_pl.quant.siblings import group_sibling_linears
    from kbbq_pl.quant.stats import act_scales_from_amax, kept_inputs, transformed_amax

    fmt_ = get_format(fmt)
    d = fmt_.block_size
    linears, transforms = {}, {}
    for index, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    key = f"model.layers.{index}.{name}"
                    linears[key] = child
                    transforms[key] = kbbq_blocks(child.in_features, d, child.weight.device,
                                                  seed=len(transforms))
    scales: dict[str, torch.Tensor] = {}
    if fmt_.global_scale:  # the pipeline's calibration of static scales
        device = calibration.device
        with kept_inputs(linears, model, device) as kept, torch.no_grad():
            model(input_ids=calibration, use_cache=False)
            amax = transformed_amax(kept, linears, transforms, fmt_, device)
        scales = act_scales_from_amax(amax, lambda value: value)
    for key, child in linears.items():
        static = key in scales
        weight = w4a4_weight(child, fmt, transforms[key],
                             act_scale="static" if static else "dynamic",
                             act_global_scale=scales.get(key), name=key)
        child.weight = nn.Parameter(weight, requires_grad=False)
    return group_sibling_linears(model)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds; for a quantized weight, its codes, scales and transforms."""
    from kbbq_pl.formats import QuantizedTensor

    if isinstance(tensor, QuantizedTensor):
        inner, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in inner)
    return tensor.numel() * tensor.element_size()


def weight_bytes(model: nn.Module, linears_only: bool) -> int:
    """Bytes of the model's parameters and buffers (only the decoder linears' with
    ``linears_only``)."""
    total = 0
    for name, module in model.named_modules():
        if linears_only and (not isinstance(module, nn.Linear) or name == "lm_head"):
            continue
        tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        total += sum(tensor_bytes(t) for t in tensors)
    return total


def decode_tokens_per_second(model, prompt: torch.Tensor, tokens: int, use_graphs: bool,
                             compiled: bool = False, trace: Path | None = None):
    """Greedy decoding of ``prompt [batch, length]``; returns (tokens/s summed over the batch,
    how it ran).  ``compiled``: each step's forward through ``torch.compile`` (Inductor's
    default mode, one shape, no graphs of its own: the step is still captured here).
    ``trace``: after the timing, one more step as it was timed (a CUDA graph's replay: its
    kernels, not their launches) under ``torch.profiler``, written there as a Chrome trace."""
    from transformers import StaticCache

    from kbbq_pl._compat import cache_argument

    device = prompt.device
    batch = prompt.shape[0]
    # room for the warm-up steps too: transformers may place each step after the cache's last
    # filled slot rather than at ``cache_position`` (an index past the end asserts on the GPU)
    length = prompt.shape[1] + tokens + 16
    try:
        cache = StaticCache(config=model.config, max_cache_len=length)
    except TypeError:  # transformers 4.x
        cache = StaticCache(config=model.config, max_batch_size=batch, max_cache_len=length,
                            device=device, dtype=torch.bfloat16)
    with_cache = {cache_argument(model): cache}
    with torch.no_grad():
        out = model(input_ids=prompt, **with_cache, use_cache=True,
                    cache_position=torch.arange(prompt.shape[1], device=device))
    ids = out.logits[:, -1:].argmax(-1)
    position = torch.tensor([prompt.shape[1]], device=device)

    forward = torch.compile(model, dynamic=False) if compiled else model

    def step():
        logits = forward(input_ids=ids, **with_cache, use_cache=True,
                         cache_position=position).logits
        ids.copy_(logits[:, -1:].argmax(-1))
        position.add_(1)

    how = "compiled, " if compiled else ""
    run = step
    if use_graphs:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(3):  # warm-up (autotuning, prepared weights) outside the capture
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.no_grad():
                step()
            run = graph.replay
            how += "CUDA graph"
        except Exception as error:  # report and measure eagerly rather than not at all
            print(f"(CUDA graph capture failed: {type(error).__name__}: {error}; decoding eagerly)")
            torch.cuda.synchronize()
    if run is step:
        how += "eager"
    position.fill_(prompt.shape[1])
    with torch.no_grad():
        if device.type == "cuda":
            run()  # warm-up
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(tokens - 1):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if trace is not None:  # a failing profile costs the trace, not the timing
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if device.type == "cuda" else [])
            try:
                with profile(activities=activities) as prof:
                    run()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                trace.parent.mkdir(parents=True, exist_ok=True)
                prof.export_chrome_trace(str(trace))
            except Exception:
                traceback.print_exc()
    return batch * (tokens - 1) / seconds, how


def module_label(module: nn.Module) -> str:
    """A module's name in the profiler's spans: its class, ``Linear W4A4`` for a linear whose
    weight is a :class:`~kbbq_pl.quant.w4a4.W4A4Weight` (the bf16 head stays ``Linear``)."""
    from kbbq_pl.quant.w4a4 import W4A4Weight

    name = type(module).__name__
    return f"{name} W4A4" if isinstance(getattr(module, "weight", None), W4A4Weight) else name


@contextlib.contextmanager
def module_spans(model: nn.Module):
    """Every module's forward inside ``model`` a ``torch.profiler`` span named by
    :func:`module_label`, so that a trace tells which module launched each kernel
    (``gpu_report.by_module``); the hooks come off on leaving.  Yields the set of the spans'
    names, filled as they open."""
    from torch.profiler import record_function

    open_spans: dict[int, list] = {}
    labels: set[str] = set()

    def enter(module, args):
        label = module_label(module)
        labels.add(label)
        span = record_function(label)
        span.__enter__()
        open_spans.setdefault(id(module), []).append(span)

    def leave(module, args, output):
        open_spans[id(module)].pop().__exit__(None, None, None)

    handles = [h for module in model.modules()
               for h in (module.register_forward_pre_hook(enter),
                         module.register_forward_hook(leave, always_call=True))]
    try:
        yield labels
    finally:
        for handle in handles:
            handle.remove()


def profile_steps(run: Run, model, prompt: torch.Tensor, batch: torch.Tensor, name: str) -> None:
    """Where the time of one eager decode step (after ``prompt``) and one prefill of ``batch``
    goes: ``torch.profiler``'s operators and kernels, the 12 longest on the device (on the CPU:
    the host), printed; the Chrome traces written beside the JSON when there is one
    (``trace_<name>_decode.json.gz``, ``trace_<name>_prefill.json.gz``; ``name`` a format, or
    ``bf16`` for the reference), each module's forward a span in them (:func:`module_spans`),
    and the decode step's kernel time by module in the summary."""
    from torch.profiler import ProfilerActivity, profile

    from kbbq_pl._compat import cache_argument

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True)
        ids = out.logits[:, -1:].argmax(-1)
        name = cache_argument(model)
        with_cache = {name: out[name]}  # the output's field is named as the argument
        steps = {"decode": lambda: model(input_ids=ids, **with_cache, use_cache=True),
                 "prefill": lambda: model(input_ids=batch, use_cache=False)}
        for what, call in steps.items():
            call()  # warm: autotuning and prepared weights stay out of the trace
            if run.cuda:
                torch.cuda.synchronize()
            with profile(activities=activities) as prof, module_spans(model) as spans:
                call()
                if run.cuda:
                    torch.cuda.synchronize()
            key = "self_device_time_total" if run.cuda else "self_cpu_time_total"
            rows = (f"batch {prompt.shape[0]}" if what == "decode"
                    else "x".join(map(str, batch.shape)))
            print(f"\n### torch.profiler: {name}, one {what} ({rows}), by {key}\n")
            operators = prof.key_averages()  # the operators and kernels, not the spans
            operators[:] = [e for e in operators if e.key not in spans]
            print(operators.table(sort_by=key, row_limit=12), flush=True)
            if run.trace_dir is not None:
                run.trace_dir.mkdir(parents=True, exist_ok=True)
                trace = run.trace_dir / f"trace_{name}_{what}.json.gz"
                prof.export_chrome_trace(str(trace))
                if run.cuda:  # the kernels by launch shape (GEMMs launched alike share a row)
                    gpu_report.report_trace(trace, 12)
                    if what == "decode":
                        attempt(run, f"decode step by module {name}", functools.partial(
                            module_line, run, trace, f"model {name}: one eager decode step "
                            f"({rows})"), None)


def step_kernels_line(run: Run, trace: Path, what: str, step_us: float) -> None:
    """A profiled decode step's kernels by launch shape (``gpu_report``), and the summary's
    line of its kernel time and launches against the step's time: where a step is far longer
    than its kernels, the time is between them (launches, the graph's gaps), not in them."""
    summary = gpu_report.report_trace(trace, 12)
    run.line(f"{what}: one batch-1 step's kernel time, launches and span (us), against the "
             f"step's {step_us:.0f} us", f"{summary.total_us:.0f}, {summary.launches}, "
             f"{summary.span_us:.0f}")


def module_line(run: Run, trace: Path, what: str) -> None:
    """The summary's line of a profiled step's kernel time by module (``gpu_report``'s
    ``module_shares``), where the trace has the modules' spans."""
    modules = gpu_report.by_module(gpu_report.read_trace(trace))
    if modules:
        run.line(f"{what}, kernel time by module (share, launches)",
                 gpu_report.module_shares(modules), "", "")


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def kernel_and_emulation(model: nn.Module, ids: torch.Tensor):
    """(largest relative difference of the first decoder block's linear outputs, kernels
    against emulation, on that block's own inputs; logits on the kernels; emulated logits).
    The emulation is ``W4A4Weight``'s product on the same device (on the CPU it took minutes)."""
    from kbbq_pl.quant import w4a4

    inputs: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_pre_hook(
        lambda module, args, name=name: inputs.setdefault(name, args[0].detach()))
        for name, module in model.model.layers[0].named_modules()
        if isinstance(module, nn.Linear) and isinstance(module.weight, w4a4.W4A4Weight)]
    with torch.no_grad():
        with mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ()):
            emulated = model(input_ids=ids, use_cache=False).logits.float()
            for hook in hooks:
                hook.remove()
            expected = {name: model.model.layers[0].get_submodule(name)(x)
                        for name, x in inputs.items()}
        kernel_logits = model(input_ids=ids, use_cache=False).logits.float()
        worst = max(relative_difference(model.model.layers[0].get_submodule(name)(x),
                                        expected[name]) for name, x in inputs.items())
    return worst, kernel_logits, emulated


def logits_to_bf16(logits: torch.Tensor, base: torch.Tensor) -> str:
    agree = float((logits.argmax(-1) == base.argmax(-1)).float().mean())
    return f"{relative_difference(logits, base):.3g} (top-1 {agree:.0%})"


def quantized_models(run: Run, section: str, state: dict, calibration: torch.Tensor):
    """``(format, model, sibling hooks)``: the Llama of ``state`` quantized by
    :func:`quantize_for_kernels` to each of the run's formats in turn, while a minute of the
    budget is left (one at a time: the caller drops each before the next)."""
    for name in run.formats:
        if run.left() < 60:
            run.notes.append(f"{section}: {name} skipped for time")
            return
        model = llama(run.shapes, run.device)
        model.load_state_dict(state)
        hooks = quantize_for_kernels(model, name, calibration)
        if run.cuda:
            torch.cuda.empty_cache()
        yield name, model, hooks
        del model


def model_section(run: Run) -> None:
    from kbbq_pl.formats import get_format
    from kbbq_pl.quant import w4a4

    shapes, device, cuda = run.shapes, run.device, run.cuda
    start = time.perf_counter()

    def progress(step: str) -> None:  # a run cut off at its time limit still shows how far it got
        print(f"  [model section, {time.perf_counter() - start:.0f} s] {step}", flush=True)

    reference = llama(shapes, device)
    gen = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, shapes["vocab"], (b, shapes["prompt"]), generator=gen)
               .to(device) for b in shapes["decode_batches"]}
    batch = torch.randint(0, shapes["vocab"], shapes["prefill"], generator=gen).to(device)
    probe = torch.randint(0, shapes["vocab"], (1, shapes["logits_tokens"]), generator=gen)

    def prefill(model):
        with torch.no_grad():
            return model(input_ids=batch, use_cache=False).logits

    def measure(model) -> dict:
        out = {"prefill": act_seconds(run, functools.partial(prefill, model))}
        for b, prompt in prompts.items():
            out[b] = decode_tokens_per_second(model, prompt, shapes["decode_tokens"], cuda)
        return out

    with torch.no_grad():
        base_logits = reference(input_ids=probe.to(device), use_cache=False).logits.float()
    base_memory = weight_bytes(reference, linears_only=False)
    base_linears = weight_bytes(reference, linears_only=True)
    progress("bf16 model built")
    base = measure(reference)
    base_prefill = prefill(reference)  # what the FP8 product's logits are held against
    if 1 in prompts:  # plain generate's decoding: no CUDA graph, each launch from the host
        base_eager, _ = decode_tokens_per_second(reference, prompts[1], shapes["decode_tokens"],
                                                 False)
    header = ["model", "weights x bf16", "linears x bf16"]
    for b in prompts:
        header += [f"decode b{b} tok/s", f"decode b{b} x bf16"]
    header += ["decode run", f"prefill {'x'.join(map(str, shapes['prefill']))} ms",
               "prefill x bf16", "prefill x bf16, MX on FP8 (opt-in)",
               "block 0 linears: kernels vs emulation",
               "logits to bf16: kernels", "logits to bf16: emulation"]
    rows = [["bf16", 1.0, 1.0] + [v for b in prompts for v in (base[b][0], 1.0)]
            + [base[next(iter(prompts))][1], base["prefill"] * 1e3, 1.0, "-", "-", "-", "-"]]
    progress(f"row {rows[-1]}")
    # the same modules' kernels, for the W4A4 steps' by-module tables to be read against
    attempt(run, "profiled bf16 steps", functools.partial(
        profile_steps, run, reference, prompts[min(prompts)], batch, "bf16"), None)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    del reference
    for name, model, hooks in quantized_models(run, "model", state, batch[:1]):
        progress(f"{name} quantized")
        memory = weight_bytes(model, linears_only=False) / base_memory
        linears = weight_bytes(model, linears_only=True) / base_linears
        got = measure(model)
        fp8_prefill, fp8_logits = float("nan"), "-"
        if get_format(name).scale_kind == "e8m0":  # the opt-in FP8 product, eager as above
            from kbbq_pl import kernels as K

            def fp8_run(model=model) -> tuple[float, str]:
                with mock.patch.object(w4a4, "PREFILL_PRODUCT", "fp8"):
                    ratio = base["prefill"] / act_seconds(run, functools.partial(prefill,
                                                                                 model))
                    with fp8_products(K) as ran:
                        on_fp8 = prefill(model).float()
                default = prefill(model).float()
                diff = float((on_fp8 - default).abs().max() / default.abs().max())
                return ratio, (f"{diff:.2g}; on FP8 in {sum(ran)} of {len(ran)} "
                               f"linears tried; to bf16's: FP8 "
                               f"{logits_to_bf16(on_fp8, base_prefill.float())}, default "
                               f"{logits_to_bf16(default, base_prefill.float())}")

            fp8_prefill, fp8_logits = attempt(run, FP8_ROWS, fp8_run, (math.nan, "FAILED"))
            run.goal(f"model {name}: prefill x bf16, MX on FP8 (opt-in; logits max |diff| "
                     f"against the default path, over max |logit|, and each path's prefill "
                     f"logits against the bf16 model's: {fp8_logits})",
                     f"{fp8_prefill:.3g}", [fp8_prefill], TARGETS["model_prefill"])
        if 1 in prompts:  # batch-1 decoding with the opt-in one-row DP4A product
            def dp4a_decode(model=model) -> float:
                with opt_in("dp4a"):
                    tps, _ = decode_tokens_per_second(model, prompts[1], shapes["decode_tokens"],
                                                      cuda)
                return tps / base[1][0]

            dp4a_ratio = attempt(run, f"one-row DP4A {name}", dp4a_decode, math.nan,
                                 step="dp4a")
            run.goal(f"model {name}: decode batch 1 x bf16, one-row DP4A product (opt-in)",
                     f"{dp4a_ratio:.3g}", [dp4a_ratio], TARGETS["model_decode_1"])
            run.add("model_dp4a", fmt=name, decode_b1_x=dp4a_ratio)
        if 1 in prompts:  # batch-1 decoding with every linear launched on its own
            from kbbq_pl.quant.siblings import group_sibling_linears

            def siblings_alone(model=model, hooks=hooks) -> float:
                hooks.remove()
                try:
                    tps, _ = decode_tokens_per_second(model, prompts[1], shapes["decode_tokens"],
                                                      cuda)
                finally:
                    group_sibling_linears(model)
                return tps / base[1][0]

            alone_ratio = attempt(run, f"siblings alone {name}", siblings_alone, math.nan)
            run.goal(f"model {name}: decode batch 1 x bf16, each linear launched on its own "
                     f"(q/k/v and gate/up not grouped; the default groups them: "
                     f"{got[1][0] / base[1][0]:.3g})", f"{alone_ratio:.3g}", [alone_ratio],
                     TARGETS["model_decode_1"])
            run.add("model_siblings_alone", fmt=name, decode_b1_x=alone_ratio)

            def eager_decode(model=model) -> float:
                tps, _ = decode_tokens_per_second(model, prompts[1], shapes["decode_tokens"],
                                                  False)
                return tps / base_eager

            eager_ratio = attempt(run, f"eager decode {name}", eager_decode, math.nan)
            run.line(f"model {name}: decode batch 1 x bf16, both without a CUDA graph (as plain "
                     f"generate decodes: host time counts; bf16 {base_eager:.1f} tok/s)",
                     f"{eager_ratio:.3g}", "", "")
            run.add("model_eager", fmt=name, decode_b1_x=eager_ratio, bf16_tok_s=base_eager)
        progress(f"{name} timed")
        profile_steps(run, model, prompts[min(prompts)], batch, name)
        linear_diff, kernel_logits, emulated = kernel_and_emulation(model, probe.to(device))
        rows.append([name, memory, linears] + [v for b in prompts
                                              for v in (got[b][0], got[b][0] / base[b][0])]
                    + [got[next(iter(prompts))][1], got["prefill"] * 1e3,
                       base["prefill"] / got["prefill"], fp8_prefill, f"{linear_diff:.2g}",
                       logits_to_bf16(kernel_logits, base_logits),
                       logits_to_bf16(emulated, base_logits)])
        progress(f"row {rows[-1]}")
        run.add("model", fmt=name, memory=memory, linears=linears,
                **{f"decode_b{b}_x": got[b][0] / base[b][0] for b in prompts},
                prefill_x=base["prefill"] / got["prefill"], prefill_fp8_x=fp8_prefill,
                prefill_fp8_logits_diff=fp8_logits, block0_diff=linear_diff)
        for b in prompts:
            key = "model_decode_1" if b == 1 else "model_decode_16"
            ratio = got[b][0] / base[b][0]
            run.goal(f"model {name}: decode batch {b} x bf16", f"{ratio:.3g}", [ratio],
                     TARGETS[key])
        ratio = base["prefill"] / got["prefill"]
        run.goal(f"model {name}: prefill x bf16", f"{ratio:.3g}", [ratio],
                 TARGETS["model_prefill"])
        run.goal(f"model {name}: weights x bf16 (linears)", f"{memory:.3g} ({linears:.3g})",
                 [memory], TARGETS["memory"], higher=False)
        del model
    table(f"whole model: random Llama, hidden {shapes['hidden']}, {shapes['layers']} layers",
          header, rows)


def compiled_section(run: Run) -> None:
    """Batch-1 greedy decoding of the model section's Llama, bf16 and W4A4, each step through
    ``torch.compile`` (Inductor fuses the norms, rotary embedding and activations between the
    linears; a W4A4 linear is one opaque operator, ``kbbq_pl::w4a4_linear``) and replayed from
    a CUDA graph, as serving stacks run decoding: the ratio with the other operations compiled
    on both sides."""
    shapes, device = run.shapes, run.device
    prompt = torch.randint(0, shapes["vocab"], (1, shapes["prompt"]),
                           generator=torch.Generator().manual_seed(1)).to(device)
    calibration = torch.randint(0, shapes["vocab"], (1, shapes["prefill"][1]),
                                generator=torch.Generator().manual_seed(2)).to(device)
    reference = llama(shapes, device)
    traces = run.trace_dir or Path(tempfile.mkdtemp(prefix="kbbq_compiled_"))
    trace = traces / "trace_bf16_compiled.json.gz"
    trace.unlink(missing_ok=True)
    base, how = decode_tokens_per_second(reference, prompt, shapes["decode_tokens"], run.cuda,
                                         compiled=True, trace=trace)
    rows = [["bf16", base, 1.0, how]]
    print(f"  bf16: {base:.1f} tok/s ({how})", flush=True)
    if trace.exists():
        attempt(run, "compiled step kernels bf16", functools.partial(
            step_kernels_line, run, trace, "model bf16 compiled", 1e6 / base), None)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    del reference
    from torch._inductor import config

    for name, model, _ in quantized_models(run, "compiled", state, calibration):
        # as loaded (Inductor's post-grad pass runs q/k/v and gate/up as one operator each),
        # then, while time is left, the same on the opt-in one-row DP4A product (which decides
        # whether it becomes the default), then with every linear its own operator (the pass off)
        grouped = config.post_grad_custom_post_pass
        compiled_with = None
        for label, compile_pass, step in ((name, grouped, None),
                                          (f"{name}, one-row DP4A", grouped, "dp4a"),
                                          (f"{name}, each linear on its own", None, None)):
            if label != name and run.left() < 60:
                run.notes.append(f"compiled: {label} skipped for time")
                continue
            if compile_pass is not compiled_with or label == name:
                # the DP4A row reuses the default's graph: the product is chosen inside the
                # opaque W4A4 operators, when they run (the CUDA graph is captured again)
                torch._dynamo.reset()
            compiled_with = compile_pass
            trace = traces / f"trace_{label.replace(', ', '_').replace(' ', '-')}_compiled.json.gz"
            trace.unlink(missing_ok=True)
            with config.patch(post_grad_custom_post_pass=compile_pass), \
                    (opt_in(step) if step else contextlib.nullcontext()):
                got, how = attempt(run, f"compiled {label}", functools.partial(
                    decode_tokens_per_second, model, prompt, shapes["decode_tokens"],
                    run.cuda, compiled=True, trace=trace), (math.nan, "failed"), step=step)
            ratio = got / base
            rows.append([label, got, ratio, how])
            print(f"  {label}: {got:.1f} tok/s ({how})", flush=True)
            if trace.exists():
                attempt(run, f"compiled step kernels {label}", functools.partial(
                    step_kernels_line, run, trace, f"model {label} compiled", 1e6 / got), None)
            run.add("compiled", fmt=name, grouped=compile_pass is not None,
                    dp4a=step == "dp4a", decode_b1_x=ratio, how=how)
            run.goal(f"model {label} compiled: decode batch 1 x bf16 compiled", f"{ratio:.3g}",
                     [ratio], TARGETS["model_decode_1"])
        found = {row[0]: row[1] for row in rows}
        if f"{name}, one-row DP4A" in found:  # what decides ONE_ROW_PRODUCT's default
            run.line(f"model {name} compiled batch 1: tok/s on the one-row DP4A product over "
                     "the default's", f"{found[f'{name}, one-row DP4A'] / found[name]:.3g}")
        del model
    table(f"whole model under torch.compile: random Llama, hidden {shapes['hidden']}, "
          f"{shapes['layers']} layers, batch-1 decode", ["model", "tok/s", "x bf16", "run"],
          rows)


# --------------------------------------------------------------------------- main


SECTIONS = {"check": (check_section, 190), "gemm": (gemm_section, 85), "act": (act_section, 45),
            "act_few": (act_few_section, 40), "model": (model_section, 230),
            "rows": (rows_section, 60),
            "peers": (peers_section, 60), "compiled": (compiled_section, 150),
            "tune": (tune_section, 60), "probe": (probe_section, 45),
            "stream": (stream_section, 60)}
"""Each section and the seconds of budget it needs to start (on an H200: the check 187 s and
the gemm 74 s on 2026-12-04, their compiles; the model section 198 s before its profiler and
FP8 rows); the default order runs first what decides a default or the sibling grouping
(check, model, gemm, compiled: the model section did not fit after gemm and act_few on
2026-12-04), then the decode step's activation kernel, the activation kernel's variants, the
rows and the peers (measured: GemLite slower on our operands), which take what time is left."""


PRECOMPILE_S = 90.0
"""The most seconds the compiles of recorded kernels (``--specs``) may run: beside the check,
whose own compiles then find them in the cache, and before any other section starts (none
runs beside a timing)."""


def stopped(signum, frame) -> None:
    """SIGTERM (``timeout`` at the end of the device call's limit): leave through ``main``'s
    ``finally``, which writes the JSON and prints the summary of what was measured."""
    raise SystemExit(f"stopped by signal {signum} (the call's time limit)")


def commit() -> str:
    """The commit of the tree measured, ``-dirty`` where it has changes: what
    ``scripts/gpu_session.sh prepare`` recorded (``KBBQ_PL_COMMIT``; the device's copy may hold
    a stale ``.git``), else ``git describe``."""
    if os.environ.get("KBBQ_PL_COMMIT"):
        return os.environ["KBBQ_PL_COMMIT"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("KBBQ_PL_COMMIT", "?")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections",
                        default="check,model,gemm,compiled,act_few,act,rows,peers",
                        help=f"comma-separated, of {', '.join(SECTIONS)} (run in that order)")
    parser.add_argument("--formats", default="nvfp4,mxfp4")
    parser.add_argument("--budget-s", type=float, default=500.0,
                        help="seconds the run may take; a section that would not fit is skipped")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--specs", type=Path,
                        help="the kernel specializations an earlier run recorded here are "
                             "compiled by parallel processes beside the check; this run's "
                             "are recorded here")
    parser.add_argument("--gemlite-autotune", default="default",
                        choices=("default", "fast", "max"),
                        help="GemLite's autotuning for the peers: its 'fast' compiles about 25 "
                             "tiles for every shape and layer (its shipped tunings cover no FP4 "
                             "type), more than a short GPU session has; 'default' tries its 2")
    parser.add_argument("--tiny", "--dry-run", dest="tiny", action="store_true",
                        help="tiny shapes on the CPU under the Triton interpreter (timings "
                             "meaningless): checks the script's logic")
    parser.add_argument("--check-child", type=Path, metavar="PATH",
                        help="run as the check section's child process, naming each step in "
                             "PATH (the section starts it: check_in_child)")
    parser.add_argument("--off", default="",
                        help=f"comma-separated, of {', '.join(SWITCHES)}: turned off for the "
                             "run, not checked")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        sys.exit("bench/gpu.py measures a CUDA GPU and none is visible; "
                 "`python bench/gpu.py --tiny` runs its logic on tiny CPU shapes")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before kbbq_pl.kernels loads triton
    from kbbq_pl import kernels as K

    device = torch.device("cuda" if cuda else "cpu")
    if not K.available(device):
        sys.exit(f"kbbq_pl.kernels cannot run on {device} (is triton installed?)")
    sections = args.sections.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    off = [step for step in args.off.split(",") if step]
    if set(off) - set(SWITCHES):
        parser.error(f"unknown switches {sorted(set(off) - set(SWITCHES))}")
    shapes = TINY if args.tiny else FULL
    run = Run(shapes, device, args.formats.split(","), args.budget_s,
              trace_dir=args.json.parent if args.json else None,
              gemlite_autotune=args.gemlite_autotune, progress=args.check_child)
    for step in off:
        switch_off(run, step)
    import triton

    where = (f"{torch.cuda.get_device_name(device)}" if cuda else
             "CPU under the Triton interpreter (tiny shapes: timings are not GPU figures)")
    print(f"{where}; torch {torch.__version__}, triton {triton.__version__}, commit {commit()}")
    patches = []
    if shapes["prefill_min_m"]:
        patches.append(mock.patch.dict(K.PREFILL_MIN_M, dict.fromkeys(K.PREFILL_MIN_M,
                                                                     shapes["prefill_min_m"])))
    if not cuda:  # a model's W4A4 layers on the kernels (the interpreter), as on a GPU
        from kbbq_pl.quant import w4a4

        patches.append(mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)))
    previous = signal.signal(signal.SIGTERM, stopped)  # the summary still comes

    def write_json() -> None:  # after every section: a hard kill loses one section at most
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(dict(device=where, commit=commit(), rows=run.rows,
                                                 summary=run.summary, notes=run.notes,
                                                 off=switched_off(run),
                                                 failed=sorted(run.failed),
                                                 **({"specializations": run.specializations.found}
                                                    if args.check_child else {})),
                                            indent=1, default=str))

    precompiling = None
    try:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            stack.enter_context(gpu_compiles.recording(run.compiles, run.specializations))
            if args.check_child:  # an error stops this process: the parent names the step
                run_checks(run)
                return
            with section(run, "device copy"):
                copy_rate(run)
            if cuda and args.specs is not None and args.specs.exists():
                arch = triton.runtime.driver.active.get_current_target().arch
                precompiling = gpu_compiles.Precompile(args.specs, arch,
                                                       (os.cpu_count() or 2) - 2)
                print(f"precompiling the {precompiling.entries} kernels recorded in "
                      f"{args.specs} in {len(precompiling.processes)} processes", flush=True)
            for index, name in enumerate(sections):
                if precompiling is not None and name != "check":  # nothing beside a timing
                    run.notes.append(precompiling.finish(PRECOMPILE_S - precompiling.seconds()))
                    print(run.notes[-1], flush=True)
                    precompiling = None
                function, needs = SECTIONS[name]
                run.reserved_s = sum(SECTIONS[later][1] for later in sections[index + 1:]
                                     ) if cuda else 0.0
                with section(run, name, needs if cuda else 0) as go:
                    if go:
                        function(run)
                write_json()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if precompiling is not None:
            run.notes.append(precompiling.finish(0.0))
        write_json()
        if args.specs is not None and not args.check_child:
            run.specializations.save(args.specs, commit())
        if not args.check_child:  # the parent's summary holds the child's lines
            print_summary(run, where)


def print_summary(run: Run, where: str) -> None:
    """The short table, last: every goal of issue 45 with what this run measured and, where it
    falls short, by how much."""
    import triton

    print(f"\n## summary: {where}, torch {torch.__version__}, triton {triton.__version__}, "
          f"commit {commit()}, {time.perf_counter() - run.start:.0f} s\n")
    print("| row | measured | target | met |")
    print("|---|---|---|---|")
    for row in run.summary:
        print("| " + " | ".join(fmt(v) for v in row) + " |")
    for note in run.notes:
        print(f"* {note}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
