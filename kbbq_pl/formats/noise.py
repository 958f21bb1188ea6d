"""The relative noise variance sigma^2_fmt of a floating-point format (paper Eq. sigmafmt)."""

from __future__ import annotations

import torch
from torch import Tensor

from .qtensor import fake_quantize
from .spec import LOG_UNIFORM_INV_M2, Format, get_format


def sigma2_fmt(fmt: str | Format, inv_m2: float = LOG_UNIFORM_INV_M2) -> float:
    """Predicted relative rounding-noise variance of a floating-point grid, Eq. sigmafmt:
    ``sigma^2 = 4^-p / 12 * E[1/m^2]`` with ``p`` mantissa bits and ``E[1/m^2] = 3 / (8 ln 2)``
    for operands log-uniform within their exponent band (E4M3: 7.04e-4; E2M1: 1.13e-2).

    Scaling granularity does not enter; the measured level of block formats sits below this
    prediction by the granularity offset the paper's Appendix on formats discusses.
    """
    fmt = get_format(fmt)
    if not 0.25 < inv_m2 <= 1.0:
        raise ValueError(f"E[1/m^2] lies in (1/4, 1] for m in [1, 2), got {inv_m2}")
    return 4.0 ** (-fmt.mantissa_bits) / 12.0 * inv_m2


@torch.no_grad()
def measure_sigma2(
    x: Tensor, fmt: str | Format, weighting: str = "element", **quantize_kwargs
) -> float:
    """Measured relative noise variance of rounding ``x`` onto ``fmt``.

    ``weighting="element"`` (default) is the mean over nonzero elements of ``(delta / a)^2``,
    the direct estimate of ``sigma^2`` in ``phi(a) = sigma^2 a^2`` averaged over the operands'
    within-band positions (Eq. sigmafmt: 7.04e-4 for E4M3 on log-uniform data).
    ``weighting="energy"`` is ``sum delta^2 / sum a^2``, the level at which the noise of a dot
    product accumulates (Eq. fplaw); it weights large mantissas more, so on log-uniform data it
    reads ``4^-p / 12 / E[m^2]`` (``E[m^2] = 3 / (2 ln 2)``), 0.685 dB lower.
    Works for any format, integer ones too.
    """
    fmt = get_format(fmt)
    xf = x.to(torch.float64)
    error = fake_quantize(x, fmt, **quantize_kwargs).to(torch.float64) - xf
    if weighting == "energy":
        energy = xf.square().sum()
        if energy == 0:
            raise ValueError(
                "measure_sigma2: the tensor is all zeros; its relative noise is undefined")
        return float(error.square().sum() / energy)
    if weighting != "element":
        raise ValueError(f"weighting must be 'element' or 'energy', got {weighting!r}")
    nonzero = xf != 0
    if not nonzero.any():
        raise ValueError("measure_sigma2: the tensor is all zeros; its relative noise is undefined")
    return float((error[nonzero] / xf[nonzero]).square().mean())
