"""torchao integration: KBBQ W4A4 through ``torchao.quantization.quantize_``.

:class:`KBBQConfig` follows torchao's convention for calibrated methods (AWQ, SmoothQuant,
GPTQ, NVFP4 static activation scales): ``step="prepare"`` attaches observers to the targeted
linear layers, the user runs calibration batches through the model, and ``step="convert"``
fits each layer's transform from what was observed and replaces its weight by a
:class:`~kbbq_pl.quant.w4a4.W4A4Weight`.  The module stays the ``nn.Linear`` it was (its weight
computes the quantized product in ``F.linear``)::

    from torchao.quantization import quantize_
    from kbbq_pl.quant import FormatConfig, QuantizationConfig, TransformConfig
    from kbbq_pl.quant.torchao import KBBQConfig

    recipe = QuantizationConfig(format=FormatConfig("nvfp4"),
                                transform=TransformConfig("kbbq", lam=0.75))
    prepare = KBBQConfig(recipe, step="prepare")
    quantize_(model, prepare, filter_fn=prepare.filter_fn)
    with torch.no_grad():
        for batch in calibration_batches:
            model(**batch)
    quantize_(model, KBBQConfig(recipe, step="convert"))

The observers are the pipeline's own: a :class:`~kbbq_pl.quant.stats.StatisticsCollector` per layer
(the ``d x d`` input second-moment blocks the WUSH / KBBQ fit needs) and, for a static NVFP4
activation scale, the layer's calibration inputs, kept on the CPU until ``convert`` computes
``amax(T x)`` with the fitted ``T`` (as torchao's AWQ and SmoothQuant observers keep theirs:
one copy of every targeted layer's inputs; ``format.act_scale: dynamic`` keeps none, and
:func:`kbbq_pl.quant.pipeline.quantize_model` makes a second pass over the data instead).  The fit,
the rounding and the scales are :mod:`kbbq_pl.transforms`, :func:`kbbq_pl.quant.layers.w4a4_weight`
and :func:`kbbq_pl.quant.stats.act_scales_from_amax`: on the same calibration batches the result
equals ``quantize_model`` with the same recipe bit for bit.  Padded batches: run them with
:func:`kbbq_pl.quant.stats.run_calibration` (or each as ``with calibrating(token_positions(
batch)): model(**batch)``, :mod:`kbbq_pl.quant.tokens`), and the observers leave the padding out
as ``quantize_model`` does.

``prepare.filter_fn`` selects the layers ``quantize_model`` would (``layers.targets`` /
``layers.ignore`` patterns; by default not the LM head) and records their names, so that at
``convert`` the NVFP4 layers vLLM fuses (q/k/v, gate/up) under a data-free transform share one
per-tensor scale, as ``quantize_model`` gives them; without it torchao's default filter
prepares every ``nn.Linear`` and each layer keeps its own.  ``convert`` converts the layers
that were prepared and leaves the others (a model never prepared, also through
transformers' ``TorchAoConfig``, which cannot calibrate, stays in full precision with a
warning).  Only ``nn.Linear`` layers are handled
(transformers' ``Conv1D``, GPT-2, multiplies with ``addmm``, not ``F.linear``: quantize it with
``quantize_model``); ``lam: auto`` and GPTQ
select or compensate on the calibration set as a whole and run only through ``quantize_model``
(as do MSE scales, ``propagate: quantized`` and ``fold_o_proj``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torchao.core.config import AOBaseConfig
from torchao.quantization.quantize_.common.quantization_step import QuantizationStep
from torchao.quantization.transform_module import register_quantize_module_handler

from ..formats import QuantizedTensor, quantize
from ..formats.padding import pad_features
from ..transforms.fit import FITTED_TRANSFORMS, fit_transform, transform_weight
from .config import QuantizationConfig
from .layers import QuantizedLinear, w4a4_weight
from .modules import first_input, fused_groups, is_targeted
from .scales import fused_weight_scales
from .stats import StatisticsCollector, act_scales_from_amax, tensor_amax
from .tokens import token_rows
from .w4a4 import transformed_input

log = logging.getLogger(__name__)

OBSERVER_ATTR = "kbbq_observer"
_STEPS = (QuantizationStep.PREPARE, QuantizationStep.CONVERT)


@dataclass
class KBBQConfig(AOBaseConfig):
    """A KBBQ-family W4A4 recipe for ``torchao.quantization.quantize_`` (module docstring).

    Args:
        config: the recipe: a :class:`~kbbq_pl.quant.config.QuantizationConfig`, or a
            packaged recipe's name or a recipe file (default: the default recipe).  torchao
            quantizes each layer on its own with RTN and a fixed lambda: GPTQ,
            ``transform.lam: auto``, ``weights.scale_search: mse``,
            ``weights.propagate: quantized`` and ``transform.fold_o_proj`` run only through
            :func:`kbbq_pl.quant.pipeline.quantize_model`.  ``layers`` and
            ``format.unaligned: skip`` act through :meth:`filter_fn`.  ``prepare`` and
            ``convert`` must agree on ``format.name`` and ``format.act_scale`` (they decide
            what is observed).
        step: ``prepare`` (attach observers) or ``convert`` (fit and quantize); keyword-only.
    """

    config: QuantizationConfig | str | Path = field(default_factory=QuantizationConfig)
    step: QuantizationStep | str = field(kw_only=True)
    # the layers filter_fn selected, by name (and their names by id), and the NVFP4
    # per-tensor scales their fused siblings share (_fused_global_scale)
    _selected: dict[str, nn.Module] = field(default_factory=dict, init=False, repr=False,
                                            compare=False)
    _names: dict[int, str] = field(default_factory=dict, init=False, repr=False, compare=False)
    _fused_scales: dict[str, Tensor | None] = field(default_factory=dict, init=False,
                                                    repr=False, compare=False)
    # convert: a layer without an observer before any layer converted is warned of, once (the
    # model was likely not prepared; a layer the filter left out comes after converted ones)
    _warn_unprepared: bool = field(default=True, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        step = self.step.value if isinstance(self.step, QuantizationStep) else str(self.step)
        if step.lower() not in [s.value for s in _STEPS]:
            raise ValueError(f"KBBQConfig step must be 'prepare' or 'convert', got {self.step!r} "
                             "(a saved state dict loads with model.load_state_dict(state, "
                             "assign=True))")
        self.step = QuantizationStep(step.lower())
        self.config = recipe = QuantizationConfig.resolve(self.config, "KBBQConfig")
        if recipe.auto:
            raise ValueError("lam='auto' selects each layer's brake on held-out calibration "
                             "sequences; run it with kbbq_pl.quantize_model")
        pipeline_only = {"weights.quantizer": recipe.weights.quantizer != "rtn",
                         "weights.scale_search": recipe.weights.scale_search != "minmax",
                         "weights.propagate": recipe.weights.propagate == "quantized",
                         "transform.fold_o_proj": recipe.transform.fold_o_proj}
        named = [name for name, used in pipeline_only.items() if used]
        if named:
            raise ValueError(f"KBBQConfig quantizes each layer on its own with RTN; "
                             f"{', '.join(named)} of {recipe.label} need the block-sequential "
                             "pipeline: run it with kbbq_pl.quantize_model")

    @property
    def static(self) -> bool:
        """Whether activations get a calibrated (static) per-tensor scale."""
        return self.config.effective_act_scale == "static"

    def filter_fn(self, module: nn.Module, fqn: str) -> bool:
        """torchao's ``filter_fn``: the ``nn.Linear`` layers ``quantize_model`` would quantize
        (``layers`` patterns; unaligned widths unless ``format.unaligned: skip``).  It sees one
        module and its name, not the model: a task head other than ``lm_head`` (a
        classifier's ``classifier``, which ``quantize_model`` leaves) is selected unless
        ``layers.ignore`` names it."""
        if (not isinstance(module, nn.Linear) or isinstance(module, QuantizedLinear)
                or isinstance(module.weight, QuantizedTensor)):
            return False
        recipe = self.config
        if not is_targeted(fqn, recipe.layers.targets, recipe.layers.ignore):
            return False
        if recipe.format.unaligned == "skip" and module.in_features % recipe.block:
            log.info("%s: skipped (in_features %d is not a multiple of the %s block %d)", fqn,
                     module.in_features, recipe.format.name, recipe.block)
            return False
        self._selected[fqn], self._names[id(module)] = module, fqn
        return True


class KBBQObserver:
    """What ``step="prepare"`` attaches to a linear layer (as the attribute ``kbbq_observer``):
    the input statistics of a fitted transform and, for a static activation scale, copies of
    the calibration inputs on the CPU; removed by ``step="convert"``."""

    def __init__(self, module: nn.Linear, ao_config: KBBQConfig) -> None:
        recipe = ao_config.config
        # its name and the other selected layers', when prepare ran with ao_config.filter_fn
        self.name = ao_config._names.get(id(module))
        self.selected, self.fused_scales = ao_config._selected, ao_config._fused_scales
        self.format = recipe.format.name
        self.static = ao_config.static
        self.label = f"nn.Linear(in_features={module.in_features}, " \
                     f"out_features={module.out_features})"
        self.collector: StatisticsCollector | None = None
        self.inputs: list[Tensor] = []
        self.handles: list[RemovableHandle] = []
        if recipe.transform.name in FITTED_TRANSFORMS:
            self.collector = StatisticsCollector({self.label: module}, recipe.block,
                                                 keep_samples=0)
            self.handles += self.collector.attach()
        if self.static:
            self.handles.append(module.register_forward_pre_hook(self._keep, with_kwargs=True))

    @torch.no_grad()
    def _keep(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.inputs.append(token_rows(first_input(args, kwargs).detach(), self.label).to(
            "cpu", copy=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def sigma_blocks(self) -> Tensor | None:
        """The input second-moment blocks (None when the transform needs none)."""
        if self.collector is None:
            return None
        self.collector.check_nonempty()
        return self.collector.stats[self.label].sigma_blocks()

    def transformed_amax(self, in_features: int, padded: int, transform: Tensor | None,
                         device: torch.device) -> Tensor:
        """``max |T x|`` over the kept inputs, each batch as ``quantize_model``'s pass computes
        it (on ``device``)."""
        if not self.inputs:
            raise ValueError(f"{self.label}: no calibration batch reached this layer between "
                             "step='prepare' and step='convert'")
        amax: Tensor | None = None
        for x in self.inputs:
            value = tensor_amax(transformed_input(x.to(device), in_features, padded, transform))
            amax = value if amax is None else torch.maximum(amax, value)
        assert amax is not None
        return amax


def _prepare(module: nn.Module, ao_config: KBBQConfig) -> nn.Module:
    if not isinstance(module, nn.Linear):
        raise TypeError(f"KBBQConfig quantizes nn.Linear layers (their forward is F.linear), "
                        f"got {type(module).__name__}; use kbbq_pl.quantize_model")
    if isinstance(module, QuantizedLinear) or isinstance(module.weight, QuantizedTensor):
        raise ValueError(f"{module}: it is quantized already")
    previous = getattr(module, OBSERVER_ATTR, None)
    if previous is not None:
        previous.remove()
    setattr(module, OBSERVER_ATTR, KBBQObserver(module, ao_config))
    return module


def _convert(module: nn.Module, ao_config: KBBQConfig) -> nn.Module:
    observer: KBBQObserver | None = getattr(module, OBSERVER_ATTR, None)
    if observer is None:
        if ao_config._warn_unprepared:
            log.warning("KBBQConfig convert: %s has no KBBQ observer (step='prepare' did not "
                        "reach it) and stays in full precision, as every layer will if the "
                        "model was not prepared: quantize_(model, prepare, "
                        "filter_fn=prepare.filter_fn) with prepare = KBBQConfig(recipe, "
                        "step='prepare'), run calibration batches, then convert", module)
            ao_config._warn_unprepared = False
        return module
    recipe = ao_config.config
    if (observer.format, observer.static) != (recipe.format.name, ao_config.static):
        raise ValueError(f"{observer.label}: prepared for format {observer.format!r} with a "
                         f"{'static' if observer.static else 'dynamic'} activation scale, "
                         f"converted with {recipe.format.name!r} / {recipe.format.act_scale!r}: "
                         "prepare and convert must agree on format and act_scale")
    if recipe.transform.name in FITTED_TRANSFORMS and observer.collector is None:
        raise ValueError(f"{observer.label}: the {recipe.transform.name} transform is fitted from "
                         "input statistics, which step='prepare' did not collect (it was "
                         "prepared for a data-free transform)")
    observer.remove()
    weight = module.weight.detach()
    padded, transform = _padded_and_transform(module, observer, recipe)
    global_scale = _fused_global_scale(observer, recipe)
    scale = None
    if ao_config.static:
        amax = observer.transformed_amax(module.in_features, padded.shape[1], transform,
                                         weight.device)
        scale = act_scales_from_amax({observer.label: amax}, lambda t: t)[observer.label]
    name = observer.name or ""  # known where prepare ran with filter_fn
    shared = None if global_scale is None else quantize(
        transform_weight(padded, transform), recipe.fmt, global_scale=global_scale,
        name=f"{name}.weight" if name else "weight")
    quantized = w4a4_weight(module, recipe.fmt, transform,
                            act_scale=recipe.effective_act_scale, act_global_scale=scale,
                            name=name, quantized_weight=shared)
    module.weight = nn.Parameter(quantized, requires_grad=False)
    delattr(module, OBSERVER_ATTR)
    ao_config._warn_unprepared = False
    return module


def _padded_and_transform(module: nn.Module, observer: KBBQObserver,
                          recipe: QuantizationConfig) -> tuple[Tensor, Tensor | None]:
    """The layer's weight zero-padded to whole blocks and its fitted transform."""
    padded = pad_features(module.weight.detach(), recipe.fmt)
    return padded, fit_transform(recipe.transform.name, padded, observer.sigma_blocks(),
                                 block=recipe.block, lam=float(recipe.transform.lam),
                                 seed=recipe.transform.seed, damping=recipe.transform.damping)


def _fused_global_scale(observer: KBBQObserver, recipe: QuantizationConfig) -> Tensor | None:
    """The NVFP4 per-tensor scale that a layer vLLM fuses with its siblings (q/k/v, gate/up:
    :func:`~kbbq_pl.quant.modules.fused_groups`) shares with them under a data-free transform,
    the largest of their own (:func:`~kbbq_pl.quant.scales.fused_weight_scales`), computed for
    the whole group at its first layer's convert, from the siblings not converted yet; None
    (its own) otherwise, or when prepare ran without ``filter_fn`` (no names)."""
    if (observer.name is None or not recipe.fmt.global_scale
            or recipe.transform.name in FITTED_TRANSFORMS):
        return None
    shared = observer.fused_scales
    if observer.name not in shared:
        group = next((g for g in fused_groups(observer.selected) if observer.name in g), None)
        if group is None:
            return None
        weights = {}
        for name in group:
            sibling = observer.selected[name]
            sibling_observer = getattr(sibling, OBSERVER_ATTR, None)  # None: converted
            if sibling_observer is not None:
                padded, transform = _padded_and_transform(sibling, sibling_observer, recipe)
                weights[name] = transform_weight(padded, transform)
        shared.update(fused_weight_scales(weights, recipe.fmt, [list(weights)]))
    return shared.get(observer.name)


@register_quantize_module_handler(KBBQConfig)
def _kbbq_transform(module: nn.Module, ao_config: KBBQConfig) -> nn.Module:
    if ao_config.step == QuantizationStep.PREPARE:
        return _prepare(module, ao_config)
    return _convert(module, ao_config)


__all__ = ["KBBQConfig", "KBBQObserver", "OBSERVER_ATTR"]
