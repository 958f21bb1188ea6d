"""GPTQ for the FP4 block formats: the algorithm on tensors (:mod:`~kbbq_pl.quant.gptq.algorithm`:
Hessians, the column recursion, the in-loop transform refit) and the GPTQ family as the
pipeline's weight quantizer (:mod:`~kbbq_pl.quant.gptq.quantizer`: Hessian collection, the
auto-brake, the split across ranks).  The block scales both round with are
:mod:`kbbq_pl.quant.scales`."""

from .algorithm import (
    DAMPING_RETRIES,
    DEFAULT_BLOCK_SIZE,
    GPTQResult,
    gptq,
    gptq_layers,
    gptq_refit,
    hessian,
    inverse_hessian_factor,
    sigma_blocks_from_hessian,
    transform_hessian,
)
from .quantizer import GPTQ, HessianCollector

__all__ = ["DAMPING_RETRIES", "DEFAULT_BLOCK_SIZE", "GPTQ", "GPTQResult", "HessianCollector",
           "gptq", "gptq_layers", "gptq_refit", "hessian", "inverse_hessian_factor",
           "sigma_blocks_from_hessian", "transform_hessian"]
