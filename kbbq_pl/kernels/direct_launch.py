"""A Triton kernel launched again without Triton's per-call Python: an eager decode's host time.

``kernel[grid](*args, **kwargs)`` binds and specializes every argument in Python at each call,
and an autotuned kernel first builds its tuning key from all of them: on a 2-core CPU about
55 us a launch of the decode GEMM (33 arguments) and 120 us through its autotuner
(``bench/host_time.py``), where the GEMM itself runs for 5 to 20 us on an H200.  An eager decode
step (transformers' ``generate`` without a static cache or CUDA graph) pays that twice a linear.
:func:`launch` lets Triton do it the first time and keeps the kernel Triton compiled with the
arguments Triton bound after the caller's (the constants it compiled with: tile, autotuned
config, heuristics, defaults); a later launch that Triton would specialize the same way
(:func:`_launch_key`) launches that compiled kernel directly,
``CompiledKernel[grid](*bound_args)``, which is how ``JITFunction.run`` launches it.  What the
cache keeps is Triton's own: the autotuner has chosen once per its key, and nothing is chosen
again.

Kernels launched here take no hooks (an autotuner's ``reset_to_zero``, ``restore_value`` or
``pre_hook``, a ``JITFunction``'s pre-run hooks) and no changing globals: the direct launch
skips them, as it skips Triton's check that a global the kernel reads has not changed.  Under
Triton's interpreter every launch goes through Triton (there is nothing compiled to keep)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

from .interpret import interpreting

INTERPRET = interpreting()
DIRECT = True
"""Launch directly after Triton's first launch (False: every launch through Triton, as
``bench/host_time.py`` compares)."""
MOST_LAUNCHES = 8192
"""Launch keys kept (each a few KB); past them the cache starts again (every distinct row
count of a decode step or a short prompt is a key: prompts of every length would grow it)."""
_launches: dict[tuple, tuple[Any, tuple]] = {}
"""Per launch key, Triton's compiled kernel bound to its grid and the arguments after the
caller's."""


def _launch_key(kernel: Any, grid: tuple | functools.partial, args: Sequence,
                kwargs: dict) -> tuple:
    """What Triton's launch depends on, and more: the kernel, the grid (a tuple, or a
    ``functools.partial`` of the constants, by its function and arguments), the current device
    (whose compiled kernel Triton launches), Triton's debug and instrumentation settings, the
    keyword arguments, and each argument's specialization: a tensor's dtype and 16-byte
    alignment (Triton's), any other argument's type and value (Triton's are coarser: an
    integer's 32 or 64 bits, 1 or a multiple of 16)."""
    grid_key = grid if isinstance(grid, tuple) else (grid.func, grid.args, *grid.keywords.items())
    tensor = torch.Tensor
    return (kernel, grid_key, driver.active.get_current_device(), knobs.runtime.debug,
            knobs.compilation.instrumentation_mode, *kwargs.items(),
            *[(a.dtype, not a.data_ptr() & 15) if isinstance(a, tensor) else (type(a), a)
              for a in args])


def _direct(compiled: Any, grid: tuple | functools.partial, args: Sequence) -> tuple:
    """The launcher of ``compiled`` (what Triton returned for the launch just made) on its grid,
    and the arguments Triton bound after ``args``: the constants it compiled with (the keyword
    arguments, the autotuner's config, the heuristics' values, the defaults), read from the
    compiled kernel itself, not from an autotuner another launch may have moved on since."""
    names = compiled.src.fn.arg_names
    constants = {names[position[0]]: value
                 for position, value in compiled.src.constants.items()}
    after = tuple(constants[name] for name in names[len(args):])  # KeyError: not a constant
    if callable(grid):
        grid = grid({**dict(zip(names, args)), **constants})
    size = tuple(grid) + (1,) * (3 - len(grid))
    return compiled[size], after


def launch(kernel: Any, grid: tuple | functools.partial, args: Sequence, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)`` (``kernel`` a ``triton.jit`` function, or autotuned
    or given heuristics, taking every runtime argument in ``args`` and only constants in
    ``kwargs``; ``grid`` a tuple, or a ``functools.partial`` that takes the bound arguments by
    name), through Triton the first time and directly after (module docstring)."""
    if INTERPRET or not DIRECT:
        kernel[grid](*args, **kwargs)
        return
    key = _launch_key(kernel, grid, args, kwargs)
    entry = _launches.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if len(_launches) >= MOST_LAUNCHES:
            _launches.clear()
        _launches[key] = _direct(compiled, grid, args)
        return
    runner, after = entry
    runner(*args, *after)
