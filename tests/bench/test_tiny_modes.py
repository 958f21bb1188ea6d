"""Every script in bench/ runs against the package as it is now: ``python bench/<script>.py
--tiny`` (a tiny random model, a few tokens, one seed, eager kernels; no network, no GPU, no
../shared/data) exits 0 and prints its table.  A script that no test runs breaks silently when
the package changes (issue 46).  Left out: bench/gpu.py and bench/gpu_compile.py, the GPU
benches (gpu.py has a --dry-run of its own), and modules starting with ``_``, the scripts'
helpers.  The runs are started together and go two at a time (each is one thread)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
GPU_BENCHES = {"gpu.py", "gpu_compile.py"}
TIMEOUT_S = 300
"""Per run; generous: the slowest (bench/scale.py, four processes) takes about 30 s of CPU."""
WORKERS = min(2, os.cpu_count() or 1)
"""Tiny runs at a time."""
NUMBER = r"-?\d+\.?\d*(?:e[-+]\d+)?"
W4A4_METHODS = ["I", "HAAR", "RTN-WUSH", "RTN-KBBQ", "GPTQ", "MR-GPTQ", "GPTQ-WUSH", "GPTQ-KBBQ",
                "GPTQ-WUSH (fixed T)", "GPTQ-KBBQ (fixed T)", "GPTQ (no act-order)",
                "GPTQ (dynamic scales)", "RTN-KBBQ (auto)", "GPTQ-KBBQ (auto)"]

TABLES: dict[str, list[str]] = {
    "batch_composition.py": [
        r"^model\s+KL alone\s+KL batched\s+KL alone\|\|batched\s+argmax\s+greedy differ$",
        rf"^full precision\s+0\.0000\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}\s+\d of 4$",
        rf"^rtn_kbbq_nvfp4_lam0\.75(\s+{NUMBER}){{4}}\s+\d of 4$"],
    "calibration_budget.py": [
        r"^recipe\s+seed\s+KL@512\s+KL@1024\s+x1024/512\s+PPL@512\s+PPL@1024\s+s@512\s+s@1024$",
        *(rf"^{re.escape(label)}\s+0(\s+{NUMBER}){{7}}$" for label in (
            "RTN-KBBQ nvfp4, lambda 0.75", "RTN-KBBQ nvfp4, lambda auto",
            "GPTQ-KBBQ nvfp4, lambda 0.75"))],
    "calibration_source.py": [
        r"^source: 1240 records, \d+\.\d MB; n_tokens 64, seq_len 32$",
        r"^reader\s+source read\s+s\s+peak RSS GB\s+tokens$",
        *(rf"^{mode}\s+{read}\s+{NUMBER}\s+{NUMBER}\s+64$"
          for mode in ("packed", "whole records", "eval text")
          for read in ("in part", "whole"))],
    "calibration_shape.py": [
        r"^format\s+calibration\s+mean\s+min\s+worst min\s+1st pct$",
        rf"^nvfp4\s+packed(\s+{NUMBER}){{4}}$",
        rf"^nvfp4\s+whole records(\s+{NUMBER}){{4}}$"],
    "eval_requests.py": [
        r"^run\s+s\s+requests\s+req/s\s+x FP time\s+scores$",
        *(rf"^{re.escape(run)}\s+{NUMBER}\s+8\s+{NUMBER}\s+{NUMBER}\s+\{{'arc_easy': "
          for run in ("FP", "W4A4, compiled kernels (cached)",
                      "W4A4, eager kernels (cached)", "W4A4, no decoded-weight cache (compiled)")),
        r"^quantized log-likelihoods identical across the three W4A4 settings: True$"],
    "finetune.py": [
        r"^\| run \| median step \(ms\) \| x full precision \| warm-up steps \(s\) \|",
        rf"^\| full precision \| {NUMBER} \| 1\.00 \| {NUMBER} \| {NUMBER} \| \d+ / \d+ \|$",
        rf"^\| KBBQ nvfp4 \(fit\)( \| {NUMBER}){{4}} \| \d+ / \d+ \|$"],
    "formats.py": [
        r"^format\s+dtype\s+ours ms\s+eager ms\s+torchao ms\s+torchao/ours\s+ours/clone",
        *(rf"^{fmt}\s+{dtype}(\s+{NUMBER}){{7}}$" for fmt in ("nvfp4", "mxfp4")
          for dtype in ("float32", "bfloat16"))],
    "generation_agreement.py": [
        r"^recipe\s+seed\s+prefix\s+match\s+agree\s+FP NLL$",
        rf"^FP\s+4\.00\s+1\.000\s+1\.000\s+{NUMBER}$",  # the FP model agrees with itself
        rf"^rtn_kbbq_nvfp4_lam0\.75\s+0(\s+{NUMBER}){{4}}$",
        rf"^rtn_wush_nvfp4\s+0(\s+{NUMBER}){{4}}$"],
    "gpu_report.py": [
        # the tiny record's times are 2 us (3 us for the linear) plus the bytes at 1 GB/s (bf16:
        # 2 us plus the bytes at 2 GB/s), the copy 4 GB/s: the fit finds them back
        r"^\| M \| format \| what \| shapes \| fixed us \| rate GB/s \| rate / copy \|",
        rf"^\| 1 \| nvfp4 \| decode GEMM \| 2 \| 2 \| 1 \| 0\.25 \| {NUMBER} \|$",
        rf"^\| 1 \| nvfp4 \| linear \(activations \+ GEMM\) \| 2 \| 3 \| 1 \| 0\.25 \| "
        rf"{NUMBER} \|$",
        rf"^\| 1 \| nvfp4 \| bf16 torch\.matmul \| 2 \| 2 \| 2 \| 0\.5 \| {NUMBER} \|$",
        # the tiny probe: four programs, two splits, two SMs, 2 GHz (gpu_report.tiny_record)
        r"^\| 64->64 \| nvfp4 \| shipped \| 2 \| 4 \| 4\.2 \| 4 \| 2 \| 2 \| 3\.8 \| 0\.3 \| 2 \| "
        r"2 \| 0\.5 \| 1 \| 0\.3 \+ 3\.5 \|$",
        r"^\| _skinny_kernel \| 64x8x1 \| 128x1x1 \| 96 \| 42\.0 \| 2 \| 20\.0 \| 10\.00 \| "
        r"10\.00 \| 10\.00 \| 0\.645 \|$",
        r"^kernel time 31\.0 us in 7 launches; span 71\.0 us$",
        # by the innermost module span around each launch: the linear's three GEMMs, the
        # norm's kernel, the layer's own, one launched outside every span, one not launched
        # in the trace
        r"^\| Linear W4A4 \| 3 \| 26\.0 \| 8\.67 \| 0\.839 \|$",
        r"^\| LlamaRMSNorm \| 1 \| 2\.0 \| 2\.00 \| 0\.065 \|$",
        r"^\| LlamaDecoderLayer \| 1 \| 1\.0 \| 1\.00 \| 0\.032 \|$",
        r"^\| \(no module\) \| 1 \| 1\.0 \| 1\.00 \| 0\.032 \|$",
        r"^\| \(launch not in the trace\) \| 1 \| 1\.0 \| 1\.00 \| 0\.032 \|$"],
    "gptq.py": [
        r"^llm-compressor: skipped",
        r"^\s+wall \(s\)\s+to disk \(s\)\s+peak RSS \(MiB\)\s+mean error$",
        rf"^kbbq-pl GPTQ\s+{NUMBER}\s+{NUMBER}\s+\d+\s+{NUMBER}$",
        rf"^kbbq-pl GPTQ-KBBQ\s+{NUMBER}\s+{NUMBER}\s+\d+\s*$",  # no error: not identity
        r"^\s+GPTQ-KBBQ / GPTQ \(kbbq-pl\)\s+wall "],
    "host_time.py": [
        r"^format\s+rows\s+launch\s+median us\s+fastest us$",
        *(rf"^{fmt}\s+{rows}\s+{how}\s+{NUMBER}\s+{NUMBER}$" for fmt in ("nvfp4", "mxfp4")
          for rows in (1, 16) for how in ("direct", "through Triton")),
        *(rf"^{fmt}\s+{how}\s+{NUMBER}\s+{NUMBER}$" for fmt in ("nvfp4", "mxfp4")
          for how in ("each layer's linear_w4a4", "linear_w4a4_siblings",
                      r"module, 3 nn\.Linear calls", r"module hooked, 3 nn\.Linear calls")),
        r"^model\s+linears\s+launch\s+step ms\s+x bf16 time$",
        rf"^bf16\s+-\s+-\s+{NUMBER}\s+1\.00$",
        *(rf"^{fmt}\s+{linears}\s+{how}\s+{NUMBER}\s+{NUMBER}$" for fmt in ("nvfp4", "mxfp4")
          for linears in ("grouped", "each alone") for how in ("direct", "through Triton"))],
    "kernel_budget.py": [
        r"^\| K->N \| M \| format \| path \| W4A4 MB \| bf16 MB \| GFLOP \|",
        *(rf"^\| 8192->8192 \| 1 \| {fmt} \| decode( \| {NUMBER}){{4}} \| (?:{NUMBER}|-)"
          rf"( \| {NUMBER}){{4}} \| " for fmt in ("nvfp4", "mxfp4"))],
    "law.py": [
        r"^format\s+records\s+slope/dec\s+intercept\s+median r\s+RMS r\s+C_fmt\s+med r - C$",
        *(rf"^{fmt}\s+\d+(\s+{NUMBER}){{6}}$" for fmt in ("fp8_e4m3", "nvfp4", "mxfp4")),
        r"^kappa\.md medians over \d+ cells"],
    "quantize.py": [
        r"^run\s+wall s\s+calibration\s+fit_transforms\s+activation_scales\s+quantize\s+total"
        r"\s+fidelity$",
        rf"^eager(\s+{NUMBER}){{6}}\s+0\.\d{{5}}$"],
    "scale.py": [
        r"^\| bf16 weights \(MiB\) \| blocks \| method \| default peak \| stream peak \| "
        r"previous peak \|",
        # the three modes: the same checkpoint, bit for bit; the tiny model is not streamed
        rf"^\| \d+ \| 1 \| rtn_kbbq( \| {NUMBER}){{7}} \| False \| True \|$",
        r"^\| method \| processes \| wall s \| same tensors as 1 process \|$",
        rf"^\| rtn_kbbq \| 1 \| {NUMBER} \| True \|$"],
    "transforms.py": [
        r"^\s+block\s+basis s\s+lambda s\s+W T\^-1 s\s+total s$",
        rf"^\s+16(\s+{NUMBER}){{4}}$",
        rf"^\s+32(\s+{NUMBER}){{4}}$",
        r"^\s+utilization at lambda 0\.75: [01]\.\d{3}$"],
    "w4a4_layer.py": [
        r"^\| layer \| bytes held \| / dense \|$",
        r"^\| W4A4 layer \| [\d.]+ MiB \| 0\.\d{3} \|$",  # smaller than the dense layer
        *(rf"^\| {m} \| {NUMBER} ms \| {NUMBER} ms \(emulation\) \| {NUMBER} ms \| "
          for m in (1, 16))],
    "w4a4_table.py": [
        r"^method\s+nvfp4 cosine\s+nvfp4 SNR$",
        *(rf"^{re.escape(name)}\s+[01]\.\d{{5}}\s+{NUMBER}$" for name in W4A4_METHODS)],
}
"""Per script, lines its tiny run must print (regular expressions, one line each): the table's
header and its rows."""


def bench_scripts() -> list[str]:
    """The scripts of bench/ that the tiny runs cover: all but the GPU benches and helpers."""
    return sorted(p.name for p in BENCH.glob("*.py")
                  if p.name not in GPU_BENCHES and not p.name.startswith("_"))


@dataclass
class TinyRun:
    """What ``python bench/<script>.py --tiny`` did; ``returncode`` None: it ran past
    TIMEOUT_S and was killed."""

    returncode: int | None
    stdout: str
    stderr: str
    seconds: float


def run_tiny(script: str) -> TinyRun:
    """Run ``python bench/<script> --tiny`` from the repository root, offline, one thread."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(BENCH / script), "--tiny"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as error:
        return TinyRun(None, _text(error.stdout), _text(error.stderr),
                       time.perf_counter() - start)
    return TinyRun(done.returncode, done.stdout, done.stderr, time.perf_counter() - start)


