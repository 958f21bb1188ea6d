"""Imports of optional or noisy dependencies, kept in one place."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


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
