"""Which modules of a model are quantized, and their weights as ``[out, in]`` matrices.

A *targeted linear* is an ``nn.Linear`` or a transformers ``Conv1D`` (GPT-2, whose weight is
stored transposed, ``[in, out]``) whose qualified name matches one of the ``targets`` regular
expressions and none of the ``ignore`` ones (``re.search``).  By default every linear layer is
a target except the LM head (and any other task head: :func:`task_head_linears`), embeddings
and BERT's pooler, which are not part of the transformer blocks (llm-compressor ignores
``lm_head`` likewise), and Mamba's time-step
projection ``dt_proj`` (Mamba, Falcon-Mamba, Jamba), whose weight the mixer reads directly
instead of calling the layer (vLLM leaves it unquantized too).  Sparse attention's key and
scoring layers stay in full precision too, as vLLM builds them: the lightning indexer's key
``wk`` and per-head ``weights_proj`` (DeepSeek-V3.2, GLM-5: one unquantized GEMM,
``wk_weights_proj``; DeepSeek-V4's ``indexer.scorer.weights_proj``) and DeepSeek-V4's KV
compressors (``compressor.kv_proj`` / ``gate_proj`` and the indexer's own, ``indexer.kv_proj``
/ ``gate_proj``: ``fused_wkv_wgate``).  The indexer's query (``wq_b``, V4's ``q_b_proj``) is
quantized.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn

from ..formats.rounding import all_finite

log = logging.getLogger(__name__)

DEFAULT_TARGETS: tuple[str, ...] = (".*",)
DEFAULT_IGNORE: tuple[str, ...] = (r"(^|\.)lm_head$", r"embed", r"(^|\.)(wte|wpe)$", r"pooler",
                                   r"(^|\.)dt_proj$",
                                   r"(^|\.)indexer\.(wk|(scorer\.)?weights_proj)$",
                                   r"(^|\.)(compressor|indexer)\.(kv|gate)_proj$")


def _conv1d_type() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is a dependency; guard for partial installs
        return None
    return Conv1D


class Quantized:
    """The base of kbbq-pl's quantized layers (:class:`~kbbq_pl.quant.layers.QuantizedLinear`,
    an ``nn.Linear`` too), which :func:`is_linear` leaves."""


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a transformers ``Conv1D`` to quantize: not a :class:`Quantized`
    layer."""
    conv1d = _conv1d_type()
    if isinstance(module, Quantized):
        return False
    return isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d))


PLAIN_LINEAR_SUBCLASSES: tuple[str, ...] = ("FalconLinear",)
"""Subclasses of ``nn.Linear`` whose own forward computes ``nn.Linear``'s product (Falcon's
``input @ weight.T + bias``), quantized as any linear layer."""


def has_own_forward(module: nn.Module) -> bool:
    """Whether a linear layer's class overrides ``forward`` with something other than the
    linear product: Llama 4's and Phi-MoE's routers subclass ``nn.Linear`` and return a tuple,
    DeepSeek-V4's grouped output projection multiplies by blocks; a quantized linear in their
    place would compute something else.  :data:`PLAIN_LINEAR_SUBCLASSES` do not count."""
    conv1d = _conv1d_type()
    base = conv1d if conv1d is not None and isinstance(module, conv1d) else nn.Linear
    return (type(module).forward is not base.forward
            and type(module).__name__ not in PLAIN_LINEAR_SUBCLASSES)


def is_transposed(module: nn.Module) -> bool:
    """Whether the module stores its weight as ``[in, out]`` (transformers ``Conv1D``)."""
    conv1d = _conv1d_type()
    return conv1d is not None and isinstance(module, conv1d)


def linear_weight(module: nn.Module) -> Tensor:
    """The weight as ``[out, in]`` (a view; ``Conv1D`` weights are transposed)."""
    weight = module.weight
    return weight.T if is_transposed(module) else weight


def in_out_features(module: nn.Module) -> tuple[int, int]:
    out_features, in_features = linear_weight(module).shape
    return in_features, out_features


def _compile(patterns: Iterable[str] | str | None, default: Sequence[str]) -> list[re.Pattern]:
    if patterns is None:
        patterns = default
    elif isinstance(patterns, str):
        patterns = [patterns]
    compiled = []
    for pattern in patterns:
        try:  # compressed-tensors / llm-compressor spell a regular expression "re:<pattern>"
            compiled.append(re.compile(pattern.removeprefix("re:")))
        except re.error as error:
            raise ValueError(f"invalid module-name pattern {pattern!r}: {error}") from None
    return compiled


