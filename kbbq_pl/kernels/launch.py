"""A Triton kernel launched again without Triton's per-call Python: an eager decode's host time.

``kernel[grid](*args, **kwargs)`` binds and specializes every argument in Python at each call,
and an autotuned kernel first builds its tuning key from all of them: on a 2-core CPU about
55 us a launch of the decode GEMM (33 arguments) and 120 us through its autotuner
(``bench/host_time.py``), where the GEMM itself runs for 5 to 20 us on an H200.  An eager decode
step (transformers' ``generate`` without a static cache or CUDA graph) pays that twice a linear.
:func:`launch` lets Triton do it the first time and keeps the kernel Triton compiled with the
arguments Triton bound after the caller's (the constants: tile, autotuned config, heuristics,
defaults); a later launch that Triton would specialize the same way (:func:`_launch_key`)
launches that compiled kernel directly, ``CompiledKernel[grid](*bound_args)``, which is how
``JITFunction.run`` launches it.  What the cache keeps is Triton's own: the autotuner has chosen
once per its key, and nothing is chosen again.

Kernels launched here take no hooks (an autotuner's ``reset_to_zero``, ``restore_value`` or
``pre_hook``): the direct launch would skip them.  Under Triton's interpreter every launch goes
through Triton (there is nothing compiled to keep)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

from .interpret import interpreting

INTERPRET = interpreting()
DIRECT = True
"""Launch directly after Triton's first launch (False: every launch through Triton, as
``bench/host_time.py`` compares)."""
_launches: dict[tuple, tuple[Any, tuple]] = {}
"""Per launch key, Triton's compiled kernel bound to its grid and the arguments after the
caller's."""


def _launch_key(kernel: Any, grid: tuple | functools.partial, args: Sequence,
                kwargs: dict) -> tuple:
    """What Triton's launch depends on, and more: the kernel, the grid (a tuple, or a
    ``functools.partial`` of the constants, by its function and arguments), the current device
    (whose compiled kernel Triton launches), the keyword arguments, and each argument's
    specialization: a tensor's dtype and 16-byte alignment (Triton's), any other argument's
    type and value (Triton's are coarser: an integer's 32 or 64 bits, 1 or a multiple of 16)."""
    grid_key = grid if isinstance(grid, tuple) else (grid.func, grid.args)
    tensor = torch.Tensor
    return (kernel, grid_key, driver.active.get_current_device(), *kwargs.items(),
            *[(a.dtype, not a.data_ptr() & 15) if isinstance(a, tensor) else (type(a), a)
              for a in args])


def _bound_after(kernel: Any, args: Sequence, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments Triton binds after ``args`` (in the kernel's order: the caller's keyword
    arguments, an autotuner's chosen config, the heuristics' values, the defaults) and all of
    them by name, as ``JITFunction.run`` binds them for the launch ``kernel`` just made."""
    kwargs = dict(kwargs)
    while not isinstance(kernel, JITFunction):
        if isinstance(kernel, Autotuner):
            config = kernel.best_config
            if kernel.reset_to_zero or kernel.restore_value or config.pre_hook is not None:
                raise ValueError(f"{kernel.base_fn.__name__}: an autotuner with hooks cannot "
                                 "be launched directly")
            kwargs.update(config.all_kwargs())
        elif isinstance(kernel, Heuristics):
            for name, heuristic in kernel.values.items():
                kwargs[name] = heuristic({**dict(zip(kernel.arg_names, args)), **kwargs})
        else:
            raise TypeError(f"cannot launch {type(kernel).__name__} directly")
        kernel = kernel.fn
    signature = inspect.signature(kernel.fn)
    bound = signature.bind(*args, **{name: value for name, value in kwargs.items()
                                     if name in signature.parameters})
    bound.apply_defaults()
    return tuple(bound.arguments.values())[len(args):], bound.arguments


def launch(kernel: Any, grid: tuple | functools.partial, args: Sequence, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` (``kernel`` a ``triton.jit`` function, or autotuned
    or given heuristics; ``grid`` a tuple, or a ``functools.partial`` that takes the bound
    arguments by name), through Triton the first time and directly after
    (module docstring)."""
    if INTERPRET or not DIRECT:
        kernel[grid](*args, **kwargs)
        return
    key = _launch_key(kernel, grid, args, kwargs)
    entry = _launches.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        after, named = _bound_after(kernel, args, kwargs)
        size = tuple(grid(named) if callable(grid) else grid)
        _launches[key] = (compiled[size + (1,) * (3 - len(size))], after)
        return
    runner, after = entry
    runner(*args, *after)
