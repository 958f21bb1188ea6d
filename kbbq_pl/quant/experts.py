"""Mixture-of-experts layers as linear layers, so that their experts are quantized.

transformers (5 and later) holds the experts of a mixture-of-experts layer as 3-D parameters
(``gate_up_proj`` or ``up_proj``, and ``down_proj``: ``[experts, out, in]``, or ``[experts, in,
out]`` where the class says ``is_transposed``; biases ``[experts, out]`` where it says
``has_bias``), which no linear-layer machinery sees: left alone, the experts (nearly all of an
MoE model's weights) would stay in full precision.  :func:`unfuse_experts` replaces each such
module by :class:`ExpertLinears`, one :class:`Expert` per expert holding its two projections as
``nn.Linear`` layers (named ``<experts>.<e>.gate_up_proj`` / ``up_proj`` and ``down_proj``),
which computes what the fused module's eager forward computes; the experts are then calibrated,
transformed and quantized as every other linear layer.  llm-compressor likewise turns fused
experts into linear layers before it quantizes them.

While a model is quantized (:func:`calibrating_every_expert`), every expert sees every
calibration token, as llm-compressor's ``calibrate_all_experts`` does: a rarely routed expert
still gets statistics for its transform, activation scale and Hessian, while the layer's output
(what the next block is calibrated on) still sums the routed experts only.  The experts' up
projections then read one tensor one after another, so the statistics collectors form its
products once: GPTQ holds one Hessian for all of them (a layer's experts are one group).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor, nn

from .modules import in_out_features, is_linear

__all__ = ["FUSED_PARAMETERS", "SCORED_EXPERTS", "Expert", "ExpertLinears", "ScoredExpertLinears",
           "calibrating_every_expert", "fuse_experts", "fused_experts", "has_plain_experts",
           "moe_routers", "unfuse_experts"]

FUSED_PARAMETERS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias",
                    "down_proj_bias")
"""The parameters a fused experts module may hold (the module docstring)."""


SCORED_EXPERTS = ("Llama4TextExperts",)
"""Fused experts classes that read every token once per expert, already scaled by its routing
score (zero where the token is not routed to it: Llama 4's ``Llama4TextMoe``):
``forward(hidden_states [experts * tokens, hidden])``, weights ``[experts, in, out]``, the gate
and up projections concatenated halves, no biases.  :class:`ScoredExpertLinears` computes them."""


def _is_scored(module: nn.Module) -> bool:
    return type(module).__name__ in SCORED_EXPERTS


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module with 3-D weights that
    :class:`ExpertLinears` computes: one decorated by
    ``transformers.integrations.moe.use_experts_implementation`` (which sets ``has_gate``,
    ``has_bias`` and ``is_transposed``), except those with a norm after each expert
    (``has_post_expert_norm``), which stay as they are; or one of :data:`SCORED_EXPERTS`."""
    down = getattr(module, "down_proj", None)
    if not (isinstance(down, nn.Parameter) and down.dim() == 3):
        return False
    return _is_scored(module) or (
        all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed"))
        and not getattr(module, "has_post_expert_norm", False))


def _layout(fused: nn.Module) -> tuple[bool, bool, bool]:
    """``(has_gate, has_bias, is_transposed)`` of a fused experts module."""
    if _is_scored(fused):
        return True, False, True
    return bool(fused.has_gate), bool(fused.has_bias), bool(fused.is_transposed)


def _chunked_gate(self: ExpertLinears, gate_up: Tensor) -> Tensor:
    """``act(gate) * up`` on the concatenated halves (transformers' default gating)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def has_plain_experts(fused: nn.Module) -> bool:
    """Whether each expert of the fused experts module ``fused`` is a plain MLP: no biases and,
    if gated, transformers' default gating (:func:`_chunked_gate`: its ``gate_up_proj`` rows
    are the gate's, then the up's), so that it splits into separate ``gate_proj``, ``up_proj``
    and ``down_proj`` linear layers; not gpt-oss (biases, interleaved and clamped gating)."""
    from transformers.integrations.moe import _default_apply_gate

    has_gate, has_bias, _ = _layout(fused)
    gating = getattr(type(fused), "_apply_gate", _default_apply_gate)
    return not has_bias and (not has_gate or gating is _default_apply_gate)


def fused_experts(model: nn.Module) -> dict[str, nn.Module]:
    """The fused experts modules of ``model`` by qualified name."""
    return {name: module for name, module in model.named_modules() if is_fused_experts(module)}


class Expert(nn.Module):
    """One expert: ``gate_up_proj`` (gated experts; ``up_proj`` otherwise) and ``down_proj``."""

    def __init__(self, up: nn.Linear, down: nn.Linear, gated: bool) -> None:
        super().__init__()
        self.add_module("gate_up_proj" if gated else "up_proj", up)
        self.down_proj = down

    @property
    def up(self) -> nn.Module:
        return self._modules.get("gate_up_proj") or self._modules["up_proj"]


class ExpertLinears(nn.Module):
    """The experts of a fused transformers experts module as :class:`Expert` children named
    ``0`` to ``experts - 1``; ``forward(hidden_states, top_k_index, top_k_weights)`` is the
    fused module's eager forward (each hit expert on its routed tokens, its output times the
    routing weight added in the input's dtype)."""

    def __init__(self, experts: list[Expert], fused: nn.Module) -> None:
        super().__init__()
        for index, expert in enumerate(experts):
            self.add_module(str(index), expert)
        self.num_experts = len(experts)
        self.has_gate, _, self.is_transposed = _layout(fused)
        self.act_fn = getattr(fused, "act_fn", None)
        # the fused class's gating (transformers' default: act(gate) * up on concatenated
        # halves; gpt-oss: its clamped, interleaved SwiGLU), with the scalars it reads (None too:
        # Ling's limit where a layer clips nothing)
        self._gate_function = (None if not self.has_gate else
                               getattr(type(fused), "_apply_gate", _chunked_gate))
        for key, value in vars(fused).items():
            if not key.startswith("_") and (value is None or isinstance(value, (bool, int, float))):
                self.__dict__.setdefault(key, value)
        self.fused_parameters = tuple(fused_weights(fused))
        self.every_expert = False
        # the fused module without its tensors (on the meta device), which fused() fills again;
        # kept outside nn.Module's registries, so that it is no child and holds no state
        object.__setattr__(self, "_fused_shell", _shell(fused))

    def fused(self) -> nn.Module:
        """The transformers experts module this one was made from, holding its experts'
        weights (and biases) stacked in that module's layout: the inverse of
        :func:`per_expert`, for experts that are ``nn.Linear`` layers (a dense model's,
        :func:`kbbq_pl.io.compressed_tensors.dense_model`)."""
        fused = copy.deepcopy(self._fused_shell)
        up_name = "gate_up_proj" if self.has_gate else "up_proj"
        experts = [self.expert(e) for e in range(self.num_experts)]
        for name, layers in ((up_name, [x.up for x in experts]),
                             ("down_proj", [x.down_proj for x in experts])):
            kinds = {type(layer).__name__ for layer in layers if type(layer) is not nn.Linear}
            if kinds:
                raise TypeError(f"experts' {name} layers are {sorted(kinds)[0]}, not nn.Linear: "
                                "only a dense model's experts fuse again")
            weight = torch.stack([layer.weight.T if self.is_transposed else layer.weight
                                  for layer in layers])
            setattr(fused, name, nn.Parameter(weight.contiguous(),
                                              requires_grad=layers[0].weight.requires_grad))
            if f"{name}_bias" in self.fused_parameters:
                bias = torch.stack([layer.bias for layer in layers])
                setattr(fused, f"{name}_bias", nn.Parameter(
                    bias, requires_grad=layers[0].bias.requires_grad))
        unfilled = [n for n, t in (*fused.named_parameters(), *fused.named_buffers())
                    if t.is_meta and n not in self.fused_parameters]
        if unfilled:
            raise NotImplementedError(f"{type(fused).__name__} holds {unfilled[0]!r} beside its "
                                      "experts' weights, which the linear layers do not keep")
        return fused

    def expert(self, index: int) -> Expert:
        return self._modules[str(index)]  # type: ignore[return-value]

    def unfused_state(self, fused: dict[str, Tensor]) -> dict[str, Tensor]:
        """This module's state (its experts' weights and biases, by their names here) from the
        fused module's parameters ``fused`` (by name: ``gate_up_proj``, ``down_proj``, ...), as
        a checkpoint stores them."""
        up_name = "gate_up_proj" if self.has_gate else "up_proj"
        state = {}
        for e, (w_up, b_up, w_down, b_down) in enumerate(per_expert(fused, self.has_gate,
                                                                    self.is_transposed)):
            for name, value in ((f"{up_name}.weight", w_up), (f"{up_name}.bias", b_up),
                                ("down_proj.weight", w_down), ("down_proj.bias", b_down)):
                if value is not None:
                    state[f"{e}.{name}"] = value.contiguous()
        return state

    def _apply_gate(self, gate_up: Tensor) -> Tensor:
        return self._gate_function(self, gate_up)

    def run_expert(self, index: int, x: Tensor) -> Tensor:
        """Expert ``index`` on tokens ``x [tokens, hidden]``."""
        return self.expert(index).down_proj(self._hidden(index, x))

    def _hidden(self, index: int, x: Tensor) -> Tensor:
        """Expert ``index``'s up projection of ``x``, gated (what its ``down_proj`` reads)."""
        h = self.expert(index).up(x)
        return self._apply_gate(h) if self.has_gate else self.act_fn(h)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                ) -> Tensor:
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            mask = mask.permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            every = range(self.num_experts) if self.every_expert else [int(e) for e in hit]
        # statistics from every token, the output from the routed ones; the up projections
        # read the input one after another, so that a statistics collector forms its products
        # (x^T x) once for all experts (it shares those of layers reading a tensor in a row)
        hidden = ([self._hidden(e, hidden_states) for e in every] if self.every_expert
                  else None)
        for position, index in enumerate(every):
            if index == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[index])
            if hidden is not None:
                out = self.expert(index).down_proj(hidden[position])[token_idx]
                hidden[position] = None
            else:
                out = self.run_expert(index, hidden_states[token_idx])
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


