"""GPTQ for the FP4 formats: the algorithm on tensors (kbbq_pl.quant.gptq.algorithm), with the
block scales (kbbq_pl.quant.scales) and round to nearest (kbbq_pl.quant.rtn.algorithm) it uses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kbbq_pl import formats as F
from kbbq_pl.quant import scales as S
from kbbq_pl.quant.gptq import algorithm as G
from kbbq_pl.quant.rtn.algorithm import rtn
from kbbq_pl.transforms import fit as T

FORMATS = ["nvfp4", "mxfp4", "mxfp4_no_clip"]


pytestmark = pytest.mark.usefixtures("one_thread")


def correlated_layer(out: int = 32, size: int = 128, n: int = 1024, seed: int = 0):
    """A weight and inputs with correlated, unequal channels (what GPTQ exploits)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, size, generator=g)
    mix = torch.randn(size, size, generator=g) / size**0.5
    x = (torch.randn(n, size, generator=g) * torch.exp(torch.randn(size, generator=g))) @ (
        torch.eye(size) + mix)
    return weight, x, 2.0 * x.T @ x / n


def output_error(weight: torch.Tensor, values: torch.Tensor, x: torch.Tensor) -> float:
    exact = x.double() @ weight.double().T
    return float((x.double() @ (weight.double() - values.double()).T).square().sum()
                 / exact.square().sum())


def same_tensor(a: F.QuantizedTensor, b: F.QuantizedTensor) -> bool:
    def raw(t):
        return t if t.dtype in (torch.float32, torch.uint8) else t.view(torch.uint8)

    globals_equal = (a.global_scale is None and b.global_scale is None) or torch.equal(
        a.global_scale, b.global_scale)
    return (torch.equal(a.qdata, b.qdata) and torch.equal(raw(a.scale), raw(b.scale))
            and globals_equal and a.shape == b.shape)


@pytest.mark.parametrize("fmt", FORMATS + ["e2m1_b16_fp32"])
@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_identity_hessian_is_rtn_bit_for_bit(fmt, mode):
    weight, _, _ = correlated_layer()
    result = G.gptq(weight, torch.eye(weight.shape[1]), fmt, act_order=True,
                    group_scales_mode=mode)
    reference = F.quantize(weight, fmt)
    assert same_tensor(result.weight, reference)
    assert torch.equal(result.values, F.dequantize(reference))
    assert torch.equal(result.perm, torch.arange(weight.shape[1]))  # equal diagonal: stable
    assert same_tensor(rtn(weight, fmt)[0], reference)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_order,mode,search", [
    (False, "static", "minmax"), (True, "static", "mse"), (False, "dynamic", "mse"),
    (True, "dynamic", "minmax")])
def test_codes_and_scales_dequantize_to_the_compensated_weight(fmt, act_order, mode, search):
    weight, _, h = correlated_layer(size=96 if fmt == "nvfp4" else 128)
    result = G.gptq(weight, h, fmt, act_order=act_order, group_scales_mode=mode,
                    scale_search=search, block_size=64 if fmt == "mxfp4" else 32)
    assert not result.fallback and result.damping == 0.01
    assert torch.equal(result.weight.dequantize(torch.float32), result.values)
    assert result.weight.dtype == weight.dtype and result.weight.shape == weight.shape


@pytest.mark.parametrize("fmt", FORMATS)
def test_gptq_reduces_the_layer_output_error_on_correlated_inputs(fmt):
    weight, x, h = correlated_layer()
    rtn = output_error(weight, F.fake_quantize(weight, fmt), x)
    for act_order in (False, True):
        ours = output_error(weight, G.gptq(weight, h, fmt, act_order=act_order).values, x)
        assert ours < 0.6 * rtn, (act_order, ours, rtn)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_refit_variant_dequantizes_exactly_and_beats_rtn_kbbq(fmt):
    weight, x, h = correlated_layer()
    block = F.get_format(fmt).block_size
    result = G.gptq_refit(weight, h, fmt, lam=0.75)
    assert torch.equal(result.weight.dequantize(torch.float32), result.values)
    assert result.transform.shape == (weight.shape[1] // block, block, block)
    effective = T.transform_weight(result.values.double(),
                                   torch.linalg.inv(result.transform))  # Q T
    sigma = G.sigma_blocks_from_hessian(h, block)
    rtn_t = T.fit_transform("kbbq", weight, sigma, block=block, lam=0.75)
    rounded = F.fake_quantize(T.transform_weight(weight, rtn_t), fmt).double()
    rtn_values = T.transform_weight(rounded, torch.linalg.inv(rtn_t))
    assert output_error(weight, effective, x) < output_error(weight, rtn_values, x)


def test_gptq_on_transformed_weight_uses_the_transformed_hessian():
    weight, x, h = correlated_layer()
    for kind in ("hadamard", "haar", "kbbq"):
        t = T.fit_transform(kind, weight, G.sigma_blocks_from_hessian(h, 16), block=16, lam=0.5)
        x_hat = T.transform_inputs(x.double(), t)
        expected = 2.0 * x_hat.T @ x_hat / x.shape[0]
        got = G.transform_hessian(h, t).double()
        assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max())


