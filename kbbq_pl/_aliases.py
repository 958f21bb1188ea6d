"""The import paths of the modules that moved into subpackages, kept as deprecated aliases.

kbbq-pl 0.1 was one flat package (``kbbq_pl.quantize``, ``kbbq_pl.export``, ...).  Its modules
now live in subpackages that show the architecture (``kbbq_pl.quant``, ``kbbq_pl.io``, ...);
``import kbbq_pl.quantize`` (or ``from kbbq_pl.export import save_quantized``, or unpickling an
object saved under an old path) still works: it warns a :class:`DeprecationWarning` naming the
new module and gives a module whose attributes are the new modules' own objects (no copies).
There is no file at an old path: a finder on ``sys.meta_path``, installed when ``kbbq_pl`` is
imported, answers for exactly the names of :data:`MOVED`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

MOVED: dict[str, tuple[str, ...]] = {
    "kbbq_pl.autobrake": ("kbbq_pl.transforms.autobrake",),
    "kbbq_pl.benchmarks": ("kbbq_pl.eval.benchmarks",),
    "kbbq_pl.compressed_tensors": ("kbbq_pl.io.compressed_tensors",),
    "kbbq_pl.data": ("kbbq_pl.io.data",),
    "kbbq_pl.evaluation": ("kbbq_pl.eval.evaluation",),
    "kbbq_pl.export": ("kbbq_pl.io.checkpoint", "kbbq_pl.io.models:from_pretrained"),
    "kbbq_pl.fileio": ("kbbq_pl.io.fileio",),
    "kbbq_pl.fold": ("kbbq_pl.transforms.fold",),
    "kbbq_pl.gptq": ("kbbq_pl.quant.gptq",),
    "kbbq_pl.law_cells": ("kbbq_pl.eval.law_cells",),
    "kbbq_pl.law_report": ("kbbq_pl.eval.law_report",),
    "kbbq_pl.layers": ("kbbq_pl.quant.layers",),
    "kbbq_pl.llama2c": ("kbbq_pl.io.llama2c",),
    "kbbq_pl.models": ("kbbq_pl.io.models",),
    # kbbq_pl.law, kbbq_pl.transforms, kbbq_pl.cli are packages now, re-exporting what they held
    "kbbq_pl.modules": ("kbbq_pl.quant.modules",),
    "kbbq_pl.quantize": ("kbbq_pl.quant.config", "kbbq_pl.quant.report", "kbbq_pl.quant.rtn",
                         "kbbq_pl.quant.pipeline"),
    "kbbq_pl.quantize_cli": ("kbbq_pl.cli.quantize",),
    "kbbq_pl.report": ("kbbq_pl.eval.report",),
    "kbbq_pl.sequential": ("kbbq_pl.quant.sequential",),
    "kbbq_pl.sequential_gptq": ("kbbq_pl.quant.gptq_quantizer", "kbbq_pl.quant.config"),
    "kbbq_pl.stats": ("kbbq_pl.quant.stats",),
    "kbbq_pl.torchao": ("kbbq_pl.quant.torchao",),
    "kbbq_pl.w4a4": ("kbbq_pl.quant.w4a4",),
    # the two pipelines of the first subpackage layout, now one (kbbq_pl.quant.pipeline)
    "kbbq_pl.quant.quantize": ("kbbq_pl.quant.config", "kbbq_pl.quant.report",
                               "kbbq_pl.quant.rtn", "kbbq_pl.quant.pipeline"),
    "kbbq_pl.quant.sequential_gptq": ("kbbq_pl.quant.gptq_quantizer", "kbbq_pl.quant.config"),
}
"""Old module -> where its contents are now, looked up in this order: a module (all its public
names) or ``module:name`` (that one name, for a function that moved on its own)."""


def public_names(module: types.ModuleType) -> list[str]:
    """``module.__all__``, or its names without a leading underscore."""
    names = getattr(module, "__all__", None)
    return list(names) if names is not None else [n for n in vars(module) if not n.startswith("_")]


def exported(target: str) -> tuple[types.ModuleType, list[str]]:
    """The module of a :data:`MOVED` target and the names the alias takes from it."""
    module_name, _, name = target.partition(":")
    module = importlib.import_module(module_name)
    return module, [name] if name else public_names(module)


def where(old: str) -> str:
    """Where the contents of ``old`` are now, in words."""
    modules = [t for t in MOVED[old] if ":" not in t]
    names = [f"{t.partition(':')[2]} in {t.partition(':')[0]}" for t in MOVED[old] if ":" in t]
    return ", ".join(modules) + (f" ({', '.join(names)})" if names else "")


class AliasModule(types.ModuleType):
    """An old import path: an attribute is looked up on the new modules (private names too, on
    a whole-module target)."""

    __targets__: tuple[tuple[types.ModuleType, list[str], bool], ...] = ()

    def __getattr__(self, name: str) -> Any:
        for module, names, whole in self.__targets__:
            if (whole or name in names) and hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"module {self.__name__!r} (moved to {where(self.__name__)}) has "
                             f"no attribute {name!r}")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self.__all__})


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return AliasModule(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        targets = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} moved to {where(module.__name__)}: import from there "
                      "(the old path is a deprecated alias)", DeprecationWarning, stacklevel=2)
        found = [(*exported(target), ":" not in target) for target in targets]
        module.__targets__ = tuple(found)
        module.__all__ = sorted({name for _, names, _ in found for name in names})
        module.__doc__ = f"Deprecated alias: moved to {where(module.__name__)}."


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader())


def install() -> None:
    """Answer imports of the old paths (idempotent)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
