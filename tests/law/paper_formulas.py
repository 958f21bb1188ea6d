"""Formulas of the KBBQ paper that the tests check the library and the paper's claims against,
and that the library itself does not compute: the integer profile and CAT's factors, exact
rounding moments by quadrature, Prop. factorization, the row ceiling, the Haar attractor by
Monte Carlo."""

from __future__ import annotations

import math

import torch
from torch import Tensor

_F64 = torch.float64


def integer_noise(weight: Tensor, sigma: Tensor, step_w: Tensor | float,
                  step_x: Tensor | float) -> Tensor:
    """Integer-profile noise of each dot product (Eq. intlaw):
    ``E[dS^2] = Delta_w^2 / 12 sum_k E[x_k^2] + Delta_x^2 / 12 sum_k w_k^2``."""
    w = weight.to(_F64)
    diag = torch.diagonal(sigma.to(_F64))
    step_w = torch.as_tensor(step_w, dtype=_F64)
    step_x = torch.as_tensor(step_x, dtype=_F64)
    return step_w.square() / 12 * diag.sum() + step_x.square() / 12 * w.square().sum(-1)


def integer_step(amax: Tensor | float, bits: int) -> Tensor:
    """Step of a symmetric ``b``-bit grid over ``[-amax, amax]``: ``Delta = 2 amax / 2^b``."""
    return 2.0 * torch.as_tensor(amax, dtype=_F64) / 2**bits


def cat_factors(x: Tensor, value_range: Tensor | float, bits: int) -> tuple[float, float]:
    """CAT's factors of the elementwise integer SQNR (Eq. catfactors):
    ``E[x^2] / (Delta^2 / 12) = 12 N(b)^2 C``, grid geometry ``N(b)^2`` with
    ``N(b) = 2^b - 1`` intervals over the range, and concentration ``C = E[x^2] / r^2``.
    Returns ``(12 N(b)^2, C)``."""
    intervals = 2**bits - 1
    r = torch.as_tensor(value_range, dtype=_F64)
    concentration = x.to(_F64).square().mean() / r.square()
    return 12.0 * intervals**2, float(concentration)


def rounding_moments(
    mantissa_bits: int, low: float, high: float, density: str = "uniform",
    points: int = 1 << 20,
) -> dict[str, float]:
    """Exact moments of round-to-nearest onto a ``p``-bit floating-point grid, by quadrature.

    The grid is the one of Eq. sigmafmt with power-of-two band edges: step ``2^(e - p)`` on
    ``[2^e, 2^(e+1))``, no clipping, no subnormals (a format whose scale is a power of two
    seen in its own units).  The operand magnitude ``a`` has a ``uniform`` or ``log_uniform``
    density on ``[low, high]``; ``delta = q(a) - a``.  Returns

    * ``signal``: ``E[a^2]``; ``noise``: ``E[delta^2]``; ``cross``: ``E[a delta]``;
    * ``relative``: ``E[(delta / a)^2]``.

    ``noise / signal`` is the energy-weighted ``sigma^2`` a dot product sees (Eq. fplaw) and
    ``relative`` the per-element one; Eq. sigmafmt approximates both by
    ``4^-p / 12 E[1/m^2]`` under the uniform-in-cell model, which is exact for ``noise`` when
    the density is uniform within each band (``E[delta^2] = step^2 / 12`` per band) and only
    approximate otherwise: on log-uniform operands ``p = 1`` deviates by tenths of a dB.
    ``cross`` is nonzero for deterministic rounding (the error is correlated with the operand
    it rounds) and enters the second-order terms of :func:`product_noise`.
    """
    if not 0 < low < high:
        raise ValueError(f"need 0 < low < high, got {low} and {high}")
    t = (torch.arange(points, dtype=_F64) + 0.5) / points
    if density == "uniform":
        a = low + (high - low) * t
    elif density == "log_uniform":
        a = low * (high / low) ** t
    else:
        raise ValueError(f"density must be 'uniform' or 'log_uniform', got {density!r}")
    step = torch.exp2(torch.floor(torch.log2(a)) - mantissa_bits)
    delta = torch.round(a / step) * step - a
    return {
        "signal": float(a.square().mean()),
        "noise": float(delta.square().mean()),
        "cross": float((a * delta).mean()),
        "relative": float((delta / a).square().mean()),
    }