def test_cholesky_failure_warns_naming_the_layer_and_falls_back_to_rtn():
    weight, _, _ = correlated_layer(size=64)
    for bad in (-torch.eye(64), torch.full((64, 64), float("nan"))):
        message = r"model\.layers\.3\.mlp\.down_proj.*round-to-nearest"
        with pytest.warns(RuntimeWarning, match=message):
            result = G.gptq(weight, bad, "nvfp4", name="model.layers.3.mlp.down_proj")
        assert result.fallback and result.damping != result.damping  # NaN
        assert same_tensor(result.weight, F.quantize(weight, "nvfp4"))
        assert torch.equal(result.values, F.fake_quantize(weight, "nvfp4"))


@pytest.mark.parametrize("chunk", [1, 7 * 48, 1 << 22])
def test_the_hessian_scaled_in_chunks_has_the_bits_of_one_float64_product(monkeypatch, chunk):
    x = torch.randn(300, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    total = x.T @ x
    monkeypatch.setattr(G, "HESSIAN_CHUNK", chunk)
    assert torch.equal(G.hessian(total, 300.0), (total * (2.0 / 300)).to(torch.float32))
    with pytest.raises(ValueError, match="no calibration tokens"):
        G.hessian(total, 0.0)


def test_more_damping_rescues_an_indefinite_hessian():
    weight, _, h = correlated_layer(size=64)
    shift = 0.05 * torch.diagonal(h).mean()
    indefinite = h - shift * torch.eye(64) - (torch.linalg.eigvalsh(h.double())[0].float())
    with pytest.warns(RuntimeWarning, match="attn.q_proj: Hessian not positive definite.*used 0.1"):
        result = G.gptq(weight, indefinite, "mxfp4", name="attn.q_proj")
    assert not result.fallback and result.damping == pytest.approx(0.1)
    assert torch.equal(result.weight.dequantize(torch.float32), result.values)


def test_dead_input_columns_get_zero_weights_and_no_nan():
    weight, x, _ = correlated_layer(size=64)
    x[:, [3, 17, 40, 41]] = 0.0
    h = 2.0 * x.T @ x / x.shape[0]
    for act_order in (False, True):
        result = G.gptq(weight, h, "nvfp4", act_order=act_order)
        assert torch.isfinite(result.values).all() and not result.fallback
        assert (result.values[:, [3, 17, 40, 41]] == 0).all()
        assert output_error(weight, result.values, x) < output_error(
            weight, F.fake_quantize(weight, "nvfp4"), x)
    everything_dead = G.gptq(weight, torch.zeros(64, 64), "nvfp4")
    assert (everything_dead.values == 0).all()


def test_act_order_returns_a_valid_permutation():
    weight, _, h = correlated_layer()
    result = G.gptq(weight, h, "nvfp4", act_order=True)
    perm = result.perm
    assert torch.equal(perm.sort().values, torch.arange(h.shape[0]))
    diag = torch.diagonal(h)[perm]
    assert (diag[:-1] >= diag[1:]).all() and not torch.equal(perm, torch.arange(h.shape[0]))
    assert G.gptq(weight, h, "nvfp4", act_order=False).perm is None


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), fmt=st.sampled_from(FORMATS),
       norm=st.sampled_from([2.0, S.MSE_NORM]), outlier=st.floats(1.0, 50.0))
