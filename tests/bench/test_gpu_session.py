"""``scripts/gpu_session.sh``'s compile cache: what a GPU call leaves in ``$OUT`` and the next
session's calls restore is a cache Triton hits (compiled here for sm_90, as on the device)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

COMPILE = """
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
sys.path.insert(0, {bench!r})
import gpu_compile as G
from kbbq_pl.kernels import skinny as S

spec = importlib.util.spec_from_file_location("bench_gpu", {bench!r} + "/gpu.py")
module = importlib.util.module_from_spec(spec)
sys.modules["bench_gpu"] = module
spec.loader.exec_module(module)
compiles = module.Compiles()
triton.knobs.compilation.listener = compiles
G.compile_decode_gemm(GPUTarget("cuda", 90, 32), 16, G.tk.SCALE_E4M3, S._CONFIGS[0])
print(compiles.kernels, compiles.hits)
"""


def session(script: str, cache: Path, out: Path) -> str:
    """``script`` run by bash with ``scripts/gpu_session.sh``'s functions, its cache at
    ``cache`` and ``$OUT`` at ``out``."""
    result = subprocess.run(
        ["bash", "-c", f"source scripts/gpu_session.sh; CACHE={cache}; OUT={out}; {script}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def compiled(cache: Path) -> tuple[int, int]:
    """(kernels compiled, found in the cache) for the decode GEMM's sm_90 compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    result = subprocess.run([sys.executable, "-c", COMPILE.format(bench=str(ROOT / "bench"))],
                            capture_output=True, text=True, env=env, timeout=300, check=False)
    if "ptxas" in result.stderr and "not found" in result.stderr:
        pytest.skip("triton's ptxas is not available on this machine")
    assert result.returncode == 0, result.stderr[-3000:]
    kernels, hits = result.stdout.split()[-2:]
    return int(kernels), int(hits)


def test_the_compile_cache_a_call_leaves_is_hit_after_it_is_restored(tmp_path):
    """A call's compile cache, left in ``$OUT`` without its intermediate IR (``leave_caches``,
    the traces beside it in one archive) and restored at the same path on a fresh machine
    (``restore_caches``), gives Triton a hit: the kernel is not compiled again."""
    pytest.importorskip("triton")
    cache, out = tmp_path / "kbbq-compile-cache", tmp_path / "out"
    out.mkdir()
    assert compiled(cache) == (1, 0)
    assert any(cache.rglob("*.ptx"))
    for name in ("trace_nvfp4_decode.json.gz", "trace_bf16_compiled.json.gz"):
        (out / name).write_bytes(b"trace")
    said = session("leave_caches", cache, out)
    assert "compile cache left in $OUT: kbbq-compile-cache," in said, said
    assert sorted(p.name for p in out.iterdir()) == ["compile-cache.tar.gz", "traces.tar"]
    subprocess.run(["rm", "-rf", str(cache)], check=True)  # a fresh machine
    said = session(f"restore_caches {out / 'compile-cache.tar.gz'}", cache, out)
    assert said.endswith(": 1 Triton kernels\n"), said
    assert not any(cache.rglob("*.ptx")) and any(cache.rglob("*.cubin"))
    assert compiled(cache) == (0, 1)
