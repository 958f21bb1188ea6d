"""The paper's statements about the noise law, checked numerically (kbbq_pl.law).

Section 2 and the appendix "Full proofs": Lemma invariance, Prop. diagblind, Prop. range,
Prop. factorization, Thm. GL ceiling and its block corollary, the row ceiling, the Haar
attractor, the format constants (Eq. sigmafmt) and Prop. interceptgap on synthetic operands.
"""

from __future__ import annotations

import itertools
import math

import paper_formulas as paper
import pytest
import torch

from kbbq_pl import formats as F
from kbbq_pl.law import noise_law as law

F64 = torch.float64


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_second_moment(size: int, seed: int = 0, decades: float = 2.0) -> torch.Tensor:
    """A positive definite Sigma with a spread spectrum, random eigenvectors and an unequal
    diagonal (so that transforms have something to move)."""
    g = generator(seed)
    basis, _ = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=F64))
    spectrum = torch.logspace(0, decades, size, dtype=F64)[torch.randperm(size, generator=g)]
    return basis @ torch.diag(spectrum) @ basis.T


def random_invertible(size: int, g: torch.Generator) -> torch.Tensor:
    """A random, reasonably conditioned invertible matrix (not orthogonal, not diagonal)."""
    left, _ = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=F64))
    right, _ = torch.linalg.qr(torch.randn(size, size, generator=g, dtype=F64))
    singular = torch.logspace(-1, 1, size, dtype=F64)
    return left @ torch.diag(singular) @ right


