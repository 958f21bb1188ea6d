"""Triton's host path without a GPU: kernels compiled for sm_90, their launches recorded, not run.

``bench/host_time.py`` times an eager decode-path linear this way, and the tests of
:mod:`kbbq_pl.kernels.direct_launch` compare what it launches with what Triton launches.  Inside
:func:`no_gpu_launches` Triton's driver is one that names an sm_90 GPU (device 0, stream 0), so
``kernel[grid](...)`` binds, specializes and compiles as it would on an H100 (Triton's wheel
ships ``ptxas``); each compiled kernel's launcher records ``(kernel name, grid, arguments)``
instead of calling CUDA; Triton's autotuner takes the first of its candidates without timing
them; kbbq-pl's kernels take CPU tensors as a CUDA device's (132 SMs).  Needs a process without
``TRITON_INTERPRET`` (the kernels must be compiled ones) on a machine without CUDA: Triton's
kernel caches of device 0 and the autotuners' choices made inside stay after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import CompiledKernel
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner

Launch = tuple[str, tuple[int, int, int], tuple]


class _Sm90Driver:
    """The parts of Triton's CUDA driver that binding and compiling read."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty


@contextlib.contextmanager
def no_gpu_launches() -> Iterator[list[Launch]]:
    """The launches made inside, in order (module docstring)."""
    from kbbq_pl import kernels as K
    from kbbq_pl.kernels import direct_launch, skinny, triton_kernels

    if triton_kernels.INTERPRET:
        raise RuntimeError("no_gpu_launches compiles the kernels: unset TRITON_INTERPRET")
    if torch.cuda.is_available():
        raise RuntimeError("no_gpu_launches stands in for a GPU on a machine without one")
    launches: list[Launch] = []

    def init_handles(kernel: CompiledKernel) -> None:
        if kernel._run is None:
            kernel.function = None
            kernel._run = lambda g0, g1, g2, stream, function, metadata, launch_metadata, \
                enter, exit_, *args: launches.append((kernel.name, (g0, g1, g2), args))

    props = type("Properties", (), {"multi_processor_count": 132})()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(CompiledKernel, "_init_handles", init_handles))
        stack.enter_context(mock.patch.object(
            Autotuner, "_bench", lambda self, *args, config, **kwargs:
            [1.0 + self.configs.index(config), 1.0, 1.0]))
        stack.enter_context(mock.patch.object(K, "_require", lambda *args: None))
        stack.enter_context(mock.patch("torch.cuda.get_device_properties",
                                       lambda device: props))
        for cache in (direct_launch._launches, skinny._counters, skinny._tables):
            stack.enter_context(mock.patch.dict(cache, clear=True))
        # the active driver as set, not as Triton would make it (none on a CPU-only machine)
        stack.enter_context(mock.patch.object(driver, "_active", _Sm90Driver()))
        triton_kernels.sm_count.cache_clear()
        try:
            yield launches
        finally:
            triton_kernels.sm_count.cache_clear()