def product_noise(weight_moments: dict[str, float], input_moments: dict[str, float]) -> float:
    """``E[(w_hat x_hat - w x)^2]`` of one product of independent operands rounded
    deterministically, from their :func:`rounding_moments` (Prop. exactmoment, diagonal):

    ``E[x^2] s_w + E[w^2] s_x`` (the law, Eq. fplaw) ``+ s_w s_x`` (R_3)
    ``+ 2 c_w c_x`` (R_0) ``+ 2 s_w c_x + 2 c_w s_x`` (R_2), with ``s = E[delta^2]``,
    ``c = E[a delta]``.  For operands with independent coordinates and random signs the
    cross-coordinate terms vanish, so a dot product's noise is ``D`` times this.
    """
    w, x = weight_moments, input_moments
    return (
        x["signal"] * w["noise"] + w["signal"] * x["noise"] + w["noise"] * x["noise"]
        + 2 * w["cross"] * x["cross"] + 2 * w["noise"] * x["cross"] + 2 * w["cross"] * x["noise"]
    )


def haar_attractor_mc(
    sigma: Tensor, gram: Tensor | None = None, samples: int = 64, seed: int = 0
) -> tuple[float, float]:
    """Monte Carlo ``E_R[kappa_bar(R)]`` over Haar rotations: (mean, standard error).

    For an orthogonal ``R``, ``T^-T = R``, so :func:`kbbq_pl.law.noise_law.kappa_bar`'s profiles are
    ``a = diag(R G R^T)`` and ``b = diag(R Sigma R^T)``; the rotations are drawn as a batch.
    """
    s = sigma.to(_F64)
    g = s if gram is None else gram.to(_F64)
    size = s.shape[-1]
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(samples, size, size, generator=generator, dtype=_F64)
    q, r = torch.linalg.qr(z)
    rotations = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    a = torch.einsum("ski,ij,skj->sk", rotations, g, rotations)
    b = torch.einsum("ski,ij,skj->sk", rotations, s, rotations)
    values = (g * s).sum() / (a * b).sum(-1)
    return float(values.mean()), float(values.std() / math.sqrt(samples))


def factorization(weight: Tensor, sigma: Tensor) -> tuple[Tensor, Tensor]:
    """Coherence and participation ratio of Prop. factorization, ``kappa = coh * D * pr``:
    ``coh = E[S^2] / (sum_k r_k)^2``, ``pr = (sum_k r_k)^2 / (D sum_k r_k^2)``, with
    ``r_k = sqrt(E[p_k^2]) = |w_k| sqrt(Sigma_kk)``."""
    w = weight.to(_F64)
    s = sigma.to(_F64)
    r = w.abs() * torch.diagonal(s).clamp(min=0).sqrt()
    total = r.sum(-1)
    numerator = ((w @ s) * w).sum(-1)
    coherence = numerator / total.square()
    participation = total.square() / (w.shape[-1] * r.square().sum(-1))
    return coherence, participation


def row_ceiling(sigma: Tensor) -> Tensor:
    """Row ceiling (Eq. rowceiling): ``lambda_max(C_B)``, ``C_B = diag(Sigma)^-1/2 Sigma
    diag(Sigma)^-1/2`` the input correlation matrix; the largest kappa of any single row.
    Coordinates with no energy are dropped."""
    s = sigma.to(_F64)
    d = torch.diagonal(s)
    keep = d > 0
    s = s[keep][:, keep]
    inv = d[keep].rsqrt()
    return torch.linalg.eigvalsh(inv[:, None] * s * inv[None, :])[-1]