def hadamard(size: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix (``size`` a power of two)."""
    h = torch.ones(1, 1, dtype=F64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    assert h.shape[0] == size
    return h / math.sqrt(size)


def samples_with_moment(sigma: torch.Tensor, count: int, seed: int) -> torch.Tensor:
    root = torch.linalg.cholesky(sigma)
    return torch.randn(count, sigma.shape[0], generator=generator(seed), dtype=F64) @ root.T


# ---------------------------------------------------------------- Lemma invariance, Prop. diagblind


def test_numerator_invariance_under_random_invertible_transforms():
    size = 12
    sigma = random_second_moment(size, seed=1)
    g = generator(2)
    weights = torch.randn(5, size, generator=g, dtype=F64)
    gram = law.weight_gram(torch.randn(40, size, generator=g, dtype=F64))
    x = samples_with_moment(sigma, 200, seed=3)
    for _ in range(5):
        t = random_invertible(size, g)
        t_inv_t = torch.linalg.inv(t).T
        w_hat, x_hat = weights @ t_inv_t.T, x @ t.T  # w -> T^-T w, x -> T x
        # the dot products are pointwise unchanged, hence E[S^2]
        assert torch.allclose(x_hat @ w_hat.T, x @ weights.T, rtol=1e-9, atol=1e-9)
        sigma_hat = t @ sigma @ t.T
        assert torch.allclose(((w_hat @ sigma_hat) * w_hat).sum(-1),
                              ((weights @ sigma) * weights).sum(-1), rtol=1e-9)
        # kappa_bar(T) is the identity aggregate of the transformed operands, numerator shared
        gram_hat = t_inv_t @ gram @ t_inv_t.T
        assert torch.allclose((gram_hat * sigma_hat).sum(), (gram * sigma).sum(), rtol=1e-9)
        assert torch.allclose(law.kappa_bar(sigma, t, gram),
                              law.kappa_bar(sigma_hat, None, gram_hat), rtol=1e-9)
        # while the per-row kappa does move (only the numerator is invariant)
        assert not torch.allclose(law.kappa(w_hat, sigma_hat), law.kappa(weights, sigma), rtol=1e-3)


def test_block_diagonal_transforms_match_their_dense_form():
    size, block = 16, 4
    sigma = random_second_moment(size, seed=4)
    g = generator(5)
    gram = law.weight_gram(torch.randn(30, size, generator=g, dtype=F64))
    blocks = torch.stack([random_invertible(block, g) for _ in range(size // block)])
    dense = torch.block_diag(*blocks)
    assert torch.allclose(law.kappa_bar(sigma, blocks, gram), law.kappa_bar(sigma, dense, gram),
                          rtol=1e-10)
    assert torch.allclose(law.kappa_bar(sigma, blocks), law.kappa_bar(sigma, dense), rtol=1e-10)


def test_diagonal_blindness():
    size = 10
    sigma = random_second_moment(size, seed=6)
    g = generator(7)
    weights = torch.randn(6, size, generator=g, dtype=F64)
    x = samples_with_moment(sigma, 300, seed=8)
    signs = torch.randint(0, 2, (size,), generator=g).to(F64) * 2 - 1
    t = signs * torch.logspace(-1.5, 1.5, size, dtype=F64)[torch.randperm(size, generator=g)]
    w_hat, x_hat = weights / t, x * t
    # every elementwise product is pointwise unchanged
    assert torch.allclose(w_hat[:, None, :] * x_hat[None], weights[:, None, :] * x[None],
                          rtol=1e-12, atol=1e-12)
    sigma_hat = t[:, None] * sigma * t[None, :]
    assert torch.allclose(law.kappa(w_hat, sigma_hat), law.kappa(weights, sigma), rtol=1e-10)
    assert torch.allclose(law.kappa_from_samples(w_hat, x_hat),
                          law.kappa_from_samples(weights, x), rtol=1e-10)
    gram = law.weight_gram(weights)
    assert torch.allclose(law.kappa_bar(sigma, torch.diag(t), gram),
                          law.kappa_bar(sigma, None, gram), rtol=1e-10)
    # the integer law is not blind: the amax of each operand, hence the steps, move
    noise = paper.integer_noise(weights, sigma, paper.integer_step(weights.abs().max(), 8),
                              paper.integer_step(x.abs().max(), 8))
    noise_hat = paper.integer_noise(w_hat, sigma_hat, paper.integer_step(w_hat.abs().max(), 8),
                                  paper.integer_step(x_hat.abs().max(), 8))
    assert ((noise_hat / noise - 1).abs() > 0.05).all()


# ---------------------------------------------------------------- Prop. range, Prop. factorization


def test_kappa_lies_in_zero_to_d_and_matches_its_sample_form():
    g = generator(9)
    for size in (2, 7, 33):
        sigma = random_second_moment(size, seed=size)
        weights = torch.randn(50, size, generator=g, dtype=F64)
        values = law.kappa(weights, sigma)
        assert ((values >= 0) & (values <= size)).all()
        x = samples_with_moment(sigma, 64, seed=size + 1)
        from_samples = law.kappa_from_samples(weights, x)
        assert torch.allclose(from_samples, law.kappa(weights, law.second_moment(x)), rtol=1e-10)
        assert ((from_samples >= 0) & (from_samples <= size)).all()


def test_kappa_reaches_d_exactly_for_fully_coherent_products():
    size = 9
    g = generator(10)
    weight = torch.randn(size, generator=g, dtype=F64)
    z = torch.randn(500, 1, generator=g, dtype=F64)
    x = z / weight  # p_k = w_k x_k = z for every k: equal RMS, correlation one
    assert math.isclose(float(law.kappa_from_samples(weight[None], x)), size, rel_tol=1e-12)
    coherence, participation = paper.factorization(weight, law.second_moment(x))
    assert math.isclose(float(coherence), 1.0, rel_tol=1e-10)
    assert math.isclose(float(participation), 1.0, rel_tol=1e-10)
    # equal RMS with correlation below one, or correlation one with unequal RMS: below D
    partial = x + 0.3 * torch.randn(500, size, generator=g, dtype=F64) / weight
    assert float(law.kappa_from_samples(weight[None], partial)) < size - 0.5
    unequal = x * torch.linspace(0.5, 1.5, size, dtype=F64)
    assert float(law.kappa_from_samples(weight[None], unequal)) < size - 0.1


def test_kappa_vanishes_under_cancellation():
    g = generator(11)
    p1 = torch.randn(4000, generator=g, dtype=F64)
    z = torch.randn(4000, generator=g, dtype=F64)
    weight = torch.ones(1, 2, dtype=F64)
    values = []
    for eps in (1.0, 0.3, 0.1, 0.01, 0.001):
        x = torch.stack([p1, -p1 + eps * z], dim=1)  # D = 2, p2 = -p1 + eps Z
        value = float(law.kappa_from_samples(weight, x))
        expected = float((eps * z).square().mean() / (p1.square().mean()
                                                     + (-p1 + eps * z).square().mean()))
        assert math.isclose(value, expected, rel_tol=1e-9)
        values.append(value)
    assert all(a > b for a, b in zip(values, values[1:]))
    assert values[-1] < 1e-6
    x = torch.stack([p1, -p1], dim=1)
    assert float(law.kappa_from_samples(weight, x)) == 0.0


def test_factorization_kappa_is_coherence_times_d_times_participation():
    g = generator(12)
    for size in (3, 16, 64):
        sigma = random_second_moment(size, seed=size + 2)
        weights = torch.randn(20, size, generator=g, dtype=F64) * torch.logspace(
            0, 1, size, dtype=F64)
        coherence, participation = paper.factorization(weights, sigma)
        assert torch.allclose(coherence * size * participation, law.kappa(weights, sigma),
                              rtol=1e-12)
        assert ((coherence >= 0) & (coherence <= 1 + 1e-12)).all()
        assert ((participation >= 1 / size - 1e-12) & (participation <= 1 + 1e-12)).all()


def test_row_ceiling_bounds_every_row_and_is_attained():
    size = 24
    sigma = random_second_moment(size, seed=13)
    ceiling = float(paper.row_ceiling(sigma))
    g = generator(14)
    weights = torch.randn(500, size, generator=g, dtype=F64) * torch.logspace(-1, 1, size,
                                                                             dtype=F64)
    assert float(law.kappa(weights, sigma).max()) <= ceiling * (1 + 1e-12)
    inv_root = torch.diagonal(sigma).rsqrt()
    correlation = inv_root[:, None] * sigma * inv_root[None, :]
    top = torch.linalg.eigh(correlation).eigenvectors[:, -1]
    assert math.isclose(float(law.kappa(inv_root * top, sigma)), ceiling, rel_tol=1e-10)
    # a coordinate with no energy is dropped, not turned into NaN
    padded = torch.zeros(size + 1, size + 1, dtype=F64)
    padded[1:, 1:] = sigma
    assert math.isclose(float(paper.row_ceiling(padded)), ceiling, rel_tol=1e-10)


# ---------------------------------------------------------------- Thm. GL ceiling


def test_gl_ceiling_bounds_every_invertible_transform():
    size = 16
    sigma = random_second_moment(size, seed=15)
    ceiling = float(law.kappa_star(sigma))
    g = generator(16)
    transforms = [random_invertible(size, g) for _ in range(20)]
    transforms += [law.haar_rotation(size, g) for _ in range(10)]
    transforms += [torch.diag(torch.rand(size, generator=g, dtype=F64) + 0.1)
                   @ law.haar_rotation(size, g) for _ in range(10)]
    transforms += [torch.triu(torch.randn(size, size, generator=g, dtype=F64)) + 3 * torch.eye(
        size, dtype=F64) for _ in range(10)]
    values = torch.stack([law.kappa_bar(sigma, t) for t in transforms])
    assert (values <= ceiling * (1 + 1e-12)).all()
    assert (values < ceiling * 0.999).all()  # none of these meets the equal-diagonal condition
    assert float(law.kappa_bar(sigma)) <= ceiling


def test_gl_ceiling_is_attained_by_hadamard_times_eigenbasis():
    size = 16
    sigma = random_second_moment(size, seed=17)
    ceiling = float(law.kappa_star(sigma))
    basis = torch.linalg.eigh(sigma).eigenvectors
    rotation = hadamard(size) @ basis.T  # T = H U^T
    rotated = rotation @ sigma @ rotation.T
    assert torch.allclose(torch.diagonal(rotated),
                          torch.full((size,), float(torch.trace(sigma)) / size, dtype=F64),
                          rtol=1e-10)
    assert math.isclose(float(law.kappa_bar(sigma, rotation)), ceiling, rel_tol=1e-10)
    # the attainer class is diag(s) R: a diagonal factor changes nothing (Prop. diagblind)
    scale = torch.diag(torch.logspace(-1, 1, size, dtype=F64))
    assert math.isclose(float(law.kappa_bar(sigma, scale @ rotation)), ceiling, rel_tol=1e-10)
    # the matched ensemble's constant c cancels
    assert math.isclose(float(law.kappa_bar(sigma, rotation, 3.7 * sigma)), ceiling,
                        rel_tol=1e-10)
    # isotropic inputs: kappa* = 1, nothing to gain (Rem. sanity)
    assert math.isclose(float(law.kappa_star(torch.eye(size, dtype=F64) * 2.5)), 1.0)


def test_randomized_hadamard_attains_the_equal_diagonal_condition_in_expectation():
    size = 8
    sigma = random_second_moment(size, seed=18)
    h = hadamard(size)
    diagonals, values = [], []
    for signs in itertools.product((-1.0, 1.0), repeat=size):  # every sign draw, exactly
        rotation = h @ torch.diag(torch.tensor(signs, dtype=F64))
        diagonals.append(torch.diagonal(rotation @ sigma @ rotation.T))
        values.append(float(law.kappa_bar(sigma, rotation)))
    expected = torch.stack(diagonals).mean(0)
    assert torch.allclose(expected, torch.full((size,), float(torch.trace(sigma)) / size,
                                               dtype=F64), rtol=1e-12)
    ceiling = float(law.kappa_star(sigma))
    # single draws do not meet the condition, and stay under the ceiling
    assert max(values) <= ceiling * (1 + 1e-12)
    assert min(float(d.std() / d.mean()) for d in diagonals) > 1e-3


# ---------------------------------------------------------------- block ceilings, WUSH


def test_block_ceilings_bound_block_transforms_and_are_attained():
    size, block = 32, 8
    sigma = random_second_moment(size, seed=19)
    ceilings = law.block_kappa_star(sigma, block)
    assert ceilings.shape == (size // block,)
    assert ((ceilings >= 1) & (ceilings <= block)).all()
    sigma_blocks = law.diagonal_blocks(sigma, block)
    g = generator(20)
    for _ in range(10):
        transforms = torch.stack([random_invertible(block, g) for _ in range(size // block)])
        per_block = torch.stack([law.kappa_bar(s, t) for s, t in zip(sigma_blocks, transforms)])
        assert (per_block <= ceilings * (1 + 1e-12)).all()
    attainers = torch.stack([hadamard(block) @ torch.linalg.eigh(s).eigenvectors.T
                             for s in sigma_blocks])
    attained = torch.stack([law.kappa_bar(s, t) for s, t in zip(sigma_blocks, attainers)])
    assert torch.allclose(attained, ceilings, rtol=1e-10)
    # on the whole layer (matched ensemble) the block attainer reaches
    # tr(Sigma^2) / sum_b (tr Sigma_b)^2 / d, which sits under the dense ceiling
    traces = torch.diagonal(sigma_blocks, dim1=-2, dim2=-1).sum(-1)
    layer_value = float(law.kappa_bar(sigma, attainers))
    assert math.isclose(layer_value, float(sigma.square().sum() / (traces.square().sum() / block)),
                        rel_tol=1e-10)
    assert layer_value <= float(law.kappa_star(sigma))
    assert torch.isnan(law.block_kappa_star(torch.zeros(8, 8, dtype=F64), 4)).all()


def test_paired_ceiling_and_wush_utilization():
    size, block = 32, 8
    sigma = random_second_moment(size, seed=21)
    sigma_blocks = law.diagonal_blocks(sigma, block)
    # matched ensemble: the paired spectrum is the spectrum of Sigma_b, the paired ceiling kappa_b*
    spectrum = law.paired_spectrum(sigma_blocks, 2.0 * sigma_blocks)
    assert torch.allclose(law.paired_ceiling(spectrum), law.block_kappa_star(sigma, block),
                          rtol=1e-9)
    # real (unmatched) weights: the WUSH transform attains utilization 1, others stay below
    g = generator(22)
    gram = law.weight_gram(torch.randn(64, size, generator=g, dtype=F64)
                           * torch.logspace(0, 1, size, dtype=F64))
    gram_blocks = law.diagonal_blocks(gram, block)
    wush = []
    for s_b, g_b in zip(sigma_blocks, gram_blocks):
        w_root, x_root = torch.linalg.cholesky(g_b), torch.linalg.cholesky(s_b)
        u, singular, _ = torch.linalg.svd(w_root.T @ x_root)
        wush.append(hadamard(block) @ torch.diag(singular.rsqrt()) @ u.T @ w_root.T)
    assert math.isclose(float(law.utilization(sigma, gram, torch.stack(wush), block)), 1.0,
                        rel_tol=1e-9)
    for _ in range(5):
        transforms = torch.stack([random_invertible(block, g) for _ in range(size // block)])
        assert float(law.utilization(sigma, gram, transforms, block)) < 1.0
    assert float(law.utilization(sigma, gram, None, block)) < 1.0


# ---------------------------------------------------------------- the Haar attractor


def test_haar_attractor_closed_form_matches_monte_carlo():
    size, samples = 24, 2000
    sigma = random_second_moment(size, seed=23)
    g = generator(24)
    gram = law.weight_gram(torch.randn(48, size, generator=g, dtype=F64)) + 0.5 * sigma
    cross = float((gram * sigma).sum())
    # the expected denominator, which the closed form gives exactly
    q, r = torch.linalg.qr(torch.randn(samples, size, size, generator=g, dtype=F64))
    rotations = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]  # Haar
    profile_w = torch.einsum("ski,ij,skj->sk", rotations, gram, rotations)
    profile_x = torch.einsum("ski,ij,skj->sk", rotations, sigma, rotations)
    denominators = (profile_w * profile_x).sum(-1)
    for rotation, denominator in zip(rotations[:10], denominators[:10]):
        assert math.isclose(cross / float(law.kappa_bar(sigma, rotation, gram)),
                            float(denominator), rel_tol=1e-10)
    expected = (float(torch.trace(gram) * torch.trace(sigma)) + 2 * cross) / (size + 2)
    error = float(denominators.std()) / math.sqrt(samples)
    assert abs(float(denominators.mean()) - expected) < 4 * error
    assert math.isclose(float(law.haar_attractor(sigma, gram)), cross / expected, rel_tol=1e-12)
    # the mean of the ratio differs from the ratio of the means by O(1/D) at most
    mean, standard_error = paper.haar_attractor_mc(sigma, gram, samples=samples, seed=25)
    closed = float(law.haar_attractor(sigma, gram))
    assert abs(mean - closed) < 4 * standard_error + 2 * closed / size
    # the matched ensemble and the isotropic limit
    assert math.isclose(float(law.haar_attractor(torch.eye(size, dtype=F64))), 1.0)
    assert float(law.haar_attractor(sigma)) <= float(law.kappa_star(sigma))


def test_haar_attractor_fourth_moment_identity():
    """E[(r^T A r)(r^T B r)] = (tr A tr B + 2 tr(AB)) / (D (D + 2)) for r uniform on the
    sphere, the identity the closed form rests on."""
    size, samples = 6, 200_000
    g = generator(26)
    a = random_second_moment(size, seed=27)
    b = law.weight_gram(torch.randn(10, size, generator=g, dtype=F64))
    r = torch.randn(samples, size, generator=g, dtype=F64)
    r = r / r.norm(dim=1, keepdim=True)
    values = ((r @ a) * r).sum(1) * ((r @ b) * r).sum(1)
    expected = float(torch.trace(a) * torch.trace(b) + 2 * (a * b).sum()) / (size * (size + 2))
    assert abs(float(values.mean()) - expected) < 4 * float(values.std()) / math.sqrt(samples)


# ---------------------------------------------------------------- format constants, law fit


def test_format_constants():
    assert round(law.c_fmt("fp8_e4m3"), 2) == 28.51
    assert math.isclose(F.sigma2_fmt("fp8_e4m3"), 4.0**-3 / 12 * 3 / (8 * math.log(2)))
    assert math.isclose(law.c_fmt("nvfp4"), -10 * math.log10(2 * F.sigma2_fmt("nvfp4")))
    assert math.isclose(law.c_fmt("nvfp4", "fp8_e4m3"),
                        -10 * math.log10(F.sigma2_fmt("nvfp4") + F.sigma2_fmt("fp8_e4m3")))
    assert math.isclose(law.intercept_gap("nvfp4", "fp8_e4m3"), 6.0206 * 2, rel_tol=1e-4)
    assert math.isclose(law.intercept_gap("nvfp4", "fp8_e4m3"),
                        law.c_fmt("fp8_e4m3") - law.c_fmt("nvfp4"), rel_tol=1e-12)
    assert law.intercept_gap("nvfp4", "mxfp4") == 0.0
    assert math.isclose(float(law.predicted_snr_db(10.0, "fp8_e4m3")), 10 + law.c_fmt("fp8_e4m3"))
    with pytest.raises(ValueError, match="integer grid"):
        law.c_fmt("int8")


def test_law_fit_recovers_slope_and_intercept():
    g = generator(28)
    kappa = torch.logspace(-1, 1.5, 300, dtype=F64)
    noise = 0.5 * torch.randn(300, generator=g, dtype=F64)
    snr = 10 * torch.log10(kappa) + 28.0 + noise
    fit = law.law_fit(kappa, snr)
    assert fit["records"] == 300
    assert abs(fit["slope_per_decade"] - 10) < 0.3 and abs(fit["intercept"] - 28) < 0.1
    assert math.isclose(fit["median_r"], float((28 + noise).quantile(0.5)), rel_tol=1e-12)
    assert math.isclose(fit["rms_r"], float(noise.std(correction=0)), rel_tol=1e-9)
    steeper = law.law_fit(kappa, 20 * torch.log10(kappa) + 5)
    assert math.isclose(steeper["slope_per_decade"], 20, rel_tol=1e-9)
    assert math.isclose(steeper["intercept"], 5, abs_tol=1e-9)
    with_bad = law.law_fit(torch.tensor([1.0, float("nan"), 2.0, 0.0]),
                           torch.tensor([28.0, 30.0, float("inf"), 29.0]))
    assert with_bad["records"] == 1 and with_bad["slope_per_decade"] is None
    assert with_bad["rms_r"] == 0.0
    assert law.law_fit(torch.ones(4), torch.arange(4.0))["slope_per_decade"] is None
    assert law.law_fit(torch.empty(0), torch.empty(0))["median_r"] is None


def test_integer_law_predicts_integer_rounding_noise():
    """Eq. intlaw with the step of the restricted-range per-tensor grid, amax / 127."""
    size = 256
    g = generator(29)
    weights = torch.randn(64, size, generator=g)
    x = torch.randn(4096, size, generator=g) * torch.logspace(-0.5, 0.5, size)
    quantized_w, quantized_x = F.fake_quantize(weights, "int8_tensor"), F.fake_quantize(
        x, "int8_tensor")
    error = (quantized_x.double() @ quantized_w.double().T - x.double() @ weights.double().T)
    measured = error.square().mean(0)
    predicted = paper.integer_noise(weights, law.second_moment(x), weights.abs().max() / 127,
                                  x.abs().max() / 127)
    assert torch.allclose(measured, predicted, rtol=0.06)
    assert math.isclose(float(paper.integer_step(1.0, 8)), 2 / 256)
    geometry, concentration = paper.cat_factors(x, x.abs().max(), 8)
    step = float(x.abs().max()) / (2**8 - 1)
    assert math.isclose(geometry * concentration,
                        float(x.double().square().mean()) / (step**2 / 12), rel_tol=1e-9)


# ---------------------------------------------------------------- Eq. sigmafmt, Prop. interceptgap


def test_rounding_moments_uniform_in_cell_is_exact_per_band():
    for bits in (1, 3):
        for low in (1.0, 2.0, 4.0):
            moments = paper.rounding_moments(bits, low, 2 * low, "uniform")
            step = low * 2.0**-bits
            assert math.isclose(moments["noise"], step**2 / 12, rel_tol=1e-6)
    # log-uniform: Eq. sigmafmt is close at p = 3 and off at p = 1 (the density varies within
    # a cell when a band has two cells)
    model = {bits: 4.0**-bits / 12 * F.LOG_UNIFORM_INV_M2 for bits in (1, 3)}
    fine, coarse = (paper.rounding_moments(b, 1.0, 2.0, "log_uniform") for b in (3, 1))
    assert abs(fine["relative"] / model[3] - 1) < 0.005
    assert coarse["relative"] / model[1] - 1 < -0.04
    with pytest.raises(ValueError):
        paper.rounding_moments(1, 2.0, 1.0)


DESIGNS = {
    # magnitude octaves (low, high, probability), the density within them, the anchor element
    "log_uniform": ([(1.0, 4.0, 1.0)], "log_uniform", 7.0),
    "uniform": ([(1.0, 2.0, 0.5), (2.0, 4.0, 0.5)], "uniform", 7.0),
    "truncated": ([(1.0, 2.0, 0.5), (2.0, 3.5, 0.5)], "uniform", 3.5),
}
"""Synthetic operands with power-of-two scales in both formats.  The anchor is the tensor's
amax, 448 * 2^-k, so the E4M3 per-tensor scale amax / 448 is a power of two and the operands'
octaves land on whole E4M3 bands (``truncated`` ends at 3.5, where E4M3's top band ends too).
E2M1 runs as ``mxfp4_ceil``: a block amax in (2, 4] gives the scale 1.  The anchor 7 puts its
own E2M1 block at the scale 2; that block moves the E2M1 noise by about 1e-4 dB."""


def synthetic_operands(shape: tuple[int, int], design: str, g: torch.Generator) -> torch.Tensor:
    """Magnitudes drawn as :data:`DESIGNS` says, random signs, the anchor at ``[0, 0]``."""
    octaves, density, anchor = DESIGNS[design]
    u = torch.rand(shape, generator=g, dtype=F64)
    if density == "log_uniform":
        (low, high, _), = octaves
        magnitude = low * (high / low) ** u
    else:
        choice = torch.randint(0, len(octaves), shape, generator=g)
        lows = torch.tensor([o[0] for o in octaves], dtype=F64)[choice]
        highs = torch.tensor([o[1] for o in octaves], dtype=F64)[choice]
        magnitude = lows + (highs - lows) * u
    sign = torch.randint(0, 2, shape, generator=g).to(F64) * 2 - 1
    operands = (magnitude * sign).float()
    operands[0, 0] = anchor
    return operands


def design_moments(bits: int, design: str) -> dict[str, float]:
    """:func:`kbbq_pl.paper.rounding_moments` of a design's magnitudes (a mixture of octaves)."""
    octaves, density, _ = DESIGNS[design]
    parts = [(paper.rounding_moments(bits, low, high, density), weight)
             for low, high, weight in octaves]
    return {key: sum(m[key] * weight for m, weight in parts) for key in parts[0][0]}


def measured_intercept_gap(weights: torch.Tensor, x: torch.Tensor, fine: str,
                           coarse: str) -> float:
    """Mean over rows of r_fine - r_coarse (Eq. residual), both operands quantized."""
    kappa = law.kappa_from_samples(weights, x)
    residual = {}
    for name in (fine, coarse):
        snr = law.snr_db(weights, x, F.fake_quantize(weights, name), F.fake_quantize(x, name))
        residual[name] = law.residual_db(snr, kappa)
    return float((residual[fine] - residual[coarse]).mean())


@pytest.mark.parametrize("design", list(DESIGNS))
def test_intercept_gap_is_mantissa_arithmetic_on_aligned_synthetic_operands(design):
    """Prop. interceptgap on dot products: E4M3 per tensor (p = 3) against E2M1 (p = 1), both
    operands quantized, power-of-two scales (see :data:`DESIGNS`).

    The law is first order (Eq. fplaw): it predicts the ratio of the energy-weighted rounding
    noise, exactly 16 = 12.04 dB when the density is uniform within each octave (uniform in
    cell, Eq. sigmafmt's model), 12.01 dB on log-uniform operands.  A measured dot product
    also carries the second-order terms of Prop. exactmoment (R_0, R_2, R_3), which
    deterministic rounding does not cancel since its error is correlated with the operand it
    rounds: +0.02 dB (log-uniform), +0.06 dB (uniform octaves), +0.05 dB (``truncated``, where
    the half cell at 2 has no partner and R_0 and R_2 are each 5 % of the noise), all from E2M1
    (E4M3's are 16 times smaller).  ``paper.product_noise`` predicts the measurement with them.
    """
    g = generator(30 + list(DESIGNS).index(design))
    weights = synthetic_operands((512, 256), design, g)
    x = synthetic_operands((4096, 256), design, g)
    anchor = DESIGNS[design][2]
    assert (F.block_dequant_scale(F.quantize(weights, "mxfp4_ceil")).flatten()[1:] == 1).all()
    assert F.quantize(x, "fp8_e4m3").scale == anchor / 448 and math.log2(anchor / 448) % 1 == 0
    measured = measured_intercept_gap(weights, x, "fp8_e4m3", "mxfp4_ceil")
    moments = {bits: design_moments(bits, design) for bits in (1, 3)}
    first_order = 10 * math.log10(moments[1]["noise"] / moments[3]["noise"])
    exact = 10 * math.log10(paper.product_noise(moments[1], moments[1])
                            / paper.product_noise(moments[3], moments[3]))
    mantissa_arithmetic = law.intercept_gap("mxfp4_ceil", "fp8_e4m3")  # 12.04 dB
    assert abs(first_order - mantissa_arithmetic) < 0.035
    assert abs(measured - exact) < 0.03
    if design == "log_uniform":
        assert abs(measured - mantissa_arithmetic) < 0.1
    else:
        assert math.isclose(first_order, mantissa_arithmetic, rel_tol=1e-6)
        # per operand, the energy-weighted noise ratio is the first-order gap itself
        per_operand = 10 * math.log10(F.measure_sigma2(x, "mxfp4_ceil", weighting="energy")
                                      / F.measure_sigma2(x, "fp8_e4m3", weighting="energy"))
        assert abs(per_operand - first_order) < 0.03
        assert exact - first_order > 0.03  # the second order is visible, and predicted


def test_e4m3_level_on_log_uniform_operands_is_energy_weighted():
    """The level of r a dot product reaches is the energy-weighted sigma^2 (Eq. fplaw weights
    each element's noise by the other operand's energy): on log-uniform operands
    ``4^-p / 12 / E[m^2]`` with ``E[m^2] = 3 / (2 ln 2)``, 0.68 dB above the per-element
    ``E[1/m^2]`` of Eq. sigmafmt behind the parameter-free 28.51 dB."""
    g = generator(33)
    weights = synthetic_operands((256, 256), "log_uniform", g)
    x = synthetic_operands((2048, 256), "log_uniform", g)
    kappa = law.kappa_from_samples(weights, x)
    snr = law.snr_db(weights, x, F.fake_quantize(weights, "fp8_e4m3"),
                     F.fake_quantize(x, "fp8_e4m3"))
    level = float(law.residual_db(snr, kappa).mean())
    energy_weighted = -10 * math.log10(2 * 4.0**-3 / 12 / (3 / (2 * math.log(2))))
    assert abs(level - energy_weighted) < 0.05
    shift = 10 * math.log10(F.LOG_UNIFORM_INV_M2 * 3 / (2 * math.log(2)))
    assert math.isclose(energy_weighted - law.c_fmt("fp8_e4m3"), shift, rel_tol=1e-9)
    assert 0.68 < shift < 0.69


def test_intercept_gap_deviations_on_log_uniform_operands():
    """Where the 6.02 dB per bit of Prop. interceptgap does not hold, and by how much.

    * Per element (E[(delta / a)^2], the average Eq. sigmafmt writes): with one mantissa bit the
      log-uniform density varies within a cell, so the uniform-in-cell model overstates E2M1's
      noise and the gap is 11.84 dB.  Dot products weight the noise by energy instead (12.01).
    * With a per-tensor E4M3 scale amax / 448 that is not a power of two, whole operand octaves
      straddle E4M3's bands, the energy lands on different mantissas in the two formats, and
      the energy-weighted gap drops to about 11.5 dB.
    The quadrature of ``paper.rounding_moments`` predicts both.
    """
    g = generator(32)
    operands = (4.0 ** torch.rand(1024, 512, generator=g, dtype=F64)).float()  # amax < 4
    assert F.quantize(operands, "fp8_e4m3").scale != 2.0**-6
    coarse = paper.rounding_moments(1, 1.0, 4.0, "log_uniform")
    fine = paper.rounding_moments(3, 1.0, 4.0, "log_uniform")
    per_element = 10 * math.log10(F.measure_sigma2(operands, "mxfp4_ceil")
                                  / F.measure_sigma2(operands, "fp8_e4m3"))
    predicted = 10 * math.log10(coarse["relative"] / fine["relative"])
    assert abs(per_element - predicted) < 0.05
    assert predicted < 12.04 - 0.15
    amax = float(operands.abs().max())
    shifted = paper.rounding_moments(3, 448 / amax, 4 * 448 / amax, "log_uniform")
    misaligned = 10 * math.log10(F.measure_sigma2(operands, "mxfp4_ceil", weighting="energy")
                                 / F.measure_sigma2(operands, "fp8_e4m3", weighting="energy"))
    predicted = 10 * math.log10((coarse["noise"] / coarse["signal"])
                                / (shifted["noise"] / shifted["signal"]))
    assert abs(misaligned - predicted) < 0.05
    assert predicted < 12.04 - 0.3


def test_the_paired_spectrum_of_a_weight_of_lower_rank_than_its_block():
    """A layer with fewer outputs than the block (a router, a gate with one output) or a zero
    block: ``G_b`` is singular and has no Cholesky factor; the spectrum is still that of
    ``W'^T Sigma_b W'`` (one output ``w``: a single value ``sqrt(w^T Sigma_b w)``)."""
    block = 8
    sigma_blocks = law.diagonal_blocks(random_second_moment(16, seed=3), block)
    w = torch.randn(1, 16, generator=generator(4), dtype=F64)
    w[:, block:] = 0  # the second block's weights are zero
    gram_blocks = law.diagonal_blocks(law.weight_gram(w), block)
    spectrum = law.paired_spectrum(sigma_blocks, gram_blocks)
    first = w[0, :block]
    assert torch.allclose(spectrum[0, -1], (first @ sigma_blocks[0] @ first).sqrt(), rtol=1e-10)
    assert spectrum[0, :-1].abs().max() < 1e-6 * spectrum[0, -1]
    assert torch.equal(spectrum[1], torch.zeros(block, dtype=F64))