class ScoredExpertLinears(ExpertLinears):
    """:class:`ExpertLinears` of one of :data:`SCORED_EXPERTS`: ``forward(hidden_states)``
    takes the tokens once per expert, scaled by their routing scores, and returns each
    expert's output on its share, as the fused module does.  Its experts are calibrated on the
    tokens as they arrive (the routed ones, scaled; the others are zero rows)."""

    def forward(self, hidden_states: Tensor) -> Tensor:  # type: ignore[override]
        shares = hidden_states.view(self.num_experts, -1, hidden_states.shape[-1])
        return torch.cat([self.run_expert(e, shares[e]) for e in range(self.num_experts)])


def _shell(module: nn.Module) -> nn.Module:
    """``module`` without its data: its class and attributes, its parameters and buffers as
    empty tensors on the meta device, its children likewise; no hooks (accelerate's, which may
    reach a whole model's offloaded weights, are not copied)."""
    shell = type(module).__new__(type(module))
    nn.Module.__init__(shell)
    fresh = set(vars(shell)) - {"training"}
    for key, value in vars(module).items():
        if key not in fresh and key not in ("_hf_hook", "_old_forward", "forward"):
            shell.__dict__[key] = value
    for name, p in module._parameters.items():
        shell._parameters[name] = None if p is None else nn.Parameter(
            torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for name, b in module._buffers.items():
        shell._buffers[name] = None if b is None else torch.empty_like(b, device="meta")
    shell._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    for name, child in module._modules.items():
        shell._modules[name] = None if child is None else _shell(child)
    return shell


def fuse_experts(model: nn.Module) -> list[str]:
    """Replace every :class:`ExpertLinears` of ``model`` by the transformers experts module it
    was made from (:meth:`ExpertLinears.fused`; in place), the inverse of
    :func:`unfuse_experts` for a dense model; return their names."""
    names = [name for name, module in model.named_modules() if isinstance(module, ExpertLinears)]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, model.get_submodule(name).fused())
    return names