def _text(output: str | bytes | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


@pytest.fixture(scope="module")
def tiny_runs(request: pytest.FixtureRequest) -> Iterator[dict[str, Future[TinyRun]]]:
    """The tiny runs of the scripts this session selected, all started at once and run
    WORKERS at a time: each is one thread, so two cores take half the time."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_tiny_mode_prints_its_table"]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        runs = {script: pool.submit(run_tiny, script) for script in selected}
        yield runs
        for run in runs.values():
            run.cancel()


def test_every_bench_script_has_a_tiny_mode():
    scripts = bench_scripts()
    assert scripts == sorted(TABLES), (
        "every bench/*.py (except gpu.py, gpu_compile.py and _helpers) needs a --tiny mode and "
        f"an entry in TABLES: scripts {scripts}, covered {sorted(TABLES)}")
    for name in scripts:
        source = (BENCH / name).read_text(encoding="utf-8")
        assert '"--tiny"' in source and f"python bench/{name} --tiny" in source, (
            f"bench/{name}: no --tiny option, or its module docstring has no usage line for it")


@pytest.mark.parametrize("script", sorted(TABLES))
def test_tiny_mode_prints_its_table(script: str, tiny_runs: dict[str, Future[TinyRun]]):
    run = tiny_runs[script].result()
    print(f"bench/{script} --tiny: {run.seconds:.1f} s")
    printed = f"{run.stdout}\n--- stderr ---\n{run.stderr[-6000:]}"
    assert run.returncode is not None, f"bench/{script} --tiny ran past {TIMEOUT_S} s:\n{printed}"
    assert run.returncode == 0, f"bench/{script} --tiny exited {run.returncode}:\n{printed}"
    missing = [line for line in TABLES[script]
               if not re.search(line, run.stdout, flags=re.MULTILINE)]
    assert not missing, f"bench/{script} --tiny printed no line matching {missing}:\n{printed}"