def test_mse_scale_search_never_increases_the_group_error(seed, fmt, norm, outlier):
    g = torch.Generator().manual_seed(seed)
    block = F.get_format(fmt).block_size
    groups = torch.randn(8, 4, block, generator=g) * torch.exp(torch.randn(8, 4, 1, generator=g))
    groups[..., 0] *= outlier
    global_scale = S.weight_global_scale(groups, F.get_format(fmt))
    minmax = S.group_scales(groups, fmt, global_scale, "minmax")
    mse = S.group_scales(groups, fmt, global_scale, "mse", norm=norm)
    error_minmax = S.group_error(groups, S.round_to_scales(groups, minmax, F.get_format(fmt)), norm)
    error_mse = S.group_error(groups, S.round_to_scales(groups, mse, F.get_format(fmt)), norm)
    assert (error_mse <= error_minmax).all()
    tensor, values = rtn(groups.reshape(8, -1), fmt, search="mse", norm=norm)
    assert torch.equal(tensor.dequantize(torch.float32), values)


def test_bad_inputs_get_errors_naming_the_layer_and_shape():
    weight, _, h = correlated_layer(size=64)
    with pytest.raises(ValueError, match=r"blk\.fc: Hessian shape \(32, 32\) does not match "
                                         r"weight shape \(32, 64\)"):
        G.gptq(weight, h[:32, :32], "nvfp4", name="blk.fc")
    with pytest.raises(ValueError, match=r"blk\.fc: in_features 60 of weight shape \(32, 60\)"):
        G.gptq(weight[:, :60], h[:60, :60], "nvfp4", name="blk.fc")
    with pytest.raises(ValueError, match=r"blk\.fc: GPTQ needs a 2-D weight"):
        G.gptq(weight[None], h, "nvfp4", name="blk.fc")
    with pytest.raises(ValueError, match=r"blk\.fc: GPTQ here quantizes to E2M1 block formats"):
        G.gptq(weight, h, "fp8_e4m3", name="blk.fc")
    with pytest.raises(ValueError, match=r"blk\.fc: block_size 24"):
        G.gptq(weight, h, "nvfp4", block_size=24, name="blk.fc")
    nan_weight = weight.clone()
    nan_weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"blk\.fc: the weight of shape \(32, 64\) holds NaN"):
        G.gptq(nan_weight, h, "nvfp4", name="blk.fc")


def test_column_rounder_is_round_e2m1_bit_for_bit():
    from kbbq_pl.formats.rounding import (
        E2M1_MIDPOINTS,
        e2m1_code_magnitude,
        round_e2m1,
        round_e2m1_counted,
    )

    grid = e2m1_code_magnitude(torch.arange(8))
    points = torch.cat([torch.tensor(E2M1_MIDPOINTS + (7.0, 1e30, 2.0**-149)), grid])
    ulps = torch.arange(-2000, 2001, dtype=torch.int32)
    near = (points.view(torch.int32)[:, None] + ulps).reshape(-1).view(torch.float32).abs()
    values = torch.cat([near, torch.linspace(0, 8, 200_001), torch.rand(100_000) * 10])
    values = values[torch.isfinite(values)]
    assert torch.equal(round_e2m1_counted(values), round_e2m1(values))


def test_column_rounder_codes_are_encode_e2m1s():
    from kbbq_pl.formats.rounding import e2m1_magnitude_code, round_e2m1, round_e2m1_counted

    values = torch.cat([torch.linspace(0, 8, 100_001), torch.rand(10_000) * 10])
    code = torch.empty(values.shape, dtype=torch.uint8)
    round_e2m1_counted(values, code)
    assert torch.equal(code, e2m1_magnitude_code(round_e2m1(values)).to(torch.uint8))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("loop", ["columns", "refit"])
