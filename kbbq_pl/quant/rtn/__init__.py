"""Round to nearest: the rounding on tensors (:mod:`~kbbq_pl.quant.rtn.algorithm`, with the block
scales of :mod:`kbbq_pl.quant.scales`) and the RTN weight quantizer of the pipeline
(:mod:`~kbbq_pl.quant.rtn.quantizer`: transforms fitted from input statistics, the auto-brake,
the ``o_proj`` fold)."""

from .algorithm import rtn
from .quantizer import RTN, auto_transform, fold_o_proj_transforms

__all__ = ["RTN", "auto_transform", "fold_o_proj_transforms", "rtn"]
