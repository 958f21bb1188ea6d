"""Input transforms (pure math on tensors): identity, Haar, Hadamard, WUSH and KBBQ, fitted and
applied (:mod:`kbbq_pl.transforms.fit`); folding an ``o_proj`` transform into ``v_proj``
(:mod:`kbbq_pl.transforms.o_proj_fold`)."""

from .fit import (
    DEFAULT_DAMPING,
    FITTED_TRANSFORMS,
    TRANSFORMS,
    KBBQBasis,
    damp,
    fit_transform,
    hadamard,
    kbbq_basis,
    transform_inputs,
    transform_weight,
    weight_block_grams,
)

__all__ = [
    "DEFAULT_DAMPING", "FITTED_TRANSFORMS", "KBBQBasis", "TRANSFORMS", "damp", "fit_transform",
    "hadamard", "kbbq_basis", "transform_inputs", "transform_weight",
    "weight_block_grams",
]
