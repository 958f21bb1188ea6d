"""The noise law: participation factor, SNR per GEMM cell, format constants and ceilings.

Pure functions on tensors, computed in float64.  Notation of the paper: a cell is one GEMM with
weight ``W [out, D]`` (rows ``w``) and inputs ``x`` with second moment ``Sigma = E[x x^T]``
(``[D, D]``); ``p_k = w_k x_k`` are the elementwise products of one dot product
``S = sum_k p_k``.  Weight ensembles are given by their Gram matrix ``G = E_w[w w^T]`` (for
real weights ``G = W^T W / out``); ``G = None`` means the matched ensemble ``G = c Sigma`` of
Thm. GL ceiling (``c`` cancels).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..formats import Format, get_format, sigma2_fmt

_F64 = torch.float64

# ---------------------------------------------------------------- moments


def second_moment(x: Tensor) -> Tensor:
    """``Sigma = E[x x^T] = X^T X / n`` of inputs ``x [n, D]`` (float64)."""
    x = x.reshape(-1, x.shape[-1]).to(_F64)
    return x.T @ x / x.shape[0]


def weight_gram(weight: Tensor) -> Tensor:
    """The empirical weight ensemble ``G = W^T W / out`` of ``weight [out, D]`` (float64)."""
    w = weight.to(_F64)
    return w.T @ w / w.shape[0]


def diagonal_blocks(matrix: Tensor, block: int) -> Tensor:
    """The ``[D / block, block, block]`` diagonal blocks of a ``[D, D]`` matrix."""
    size = matrix.shape[-1]
    if size % block:
        raise ValueError(f"dimension {size} is not a multiple of the block size {block}")
    n = size // block
    grid = matrix.reshape(n, block, n, block)
    index = torch.arange(n, device=matrix.device)
    return grid[index, :, index, :]


# ---------------------------------------------------------------- the participation factor


def kappa(weight: Tensor, sigma: Tensor) -> Tensor:
    """Participation factor of each dot product (Def. kappa):
    ``kappa = E[S^2] / sum_k E[(w_k x_k)^2] = w^T Sigma w / w^T diag(Sigma) w``.

    ``weight`` is one row ``[D]`` or rows ``[out, D]``; returns a scalar or ``[out]``.  A row
    whose products have no energy gives NaN (kappa is undefined there).
    """
    w = weight.to(_F64)
    s = sigma.to(_F64)
    numerator = ((w @ s) * w).sum(-1)
    denominator = (w.square() * torch.diagonal(s)).sum(-1)
    return numerator / denominator


def kappa_from_samples(weight: Tensor, x: Tensor) -> Tensor:
    """Def. kappa with the expectations taken over samples ``x [n, D]`` directly."""
    w = weight.to(_F64)
    x = x.to(_F64)
    s = x @ w.T  # [n, out] dot products
    products = (x.square().mean(0) * w.square()).sum(-1)
    return s.square().mean(0) / products


def _inverse_transpose_quadratic_diag(transform: Tensor, gram: Tensor) -> Tensor:
    """``diag(T^-T G T^-1)`` without forming ``T^-1`` (solve, do not invert)."""
    # T^-T G T^-1 = (G^{1/2} T^-1)^T (G^{1/2} T^-1); with Y = T^-T G, diag(Y T^-1) = diag(...)
    left = torch.linalg.solve(transform.T, gram)  # T^-T G
    return torch.diagonal(torch.linalg.solve(transform.T, left.T).T, dim1=-2, dim2=-1)


def kappa_bar(sigma: Tensor, transform: Tensor | None = None, gram: Tensor | None = None) -> Tensor:
    """Aggregate participation factor of a cell under an invertible transform (Thm. GL ceiling):

    ``kappa_bar(T) = tr(G Sigma) / sum_k a_k b_k``, ``a = diag(T^-T G T^-1)``,
    ``b = diag(T Sigma T^T)`` (weights ``w -> T^-T w``, inputs ``x -> T x``).

    ``gram`` is the weight ensemble (``None``: matched, ``G = Sigma``); ``transform`` is a
    ``[D, D]`` matrix or a batch of diagonal blocks ``[D / d, d, d]`` (``None``: identity).
    The numerator is invariant (Lemma invariance); only the denominator moves.
    """
    s = sigma.to(_F64)
    g = s if gram is None else gram.to(_F64)
    numerator = (g * s).sum()
    return numerator / _denominator(s, g, transform)


def _denominator(sigma: Tensor, gram: Tensor, transform: Tensor | None) -> Tensor:
    """``sum_k a_k b_k`` of :func:`kappa_bar`, blockwise when the transform is block-diagonal."""
    if transform is None:
        return (torch.diagonal(gram) * torch.diagonal(sigma)).sum()
    t = transform.to(_F64)
    if t.dim() == 2:
        a = _inverse_transpose_quadratic_diag(t, gram)
        b = torch.diagonal(t @ sigma @ t.T)
        return (a * b).sum()
    block = t.shape[-1]
    return block_denominator(diagonal_blocks(sigma, block), diagonal_blocks(gram, block), t)


def block_denominator(s_blocks: Tensor, g_blocks: Tensor, transform: Tensor | None) -> Tensor:
    """:func:`_denominator` from the diagonal blocks ``[D / d, d, d]`` of ``Sigma`` and ``G``
    alone (the only part a block-diagonal ``transform`` of the same blocks, or none, reads):
    no ``D x D`` matrix is formed."""
    if transform is None:
        a = torch.diagonal(g_blocks, dim1=-2, dim2=-1).reshape(-1)
        return (a * torch.diagonal(s_blocks, dim1=-2, dim2=-1).reshape(-1)).sum()
    t = transform.to(_F64)
    b = torch.diagonal(t @ s_blocks @ t.transpose(-1, -2), dim1=-2, dim2=-1)
    left = torch.linalg.solve(t.transpose(-1, -2), g_blocks)  # T^-T G per block
    a = torch.diagonal(torch.linalg.solve(t.transpose(-1, -2), left.transpose(-1, -2)),
                       dim1=-2, dim2=-1)
    return (a * b).sum()


# ---------------------------------------------------------------- ceilings


def kappa_star(sigma: Tensor) -> Tensor:
    """Layer ceiling (Eq. glceiling): ``kappa* = D tr(Sigma^2) / (tr Sigma)^2``, the largest
    aggregate participation any invertible transform reaches under a matched ensemble."""
    s = sigma.to(_F64)
    return s.shape[-1] * s.square().sum() / torch.trace(s).square()


def block_kappa_star(sigma: Tensor, block: int) -> Tensor:
    """Block ceilings (Eq. blockceiling): ``kappa_b* = d tr(Sigma_b^2) / (tr Sigma_b)^2`` for
    every diagonal block ``Sigma_b`` of size ``d = block``; returns ``[D / d]`` (NaN where a
    block has no energy)."""
    return block_ceilings(diagonal_blocks(sigma.to(_F64), block))


def block_ceilings(sigma_blocks: Tensor) -> Tensor:
    """:func:`block_kappa_star` from the diagonal blocks ``[D / d, d, d]`` of ``Sigma``."""
    blocks = sigma_blocks.to(_F64)
    trace = torch.diagonal(blocks, dim1=-2, dim2=-1).sum(-1)
    return blocks.shape[-1] * blocks.square().sum((-1, -2)) / trace.square()


def paired_spectrum(sigma_blocks: Tensor, gram_blocks: Tensor) -> Tensor:
    """Singular values ``s`` of ``W'^T X'`` per block (Eq. wushsvd), from the blocks of the
    input second moment and of the weight Gram (``[..., d, d]``): the square roots of the
    eigenvalues of ``W'^T Sigma_b W'`` for any ``W' W'^T = G_b``; here the symmetric root
    ``W' = G_b^(1/2)``, defined for every positive semi-definite block: a weight block of rank
    below ``d`` (a layer with fewer than ``d`` outputs, zero columns) has zeros in its
    spectrum where a Cholesky factor would not exist."""
    g = gram_blocks.to(_F64)
    s = sigma_blocks.to(_F64)
    eigenvalues, vectors = torch.linalg.eigh(g)
    root = (vectors * eigenvalues.clamp(min=0).sqrt()[..., None, :]) @ vectors.transpose(-1, -2)
    paired = root @ s @ root
    return torch.linalg.eigvalsh(paired).clamp(min=0).sqrt()


def paired_ceiling(singular_values: Tensor) -> Tensor:
    """Paired ceiling (Eq. wushratio): ``d tr(S^2) / (tr S)^2`` per block, in ``[1, d]``; the
    factor by which the WUSH transform (KBBQ at lambda = 1) lowers FP noise in the block."""
    s = singular_values.to(_F64)
    return s.shape[-1] * s.square().sum(-1) / s.sum(-1).square()


def optimal_block_denominator(singular_values: Tensor) -> Tensor:
    """Smallest ``sum_k a_k b_k`` a block-diagonal transform can reach: ``sum_b (tr S_b)^2 / d``
    (WUSH's Eq. 20).  :func:`kappa_bar` with it in the denominator is the paired ceiling of the
    layer; the utilization of a transform is this over its own denominator."""
    s = singular_values.to(_F64)
    return (s.sum(-1).square() / s.shape[-1]).sum()


def utilization(sigma: Tensor, gram: Tensor, transform: Tensor | None, block: int) -> Tensor:
    """``kappa_bar(T) / kappa_bar(T_WUSH)`` for block-diagonal ``T`` with the real weights:
    1 at the paired ceiling, which WUSH (KBBQ lambda = 1) fitted on undamped ``sigma`` attains
    (the default damping keeps it a little below: 0.98 on ill-conditioned data)."""
    s = sigma.to(_F64)
    g = gram.to(_F64)
    spectrum = paired_spectrum(diagonal_blocks(s, block), diagonal_blocks(g, block))
    return optimal_block_denominator(spectrum) / _denominator(s, g, transform)


def haar_attractor(sigma: Tensor, gram: Tensor | None = None) -> Tensor:
    """Haar attractor ``kappa_bar_rot``: the aggregate participation after a uniformly random
    rotation ``R``, in closed form.

    For a row ``r`` of a Haar ``R`` (uniform on the sphere),
    ``E[(r^T A r)(r^T B r)] = (tr A tr B + 2 tr(AB)) / (D (D + 2))``, so the expected
    denominator of :func:`kappa_bar` is ``(tr G tr Sigma + 2 tr(G Sigma)) / (D + 2)`` and
    ``kappa_bar_rot = (D + 2) tr(G Sigma) / (tr G tr Sigma + 2 tr(G Sigma))``.
    This is the numerator over the expected denominator; the expected ratio (a Monte Carlo
    over rotations estimates it) differs by O(1/D).
    """
    s = sigma.to(_F64)
    g = s if gram is None else gram.to(_F64)
    size = s.shape[-1]
    cross = (g * s).sum()
    return (size + 2) * cross / (torch.trace(g) * torch.trace(s) + 2 * cross)


def haar_rotation(size: int, generator: torch.Generator | None = None,
                  dtype: torch.dtype = _F64) -> Tensor:
    """A Haar-distributed orthogonal matrix (QR of a Gaussian with the sign fix)."""
    z = torch.randn(size, size, generator=generator, dtype=_F64)
    q, r = torch.linalg.qr(z)
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


# ---------------------------------------------------------------- formats and SNR


def c_fmt(weight_format: str | Format, input_format: str | Format | None = None) -> float:
    """Predicted format constant (Eqs. kappalaw, fplaw, sigmafmt):
    ``C_fmt = -10 log10(sigma_w^2 + sigma_x^2)``; 28.51 dB for E4M3 on both operands.

    Eq. sigmafmt averages the within-band modulation per element, ``E[1/m^2] = 3 / (8 ln 2)``;
    a dot product weights each element's noise by energy instead, which on log-uniform
    operands gives ``1 / E[m^2] = 2 ln 2 / 3`` and a constant 0.68 dB higher (29.19 dB for
    E4M3)."""
    sw = sigma2_fmt(weight_format)
    sx = sigma2_fmt(input_format if input_format is not None else weight_format)
    return -10.0 * math.log10(sw + sx)


def predicted_snr_db(kappa_value: Tensor | float, weight_format: str | Format,
                     input_format: str | Format | None = None) -> Tensor:
    """The law (Eq. kappalaw): ``SNR_dB = 10 log10 kappa + C_fmt``."""
    value = torch.as_tensor(kappa_value, dtype=_F64)
    return 10.0 * torch.log10(value) + c_fmt(weight_format, input_format)


def intercept_gap(format_a: str | Format, format_b: str | Format) -> float:
    """Predicted intercept spacing ``C_b - C_a = 6.02 (p_b - p_a)`` dB (Prop. interceptgap)
    for two floating-point formats on the same operand distribution."""
    pa = get_format(format_a).mantissa_bits
    pb = get_format(format_b).mantissa_bits
    return 10.0 * (pb - pa) * math.log10(4.0)


def snr_db(weight: Tensor, x: Tensor, weight_hat: Tensor, x_hat: Tensor) -> Tensor:
    """Measured SNR of each dot product from the realized rounding of both operands:
    ``10 log10(E[S^2] / E[dS^2])`` over the samples, ``dS = w_hat . x_hat - w . x``
    (``weight [out, D]``, ``x [n, D]``; returns ``[out]``)."""
    w = weight.to(_F64)
    x = x.to(_F64)
    exact = x @ w.T
    error = x_hat.to(_F64) @ weight_hat.to(_F64).T - exact
    return 10.0 * torch.log10(exact.square().mean(0) / error.square().mean(0))


def residual_db(snr: Tensor, kappa_value: Tensor) -> Tensor:
    """Residual of the law (Eq. residual): ``r = SNR_dB - 10 log10 kappa``, which the law says
    equals ``C_fmt`` for every cell."""
    return snr.to(_F64) - 10.0 * torch.log10(kappa_value.to(_F64))


# ---------------------------------------------------------------- fitting the law


def law_fit(kappa_value: Tensor, snr: Tensor) -> dict[str, float | int | None]:
    """Fit Eq. kappalaw to records ``(kappa, SNR_dB)`` of one format.

    * ``slope_per_decade``: least-squares slope of SNR on ``log10 kappa``, dB per decade of
      kappa (the law says 10);
    * ``intercept``: least-squares intercept of SNR on ``10 log10 kappa`` (the SNR the fit
      gives at ``kappa = 1``; the law says ``C_fmt``);
    * ``median_r`` / ``mean_r``: median and mean of the residual ``r`` of Eq. residual, the
      level of the law at unit slope (the law says ``C_fmt``);
    * ``rms_r``: RMS of ``r`` about its mean, the scatter the law leaves.

    Records with a non-finite kappa or SNR are dropped; slope and intercept are None when
    fewer than two records or a single kappa value leave the regression undefined.
    """
    k = torch.as_tensor(kappa_value, dtype=_F64).reshape(-1)
    y = torch.as_tensor(snr, dtype=_F64).reshape(-1)
    keep = torch.isfinite(k) & torch.isfinite(y) & (k > 0)
    k, y = k[keep], y[keep]
    count = int(k.numel())
    if count == 0:
        return {"records": 0, "slope_per_decade": None, "intercept": None, "median_r": None,
                "mean_r": None, "rms_r": None}
    decades = torch.log10(k)
    r = y - 10.0 * decades
    slope = intercept = None
    spread = decades - decades.mean()
    if count >= 2 and float(spread.square().sum()) > 0:
        slope_value = float((spread * (y - y.mean())).sum() / spread.square().sum())
        slope = slope_value
        intercept = float(y.mean() - slope_value * decades.mean())
    return {
        "records": count,
        "slope_per_decade": slope,
        "intercept": intercept,
        "median_r": float(r.quantile(0.5)),
        "mean_r": float(r.mean()),
        "rms_r": float((r - r.mean()).square().mean().sqrt()),
    }