def _linear(weight: Tensor, bias: Tensor | None, trainable: bool) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight [out, in]`` and ``bias`` (copies; on the meta device
    where they are); ``trainable``: whether its parameters require gradients."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta",
                      dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.detach().clone().contiguous(), requires_grad=trainable)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone().contiguous(), requires_grad=trainable)
    return layer


def fused_weights(fused: nn.Module) -> dict[str, Tensor]:
    """The weights (and biases, where the class says ``has_bias``) of the fused experts module
    ``fused`` by parameter name (:data:`FUSED_PARAMETERS`)."""
    has_gate, has_bias, _ = _layout(fused)
    up_name = "gate_up_proj" if has_gate else "up_proj"
    names = [up_name, "down_proj"] + ([f"{up_name}_bias", "down_proj_bias"] if has_bias else [])
    return {name: getattr(fused, name) for name in names}


def per_expert(fused: dict[str, Tensor], gated: bool, transposed: bool,
               ) -> Iterator[tuple[Tensor, Tensor | None, Tensor, Tensor | None]]:
    """Each expert's ``(up weight [out, in], up bias, down weight, down bias)`` (views) from
    the fused parameters ``fused`` (:func:`fused_weights`'s names and layout)."""
    up_name = "gate_up_proj" if gated else "up_proj"
    up, down = fused[up_name], fused["down_proj"]
    up_bias, down_bias = fused.get(f"{up_name}_bias"), fused.get("down_proj_bias")
    for e in range(down.shape[0]):
        w_up, w_down = (up[e].T, down[e].T) if transposed else (up[e], down[e])
        yield (w_up, None if up_bias is None else up_bias[e], w_down,
               None if down_bias is None else down_bias[e])


