"""What spares a GPU session's device time compiles: ``scripts/gpu_session.sh``'s compile cache
(what a call leaves in ``$OUT`` and the next session's calls restore is a cache Triton hits) and
``bench/_gpu_compiles.py``'s precompile (the kernel specializations a run recorded, compiled
again by parallel processes into hits).  Compiled here for sm_90, as on the device."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import _gpu_compiles  # noqa: E402

COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
sys.path.insert(0, {bench!r})
import _gpu_compiles, gpu_compile as G
from kbbq_pl.kernels import skinny as S

compiles = _gpu_compiles.Compiles()
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


PRECOMPILE = """
import shutil, sys
import torch, triton
sys.path.insert(0, {bench!r})
import _gpu_compiles as C, _gpu_stream
from kbbq_pl.kernels import triton_kernels as tk

codes, scales = torch.zeros(64, 128, dtype=torch.uint8), torch.zeros(64, 16, dtype=torch.uint8)
out, words = torch.empty(64, 256, dtype=torch.bfloat16), torch.empty(1, 64, dtype=torch.int32)


def launch():  # as a run launches them (warmup: compiled, not run), a package's and a script's
    tk._decode_kernel.warmup(codes, scales, out, 64, 256, 128, 16, 256, D=16,
                             SCALE_KIND=tk.SCALE_E4M3, BLOCK_R=16, BLOCK_K=64, grid=(1,),
                             num_warps=4)
    _gpu_stream._stream_kernel.warmup(codes, scales, words, 32, 32, 16, TILED=False, D=16,
                                      BLOCK_N=64, BLOCK_C=32, STAGES=3, grid=(1, 1),
                                      num_warps=4)


compiles, specs = C.Compiles(), C.Specializations()
with C.compile_only(90), C.recording(compiles, specs):
    launch()
assert (compiles.kernels, compiles.hits, len(specs.found)) == (2, 0, 2), (compiles, specs.found)
modules = {{s["module"] for s in specs.found.values()}}
assert modules == {{"kbbq_pl.kernels.triton_kernels", "_gpu_stream"}}, modules
specs.save({specs!r}, "abc")
shutil.rmtree({cache!r})  # a fresh machine: nothing compiled
said = C.Precompile({specs!r}, 90, 2).finish(240)
assert said.startswith("precompile: 2 of 2 recorded kernels compiled, 0 failed, 0 not reached, "
                       "by 2 processes in "), said
for kernel in (tk._decode_kernel, _gpu_stream._stream_kernel):
    kernel.device_caches.clear()  # this process's own kernels forgotten
again = C.Compiles()
with C.compile_only(90), C.recording(again, C.Specializations()):
    launch()
assert (again.kernels, again.hits) == (0, 2), again
from triton.runtime import jit  # a constant Triton cannot write as JSON: launched, not recorded


def unwritable(*args, **kwargs):
    raise TypeError("not JSON serializable")


jit.serialize_specialization_data = unwritable
for kernel in (tk._decode_kernel, _gpu_stream._stream_kernel):
    kernel.device_caches.clear()
quiet = C.Specializations()
with C.compile_only(90), C.recording(C.Compiles(), quiet):
    launch()
assert quiet.found == {{}} and jit.serialize_specialization_data is unwritable, quiet.found
print("ok")
"""


def test_recorded_kernels_precompiled_in_parallel_are_hits(tmp_path):
    """The kernel specializations a run launched (Triton's post-compile hook), saved and
    compiled again by parallel worker processes with no GPU context (``Precompile``), are
    cache hits when the run launches them again: a package's kernel and a script's.  A
    specialization Triton cannot serialize is launched all the same, and not recorded."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    script = PRECOMPILE.format(bench=str(ROOT / "bench"), specs=str(tmp_path / "specs.json"),
                               cache=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=600, check=False)
    if "ptxas" in result.stderr and "not found" in result.stderr:
        pytest.skip("triton's ptxas is not available on this machine")
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_precompile_stops_its_workers_and_says_what_it_reached(tmp_path):
    """``finish`` stops the workers still compiling when its wait ends, and counts what they
    compiled and failed from what each printed; a kernel gone since it was recorded fails with
    its name; no recorded kernels, no processes."""
    path = tmp_path / "specs.json"
    gone = dict(module="kbbq_pl.kernels.skinny", name="_no_such_kernel", path=None)
    _gpu_compiles.Specializations.save(types.SimpleNamespace(found={"{}": gone}), path, "a")
    said = _gpu_compiles.Precompile(path, 90, 4).finish(120)
    assert said.startswith("precompile: 0 of 1 recorded kernels compiled, 1 failed, 0 not "
                           "reached, by 1 processes in "), said
    assert "failed: kbbq_pl.kernels.skinny._no_such_kernel: AttributeError" in said, said
    sleeper = tmp_path / "sleeper"  # stands for a worker still compiling when the wait ends
    sleeper.write_text("#!/bin/sh\nsleep 60\n")
    sleeper.chmod(0o755)
    with mock.patch.object(sys, "executable", str(sleeper)):
        slow = _gpu_compiles.Precompile(path, 90, 2)
    assert "0 of 1 recorded kernels compiled, 0 failed, 1 not reached" in slow.finish(0.5)
    assert slow.processes[0].returncode is not None  # stopped
    path.write_text("[]")
    none = _gpu_compiles.Precompile(path, 90, 4)
    assert none.processes == [] and none.finish(0.0) == "precompile: no kernels recorded"


def test_recorded_kernels_are_kept_for_two_commits(tmp_path):
    """A run adds its specializations to those recorded at its commit and the one before (a
    session's second call adds its sections'); older ones are dropped, and the same
    specialization is kept once, at its latest commit."""
    path = tmp_path / "specs.json"

    def save(commit: str, *names: str) -> None:
        specs = _gpu_compiles.Specializations()
        for name in names:
            specs.found[f"data {name}"] = dict(module="kbbq_pl.x", name=name, path=None)
        specs.save(path, commit)

    save("a", "one", "two")
    save("a", "three")
    save("b", "two", "four")
    found = {s["name"]: s["commit"] for s in _gpu_compiles.load(path)}
    assert found == {"one": "a", "two": "b", "three": "a", "four": "b"}, found
    save("c", "five")
    found = {s["name"]: s["commit"] for s in _gpu_compiles.load(path)}
    assert found == {"two": "b", "four": "b", "five": "c"}, found
    assert not path.with_suffix(".partial").exists()
