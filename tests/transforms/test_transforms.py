"""Transforms: function preservation, the KBBQ construction, utilization of the paired ceiling."""

from __future__ import annotations

import pytest
import torch

from kbbq_pl.law import noise_law as law
from kbbq_pl.transforms import fit as T


def correlated_inputs(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g, dtype=torch.float64) / dim**0.5
    scales = torch.exp(torch.randn(dim, generator=g, dtype=torch.float64))
    return (torch.randn(n, dim, generator=g, dtype=torch.float64) * scales) @ (
        torch.eye(dim, dtype=torch.float64) + mix)


@pytest.fixture
def layer():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 64, generator=g, dtype=torch.float64)
    weight[:, 5] *= 8  # an outlier column
    x = correlated_inputs(4096, 64)
    return weight, x, law.second_moment(x)


@pytest.mark.parametrize("kind,lam", [("identity", 0.0), ("haar", 0.0), ("hadamard", 0.0),
                                      ("wush", 1.0), ("kbbq", 0.0), ("kbbq", 0.5), ("kbbq", 0.75)])
def test_every_transform_preserves_the_function(layer, kind, lam):
    weight, x, sigma = layer
    t = T.fit_transform(kind, weight, law.diagonal_blocks(sigma, 16), block=16, lam=lam)
    y = x @ weight.T
    y_hat = T.transform_inputs(x, t) @ T.transform_weight(weight, t).T
    assert torch.allclose(y_hat, y, rtol=0, atol=1e-10 * y.abs().max())


def test_hadamard_is_orthonormal_and_sylvester():
    h = T.hadamard(16)
    assert torch.allclose(h @ h.T, torch.eye(16, dtype=torch.float64), atol=1e-15)
    assert torch.equal((h * 4).abs(), torch.ones(16, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="power-of-two"):
        T.hadamard(12)


def test_kbbq_endpoints(layer):
    """lambda = 1: transformed weight and input block moments are both H S H (balanced);
    lambda = 0: the weight side is whitened (anchors notes on WUSH)."""
    weight, _, sigma = layer
    sigma_blocks = law.diagonal_blocks(sigma, 16)
    basis = T.kbbq_basis(weight, sigma_blocks, damping=0.01)
    g_w = T.damp(T.weight_block_grams(weight, 16))
    g_x = T.damp(sigma_blocks)
    h = T.hadamard(16)
    hsh = h @ torch.diag_embed(basis.paired_spectrum) @ h.T
    t1 = basis.transform(1.0)
    t1_inv = torch.linalg.inv(t1)
    assert torch.allclose(t1 @ g_x @ t1.transpose(-1, -2), hsh, atol=1e-9)
    assert torch.allclose(t1_inv.transpose(-1, -2) @ g_w @ t1_inv, hsh, atol=1e-9)
    t0 = basis.transform(0.0)
    t0_inv = torch.linalg.inv(t0)
    eye = torch.eye(16, dtype=torch.float64).expand_as(t0)
    assert torch.allclose(t0_inv.transpose(-1, -2) @ g_w @ t0_inv, eye, atol=1e-9)
    assert torch.allclose(basis.transform(1.0), T.fit_transform("wush", weight, sigma_blocks,
                                                                block=16))
    with pytest.raises(ValueError, match="lies in"):
        basis.transform(1.5)


def test_utilization_rises_monotonically_to_one(layer):
    weight, _, sigma = layer
    basis = T.kbbq_basis(weight, law.diagonal_blocks(sigma, 16), damping=1e-9)
    gram = law.weight_gram(weight)
    values = [float(law.utilization(sigma, gram, basis.transform(lam), 16))
              for lam in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert all(b > a for a, b in zip(values, values[1:])), values
    assert values[-1] == pytest.approx(1.0, abs=1e-6)
    assert values[0] < 0.95
    # the layer aggregate at lambda = 1 is the paired ceiling: no block-diagonal transform beats it
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        random = torch.randn(4, 16, 16, generator=g, dtype=torch.float64) + 3 * torch.eye(16)
        assert float(law.utilization(sigma, gram, random, 16)) <= 1.0 + 1e-9


def test_degenerate_blocks_keep_the_identity():
    weight = torch.randn(8, 32, dtype=torch.float64)
    x = torch.randn(256, 32, dtype=torch.float64)
    x[:, 16:] = 0  # the second block never sees energy
    basis = T.kbbq_basis(weight, law.diagonal_blocks(law.second_moment(x), 16))
    assert basis.degenerate.tolist() == [False, True]
    assert torch.equal(basis.transform(0.5)[1], torch.eye(16, dtype=torch.float64))


def test_undamped_fit_of_a_singular_weight_gram_names_the_layer_and_block():
    """Without damping (the paper's WUSH) a zero weight column, e.g. the zero padding of a
    width that is not a multiple of the block, leaves ``G_W`` singular: a ValueError names the
    layer, the block and the damping, not a bare Cholesky error."""
    weight = torch.randn(32, 32, dtype=torch.float64)
    sigma = law.diagonal_blocks(law.second_moment(torch.randn(256, 32, dtype=torch.float64)), 16)
    T.kbbq_basis(weight, sigma, damping=0.0)  # full rank: fits
    weight[:, 20] = 0
    with pytest.raises(ValueError, match=r"mlp\.down_proj: cannot fit the transform: the weight "
                                         r"Gram of 1 of 2 blocks \(first: block 1, input features "
                                         r"16\.\.31\) is singular with damping 0\.0"):
        T.kbbq_basis(weight, sigma, damping=0.0, name="mlp.down_proj")


def test_batched_fit_matches_per_block_fit(layer):
    weight, _, sigma = layer
    blocks = law.diagonal_blocks(sigma, 16)
    batched = T.kbbq_basis(weight, blocks).transform(0.6)
    for b in range(4):
        single = T.kbbq_basis(weight[:, 16 * b:16 * (b + 1)], blocks[b:b + 1]).transform(0.6)
        assert torch.allclose(single[0], batched[b], atol=1e-12)


def test_bad_input_errors():
    weight = torch.randn(8, 24)
    with pytest.raises(ValueError, match="not a multiple of the block size 16"):
        T.fit_transform("hadamard", weight, block=16)
    with pytest.raises(ValueError, match="fitted from calibration statistics"):
        T.fit_transform("kbbq", torch.randn(8, 32), block=16)
    with pytest.raises(ValueError, match="unknown transform"):
        T.fit_transform("spin", torch.randn(8, 32), block=16)