def _selected(name: str, target_res: list[re.Pattern], ignore_res: list[re.Pattern]) -> bool:
    return (not any(p.search(name) for p in ignore_res)
            and any(p.search(name) for p in target_res))


def is_targeted(
    name: str,
    targets: Iterable[str] | str | None = None,
    ignore: Iterable[str] | str | None = None,
) -> bool:
    """Whether a linear layer named ``name`` is a target (module docstring)."""
    return _selected(name, _compile(targets, DEFAULT_TARGETS), _compile(ignore, DEFAULT_IGNORE))


def find_linears(
    model: nn.Module,
    targets: Iterable[str] | str | None = None,
    ignore: Iterable[str] | str | None = None,
) -> dict[str, nn.Module]:
    """Targeted linear modules by qualified name, in model order.

    Raises ``ValueError`` when nothing matches, naming the patterns and a few linear layers
    that exist, so a wrong pattern is caught before any work is done.
    """
    target_res = _compile(targets, DEFAULT_TARGETS)
    ignore_res = _compile(ignore, DEFAULT_IGNORE)
    found: dict[str, nn.Module] = {}
    linears = []
    for name, module in model.named_modules():
        if not is_linear(module):
            continue
        linears.append(name)
        if _selected(name, target_res, ignore_res):
            found[name] = module
    examples = ", ".join(linears[:6]) or "none"
    for pattern in ignore_res if ignore is not None else ():
        if not any(pattern.search(name) for name in linears):
            log.warning("layers.ignore pattern %r matches no linear layer of %s (its linear "
                        "layers: %s%s): it leaves nothing out", pattern.pattern,
                        type(model).__name__, examples, ", ..." if len(linears) > 6 else "")
    if not found:
        raise ValueError(
            f"no linear layer of {type(model).__name__} matches targets "
            f"{[p.pattern for p in target_res]} without matching ignore "
            f"{[p.pattern for p in ignore_res]}; its linear layers: {examples}"
            + (f" (and {len(linears) - 6} more)" if len(linears) > 6 else "")
        )
    return found


