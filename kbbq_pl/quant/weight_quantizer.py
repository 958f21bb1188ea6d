"""The weight quantizer of the pipeline, a strategy object: what a method needs to observe in a
block's calibration run, and how it turns the block's linears into FP4 weights.

:func:`kbbq_pl.quant.pipeline.quantize_model` walks the blocks and, for each, calls
:meth:`WeightQuantizer.calibrate` (runs the full-precision block over its cached inputs with the
method's hooks) and :meth:`WeightQuantizer.quantize` (fits the transforms and quantizes the
weights, returning one :class:`LayerPlan` per linear); the pipeline then calibrates the static
activation scales, swaps the layers in and produces the next block's inputs.  Two strategies
ship: :class:`~kbbq_pl.quant.rtn.RTN` and :class:`~kbbq_pl.quant.gptq.GPTQ`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from torch import Tensor, nn

from ..formats import QuantizedTensor
from .autobrake import LambdaChoice
from .collectives import Collectives
from .config import QuantizationConfig
from .modules import linear_weight
from .report import QuantizationReport
from .sequential import BlockStep, CalibrationSplit
from .stats import LayerStatistics

__all__ = ["Block", "LayerPlan", "WeightQuantizer"]

Propagation = Literal["fp", "quantized"]


@dataclass
class Block:
    """One block as a weight quantizer sees it: its step (runs the block over the cached
    inputs, whose parts ``split`` names), its targeted linears by qualified name, and the run's
    settings."""

    step: BlockStep
    linears: dict[str, nn.Module]
    model: nn.Module
    config: QuantizationConfig
    collectives: Collectives
    split: CalibrationSplit
    timing: dict[str, float]
    progress: bool = False


@dataclass
class LayerPlan:
    """What the pipeline swaps in for one linear.

    Attributes:
        transform: the fitted ``T`` (float64; None for the identity), as the report reads it.
        online: the transform applied to the layer's inputs at run time (``transform``, or None
            when it is folded into the producer of the inputs).
        stats: the layer's calibration statistics (report rows).
        weight: the quantized ``W T^-1``, or None to round to nearest when the layer is built
            (and keep master weights when the pipeline runs ``trainable``).
        full_precision: a new full-precision ``(weight, bias)`` the module takes before it is
            quantized (a ``v_proj`` with an ``o_proj`` transform folded in), else None.
        choice: the auto-brake's choice of lambda, if any.
        folded: the layer receives ``T x`` from its producer (no online transform).
    """

    transform: Tensor | None
    online: Tensor | None
    stats: LayerStatistics
    weight: QuantizedTensor | None = None
    full_precision: tuple[Tensor, Tensor | None] | None = None
    choice: LambdaChoice | None = None
    folded: bool = False


class WeightQuantizer(ABC):
    """A method of quantizing a block's weights (module docstring).

    ``propagate`` is the default source of the next block's inputs (``fp`` or ``quantized``;
    a recipe's ``weights.propagate`` overrides it); ``trainable`` keeps high-precision master
    weights for fine-tuning where the method allows it; ``work_stage`` names the method's stage in
    ``report.seconds``; ``splits_work``: the method splits its work across data-parallel ranks
    (and needs a ``broadcast``)."""

    propagate: ClassVar[Propagation]
    work_stage: ClassVar[str]
    splits_work: ClassVar[bool] = False  # across ranks: needs Collectives.broadcast

    def __init__(self, config: QuantizationConfig, *, trainable: bool = False) -> None:
        self.config = config
        self.trainable = trainable

    def keeps_master(self, module: nn.Module) -> bool:
        """Whether ``module`` becomes a trainable master weight: ``trainable``, and its weight
        requires grad (a frozen one, as under peft's adapters, stores codes and stays
        frozen)."""
        return self.trainable and linear_weight(module).requires_grad

    @abstractmethod
    def calibrate(self, block: Block, keep_outputs: bool) -> tuple[Any, list[Tensor] | None]:
        """Run the full-precision block over its cached inputs with the method's hooks; returns
        what was observed and, with ``keep_outputs``, the block's outputs for every cached
        input in order."""

    @abstractmethod
    def quantize(self, block: Block, calibration: Any) -> dict[str, LayerPlan]:
        """Fit every linear's transform and quantize its weight from ``calibration``."""

    def finish(self, report: QuantizationReport) -> None:  # noqa: B027 - optional hook
        """Add the method's model-level entries to ``report`` after the last block (none by
        default)."""

