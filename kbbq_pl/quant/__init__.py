"""Quantizing a model: target layers and their calibration statistics
(:mod:`~kbbq_pl.quant.modules`, :mod:`~kbbq_pl.quant.stats`), the quantized layer and its W4A4
weight subclass (:mod:`~kbbq_pl.quant.layers`, :mod:`~kbbq_pl.quant.w4a4`) with the activations'
per-tensor scale rule (:mod:`~kbbq_pl.quant.act_scale`), the recipe and the report
(:mod:`~kbbq_pl.quant.config`, :mod:`~kbbq_pl.quant.report`), the one block-sequential pipeline
(:mod:`~kbbq_pl.quant.pipeline` over :mod:`~kbbq_pl.quant.sequential`) with its weight
quantizers (:mod:`~kbbq_pl.quant.weight_quantizer`), each with its math and strategy in one
place: round to nearest (:mod:`~kbbq_pl.quant.rtn`) and GPTQ (:mod:`~kbbq_pl.quant.gptq`), over
the FP4 block scales they share (:mod:`~kbbq_pl.quant.scales`), and torchao's ``quantize_``
entry (:mod:`~kbbq_pl.quant.torchao`).  No I/O, Lightning or HuggingFace imports."""

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
