"""The noise law (pure math on tensors): participation factor kappa, SNR per GEMM cell, format
constants and ceilings (:mod:`kbbq_pl.law.noise_law`).  Measuring it on a model is
:mod:`kbbq_pl.eval.law_cells`; its report, :mod:`kbbq_pl.eval.law_report`."""

from .noise_law import (
    block_kappa_star,
    c_fmt,
    diagonal_blocks,
    haar_attractor,
    haar_rotation,
    intercept_gap,
    kappa,
    kappa_bar,
    kappa_from_samples,
    kappa_star,
    law_fit,
    optimal_block_denominator,
    paired_ceiling,
    paired_spectrum,
    predicted_snr_db,
    residual_db,
    second_moment,
    snr_db,
    utilization,
    weight_gram,
)

__all__ = [
    "block_kappa_star", "c_fmt", "diagonal_blocks", "haar_attractor", "haar_rotation",
    "intercept_gap", "kappa", "kappa_bar", "kappa_from_samples", "kappa_star", "law_fit",
    "optimal_block_denominator", "paired_ceiling", "paired_spectrum", "predicted_snr_db",
    "residual_db", "second_moment", "snr_db", "utilization", "weight_gram",
]
