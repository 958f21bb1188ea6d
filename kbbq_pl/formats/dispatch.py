"""Runs the rounding kernels compiled by ``torch.compile`` where it can, eagerly elsewhere.

``torch.compile`` fuses each kernel of :mod:`kbbq_pl.formats.rounding` into one or two passes
over the data (a C++ loop on CPU, a Triton kernel on CUDA); eager PyTorch makes about ten.  The
compiled and eager kernels are the same Python functions and agree bit for bit (tested).

``KBBQ_PL_COMPILE`` chooses: ``auto`` (default: on the CPU where a C++ compiler is found, a
kernel is compiled once its eager calls have taken :data:`COMPILE_AFTER_S` in the process;
eager on CUDA), ``1`` (always) or ``0`` (never).  :func:`set_compile` changes it at run time.
If a compilation fails, kbbq-pl warns once and stays eager.

On CUDA ``auto`` stays eager: the eager kernels give the CPU's bits for every format and dtype
on a GPU, the compiled E2M1 kernels (NVFP4, MXFP4) have not been shown to.  The W4A4 activation
path on CUDA runs the Triton kernels of :mod:`kbbq_pl.kernels`, not these.
"""

from __future__ import annotations

import functools
import os
import shutil
import types
import warnings
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch
from torch import Tensor

from .._compat import tracing

_mode = os.environ.get("KBBQ_PL_COMPILE", "auto").strip().lower()
_broken = False
_cache: dict[tuple, Callable[..., Any]] = {}
_eager_s: dict[tuple, float] = {}
_ALWAYS = ("1", "on", "true")
_NEVER = ("0", "off", "false")

COMPILE_AFTER_S = 10.0
"""Under ``auto``, the seconds a kernel (one set of static options) runs eagerly in a process
before it is compiled.  On a 2-core CPU a process's first compilation costs about 4 s where
Inductor's cache holds the kernel and 19 s where it does not (later ones 0.2 to 4 s), and a
compiled kernel then saves most of each call's time; so a kernel compiles once it has run
about as long as a compilation costs (the ski-rental rule: a few times the better of the two
choices made in hindsight at worst, whatever the run's length).  A quantization or an
evaluation of a small model stays eager, a long evaluation or fine-tuning run compiles."""


def set_compile(mode: bool | str) -> None:
    """Use compiled kernels always (``True``/``"1"``), never (``False``/``"0"``) or ``"auto"``."""
    global _mode
    value = {True: "1", False: "0"}.get(mode, mode) if isinstance(mode, bool) else mode
    if str(value).lower() not in ("auto", "1", "0"):
        raise ValueError(f"compile mode must be True, False or 'auto', got {mode!r}")
    _mode = str(value).lower()


@functools.cache
def _backend_available(device_type: str) -> bool:
    """Whether ``auto`` compiles on ``device_type``: on the CPU where a C++ compiler is found
    (CUDA stays eager, see the module docstring)."""
    if device_type != "cpu":
        return False
    compiler = os.environ.get("CXX")
    return any(shutil.which(c) for c in filter(None, (compiler, "g++", "c++", "clang++")))


