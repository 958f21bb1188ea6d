"""Triton's compiles in a ``bench/gpu.py`` run on a GPU: counted (:class:`Compiles`, Triton's
compilation listener), recorded (:class:`Specializations`, its post-compile hook: each kernel
specialization the run launched, as Triton serializes it for ``JITFunction.preload``) and, at
the next run, compiled again by parallel processes beside the check (:class:`Precompile`).
The check took 187 s on an H200 (2026-12-04), thought to be mostly compiles, one after another
on one core of the machine's 16.  A precompiled kernel is a hit in Triton's cache when the run
launches it: the same source, specialization, options and Triton give the same cache key,
whichever process compiled it (``scripts/gpu_session.sh`` also carries the cache itself from
one GPU session to the next).  A specialization whose kernel changed its signature since fails
or goes unused; the run compiles what it needs either way.

    python bench/_gpu_compiles.py SPECS RANK WORKERS ARCH   # one precompile worker
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RECORDED = ("kbbq_pl", "gemlite")
"""The packages whose kernels are recorded (with this folder's scripts); Inductor compiles its
own in parallel already."""


@dataclass
class Compiles:
    """Triton's compiles in this process, as its compilation listener sees them
    (``triton.knobs.compilation.listener``): the device time a GPU run spends compiling rather
    than measuring, and what a cache carried or precompiled saved.  Seconds are the compile
    pipeline's (source to cubin), not the launcher's build."""

    kernels: int = 0  # compiled here
    hits: int = 0  # found in Triton's cache
    seconds: float = 0.0

    def __call__(self, *, times, cache_hit, **_) -> None:
        if cache_hit:
            self.hits += 1
            return
        self.kernels += 1
        with contextlib.suppress(AttributeError, TypeError):  # a count never fails a compile
            self.seconds += (times.ir_initialization + sum(us for _, us in
                                                           times.lowering_stages)
                             + times.store_results) / 1e6

    def since(self, before: Compiles) -> Compiles:
        return Compiles(self.kernels - before.kernels, self.hits - before.hits,
                        self.seconds - before.seconds)

    def __str__(self) -> str:
        kernels = f"{self.kernels} Triton kernel{'s' * (self.kernels != 1)}"
        return f"compiling {kernels}: {self.seconds:.0f} s; {self.hits} from the cache"


class Specializations:
    """The kernel specializations this process launched (``triton.knobs.runtime.
    jit_post_compile_hook``): ``found``, by Triton's serialized specialization, where the
    kernel is (module, name, source file) to find it again in another process."""

    def __init__(self) -> None:
        self.found: dict[str, dict] = {}

    def __call__(self, *, fn, compile, **_) -> None:
        data = compile.get("specialization_data") if isinstance(compile, dict) else None
        if data is None or not hasattr(fn, "jit_function"):  # not serializable; Inductor's
            return
        try:
            path = inspect.getsourcefile(fn.jit_function.fn)
        except TypeError:
            return
        if fn.module.split(".")[0] in RECORDED or (path and Path(path).parent == BENCH):
            self.found[data] = dict(module=fn.module, name=fn.name, path=path)

    def save(self, path: Path | str, commit: str) -> None:
        """Written to ``path`` (atomically) with the earlier ones recorded there at this commit
        and the one before: a second call of a session adds its sections' kernels, and a
        kernel no commit since has launched is dropped."""
        path = Path(path)
        kept = [s for s in load(path) if s["data"] not in self.found]
        commits = list(dict.fromkeys([commit] + [s["commit"] for s in kept]))[:2]
        found = [dict(entry, data=data, commit=commit) for data, entry in self.found.items()]
        found += [s for s in kept if s["commit"] in commits]
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(found, indent=0))
        os.replace(partial, path)


def load(path: Path | str) -> list[dict]:
    """The specializations recorded at ``path`` (none where it is missing or unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []


@contextlib.contextmanager
def recording(compiles: Compiles, specializations: Specializations):
    """Triton's compilation listener and post-compile hook set to these for the block.  Triton
    serializes a specialization for the hook before calling it, and a constant it cannot write
    as JSON would fail the launch: its serializer is wrapped to give None instead."""
    import triton
    from triton.runtime import jit

    knobs = triton.knobs
    serialize = jit.serialize_specialization_data

    def serialized(*args, **kwargs) -> str | None:
        try:
            return serialize(*args, **kwargs)
        except (TypeError, ValueError):
            return None

    before = knobs.compilation.listener, knobs.runtime.jit_post_compile_hook
    knobs.compilation.listener, knobs.runtime.jit_post_compile_hook = compiles, specializations
    jit.serialize_specialization_data = serialized
    try:
        yield
    finally:
        knobs.compilation.listener, knobs.runtime.jit_post_compile_hook = before
        jit.serialize_specialization_data = serialize


class CompileOnly:
    """A Triton driver that only names a target: ``JITFunction.preload`` (and ``warmup``)
    compile for it in a process that has no GPU context (no CUDA, no device memory)."""

    def __init__(self, target):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self):
        return self.target


@contextlib.contextmanager
def compile_only(arch: int):
    """Triton's active driver replaced by :class:`CompileOnly` for ``cuda`` sm_``arch``."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    before = driver._active
    driver.set_active(CompileOnly(GPUTarget("cuda", arch, 32)))
    try:
        yield
    finally:
        driver._active = before


def kernel(entry: dict):
    """The ``triton.jit`` function an entry of :class:`Specializations` names: its module
    imported, or loaded from its file (this folder's scripts) under the same name."""
    try:
        module = importlib.import_module(entry["module"])
    except ImportError:
        spec = importlib.util.spec_from_file_location(entry["module"], entry["path"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[entry["module"]] = module
        spec.loader.exec_module(module)
    found = module
    for part in entry["name"].split("."):
        found = getattr(found, part)
    return found


def worker(specs: Path, rank: int, workers: int, arch: int) -> None:
    """Compile every ``workers``-th specialization recorded in ``specs`` from ``rank`` on,
    printing ``compiled`` or ``failed: why`` for each as it ends."""
    with compile_only(arch):
        for index, entry in enumerate(load(specs)):
            if index % workers != rank:
                continue
            try:
                kernel(entry).preload(entry["data"])
                print("compiled", flush=True)
            except Exception as error:  # a kernel changed or gone since it was recorded
                why = str(error).splitlines()[0][:160] if str(error) else ""
                print(f"failed: {entry['module']}.{entry['name']}: {type(error).__name__}: "
                      f"{why}", flush=True)


class Precompile:
    """Every specialization recorded in ``specs`` compiled into Triton's cache for sm_``arch``
    by up to ``workers`` processes (this script), which start at once and run beside the run
    (the check, whose kernels were recorded first) until :meth:`finish`."""

    def __init__(self, specs: Path | str, arch: int, workers: int) -> None:
        self.entries = len(load(specs))
        self.began = time.perf_counter()
        self.logs = tempfile.TemporaryDirectory(prefix="kbbq_precompile_")
        self.processes = []
        count = max(1, min(workers, self.entries)) if self.entries else 0
        for rank in range(count):
            with open(Path(self.logs.name) / f"{rank}.log", "w") as log:
                self.processes.append(subprocess.Popen(
                    [sys.executable, str(Path(__file__)), str(specs), str(rank), str(count),
                     str(arch)], stdout=log, stderr=subprocess.STDOUT))

    def seconds(self) -> float:
        return time.perf_counter() - self.began

    def finish(self, wait_s: float) -> str:
        """The workers given ``wait_s`` more to end, then stopped (a kernel half compiled is
        not in the cache: Triton writes each file whole): a line saying how many compiled,
        failed and were not reached, in how many seconds."""
        deadline = time.perf_counter() + wait_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        lines = [line for log in sorted(Path(self.logs.name).glob("*.log"))
                 for line in log.read_text().splitlines()]
        self.logs.cleanup()
        if not self.entries:
            return "precompile: no kernels recorded"
        done = lines.count("compiled")
        failed = [line for line in lines if line.startswith("failed: ")]
        return (f"precompile: {done} of {self.entries} recorded kernels compiled, "
                f"{len(failed)} failed, {self.entries - done - len(failed)} not reached, by "
                f"{len(self.processes)} processes in {self.seconds():.0f} s"
                + "".join(f"; {line[:200]}" for line in failed[:2]))


if __name__ == "__main__":
    worker(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
