"""Quantizing a model: target layers and their calibration statistics
(:mod:`~kbbq_pl.quant.modules`, :mod:`~kbbq_pl.quant.stats`), the GPTQ math
(:mod:`~kbbq_pl.quant.gptq`), the quantized layer and its W4A4 weight subclass
(:mod:`~kbbq_pl.quant.layers`, :mod:`~kbbq_pl.quant.w4a4`), the block-by-block runner
(:mod:`~kbbq_pl.quant.sequential`), the RTN and GPTQ pipelines (:mod:`~kbbq_pl.quant.quantize`,
:mod:`~kbbq_pl.quant.sequential_gptq`) and torchao's ``quantize_`` entry
(:mod:`~kbbq_pl.quant.torchao`).  No I/O, Lightning or HuggingFace imports."""

from .pipeline import quantize_model
from .quantize import QuantizationConfig, QuantizationReport

__all__ = ["QuantizationConfig", "QuantizationReport", "quantize_model"]