def compile_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` may run compiled under the current mode (under ``auto``,
    once they have run :data:`COMPILE_AFTER_S` eagerly: :func:`compile_rule` says which)."""
    if _broken or _mode in _NEVER or tracing():
        return False
    if _mode in _ALWAYS:
        return True
    return _backend_available(device.type)


def compile_rule(device: torch.device) -> str:
    """How kernels on ``device`` run under the current mode, in words (for reports)."""
    if not compile_enabled(device):
        return "eager"
    if _mode in _ALWAYS:
        return "compiled"
    return f"compiled once a kernel has run {COMPILE_AFTER_S:g} s eagerly"


_SIMD_BITS = {"AVX512": 512, "AVX2": 256}


def _inductor_options(device_type: str) -> dict[str, Any]:
    """Inductor settings of the compiled kernels: on an x86 CPU the vector width of the
    kernels ATen runs (``torch.backends.cpu.get_cpu_capability()``), set explicitly.

    Left to inductor (``cpp.simdlen = None``), torch 2.13 on an AMD EPYC with AVX-512 VNNI
    (2026-11-26) compiled E2M1 kernels that gave wrong values or corrupted the heap once a
    second format's kernel was compiled in the same process (NVFP4 after MXFP4 and the
    reverse); with the width named they match the eager kernels bit for bit
    (``tests/formats/test_formats.py``), as they did on AVX2 CPUs, where this is the width
    inductor picks by itself."""
    if device_type != "cpu":
        return {}
    bits = _SIMD_BITS.get(torch.backends.cpu.get_cpu_capability())
    return {"cpp.simdlen": bits} if bits else {}


def _specialize(kernel: Callable[..., Any], static: dict[str, Any]) -> Callable[..., Any]:
    """``kernel`` with ``static`` bound, under a code object of its own: dynamo keeps its
    compiled graphs (and counts recompilations) per code object, so each set of options gets
    its own cache instead of crowding one."""

    def bound(groups: Tensor, *args: Any) -> Any:
        return kernel(groups, *args, **static)

    code = bound.__code__.replace(co_name=f"{kernel.__name__}_{len(_cache)}")
    return types.FunctionType(code, bound.__globals__, code.co_name, None, bound.__closure__)


def run_kernel(
    kernel: Callable[..., Any],
    groups: Tensor,
    *args: Any,
    dynamic_group_len: bool = False,
    **static: Any,
) -> Any:
    """Call ``kernel(groups, *args, **static)``, compiled when enabled.

    ``static`` holds the Python-level options (format, policy, dtype): each distinct set gets
    its own compiled graph.  The number of groups is dynamic (in ``groups`` and in every tensor
    of ``args`` with one entry per group), so new shapes do not recompile;
    the group length is dynamic too when ``dynamic_group_len`` (rows and whole tensors), and
    static for blocks, which lets the compiler unroll and vectorize over the block.
    """
    global _broken
    if not compile_enabled(groups.device):
        return kernel(groups, *args, **static)
    key = (kernel.__name__, groups.device.type, tuple(sorted(static.items())))
    compiled = _cache.get(key)
    if compiled is None and _mode not in _ALWAYS and _eager_s.get(key, 0.0) < COMPILE_AFTER_S:
        start = perf_counter()  # the CPU runs the kernel before it returns
        result = kernel(groups, *args, **static)
        _eager_s[key] = _eager_s.get(key, 0.0) + perf_counter() - start
        return result
    if compiled is None:
        compiled = torch.compile(_specialize(kernel, static), dynamic=False, fullgraph=True,
                                 options=_inductor_options(groups.device.type))
        _cache[key] = compiled
    torch._dynamo.maybe_mark_dynamic(groups, 0)
    for arg in args:  # per-group operands (the decode's scales [G]) follow the group count:
        # left static, their size would pin the number of groups and recompile every shape
        if isinstance(arg, Tensor) and arg.dim() and arg.shape[0] == groups.shape[0]:
            torch._dynamo.maybe_mark_dynamic(arg, 0)
    if dynamic_group_len:
        torch._dynamo.maybe_mark_dynamic(groups, 1)
    # The kernels name every dtype they compute in, so autocast changes nothing in them; left
    # on (bf16-mixed training), it would give each kernel a second graph (dynamo guards on it)
    device_type = groups.device.type
    autocast = torch.is_autocast_enabled(device_type)
    try:
        if autocast:
            with torch.autocast(device_type, enabled=False, cache_enabled=True):
                return compiled(groups, *args)
        return compiled(groups, *args)
    except Exception as error:  # a compiler or backend failure: stay correct, go eager
        result = kernel(groups, *args, **static)
        _broken = True
        warnings.warn(
            f"torch.compile failed for {kernel.__name__} ({type(error).__name__}: {error}); "
            "kbbq-pl uses its eager kernels from now on (set KBBQ_PL_COMPILE=0 to skip compiling)",
            RuntimeWarning,
            stacklevel=3,
        )
        return result
