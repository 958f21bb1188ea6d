"""The one entry of post-training quantization: :func:`quantize_model` runs the pipeline the
recipe's weight quantizer names.

* ``weight_quantizer="rtn"``: :func:`~kbbq_pl.quant.quantize.quantize_model_rtn`, one
  calibration pass over the whole model (statistics of the full-precision inputs), transforms
  fitted per layer, weights rounded to nearest;
* ``weight_quantizer="gptq"``: :func:`~kbbq_pl.quant.sequential_gptq.quantize_model_sequential`,
  block by block, each block's inputs computed by the quantized blocks before it.

Both return the same :class:`~kbbq_pl.quant.quantize.QuantizationReport`.
"""

from __future__ import annotations

from torch import nn

from .quantize import (
    Batches,
    BroadcastFn,
    QuantizationConfig,
    QuantizationReport,
    ReduceFn,
    WeightQuantizer,
    _identity,
    quantize_model_rtn,
)
from .sequential_gptq import quantize_model_sequential

__all__ = ["quantize_model"]


def quantize_model(
    model: nn.Module,
    batches: Batches,
    config: QuantizationConfig,
    *,
    reduce_sum: ReduceFn = _identity,
    reduce_max: ReduceFn = _identity,
    weight_quantizer: WeightQuantizer | None = None,
    expected_tokens: int | None = None,
    trainable: bool = False,
    progress: bool = True,
    broadcast: BroadcastFn | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> QuantizationReport:
    """Quantize ``model`` in place with ``config``; returns the report.

    ``batches`` is re-iterated when a second pass is needed (static activation scales), so pass
    a list or a DataLoader, not a generator.  ``reduce_sum`` / ``reduce_max`` all-reduce a tensor
    across data-parallel ranks (identity on one process).  ``trainable`` keeps high-precision
    master weights ``W T^-1`` for fine-tuning (RTN only, see
    :class:`~kbbq_pl.quant.layers.QuantizedLinear`); ``weight_quantizer`` replaces RTN's
    rounding by a callable.

    ``config.weight_quantizer == "gptq"`` runs the block-sequential GPTQ loop, which also takes
    ``broadcast(obj, src) -> obj``, ``rank`` and ``world_size`` to split its work across ranks.
    """
    if config.weight_quantizer == "gptq":
        if weight_quantizer is not None:
            raise ValueError("a weight_quantizer callable replaces RTN; it cannot be combined "
                             "with config.weight_quantizer='gptq'")
        if trainable:
            raise ValueError("GPTQ stores rounded codes, not master weights: fine-tune from "
                             "weight_quantizer='rtn' (trainable=True), or run GPTQ after")
        return quantize_model_sequential(
            model, batches, config, reduce_sum=reduce_sum, reduce_max=reduce_max,
            broadcast=broadcast, rank=rank, world_size=world_size,
            expected_tokens=expected_tokens, progress=progress)
    return quantize_model_rtn(
        model, batches, config, reduce_sum=reduce_sum, reduce_max=reduce_max,
        weight_quantizer=weight_quantizer, expected_tokens=expected_tokens, trainable=trainable,
        progress=progress)
