"""Imports of optional or noisy dependencies, and what differs between the torch and
transformers versions supported, kept in one place."""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR) -> Iterator[None]:
    """Raise the level of the named loggers for the duration of the block."""
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, saved):
            logger.setLevel(old)


# torchao warns at import about its CUDA-only extension libraries on CPU machines, and torch
# about torchao's enum registrations; neither concerns kbbq-pl's users.
with quiet_loggers("torchao", "torch.utils._pytree"):
    import torchao.prototype.mx_formats  # noqa: F401  (registers its enums with torch now)
    from torchao.utils import TorchAOBaseTensor  # noqa: F401


def tracing() -> bool:
    """Whether ``torch.compile`` or ``torch.export`` is tracing the current call: code then
    takes its traceable path (no read to the host, no eager-only cache, no nested compile).

    ``torch.compiler.is_compiling()`` alone does not say it on every torch supported: torch
    2.11 traces a tensor subclass's ``__torch_function__`` (``F.linear`` of a ``W4A4Weight``)
    by running it on fake tensors with ``is_compiling()`` False (2.13 says True).  The fake
    tensor mode those runs are under says it on both; read as torch's fake tensors read it (a C
    lookup, ~0.1 us: every quantized linear's forward asks, and
    ``torch._guards.active_fake_mode`` walks the mode stack in Python)."""
    return (torch.compiler.is_compiling()
            or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None)


CACHE_ARGUMENTS = ("cache", "past_key_values")
"""The names transformers gives a model's (and a decoder layer's) key-value cache argument:
``cache`` from 5.24, ``past_key_values`` before (and, deprecated, up to 5.39)."""


def cache_argument(model: torch.nn.Module) -> str:
    """The name ``model``'s forward takes its key-value cache by (:data:`CACHE_ARGUMENTS`)."""
    parameters = inspect.signature(model.forward).parameters
    return next((name for name in CACHE_ARGUMENTS if name in parameters), CACHE_ARGUMENTS[-1])
