"""Quantizing a model: target layers and their calibration statistics
(:mod:`~kbbq_pl.quant.modules`, :mod:`~kbbq_pl.quant.stats`), the GPTQ math
(:mod:`~kbbq_pl.quant.gptq`), the quantized layer and its W4A4 weight subclass
(:mod:`~kbbq_pl.quant.layers`, :mod:`~kbbq_pl.quant.w4a4`), the recipe and the report
(:mod:`~kbbq_pl.quant.config`, :mod:`~kbbq_pl.quant.report`), the one block-sequential pipeline
(:mod:`~kbbq_pl.quant.pipeline` over :mod:`~kbbq_pl.quant.sequential`) with its weight
quantizers (:mod:`~kbbq_pl.quant.weight_quantizer`: :mod:`~kbbq_pl.quant.rtn`,
:mod:`~kbbq_pl.quant.gptq_quantizer`) and torchao's ``quantize_`` entry
(:mod:`~kbbq_pl.quant.torchao`).  No I/O, Lightning or HuggingFace imports."""

from .config import (
    AutoBrakeConfig,
    FormatConfig,
    LayersConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
)
from .pipeline import quantize_model
from .report import QuantizationReport

__all__ = ["AutoBrakeConfig", "FormatConfig", "LayersConfig", "QuantizationConfig",
           "QuantizationReport", "TransformConfig", "WeightsConfig", "quantize_model"]