def test_the_loops_codes_are_a_fresh_encode_of_what_they_rounded(fmt, loop, monkeypatch):
    """GPTQ stores the codes its column loop rounded to; encoding the values it rounded from
    again (what assemble did before) gives the same bytes, zero and negative-zero columns
    included."""
    weight, _, h = correlated_layer(out=24)
    weight = weight.clone()
    weight[:, 5] = 0.0
    weight[:, 6] = -0.0
    weight[3, :16] = 0.0  # a whole zero group
    seen = []
    original = S.assemble

    def both(rounded_from, scales, fmt_, dtype, gs=None, *, magnitude_codes=None):
        fresh = original(rounded_from, scales, fmt_, dtype, gs)
        stored = original(rounded_from, scales, fmt_, dtype, gs, magnitude_codes=magnitude_codes)
        seen.append(magnitude_codes is not None and torch.equal(fresh.qdata, stored.qdata))
        return stored

    monkeypatch.setattr(G, "assemble", both)
    if loop == "columns":
        G.gptq(weight, h, fmt, act_order=True)
    else:
        G.gptq_refit(weight, h, fmt, lam=0.75)
    assert seen == [True]


@pytest.mark.parametrize("fmt,act_order,mode", [("nvfp4", True, "static"),
                                                ("mxfp4", False, "dynamic"),
                                                ("nvfp4", True, "dynamic")])
def test_stacked_layers_equal_separate_runs(fmt, act_order, mode):
    weight, _, h = correlated_layer(out=48)
    parts = [weight[:16] * 3.0, weight[16:40], weight[40:] * 0.1]
    stacked = G.gptq_layers(parts, h, fmt, act_order=act_order, group_scales_mode=mode,
                            names=["q", "k", "v"])
    for part, result in zip(parts, stacked):
        alone = G.gptq(part, h, fmt, act_order=act_order, group_scales_mode=mode)
        assert same_tensor(result.weight, alone.weight)
        assert torch.equal(result.values, alone.values)


def test_inverse_hessian_factor_is_the_upper_cholesky_factor_of_the_inverse():
    _, _, h = correlated_layer(size=96)
    upper, used = G.inverse_hessian_factor(h, 0.01)
    damped = h.double() + 0.01 * torch.diagonal(h).double().mean() * torch.eye(96,
                                                                              dtype=torch.float64)
    reference = torch.linalg.cholesky(torch.linalg.inv(damped), upper=True)
    assert used == 0.01 and torch.equal(upper, upper.triu())
    assert torch.allclose(upper.double(), reference, rtol=1e-3, atol=1e-4 * reference.abs().max())


@pytest.mark.parametrize("size", [7, 256, 600])
def test_lower_triangular_inverse_matches_a_triangular_solve(size):
    """By halves past the leaf (600 = 300 + 300, each 150 + 150), one solve below it."""
    generator = torch.Generator().manual_seed(size)
    lower = torch.randn(size, size, generator=generator, dtype=torch.float64).tril()
    lower.diagonal().copy_(1.0 + torch.rand(size, generator=generator, dtype=torch.float64))
    inverse = G.lower_triangular_inverse(lower)
    reference = torch.linalg.solve_triangular(lower, torch.eye(size, dtype=torch.float64),
                                              upper=False)
    assert torch.equal(inverse, inverse.tril())
    assert torch.allclose(inverse, reference, rtol=1e-9, atol=1e-9 * reference.abs().max())


def test_inverse_hessian_factor_from_one_factorization_is_as_accurate_as_three():
    """``J chol(J H J)^-1 J`` against the float64 factor, beside the float32 chain of three
    factorizations it replaced (Cholesky, ``cholesky_inverse``, Cholesky)."""
    _, _, h = correlated_layer(size=512)
    damped = h.double() + 0.01 * torch.diagonal(h).double().mean() * torch.eye(512,
                                                                               dtype=torch.float64)
    reference = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)),
                                      upper=True)
    upper, _ = G.inverse_hessian_factor(h, 0.01)
    three = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped.float())),
                                  upper=True)
    error = float((upper.double() - reference).norm() / reference.norm())
    assert error <= 2 * float((three.double() - reference).norm() / reference.norm())


