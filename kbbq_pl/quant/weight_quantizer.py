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
from ..transforms.autobrake import LambdaChoice
from .config import Collectives, QuantizationConfig
from .report import QuantizationReport
from .sequential import BlockStep
from .stats import LayerStatistics

__all__ = ["Block", "CalibrationSplit", "LayerPlan", "WeightQuantizer"]

Propagation = Literal["fp", "quantized"]


@dataclass(frozen=True)
class CalibrationSplit:
    """How the cached calibration inputs divide: the first ``fit`` batches fit the transforms,
    the ``held_out`` batches after them select the auto-brake's lambda (none without
    ``lam="auto"``); with cross-fitting (``autobrake.folds`` K >= 2) every batch fits
    (``held_out`` is 0) and ``folds`` holds the batch count of each fold, in order.

    ``part_tokens``: the tokens of each part (fit and held-out, or each fold) over the ranks
    that share it (this rank's alone when each rank brought its own batches); ``offsets``: the
    index of this rank's first token within each part.  The kept samples are spread over these
    indices (:func:`~kbbq_pl.quant.stats.spread_sample`), so a calibration sharded over ranks
    keeps one process's tokens."""

    fit: int
    held_out: int
    part_tokens: tuple[int, ...]
    offsets: tuple[int, ...]
    folds: tuple[int, ...] = ()

    def stride(self, keep: int, part: int | None = None) -> int:
        """One token in how many a sample of ``keep`` tokens spread over ``part`` (all parts
        when None) keeps."""
        tokens = sum(self.part_tokens) if part is None else self.part_tokens[part]
        return max(1, tokens // max(1, keep))

    def position(self, part: int) -> int:
        """The index of this rank's first token of ``part`` when the parts are run in order."""
        return sum(self.part_tokens[:part]) + self.offsets[part]

    @property
    def fold_parts(self) -> list[slice]:
        """The batches of each fold (cross-fitting)."""
        ends = [sum(self.folds[:k + 1]) for k in range(len(self.folds))]
        return [slice(end - size, end) for end, size in zip(ends, self.folds)]

    @property
    def total(self) -> int:
        return self.fit + self.held_out

    @property
    def fit_part(self) -> slice:
        return slice(0, self.fit)

    @property
    def held_out_part(self) -> slice:
        return slice(self.fit, self.total)


@dataclass
class Block:
    """One block as a weight quantizer sees it: its step (runs the block over the cached
    inputs), its targeted linears by qualified name, and the run's settings."""

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

    @abstractmethod
    def calibrate(self, block: Block, keep_outputs: bool) -> tuple[Any, list[Tensor] | None]:
        """Run the full-precision block over its cached inputs with the method's hooks; returns
        what was observed and, with ``keep_outputs``, the block's outputs for every cached
        input in order."""

    @abstractmethod
    def quantize(self, block: Block, calibration: Any) -> dict[str, LayerPlan]:
        """Fit every linear's transform and quantize its weight from ``calibration``."""

    def finish(self, report: QuantizationReport) -> None:
        """Add the method's model-level entries to ``report`` after the last block."""