def task_head_linears(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The names among ``names`` outside ``model``'s base model (transformers'
    ``base_model``, the encoder or decoder a task class puts its head on): the task head, such
    as ``classifier`` (sequence and token classification, cross-encoders), ``score`` (reward
    models), ``qa_outputs`` or a masked-LM head, and the LM head; none for a bare model."""
    base = getattr(model, "base_model", model)
    prefix = next((name for name, module in model.named_modules() if module is base), "")
    return [name for name in names if prefix and not name.startswith(f"{prefix}.")]


def adapter_linears(model: nn.Module) -> list[str]:
    """The linear layers of peft's adapters (LoRA's ``lora_A`` and ``lora_B``, ...): those
    inside a tuner layer's adapter modules (peft's ``BaseTunerLayer.adapter_layer_names``), not
    its ``base_layer``.  They train in full precision beside the quantized base layer, as in
    QLoRA."""
    adapters = [f"{name}.{attr}." for name, module in model.named_modules()
                for attr in getattr(module, "adapter_layer_names", ())
                if isinstance(getattr(module, "base_layer", None), nn.Module)]
    return [name for name, module in model.named_modules()
            if is_linear(module) and any(f"{name}.".startswith(lead) for lead in adapters)]


def modality_encoders(model: nn.Module) -> list[str]:
    """The parts of a multimodal model outside its language model, by qualified name (Llava
    and Gemma 3: ``model.vision_tower`` and ``model.multi_modal_projector``; Qwen2.5-VL:
    ``model.visual``; Step 3.7's projector is one linear layer): the other children of the
    module that holds ``model.get_decoder()`` in a model whose config has a ``vision_config``;
    none for a text model.  Text calibration never runs them, so they are not quantized."""
    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        return []
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError):
        return []
    path = next((name for name, module in model.named_modules() if module is decoder), None)
    if not path or decoder is getattr(model, "base_model", None):
        return []
    parent_name = path.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    lead = f"{parent_name}." if parent_name else ""
    return [lead + name for name, child in parent.named_children()
            if child is not decoder and next(child.parameters(), None) is not None]


def weights_outside_linears(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Weight matrices (2-D or more) that no linear layer holds, by qualified name, with their
    shapes: MoE experts stored as 3-D tensors (transformers' fused experts that
    :func:`kbbq_pl.quant.experts.unfuse_experts` does not take), routers held as bare
    parameters.  kbbq-pl quantizes linear layers only, so these stay in full precision.
    Embeddings and what :data:`DEFAULT_IGNORE` names (the LM head) are not counted."""
    ignore_res = _compile(None, DEFAULT_IGNORE)
    found: dict[str, tuple[int, ...]] = {}
    for module_name, module in model.named_modules():
        if is_linear(module) or isinstance(module, nn.Embedding):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{param_name}" if module_name else param_name
            if param.dim() >= 2 and not any(p.search(name) for p in ignore_res):
                found[name] = tuple(param.shape)
    return found


def linear_weight_count(model: nn.Module) -> int:
    """Elements of the weights of every linear layer outside :data:`DEFAULT_IGNORE` (the LM
    head, embeddings)."""
    ignore_res = _compile(None, DEFAULT_IGNORE)
    return sum(linear_weight(module).numel() for name, module in model.named_modules()
               if is_linear(module) and not any(p.search(name) for p in ignore_res))


_CELL_PATTERNS = (
    ("qkv", r"(q_proj|k_proj|v_proj|qkv_proj|query|key|value|c_attn|Wqkv)$"),
    ("out", r"(o_proj|out_proj|attention\.output\.dense|attn\.c_proj|self_attn\.dense)$"),
    ("up", r"(gate_proj|up_proj|gate_up_proj|intermediate\.dense|c_fc|fc1|w1|w3)$"),
    ("down", r"(down_proj|(?<!attention\.)output\.dense|mlp\.c_proj|fc2|w2)$"),
)


def cell_kind(name: str) -> str:
    """The GEMM cell a linear layer belongs to: ``qkv``, ``out``, ``up``, ``down`` (the four
    fused GEMMs of a transformer block, paper Sec. 2 Measurement) or ``other``."""
    for kind, pattern in _CELL_PATTERNS:
        if re.search(pattern, name):
            return kind
    return "other"


#: Sibling linears that vLLM runs as one fused linear (its ``packed_modules_mapping``:
#: ``qkv_proj``, BERT's ``query`` / ``key`` / ``value``, ``gate_up_proj``, DeepSeek's
#: ``fused_qkv_a_proj``), the groups llm-compressor gives one NVFP4 per-tensor scale
#: (``update_fused_layer_weight_global_scales``).
FUSED_SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("gate_proj", "up_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
)


def fused_groups(names: Iterable[str]) -> list[list[str]]:
    """The layers among ``names`` (qualified) that vLLM runs as one fused linear
    (:data:`FUSED_SIBLINGS` under one parent, at least two of them present), in
    :data:`FUSED_SIBLINGS` order."""
    present = set(names)
    parents = sorted({name.rpartition(".")[0] for name in present})
    groups = []
    for parent in parents:
        prefix = f"{parent}." if parent else ""
        for siblings in FUSED_SIBLINGS:
            group = [prefix + leaf for leaf in siblings if prefix + leaf in present]
            if len(group) > 1:
                groups.append(group)
    return groups


def parent_and_attr(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The parent module of ``name`` and the attribute under which it holds it."""
    parent_name, _, attr = name.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def first_input(args: tuple, kwargs: dict) -> Tensor:
    """The activation a linear layer receives (positional, or ``input=`` / ``hidden_states=``)."""
    if args:
        return args[0]
    for key in ("input", "x", "hidden_states"):
        if key in kwargs:
            return kwargs[key]
    raise ValueError("could not find the input tensor of a linear layer call")


def flatten_tokens(x: Tensor) -> Tensor:
    """Inputs ``[..., in]`` as ``[tokens, in]``."""
    return x.reshape(-1, x.shape[-1])


def check_layer_finite(module: nn.Module, layer: str) -> None:
    """:func:`check_finite` of a linear ``module``'s weight and bias (a NaN bias would show up
    as the next layer's input)."""
    check_finite(linear_weight(module), layer, "weight")
    bias = getattr(module, "bias", None)
    if isinstance(bias, Tensor) and not bias.is_meta:
        check_finite(bias, layer, "bias")


@torch.no_grad()
def check_finite(x: Tensor, layer: str, what: str = "input") -> None:
    """Raise a ValueError naming ``layer`` when ``x`` (its ``what``: input or weight) holds NaN
    or Inf."""
    if not all_finite(x):
        nan = int(torch.isnan(x).sum())
        inf = int(torch.isinf(x).sum())
        advice = "check the model" + (" and the calibration data" if what == "input" else "")
        raise ValueError(
            f"{layer}: its {what} holds {nan} NaN and {inf} Inf values "
            f"(shape {tuple(x.shape)}, {x.device}); {advice}"
        )
