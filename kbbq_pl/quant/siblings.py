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
on a GPU it may not).  Anything else (a prefill, the emulation on a CPU, a gradient, an
inference-mode input, whose changes no version counter tells) runs each layer on its own, as
without the hooks; so does, from then on, a group whose outputs were
computed together but not all asked for with that input (cross-attention's keys and values
read the encoder's states).  A write the version counter does not see (through ``.data``, a
kernel's or DLPack's) between two siblings' calls would go unnoticed, as it would by any
cache keyed on it.

Under ``torch.compile`` the hooks stand aside: each linear reaches the graph as one
``kbbq_pl::w4a4_linear`` operator, and :func:`merge_sibling_linears`, Inductor's post-grad pass
(:class:`SiblingLinearPass`, installed by :func:`group_sibling_linears`), puts one
``kbbq_pl::w4a4_linear_siblings`` operator in place of the siblings' that read one input node.

The loaders (``from_pretrained`` through transformers, :func:`kbbq_pl.from_pretrained`) and
:func:`kbbq_pl.quantize_model` group the siblings of the models they return; call
:func:`group_sibling_linears` on any other (torchao's ``quantize_``, a model built by hand).
"""

from __future__ import annotations

import operator
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
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
        outputs = w4a4.grouped_linears(x, [m.weight for m in group], [m.bias for m in group])
        if outputs is None:
            return None
        mine = None
        for module, y in zip(group, outputs):
            if module.weight is weight:
                mine = y
            else:
                self.kept[id(module.weight)] = _Kept(index, weakref.ref(x), x._version,
                                                     module.bias, y)
        return mine


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
    its own layers; the hooks pickle).  Where it hooks any, it installs the compiler's pass
    too (:func:`install_compile_pass`).  Returns the hooks (the groups hooked, and
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
    if hooks.groups:
        install_compile_pass()
    return hooks


def ungroup_sibling_linears(model: nn.Module) -> None:
    """Take off every hook :func:`group_sibling_linears` put on ``model`` (also those of a copy
    or an unpickled model, whose :class:`SiblingHooks` the caller does not hold)."""
    for module in model.modules():
        if not module.__dict__.pop(_HOOKED, None):
            continue
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, hook in hooks.items()
                        if isinstance(getattr(hook, "__self__", None), _ParentHooks)]:
                del hooks[key]
                module._forward_hooks_always_called.pop(key, None)


class _ParentHooks:
    """A parent's hooks.  Before its forward, its sibling groups (attribute names) become the
    innermost scope (not while ``torch.compile`` traces it); after (an error too), the scope
    ends, and a group whose outputs were computed together but not all asked for (siblings
    reading different inputs: cross-attention) runs alone from then on."""

    def __init__(self, groups: tuple[tuple[str, ...], ...]) -> None:
        self.groups = groups
        self.alone: set[int] = set()

    def __setstate__(self, state: dict) -> None:
        """Unpickled with its model (``torch.load`` of a whole model): the compiler's pass too,
        as :func:`group_sibling_linears` installs it."""
        self.__dict__.update(state)
        install_compile_pass()

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


# ---------------------------------------------------------------------- under torch.compile


def merge_sibling_linears(graph: torch.fx.Graph) -> int:
    """Inductor's post-grad graph with each run of sibling ``kbbq_pl::w4a4_linear`` calls (2 or
    3 reading the same input node in one format, width and kind of transform, static scale and
    bias) replaced by one ``kbbq_pl::w4a4_linear_siblings`` call, placed before the first of
    them; a call whose operands the graph computes only after the first waits for the next
    group (with the calls after it) or runs alone.  The compiled form of the eager hooks: each
    output is its layer's (:func:`w4a4.grouped_linears`).  Returns the number of calls made.
    Nothing changes without ``kbbq_pl.kernels``."""
    single = torch.ops.kbbq_pl.w4a4_linear.default
    candidates: dict[tuple, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is single:
            candidates.setdefault(_sibling_key(node), []).append(node)
    kernels = w4a4._kernels() if any(len(nodes) > 1 for nodes in candidates.values()) else None
    if kernels is None:
        return 0
    order: dict[torch.fx.Node, float] = {node: i for i, node in enumerate(graph.nodes)}
    made = 0
    for nodes in candidates.values():
        while len(nodes) > 1:
            first, group, rest = nodes[0], [nodes[0]], []
            for node in nodes[1:]:
                if len(group) < kernels.MAX_SIBLINGS and all(
                        order[n] < order[first] for n in node.all_input_nodes):
                    group.append(node)
                else:
                    rest.append(node)
            if len(group) > 1:
                for node in _replace_with_one_call(graph, group):
                    order[node] = order[first] - 0.5  # just before the first, after its inputs
                made += 1
            nodes = rest
    return made


def _sibling_key(node: torch.fx.Node) -> tuple:
    """What sibling calls must share to run as one: the input node, the format's fields and
    the padded width (``kbbq_pl::w4a4_linear``'s arguments 7 to 12), whether each has a
    transform, a static activation scale and a bias (of which dtype)."""
    x, _, _, _, transform, _, bias, *fields = node.args
    bias_val = None if bias is None else bias.meta.get("val")
    return (x, *fields[:6], transform is None, fields[7] == "static",
            None if bias is None else getattr(bias_val, "dtype", "bias"))


def _replace_with_one_call(graph: torch.fx.Graph,
                           group: list[torch.fx.Node]) -> list[torch.fx.Node]:
    """The grouped call and its items in place of ``group``'s calls (returned: the new
    nodes, inserted before the first)."""
    columns = list(zip(*(node.args for node in group)))
    x, fmt_fields, last_dim = group[0].args[0], group[0].args[7:12], group[0].args[12]
    args = (x, *(list(columns[i]) for i in range(1, 7)), *fmt_fields, last_dim,
            list(columns[13]), list(columns[14]), list(columns[15]))
    with graph.inserting_before(group[0]):
        call = graph.call_function(torch.ops.kbbq_pl.w4a4_linear_siblings.default, args)
        call.meta["val"] = [node.meta.get("val") for node in group]
        made = [call]
        for i, node in enumerate(group):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta.update(node.meta)
            node.replace_all_uses_with(item)
            made.append(item)
    for node in group:
        graph.erase_node(node)
    return made


class SiblingLinearPass(CustomGraphPass):
    """:func:`merge_sibling_linears` as Inductor's ``post_grad_custom_post_pass`` (its
    ``uuid`` keys the compile cache on this file and the operators')."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        merge_sibling_linears(graph)

    def uuid(self) -> bytes:
        kernels = Path(__file__).parents[1] / "kernels" / "__init__.py"  # MAX_SIBLINGS
        return get_hash_for_files((__file__, w4a4.__file__, str(kernels)))


def install_compile_pass() -> bool:
    """Make :class:`SiblingLinearPass` Inductor's ``post_grad_custom_post_pass`` (a global
    setting, as torchao's concat-linear passes set it) unless another pass holds it: call
    :func:`merge_sibling_linears` from that one.  Returns whether the pass is installed."""
    from torch._inductor import config

    if config.post_grad_custom_post_pass is None:
        config.post_grad_custom_post_pass = SiblingLinearPass()
    if isinstance(config.post_grad_custom_post_pass, SiblingLinearPass):
        return True
    warnings.warn("torch._inductor.config.post_grad_custom_post_pass holds another pass: under "
                  "torch.compile each W4A4 linear runs alone unless that pass calls "
                  "kbbq_pl.quant.siblings.merge_sibling_linears(graph)", stacklevel=2)
    return False