def expert_linears(fused: nn.Module) -> ExpertLinears:
    """``fused`` (see :func:`is_fused_experts`) as :class:`ExpertLinears` with the same
    weights, dtype and device."""
    weights = fused_weights(fused)
    has_gate, _, transposed = _layout(fused)
    up_trainable, down_trainable = (weights[name].requires_grad for name in (
        "gate_up_proj" if has_gate else "up_proj", "down_proj"))
    experts = [Expert(_linear(w_up, b_up, up_trainable), _linear(w_down, b_down, down_trainable),
                      has_gate)
               for w_up, b_up, w_down, b_down in per_expert(weights, has_gate, transposed)]
    return (ScoredExpertLinears if _is_scored(fused) else ExpertLinears)(experts, fused)


def unfuse_experts(model: nn.Module, stored: Iterable[str] | None = None) -> list[str]:
    """Replace every fused experts module of ``model`` by :class:`ExpertLinears` (in place;
    on the meta device, a model built to be loaded into, the experts stay there), and return
    their names.  ``stored``: the names a checkpoint holds (layers or tensors); only the
    modules that it stores expert by expert (``<name>.<e>.``) are replaced."""
    names = list(stored) if stored is not None else None
    replaced = []
    for name, module in fused_experts(model).items():
        if names is not None:
            pattern = re.compile(re.escape(name) + r"\.\d+\.")
            if not any(pattern.match(stored_name) for stored_name in names):
                continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, expert_linears(module))
        replaced.append(name)
    return replaced


