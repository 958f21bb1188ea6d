"""Input transforms (pure math on tensors): identity, Haar, Hadamard, WUSH and KBBQ, fitted and
applied (:mod:`kbbq_pl.transforms.fit`); the auto-brake choosing KBBQ's lambda
(:mod:`kbbq_pl.transforms.autobrake`); folding ``o_proj`` transforms into ``v_proj``
(:mod:`kbbq_pl.transforms.fold`)."""

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
    transform_sigma,
    transform_weight,
    weight_block_grams,
)

__all__ = [
    "DEFAULT_DAMPING", "FITTED_TRANSFORMS", "KBBQBasis", "TRANSFORMS", "damp", "fit_transform",
    "hadamard", "kbbq_basis", "transform_inputs", "transform_sigma", "transform_weight",
    "weight_block_grams",
]