def test_lazy_batches_match_the_plain_column_recursion():
    """Act-order with dynamic scales: the scales of a group are computed from its columns as
    they are when its first column is reached, pending lazy updates included."""
    weight, _, h = correlated_layer(out=16, size=64)
    fmt = F.get_format("nvfp4")
    result = G.gptq(weight, h, fmt, act_order=True, group_scales_mode="dynamic", block_size=32)
    perm = result.perm
    upper, _ = G.inverse_hessian_factor(h[perm][:, perm], 0.01)
    w = weight.clone()[:, perm]
    gs = S.weight_global_scale(weight, fmt)
    values = torch.empty_like(w)
    scales = {}
    for j in range(64):  # no lazy batching: every update applied at once
        group = int(perm[j]) // 16
        if group not in scales:
            members = [int(k) for k in (perm // 16 == group).nonzero().squeeze(1)]
            scales[group] = S.group_scales(w[:, members], fmt, gs)    # [out, 1] fields
        y = S.round_to_scales(w[:, j:j + 1], scales[group], fmt).squeeze(1)
        values[:, j] = y
        err = (w[:, j] - y) / upper[j, j]
        w[:, j + 1:] -= err[:, None] * upper[j, j + 1:][None, :]
    reference = values[:, torch.argsort(perm)]
    assert (result.values == reference).float().mean() > 0.99
    assert torch.allclose(result.values, reference, atol=1e-2 * weight.abs().max())


@pytest.mark.parametrize("fmt", FORMATS + ["e2m1_b16_fp32"])
def test_mse_search_over_distinct_scales_equals_the_full_grid(fmt):
    fmt = F.get_format(fmt)
    g = torch.Generator().manual_seed(3)
    groups = torch.randn(64, 8, fmt.block_size, generator=g) * torch.exp(
        2 * torch.randn(64, 8, 1, generator=g))
    groups[::3, :, 0] *= 20
    gs = S.weight_global_scale(groups, fmt)
    amax = groups.abs().amax(-1, keepdim=True)
    best = S._scales(amax, fmt, gs)
    best_error = S.group_error(groups, S.round_to_scales(groups, best, fmt))
    for i in range(1, S.MSE_GRID):  # the definition: every shrink factor in turn
        shrink = torch.tensor(1.0 - S.MSE_SHRINK * i / S.MSE_GRID, dtype=torch.float64).float()
        candidate = S._scales(amax * shrink, fmt, gs)
        error = S.group_error(groups, S.round_to_scales(groups, candidate, fmt))
        better = error < best_error
        best = S._select(better, candidate, best)
        best_error = torch.where(better, error, best_error)
    fast = S.group_scales(groups, fmt, gs, "mse")
    raw = (lambda t: t.view(torch.uint8)) if fmt.scale_kind == "e4m3" else (lambda t: t)
    assert torch.equal(raw(fast.code), raw(best.code))
    assert torch.equal(fast.dequant, best.dequant)


def test_refit_bookkeeping_equals_gptq_on_the_transformed_layer(monkeypatch):
    """With every block refit to the same T (here a Hadamard), the in-loop variant is GPTQ on
    W T^-1 with T H T^T (no act-order, scales from each whole group): the QR rotation carries
    the transformed group's errors exactly."""
    weight, _, h = correlated_layer(out=24, size=64)
    blocks = T.hadamard(16).expand(4, 16, 16).clone()

    class Basis:
        def __init__(self, weight, sigma, damping, name=""):
            self.count = sigma.shape[0]

        def transform(self, lam):
            return blocks[: self.count].clone()

    monkeypatch.setattr(G, "kbbq_basis", Basis)
    refit = G.gptq_refit(weight, h, "nvfp4")
    fixed = G.gptq(T.transform_weight(weight, blocks), G.transform_hessian(h, blocks), "nvfp4",
                   act_order=False, group_scales_mode="dynamic")
    assert torch.equal(refit.transform, blocks)
    assert (refit.values == fixed.values).float().mean() > 0.98
    assert torch.allclose(refit.values, fixed.values, atol=0.05 * weight.abs().max())


def test_mse_search_in_row_chunks_equals_one_piece(monkeypatch):
    weight, _, _ = correlated_layer(out=40, size=64)
    fmt = F.get_format("nvfp4")
    rows = torch.linspace(0.01, 1, 40)[:, None, None]  # per-row global scales, as when stacked
    grouped = weight.reshape(40, 4, 16)
    whole = S.group_scales(grouped, fmt, rows, "mse")
    monkeypatch.setattr(S, "_MSE_CHUNK", 4 * 100 * 7)  # 7 rows per chunk
    chunked = S.group_scales(grouped, fmt, rows, "mse")
    assert torch.equal(whole.code.view(torch.uint8), chunked.code.view(torch.uint8))
    assert torch.equal(whole.dequant, chunked.dequant)