@contextlib.contextmanager
def calibrating_every_expert(model: nn.Module) -> Iterator[None]:
    """Within it, every :class:`ExpertLinears` of ``model`` runs every expert on every token
    (the module docstring)."""
    modules = [m for m in model.modules() if isinstance(m, ExpertLinears)]
    for module in modules:
        module.every_expert = True
    try:
        yield
    finally:
        for module in modules:
            module.every_expert = False


def _expert_count(experts: nn.Module) -> int | None:
    """How many experts an ``experts`` module holds (:class:`ExpertLinears`, a fused module,
    a ``ModuleList``), or None when it does not say."""
    count = getattr(experts, "num_experts", None)
    if isinstance(count, int):
        return count
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    down = getattr(experts, "down_proj", None)
    return down.shape[0] if isinstance(down, nn.Parameter) and down.dim() == 3 else None


def expert_projections(names: Iterable[str], is_experts: Callable[[str], bool]
                       ) -> list[list[str]]:
    """The layers among ``names`` (qualified) that are one projection of the experts of one
    experts module (``is_experts(name)``: an :class:`ExpertLinears`; every
    ``<experts>.<e>.gate_up_proj``, every ``down_proj``), in order: vLLM's fused MoE layer
    rounds each projection's inputs, for all its experts, under one NVFP4 activation scale."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name in names:
        parts = name.rsplit(".", 2)
        if len(parts) == 3 and parts[1].isdigit() and is_experts(parts[0]):
            groups.setdefault((parts[0], parts[2]), []).append(name)
    return [group for group in groups.values() if len(group) > 1]


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
"""The config fields that give the number of routed experts."""


def _stacked_experts(module: nn.Module, count: int | None) -> nn.Module | None:
    """The child of ``module`` that holds its experts' weights stacked in one 3-D parameter of
    ``count`` (the config's expert count) rows, under another name than ``experts`` (JetMoE's
    ``input_linear``); None where there is none (a convolution's 3-D kernel is not one)."""
    if count is None:
        return None
    for child in module.children():
        if isinstance(child, nn.modules.conv._ConvNd):
            continue
        if any(p.dim() == 3 and p.shape[0] == count for p in child._parameters.values()
               if p is not None):
            return child
    return None


def moe_routers(model: nn.Module) -> list[str]:
    """The linear layers that route tokens in ``model``'s mixture-of-experts layers, by
    qualified name: in a module with an ``experts`` child (or a child holding the experts'
    weights stacked, as many as the config's expert count: JetMoE's ``input_linear``), each
    linear layer that is alone in its child of that module (the child itself, or e.g. Arcee's
    ``router.gate``, Hunyuan's ``gate.wg``, JetMoE's ``router.layer``), outside the experts,
    with no more outputs than there are experts: the router (one logit per expert; Llama 4,
    Phi-MoE; LongCat-Flash's ``router.classifier`` also scores its ``zero_expert_num``
    identity experts) and Qwen2-MoE's ``shared_expert_gate`` (one).  A shared expert (three
    linear layers in one child) is not a router."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    declared = next((value for key in EXPERT_COUNT_KEYS
                     if isinstance(value := getattr(text, key, None), int) and value > 1), None)
    routers = []
    for name, module in model.named_modules():
        experts = module._modules.get("experts")
        count = None if experts is None else _expert_count(experts)
        if count is None:
            experts = _stacked_experts(module, declared)
            count = None if experts is None else declared
        if count is None:
            continue
        # LongCat-Flash's identity experts, counted on its experts (transformers 5.24) or on
        # their MoE module (5.25)
        count += getattr(experts, "zero_expert_num", 0) or getattr(module, "zero_expert_num",
                                                                    0) or 0
        lead = f"{name}." if name else ""
        for child_name, child in module.named_children():
            if child is experts:
                continue
            linears = [(sub, m) for sub, m in child.named_modules() if is_linear(m)]
            if len(linears) == 1 and in_out_features(linears[0][1])[1] <= count:
                sub = linears[0][0]
                routers.append(lead + child_name + (f".{sub}" if sub else ""))
    return routers
