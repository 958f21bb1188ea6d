"""The ``kbbq-pl`` command (:mod:`kbbq_pl.cli.commands`) and its ``quantize`` recipe runner
(:mod:`kbbq_pl.cli.quantize`)."""

from .commands import main

__all__ = ["main"]
