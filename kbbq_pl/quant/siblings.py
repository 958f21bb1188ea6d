"""Sibling linears in one pair of launches: q/k/v and gate/up on the kernels' decode path.

A decode step's linears are short (a few microseconds on a GPU), so their launches are much
of its time.  vLLM merges the layers that read the same input (q/k/v, gate/up: its packed
modules) into one linear when it loads a model.  KBBQ's layers cannot be merged into one
weight: each has its own transform, so each rounds the shared input its own way.  Instead,
:func:`group_sibling_linears` hooks the module that holds them (the attention, the MLP:
:data:`~kbbq_pl.quant.modules.FUSED_SIBLINGS` under one parent): while it runs, the first
sibling's product (``F.linear`` of a :class:`~kbbq_pl.quant.w4a4.W4A4Weight` on the kernels'
decode path) computes every sibling's output in two launches
(:func:`kbbq_pl.kernels.linear_w4a4_siblings`) and keeps the others' until their own calls
ask for them with the same input (the same tensor, unchanged since: its version counter) and
the same bias.  Each output is what the layer's own call would give: within the same one
rounding of the exact product of its codes, and the same bits where the grouped launch takes
the layer's own tile and K splits (it chooses them for all the siblings' columns together, so
on a GPU it may not).  Anything else (a prefill, the emulation on a CPU, a gradient,
``torch.compile``, an inference-mode input, whose changes no version counter tells) runs each
layer on its own, as without the hooks; so does, from then on, a group whose outputs were
computed together but not all asked for with that input (cross-attention's keys and values
read the encoder's states).  A write the version counter does not see (through ``.data``, a
kernel's or DLPack's) between two siblings' calls would go unnoticed, as it would by any
cache keyed on it.

The loaders (``from_pretrained`` through transformers, :func:`kbbq_pl.from_pretrained`) and
:func:`kbbq_pl.quantize_model` group the siblings of the models they return; call
:func:`group_sibling_linears` on any other (torchao's ``quantize_``, a model built by hand).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from . import w4a4
from .layers import QuantizedLinear
from .modules import fused_groups
from .w4a4 import W4A4Weight


@dataclass
class _Kept:
    """A sibling's output computed with the first sibling's, waiting for its own call."""

    group: int  # the group's index in its parent's hooks
    source: weakref.ref[Tensor]  # the input (not kept alive)
    version: int
    bias: Tensor | None
    output: Tensor


@dataclass
class _Scope:
    """One run of a parent module: its sibling groups (by index) and the outputs kept for
    their calls."""

    owner: nn.Module
    groups: dict[int, list[nn.Module]]
    kept: dict[int, _Kept] = field(default_factory=dict)  # by id of the sibling's weight
    unserved: set[int] = field(default_factory=set)  # groups whose kept output was not asked

    def output(self, x: Tensor, weight: W4A4Weight, bias: Tensor | None) -> Tensor | None:
        """``F.linear(x, weight, bias)`` if ``weight`` is a sibling's here and the siblings
        run together (from the outputs kept or computed now), else None.  A kept output that
        does not serve the call (another input: cross-attention's keys and values) is
        dropped and this layer runs alone."""
        kept = self.kept.pop(id(weight), None)
        if kept is not None:
            if kept.source() is x and kept.version == x._version and kept.bias is bias:
                return kept.output
            self.unserved.add(kept.group)
            return None
        index, group = next(((i, g) for i, g in self.groups.items()
                             if any(m.weight is weight for m in g)), (None, None))
        if group is None or any(m.weight is weight and m.bias is not bias for m in group):
            return None
        weights = [m.weight for m in group]
        if not all(_runs_with(x, w, weight) for w in weights):
            return None
        kernels = w4a4._kernels()
        assert kernels is not None  # uses_kernels said so
        rows = x.numel() // x.shape[-1]
        if kernels.choose_path(rows, weight.fmt) != "decode":
            return None
        scales = [w.act_global_scale if w.act_scale == "static" else None for w in weights]
        layers = [kernels.SiblingLinear(w.qdata, w.scale, w.global_scale, w.transform, scale,
                                        m.bias, w4a4._prepared_weight(kernels, w, scale))
                  for w, scale, m in zip(weights, scales, group)]
        outputs = kernels.linear_w4a4_siblings(x, layers, weight.fmt)
        mine = None
        for module, y in zip(group, outputs):
            if module.weight is weight:
                mine = y
            else:
                self.kept[id(module.weight)] = _Kept(index, weakref.ref(x), x._version,
                                                     module.bias, y)
        return mine


def _runs_with(x: Tensor, weight: object, first: W4A4Weight) -> bool:
    """Whether sibling ``weight`` runs on the kernels for ``x`` in the first's format and
    width, its static activation scale (if any) calibrated."""
    return (isinstance(weight, W4A4Weight) and weight.fmt == first.fmt
            and weight.last_dim == first.last_dim
            and x.shape[-1] in (weight.in_features, weight.last_dim)
            and weight.qdata.device == x.device and w4a4.uses_kernels(x, weight)
            and (weight.act_scale != "static" or weight.act_global_scale is not None))


class SiblingHooks:
    """The hooks :func:`group_sibling_linears` installed: ``groups`` (qualified names, per
    group) and :meth:`remove`."""

    def __init__(self) -> None:
        self.groups: list[list[str]] = []
        self._hooked: list[tuple[nn.Module, list[RemovableHandle]]] = []

    def remove(self) -> None:
        """Take the hooks off: every layer runs on its own again."""
        for parent, handles in self._hooked:
            for handle in handles:
                handle.remove()
            parent.__dict__.pop(_HOOKED, None)
        self._hooked = []
        self.groups = []


_HOOKED = "_kbbq_sibling_hooks"


def group_sibling_linears(model: nn.Module) -> SiblingHooks:
    """Hook every module of ``model`` that holds quantized sibling linears (q/k/v, gate/up:
    :func:`~kbbq_pl.quant.modules.fused_groups`) so that, on the kernels' decode path, the
    siblings run in two launches together (module docstring).  A parent already hooked is
    left as it is.  The hooks name the siblings by attribute (a deep copy of the model groups
    its own layers; the hooks pickle).  Returns the hooks (the groups hooked, and
    ``remove()``)."""
    names = [name for name, module in model.named_modules()  # the quantized linears only
             if isinstance(module, QuantizedLinear)
             or isinstance(getattr(module, "weight", None), W4A4Weight)]
    by_parent: dict[str, list[list[str]]] = {}
    for group in fused_groups(names):
        by_parent.setdefault(group[0].rpartition(".")[0], []).append(group)
    hooks = SiblingHooks()
    for parent_name, groups in by_parent.items():
        parent = model.get_submodule(parent_name) if parent_name else model
        if parent.__dict__.get(_HOOKED):
            continue
        parent_hooks = _ParentHooks(tuple(tuple(name.rpartition(".")[2] for name in group)
                                          for group in groups))
        parent.__dict__[_HOOKED] = True
        hooks._hooked.append((parent, [
            parent.register_forward_pre_hook(parent_hooks.enter),
            parent.register_forward_hook(parent_hooks.leave, always_call=True)]))
        hooks.groups += groups
    return hooks


class _ParentHooks:
    """A parent's hooks.  Before its forward, its sibling groups (attribute names) become the
    innermost scope (not while ``torch.compile`` traces it); after (an error too), the scope
    ends, and a group whose outputs were computed together but not all asked for (siblings
    reading different inputs: cross-attention) runs alone from then on."""

    def __init__(self, groups: tuple[tuple[str, ...], ...]) -> None:
        self.groups = groups
        self.alone: set[int] = set()

    def enter(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            return
        groups = {}
        for index, names in enumerate(self.groups):
            group = [getattr(module, name, None) for name in names]
            if index not in self.alone and all(
                    isinstance(getattr(m, "weight", None), Tensor) for m in group):
                groups[index] = group
        w4a4.sibling_scopes.stack.append(_Scope(module, groups))

    def leave(self, module: nn.Module, args: tuple, output: object) -> None:
        if torch.compiler.is_compiling():
            return
        stack = w4a4.sibling_scopes.stack
        if stack and stack[-1].owner is module:
            scope = stack.pop()
            self.alone.update(scope.unserved, (kept.group for kept in scope.kept.values()))
