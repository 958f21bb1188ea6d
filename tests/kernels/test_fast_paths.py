"""The decode and prefill paths of kbbq_pl.kernels (issue 45) against the exact product.

Under Triton's interpreter on the CPU (tests/conftest.py), small shapes: the activation values
must be bit for bit the decoded CPU reference codes, every product within one rounding of the
float64 product of the same codes, the split-K reduction deterministic and its counters left
at zero.  The exactness facts the paths rest on (kbbq_pl.kernels.exact) are checked for every
E2M1 code against every scale byte.  The ``gpu`` tests repeat the comparisons on a CUDA device.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from test_kernels import (
    assert_within_one_bf16_rounding,
    block,
    gemm_error,
    make_transform,
    run_compile_check,
    ties_rows,
)
from torch import nn

from kbbq_pl import formats as F
from kbbq_pl import kernels as K
from kbbq_pl.kernels import exact

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E2M1_ALL = torch.cat([E2M1, -E2M1])  # code c: sign in bit 3 (code 8 is -0)


def needs_kernels(device: torch.device = CPU):
    if not K.available(device):
        pytest.skip(f"kbbq_pl.kernels do not run on {device} here")


def bits16(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bits (signed zeros included) where finite, NaN in the same places."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    view = torch.int32 if got.dtype == torch.float32 else torch.int16
    differ = int((got[~nan].contiguous().view(view) != want[~nan].contiguous().view(view)).sum())
    assert differ == 0, f"{differ} of {int((~nan).sum())} values differ from the reference"


# --------------------------------------------------------------------------- exactness


def test_e2m1_half_bits_are_the_values_times_a_power_of_two():
    codes = torch.arange(16)
    for dtype, power in ((torch.float16, -14), (torch.bfloat16, -126)):
        got = exact.e2m1_half_bits(codes, dtype).double()
        want = E2M1_ALL * 2.0**power
        assert torch.equal(got, want), dtype
        assert torch.signbit(got[8]) and not torch.signbit(got[0])  # -0 stays -0


def _e4m3_bytes() -> torch.Tensor:
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    return b[(b.to(torch.int32) & 0x7F) != 0x7F]  # NaN bytes aside


def test_nvfp4_products_are_exact_in_fp16_and_bf16():
    """q * s * 2^-14 (the decode path's fp16 weights), q * s in fp16 (its activations) and
    q * s in bf16 (the prefill path) are exact for every E2M1 value and E4M3 scale byte."""
    s = _e4m3_bytes().view(torch.float8_e4m3fn).double()
    q = E2M1_ALL
    exact_values = q[:, None] * s[None, :]
    for dtype, factor in ((torch.float16, 2.0**-14), (torch.float16, 1.0), (torch.bfloat16, 1.0)):
        wanted = exact_values * factor
        assert torch.equal(wanted.to(dtype).double(), wanted), (dtype, factor)
    # and the decode path's arithmetic gives them: bit pattern times the fp16 scale
    bits = exact.e2m1_half_bits(torch.arange(16), torch.float16)
    scales = exact.e4m3_fp16(_e4m3_bytes())
    product = (bits[:, None] * scales[None, :]).double()  # fp16 multiply, exact
    assert torch.equal(product, exact_values * 2.0**-14)


def test_mx_products_are_exact_in_bf16_where_fp32_is_finite():
    e = torch.arange(255, dtype=torch.float64) - 127  # biased 0..254
    values = E2M1_ALL[:, None] * torch.pow(2.0, e)[None, :]
    finite32 = torch.isfinite(values.to(torch.float32))
    as_bf16 = values.to(torch.bfloat16).double()
    assert torch.equal(as_bf16[finite32], values[finite32])
    for byte in range(255):
        column_finite = bool(finite32[:, byte].all())
        assert exact.bf16_exact_scale("e8m0", byte) == column_finite, byte
    assert exact.bf16_exact_scale("e4m3", 0x7E) and not exact.bf16_exact_scale("e4m3", 0xFF)


def test_mx_decode_multipliers_give_q_times_two_to_e_minus_shift():
    for chosen in (torch.tensor([0, 1, 100, 127, 128], dtype=torch.uint8),
                   torch.tensor([125, 130, 200, 254], dtype=torch.uint8)):
        shift = exact.mx_shift(chosen)
        mult = exact.mx_multiplier_bits(chosen, shift).view(torch.bfloat16)
        bits = exact.e2m1_half_bits(torch.arange(16), torch.bfloat16)
        got = (bits[:, None] * mult[None, :]).double()  # bf16 multiply
        e = chosen.to(torch.float64) - 127 - shift
        want = E2M1_ALL[:, None] * torch.pow(2.0, e)[None, :]
        assert torch.equal(got, want), shift
    assert exact.mx_shift(torch.tensor([0, 128], dtype=torch.uint8)) == 0
    assert exact.mx_shift(torch.tensor([10, 140, 255], dtype=torch.uint8)) == 12
    nan = exact.mx_multiplier_bits(torch.tensor([255], dtype=torch.uint8), 0).view(torch.bfloat16)
    assert torch.isnan(nan).all()
    for span in ([0, 134], [120, 254]):
        with pytest.raises(ValueError, match="no shift keeps"):
            exact.mx_shift(torch.tensor(span, dtype=torch.uint8))
    assert exact.mx_shift(torch.tensor([0, 133], dtype=torch.uint8)) == 5


def test_split_bf16x3_parts_sum_to_the_fp32_operand():
    """Three bf16 parts, each under the one before, sum to any FP32 transform exactly (three
    times bf16's 8 significant bits: FP32's 24); a value whose last part would be under bf16's
    subnormals is refused, with its magnitude named."""
    t = torch.randn(64, 32, 32, generator=torch.Generator().manual_seed(0)) / 5.6
    t[0, 0, :4] = torch.tensor([0.0, -0.0, 1.0 + 2 ** -23, -(2 ** -100)])
    parts = exact.split_bf16x3(t)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, *t.shape)
    assert torch.equal(parts[0].float() + parts[1].float() + parts[2].float(), t)
    assert (parts[1].float().abs() <= parts[0].float().abs() * 2 ** -8).all()
    assert not torch.equal(parts[2], torch.zeros_like(parts[2]))  # all three parts are used
    with pytest.raises(ValueError, match="three bf16 parts"):
        exact.split_bf16x3(torch.tensor([1.0 + 2 ** -23, 2 ** -120 * (1 + 2 ** -23)]))


def test_word_order_is_a_permutation_within_each_chunk():
    k = torch.arange(384)
    index = exact.word_order_index(k)
    assert sorted(index.tolist()) == k.tolist()
    assert torch.equal(index // 128, k // 128)
    # word 0: elements 0 and 4 side by side at 0, 1; 1 and 5 at 32, 33; ...; word 1 after them
    assert index[:9].tolist() == [0, 32, 64, 96, 1, 33, 65, 97, 2]
    values = torch.randn(3, 48)  # a partial last chunk keeps its slots
    ordered = exact.word_order(values)
    assert ordered.shape == (3, 128)
    assert torch.equal(ordered[:, exact.word_order_index(torch.arange(48))], values)


# --------------------------------------------------------------------------- activation values


def reference_values(x, t, fmt, scale=None, dtype=torch.float32, split=False):
    """The values the kernel must write (kbbq_pl.kernels.reference_activation_values), in word
    order if ``split``."""
    values, pts = K.reference_activation_values(x, t, fmt, scale, dtype)
    return (exact.word_order(values) if split else values), pts


@pytest.mark.parametrize("fmt,dtype,split,kind", [
    ("nvfp4", torch.float16, True, "random"),
    ("nvfp4", torch.bfloat16, False, None),
    ("mxfp4", torch.bfloat16, True, "hadamard"),
    ("mxfp4_rceil", torch.float32, False, "random"),
    ("mxfp4_no_clip", torch.bfloat16, False, None),
])
def test_activation_values_are_the_reference_codes_decoded(fmt, dtype, split, kind):
    needs_kernels()
    d = block(fmt)
    k = 3 * d  # NVFP4: a partial group of 32 at the end
    x = (torch.randn(5, k) * 3).to(torch.bfloat16)
    x[1, 2] = float("nan")
    x[3, k - 1] = -float("inf")
    t = make_transform(kind, k, d, seed=4)
    values, pts = K.quantize_activation_values(x, t, fmt, dtype=dtype, word_order=split)
    want, want_pts = reference_values(x, t, fmt, dtype=dtype, split=split)
    assert values.dtype == dtype and values.shape == want.shape
    assert_same_values(values, want)  # in word order, a partial chunk's empty slots zeros
    valid = (exact.word_order(torch.ones(5, k)) if split else torch.ones(5, k)).bool()
    assert torch.isnan(values[1][valid[1]]).any() and not torch.isnan(values[0][valid[0]]).any()
    assert torch.isnan(values[3][valid[3]]).any() and not torch.isinf(values[valid]).any()
    if want_pts is not None:
        assert torch.equal(pts.reshape(1).view(torch.int32), want_pts.reshape(1).view(torch.int32))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp4_even", "mxfp4_rceil"])
def test_activation_values_at_ties_and_extremes(fmt):
    """Every E2M1 rounding boundary, the FP32 numbers next to it, signed zeros and extreme
    block amax (test_kernels' adversarial rows): the values are the reference codes decoded."""
    needs_kernels()
    d = block(fmt)
    scale = 1.0 if fmt == "nvfp4" else None
    ties = ties_rows(d)
    values, _ = K.quantize_activation_values(ties, None, fmt, scale, dtype=torch.float32)
    assert_same_values(values, reference_values(ties, None, fmt, scale)[0])
    k = 2 * d
    rows = torch.stack([torch.zeros(k), torch.full((k,), -0.0), torch.linspace(-3e38, 3e38, k),
                        torch.linspace(-1e-38, 1e-38, k),
                        torch.tensor([1e30] + [1e-30] * (k - 1))])
    for kind in (None, "random"):
        t = make_transform(kind, k, d)
        values, _ = K.quantize_activation_values(rows, t, fmt, dtype=torch.float32)
        assert_same_values(values, reference_values(rows, t, fmt)[0])


def test_static_nvfp4_values_and_argument_errors():
    needs_kernels()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    values, pts = K.quantize_activation_values(x, None, "nvfp4", 0.002, dtype=torch.float16)
    want, _ = reference_values(x, None, "nvfp4", 0.002, torch.float16)
    assert_same_values(values, want)
    assert float(pts) == float(torch.tensor(0.002))
    with pytest.raises(ValueError, match="not exact in fp16"):
        K.quantize_activation_values(x, None, "mxfp4", dtype=torch.float16)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        K.quantize_activation_values(x, None, "nvfp4", dtype=torch.int8)


# --------------------------------------------------------------------------- decode GEMM


def assert_each_row_close(y, ref, tolerance=1e-5):
    """Every output row within ``tolerance`` of the reference relative to that row's own
    size (rows of weights scaled by 2^-20 would vanish in one norm over all of them)."""
    y, ref = y.double(), ref.double()
    size = ref.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    worst = float(((y - ref).abs() / size).max())
    assert worst <= tolerance, f"a row differs by {worst:.3g} of its largest output"


def decode_operands(fmt, m, n, k, seed=0, transform=None, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * scale).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    return x, F.quantize(w, fmt)


def exact_product(x, q, fmt, t=None, scale=None, bias=None):
    codes, scales, pts = K.reference_quantize_activations(x, t, fmt, scale)
    return K.reference_w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, fmt,
                                   bias)


def skinny(x, q, fmt, t=None, scale=None, bias=None, out_dtype=torch.float32, **kwargs):
    from kbbq_pl.kernels import skinny as S

    fmt = F.get_format(fmt)
    kind, _, gain = K._scale_meta(fmt)
    values, pts = K.quantize_activation_values(x, t, fmt, scale, dtype=S.activation_dtype(kind),
                                               word_order=True)
    shift = exact.mx_shift(q.scale) if fmt.scale_kind == "e8m0" else 0
    return S.skinny_matmul(values, x.shape[0], q.qdata, q.scale.view(torch.uint8), pts,
                           q.global_scale, fmt.block_size, kind, gain, shift, bias, out_dtype,
                           **kwargs)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp4_no_clip"])
@pytest.mark.parametrize("m,split", [(1, 1), (3, 3), (16, 2), (40, 1), (40, 3)])
def test_decode_gemm_matches_the_exact_product(fmt, m, split):
    """At 40 rows the interpreter's 16-row tiles make three row tiles (the last one partial),
    each split along K in the 3-split case."""
    needs_kernels()
    n, k = 40, 160 if fmt == "nvfp4" else 192  # N, K not multiples of the tile; 160 = 5 * 32
    x, q = decode_operands(fmt, m, n, k, seed=m)
    bias = torch.randn(n)
    ref = exact_product(x, q, fmt, bias=bias)
    y = skinny(x, q, fmt, bias=bias, split_k=split)
    assert y.shape == (m, n) and gemm_error(y, ref) <= 1e-5
    y16 = skinny(x, q, fmt, bias=bias, out_dtype=torch.bfloat16, split_k=split)
    assert y16.dtype == torch.bfloat16
    assert_within_one_bf16_rounding(y16, ref)


@pytest.mark.parametrize("m,split", [(1, 1), (1, 3), (20, 2)])
def test_decode_gemm_probe_fills_a_row_for_each_program(m, split):
    """``probe`` (the ``probe`` section's diagnostic; compiled for sm_90 it reads the GPU's
    clocks, the compile check below): each program fills its row, the last split of each
    output tile says it summed the splits, the output is unchanged; under the interpreter the
    SM slot names the program's place in the grid and the clocks read 0."""
    needs_kernels()
    from kbbq_pl.kernels import skinny as S

    x, q = decode_operands("nvfp4", m, 40, 384, seed=m)
    columns, rows = -(-40 // 16), -(-m // 16)  # the interpreter's 16 x 16 x 128 tile
    needed = S.programs((40,), 384, m, 4, split, ((16, 16, 128),))
    assert needed == columns * split * rows
    probe = torch.full((needed + 1, S.PROBE_SLOTS), -1, dtype=torch.int64)
    y = skinny(x, q, "nvfp4", split_k=split, probe=probe)
    assert torch.equal(y, skinny(x, q, "nvfp4", split_k=split))
    place = [column + 256 * k + 65536 * row for row in range(rows) for k in range(split)
             for column in range(columns)]
    assert probe[:needed, 5].tolist() == place and (probe[needed] == -1).all()
    summed = probe[:needed, 6].view(rows, split, columns)
    assert (summed.sum(1) == (1 if split > 1 else 0)).all()
    assert (probe[:needed, [0, 1, 2, 3, 4, 7]] == 0).all()
    with pytest.raises(ValueError, match="int64"):
        skinny(x, q, "nvfp4", split_k=split, probe=probe[:needed - 1])
    if m == 1:  # the one-row DP4A product's programs (the interpreter's 1 x 16 x 128 tile)
        tile = S.INTERPRETER_DP4A_CONFIG
        needed = S.programs((40,), 384, 1, 4, split,
                            ((tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]),))
        assert needed == columns * split
        probe = torch.full((needed, S.PROBE_SLOTS), -1, dtype=torch.int64)
        y = dp4a(x, q, "nvfp4", split_k=split, probe=probe)
        assert torch.equal(y, dp4a(x, q, "nvfp4", split_k=split))
        assert probe[:, 5].tolist() == place
        assert (probe[:, 6].view(split, columns).sum(0) == (1 if split > 1 else 0)).all()


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # raw bits: inf, NaN
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_decode_gemm_without_its_decode_reads_codes_and_scales(fmt):
    """``decode=False`` (the ``stream`` section's diagnostic) multiplies the code words' bits,
    each XORed with its block's scale byte, as they are: nothing where both are zero, something
    where either is not (both are read), not the product; the tensor cores only."""
    needs_kernels()
    from types import SimpleNamespace

    x, q = decode_operands(fmt, 2, 32, 512, seed=7)

    def raw(codes, scale_bytes):
        weights = SimpleNamespace(qdata=codes, scale=scale_bytes.view(q.scale.dtype),
                                  global_scale=q.global_scale)
        return skinny(x, weights, fmt, split_k=2, decode=False)

    zeros = torch.zeros_like(q.scale.view(torch.uint8))
    assert (raw(torch.zeros_like(q.qdata), zeros) == 0).all()
    assert (raw(torch.zeros_like(q.qdata), zeros + 1) != 0).any()
    undecoded = raw(q.qdata, zeros)
    assert (undecoded != 0).any() and not torch.equal(undecoded, skinny(x, q, fmt, split_k=2))
    with pytest.raises(ValueError, match="decode=False"):
        dp4a(x[:1], q, fmt, decode=False)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,split", [(1, 1), (3, 2), (16, 4)])
def test_decode_gemm_reads_tile_major_weights_to_the_same_bits(fmt, m, split):
    """Weights in ``tile_major``'s layout (the ``stream`` section's diagnostic: each trip of a
    column tile one run of memory) give the decode GEMM the same products in the same order,
    so the bits of the weights as stored; the tiles in another order do not; it refuses more
    rows than a decode step's, the DP4A product and another tile than the launch's."""
    needs_kernels()
    from types import SimpleNamespace

    from kbbq_pl.kernels import skinny as S

    x, q = decode_operands(fmt, m, 32, 512, seed=m)  # 4 trips of the interpreter's 128
    codes, scales = S.tile_major(q.qdata, q.scale.view(torch.uint8), *S.decode_step_tile())
    tiled = SimpleNamespace(qdata=codes, scale=scales.view(q.scale.dtype),
                            global_scale=q.global_scale)
    as_stored = skinny(x, q, fmt, out_dtype=torch.bfloat16, split_k=split)
    by_tile = skinny(x, tiled, fmt, out_dtype=torch.bfloat16, split_k=split)
    assert torch.equal(by_tile.view(torch.int16), as_stored.view(torch.int16))
    swapped = SimpleNamespace(qdata=codes.flip(1).contiguous(),
                              scale=scales.flip(1).contiguous().view(q.scale.dtype),
                              global_scale=q.global_scale)
    assert not torch.equal(skinny(x, swapped, fmt, out_dtype=torch.bfloat16, split_k=split),
                           as_stored)
    if m == 1:
        with pytest.raises(ValueError, match="tile-major weights"):
            dp4a(x, tiled, fmt, split_k=split)
        x17, _ = decode_operands(fmt, 17, 32, 512, seed=m)
        with pytest.raises(ValueError, match="at most 16 rows"):
            skinny(x17, tiled, fmt, split_k=split)
        with pytest.raises(ValueError, match="in the launch's tile 32 x 128"):
            skinny(x, tiled, fmt, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128,
                                          "PRODUCT": S.PRODUCT_DOT})
        with pytest.raises(ValueError, match="whole 16 x 128 tiles"):
            S.tile_major(q.qdata[:24], q.scale.view(torch.uint8)[:24], 16, 128)


def test_decode_gemm_tiles():
    needs_kernels()
    from kbbq_pl.kernels import skinny as S

    for fmt in ("nvfp4", "mxfp4"):
        x, q = decode_operands(fmt, 1, 24, 256, seed=5)
        ref = exact_product(x, q, fmt)
        wide = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "PRODUCT": S.PRODUCT_DOT}
        assert gemm_error(skinny(x, q, fmt, config=wide), ref) <= 1e-5
        x, q = decode_operands(fmt, 45, 24, 256, seed=6)  # the row tiles of more rows
        ref = exact_product(x, q, fmt)
        tall = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 128, "PRODUCT": S.PRODUCT_DOT}
        assert gemm_error(skinny(x, q, fmt, config=tall, split_k=2), ref) <= 1e-5


def test_decode_gemm_many_row_tiles():
    """150 rows in the interpreter's 16-row tiles: ten row tiles taken in groups of eight (the
    second group partial) down three column tiles, with and without split-K."""
    needs_kernels()
    x, q = decode_operands("nvfp4", 150, 40, 256, seed=11)
    ref = exact_product(x, q, "nvfp4")
    for split in (1, 2):
        assert gemm_error(skinny(x, q, "nvfp4", split_k=split), ref) <= 1e-5


def test_decode_gemm_autotuned_launch_under_the_interpreter():
    """The launch a GPU takes (the autotuner over the tiles pruned for M, its grid, the
    partials sized for every candidate) run by the interpreter, Triton's benchmark stubbed (it
    needs a GPU): 3 rows try only 16-row tiles, 40 rows the 32- and 64-row ones, and every
    output is the exact product."""
    needs_kernels()
    import triton
    from triton.runtime.autotuner import Autotuner

    from kbbq_pl.kernels import skinny as S

    tiles = [triton.Config({"BLOCK_M": rows, "BLOCK_N": 16, "BLOCK_K": 128, "PRODUCT":
                            S.PRODUCT_DOT}, num_warps=4, num_stages=2) for rows in (16, 32, 64)]
    tuned = triton.autotune(configs=tiles, key=S._KEY,
                            prune_configs_by={"early_config_prune": S._prune_configs})(
        triton.heuristics({"EVEN_K": S._even_k})(S._skinny_kernel))
    tried = []

    def bench(self, *args, config, **meta):
        tried.append((args[self.arg_names.index("M")], config.kwargs["BLOCK_M"]))  # (M, tile)
        return [float(config.kwargs["BLOCK_M"])] * 3

    one_sm_per = type("Properties", (), {"multi_processor_count": 4})()
    with mock.patch.object(Autotuner, "_bench", bench), \
            mock.patch.object(S, "_skinny_tuned", tuned), mock.patch.object(S, "_CONFIGS", tiles), \
            mock.patch.object(S, "INTERPRET", False), \
            mock.patch("torch.cuda.get_device_properties", lambda device: one_sm_per):
        S._partial_rows.cache_clear()
        for m in (3, 40):
            x, q = decode_operands("nvfp4", m, 48, 256, seed=m)
            assert gemm_error(skinny(x, q, "nvfp4"), exact_product(x, q, "nvfp4")) <= 1e-5
    S._partial_rows.cache_clear()
    # 3 rows: one candidate (Triton 3.9 does not benchmark it, 3.6 does)
    assert [tile for m, tile in tried if m == 3] in ([], [16])
    assert [tile for m, tile in tried if m == 40] == [32, 64]


@pytest.mark.parametrize("fmt, act_scale, fills", [("nvfp4", 0.01, 0), ("mxfp4", None, 0),
                                                   ("nvfp4", None, 1)])
def test_activation_kernel_fills_nothing_it_does_not_read(fmt, act_scale, fills):
    """A fill is a launch of its own (a node of a CUDA graph) per linear: the activation
    kernel's launcher fills only the amax that dynamic NVFP4 accumulates; the per-tensor scale
    is the kernel's to write (1 only for an empty input, which launches no program)."""
    needs_kernels()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    t = make_transform("random", 64, 16 if fmt == "nvfp4" else 32)
    with mock.patch("torch.zeros", wraps=torch.zeros) as zeros, \
            mock.patch("torch.ones", wraps=torch.ones) as ones:
        _, pts = K.quantize_activation_values(x, t, fmt, act_scale)
    assert zeros.call_count == fills and ones.call_count == 0
    if act_scale is not None:  # written by the kernel, not left as allocated
        assert float(pts) == pytest.approx(act_scale)


def dp4a(x, q, fmt, t=None, scale=None, bias=None, out_dtype=torch.float32, **kwargs):
    """The decode GEMM's one-row DP4A product on ``x``'s rows rounded to int8 ``2q``."""
    from kbbq_pl.kernels import skinny as S

    fmt = F.get_format(fmt)
    kind, _, gain = K._scale_meta(fmt)
    _, a_scales, pts, doubled = K._activation_kernel(x, t, fmt, scale, "test", None,
                                                     values_dtype=torch.int8, codes=False)
    shift = exact.mx_shift(q.scale) if fmt.scale_kind == "e8m0" else 0
    return S.skinny_matmul(doubled, x.shape[0], q.qdata, q.scale.view(torch.uint8), pts,
                           q.global_scale, fmt.block_size, kind, gain, shift, bias, out_dtype,
                           a_scales=a_scales, **kwargs)


@pytest.mark.parametrize("fmt,k,split", [("nvfp4", 256, 1), ("nvfp4", 160, 2),
                                         ("mxfp4", 192, 2), ("mxfp4_no_clip", 256, 1)])
def test_dp4a_product_matches_the_exact_product(fmt, k, split):
    """The one-row integer product (the interpreter runs its PTX's arithmetic in Triton:
    ``test_dp4a_ptx_gives_the_block_sums`` checks the PTX itself), K a multiple of the tile
    or not, split along K or not, with a bias and a transform."""
    needs_kernels()
    n = 40
    t = make_transform("random", k, block(fmt), seed=1)
    x, q = decode_operands(fmt, 1, n, k, seed=k + split)
    bias = torch.randn(n)
    scale = torch.tensor(0.004) if fmt == "nvfp4" and split == 1 else None
    ref = exact_product(x, q, fmt, t, scale, bias)
    y = dp4a(x, q, fmt, t, scale, bias, split_k=split)
    assert y.shape == (1, n) and gemm_error(y, ref) <= 1e-5
    assert_within_one_bf16_rounding(dp4a(x, q, fmt, t, scale, bias, torch.bfloat16,
                                         split_k=split), ref)


def test_dp4a_product_nan_blocks_extremes_and_errors():
    from kbbq_pl.kernels import skinny as S

    needs_kernels()
    x, q = decode_operands("mxfp4", 1, 16, 64, seed=3)
    x[0, 40] = float("nan")
    assert torch.isnan(dp4a(x, q, "mxfp4")).all()
    # every E2M1 code against every activation value, and MX weights that need a shift
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(16, 128, generator=gen) * torch.pow(2.0, torch.randint(-20, 12, (16, 1),
                                                                           generator=gen))
    q = F.quantize(w, "mxfp4")
    codes = set(torch.cat([q.qdata & 15, q.qdata >> 4]).unique().tolist())
    assert exact.mx_shift(q.scale) > 0 and codes >= set(range(1, 8)) | set(range(9, 16))
    x = (torch.randn(1, 128, generator=gen) * 4).to(torch.bfloat16)
    assert_each_row_close(dp4a(x, q, "mxfp4").T, exact_product(x, q, "mxfp4").T)
    x2, q2 = decode_operands("nvfp4", 2, 16, 64)
    values, pts = K.quantize_activation_values(x2, None, "nvfp4", dtype=torch.float16,
                                               word_order=True)
    with pytest.raises(ValueError, match="int8 activations"):
        S.skinny_matmul(values, 2, q2.qdata, q2.scale.view(torch.uint8), pts, q2.global_scale,
                        16, 0, 1.0, 0, None, torch.float32, a_scales=torch.ones(2, 4))
    with pytest.raises(ValueError, match="one row a tile"):
        dp4a(x2, q2, "nvfp4", config={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128,
                                      "PRODUCT": S.PRODUCT_DP4A})
    with pytest.raises(ValueError, match="whole blocks of 32"):
        dp4a(x[:, :64], F.quantize(w[:, :64], "mxfp4"), "mxfp4",
             config={"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 16, "PRODUCT": S.PRODUCT_DP4A})
    with pytest.raises(ValueError, match="come alone"):
        K._activation_kernel(x2, None, F.get_format("nvfp4"), None, "test", None,
                             values_dtype=torch.int8, codes=False, word_order=True)


@pytest.mark.parametrize("fmt,kind", [("nvfp4", "random"), ("mxfp4", "hadamard"),
                                      ("mxfp4_no_clip", None)])
def test_int8_activation_values_are_twice_the_reference_codes(fmt, kind):
    """The DP4A product's operand: ``2q`` of every element bit for bit the reference code's,
    the block scales its values (NaN where a block is not finite, its ``2q`` then 0)."""
    needs_kernels()
    f = F.get_format(fmt)
    d = f.block_size
    k = 3 * d
    x = (torch.randn(5, k) * 3).to(torch.bfloat16)
    x[1, 2] = float("nan")
    t = make_transform(kind, k, d, seed=4)
    _, scales, pts, doubled = K._activation_kernel(x, t, f, None, "test", None,
                                                   values_dtype=torch.int8, codes=False)
    codes, scale_bytes, want_pts = K.reference_quantize_activations(x, t, fmt)
    q = E2M1_ALL.to(torch.float32)[torch.stack([codes & 15, codes >> 4], -1).reshape(5, k).long()]
    want = (2 * q).to(torch.int8)
    bad = torch.zeros(5, k // d, dtype=torch.bool)
    bad[1, 0] = True
    assert doubled.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(doubled.reshape(5, k // d, d)[~bad], want.reshape(5, k // d, d)[~bad])
    assert (doubled.reshape(5, k // d, d)[bad] == 0).all()
    if f.scale_kind == "e4m3":
        want_scales = scale_bytes.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        want_scales = torch.ldexp(torch.ones(scale_bytes.shape),
                                  scale_bytes.to(torch.int32) - 127)
    assert torch.equal(scales[~bad], want_scales[~bad])
    assert torch.isnan(scales[bad]).all()
    if want_pts is not None:
        assert torch.equal(pts.reshape(1), want_pts.reshape(1))


def test_dp4a_ptx_gives_the_block_sums():
    """The PTX of the DP4A product, executed by a small model of the five instructions it
    uses (``prmt`` in its default mode and ``dp4a`` as PTX's ISA defines them), gives the
    exact block sums ``sum 2q_w 2q_a`` on random words covering every code, for NVFP4 (two
    words a block) and MX (four)."""
    import re

    from kbbq_pl.kernels import skinny as S

    def prmt(a, b, c):
        source = (b << 32) | a
        out = 0
        for i in range(4):
            sel = (c >> (4 * i)) & 15
            byte = (source >> (8 * (sel & 7))) & 255
            if sel & 8:
                byte = 255 if byte & 128 else 0
            out |= byte << (8 * i)
        return out

    def signed_bytes(v):
        return [((v >> (8 * i)) & 255) - (256 if (v >> (8 * i)) & 128 else 0) for i in range(4)]

    def run(asm, operands):
        regs = {f"${i + 1}": v & 0xFFFFFFFF for i, v in enumerate(operands)}

        def value(token):
            token = token.strip()
            if token in regs:
                return regs[token]
            return int(token, 0) & 0xFFFFFFFF

        for line in asm.splitlines():
            line = line.strip().rstrip(";")
            if not line or line in "{}" or line.startswith(".reg"):
                continue
            op, args = line.split(None, 1)
            dst, *src = [a.strip() for a in args.split(",")]
            v = [value(a) for a in src]
            if op == "mov.b32":
                r = v[0]
            elif op == "xor.b32":
                r = v[0] ^ v[1]
            elif op == "shr.u32":
                r = v[0] >> v[1]
            elif op == "prmt.b32":
                r = prmt(v[0], v[1], v[2])
            elif op == "dp4a.s32.s32":
                acc = v[2] - (1 << 32) if v[2] & (1 << 31) else v[2]
                r = acc + sum(p * q for p, q in zip(signed_bytes(v[0]), signed_bytes(v[1])))
            elif op == "sub.s32":
                r = v[0] - v[1]
            else:
                raise AssertionError(f"unmodelled PTX: {line}")
            regs[dst] = r & 0xFFFFFFFF
        assert re.search(r"\$0", asm)
        out = regs["$0"]
        return out - (1 << 32) if out & (1 << 31) else out

    doubled = [0, 1, 2, 3, 4, 6, 8, 12]
    gen = torch.Generator().manual_seed(0)
    for words in (2, 4):
        asm = S._dp4a_block_asm(words)
        for trial in range(40):
            codes = torch.randint(0, 16, (words * 8,), generator=gen).tolist()
            if trial == 0:
                codes = (list(range(16)) * 2)[: words * 8]
            acts = torch.randint(-12, 13, (words * 8,), generator=gen).tolist()
            packed = [sum(codes[8 * i + j] << (4 * j) for j in range(8)) for i in range(words)]
            a_words = [sum((acts[4 * i + j] & 255) << (8 * j) for j in range(4))
                       for i in range(2 * words)]
            want = sum((-1 if c & 8 else 1) * doubled[c & 7] * a for c, a in zip(codes, acts))
            got = run(asm, packed + a_words + [S.E2M1_DOUBLED_LOW, int(S.E2M1_DOUBLED_HIGH)])
            assert got == want, (words, codes, acts)


def test_one_row_product_switch_takes_the_linear_through_dp4a():
    """``ONE_ROW_PRODUCT``: a one-row linear through the DP4A product (within one rounding of
    the exact product), more rows through the tensor cores as before."""
    from kbbq_pl.kernels import skinny as S

    needs_kernels()
    fmt, k, n = "nvfp4", 64, 24
    t = make_transform("random", k, 16, seed=2)
    x, q = decode_operands(fmt, 3, n, k, seed=9)
    calls = []
    real = S.skinny_matmul

    def spy(*args, **kwargs):
        calls.append(kwargs.get("a_scales") is not None)
        return real(*args, **kwargs)

    with mock.patch.object(S, "ONE_ROW_PRODUCT", S.PRODUCT_DP4A), \
            mock.patch.object(S, "skinny_matmul", spy):
        for rows in (1, 3):
            y = K.linear_w4a4(x[:rows], q.qdata, q.scale, q.global_scale, fmt, t)
            assert_within_one_bf16_rounding(y, exact_product(x[:rows], q, fmt, t))
    assert calls == [True, False]


def test_decode_gemm_split_k_is_deterministic_and_leaves_counters_at_zero():
    needs_kernels()
    from kbbq_pl.kernels import skinny as S

    for m in (4, 36):  # one row tile; three, each with its own counter
        x, q = decode_operands("nvfp4", m, 48, 512, seed=9)
        first = skinny(x, q, "nvfp4", split_k=4)
        second = skinny(x, q, "nvfp4", split_k=4)
        assert torch.equal(first.view(torch.int32), second.view(torch.int32))
        assert int(S._counter(CPU).abs().sum()) == 0
        whole = skinny(x, q, "nvfp4", split_k=1)
        assert torch.allclose(first, whole, rtol=1e-6, atol=1e-6)


def test_decode_gemm_nan_blocks_and_large_mx_exponents():
    needs_kernels()
    x, q = decode_operands("mxfp4", 2, 16, 64, seed=3)
    x[1, 40] = float("nan")
    y = skinny(x, q, "mxfp4")
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    # weights whose block scales need a shift (2^10 .. 2^-20): still the exact product
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=gen) * torch.pow(2.0, torch.randint(-20, 12, (16, 1),
                                                                          generator=gen))
    q = F.quantize(w, "mxfp4")
    assert exact.mx_shift(q.scale) > 0
    ref = exact_product(x[:1], q, "mxfp4")
    assert_each_row_close(skinny(x[:1], q, "mxfp4").T, ref.T)


def test_split_count_fills_the_gpu():
    from kbbq_pl.kernels.skinny import MAX_SPLITS, m_bucket, split_count

    assert split_count(4096, 4096, 64, 256, 132) == 8  # 64 tiles: 512 programs
    assert split_count(14336, 4096, 64, 256, 132) == 2  # 224 tiles
    assert split_count(4096, 1024, 64, 256, 132) == 2  # splits stay >= 512 deep
    assert split_count(4096, 512, 64, 256, 132) == 1
    assert split_count(1024, 1 << 20, 64, 256, 132) == MAX_SPLITS
    # row tiles count too: 2 x 32 tiles at M = 256
    assert split_count(4096, 8192, 128, 256, 132, m=256, block_m=128) == 8
    assert split_count(8192, 8192, 128, 128, 132, m=1000, block_m=128) == 1  # 512 tiles
    assert [m_bucket(m) for m in (1, 2, 16, 17, 100, 1000, 10**5)] == [
        1, 16, 16, 32, 128, 1024, 8192]


def test_decode_gemm_tiles_follow_the_rows():
    from kbbq_pl.kernels import skinny as S

    def tiles(m):
        return {c.kwargs["BLOCK_M"] for c in S._prune_configs(S._configs(),
                                                                {"m_bucket": S.m_bucket(m)})}

    # the tensor-core product reads the activations a whole word-order chunk per K tile
    assert all(c.kwargs["BLOCK_K"] % S.WORD_ORDER_CHUNK == 0 for c in S._configs())
    assert tiles(1) == tiles(16) == {16}
    assert tiles(17) == tiles(32) == {32}
    assert tiles(64) == {32, 64}
    assert tiles(500) == tiles(4096) == {32, 64, 128}


# --------------------------------------------------------------------------- linear_w4a4 paths


@pytest.mark.parametrize("fmt,static", [("nvfp4", False), ("nvfp4", True), ("mxfp4", False),
                                        ("mxfp4_no_clip", False)])
def test_every_path_is_within_one_rounding_of_the_exact_product(fmt, static):
    needs_kernels()
    d = block(fmt)
    k, n = 4 * d, 24
    t = make_transform("random", k, d, seed=2)
    x, q = decode_operands(fmt, 20, n, k, seed=7)
    x = x[:, : k - 3]  # zero-padded to K
    scale = torch.tensor(0.002) if static else None
    bias = torch.randn(n, dtype=torch.bfloat16)
    padded = nn.functional.pad(x.float(), (0, 3))
    ref = exact_product(padded, q, fmt, t, scale, bias.float())
    ref_few = exact_product(padded[:3], q, fmt, t, scale, bias.float())  # dynamic: 3 rows' amax
    prepared = K.prepare_weight(q.qdata, q.scale, q.global_scale, fmt, scale,
                                keep_decoded=True)
    for path, rows in (("decode", 3), ("decode", 20), ("tiled", 20), ("prefill", 20)):
        products = ("auto", "cublas", "triton") if path == "prefill" else ("auto",)
        for product in products:
            for kept in (None, prepared):
                y = K.linear_w4a4(x[:rows], q.qdata, q.scale, q.global_scale, fmt, t, scale,
                                  bias, path=path, prefill_product=product, prepared=kept)
                assert y.shape == (rows, n) and y.dtype == torch.bfloat16
                assert_within_one_bf16_rounding(y, ref if rows == 20 else ref_few)
    fp32 = K.linear_w4a4(x.float(), q.qdata, q.scale, q.global_scale, fmt, t, scale,
                         bias.float(), path="prefill")
    assert fp32.dtype == torch.float32 and gemm_error(fp32, ref) <= 1e-5


def test_the_prefill_product_takes_the_call_s_scales_whatever_the_weight_was_prepared_with():
    """A prepared weight's host multiplier (cuBLAS's ``alpha``) serves only a call that passes
    the scales it read (the same tensors, unchanged, or the same numbers): a call with another
    activation scale, or after a scale changed in place, is scaled by its own (the product was
    off by their ratio, 0.5 here, on the prefill path only)."""
    needs_kernels()
    x, q = decode_operands("nvfp4", 4, 16, 64)
    act = torch.tensor(0.002)
    prepared = K.prepare_weight(q.qdata, q.scale, q.global_scale, "nvfp4", act)

    def check(scale):
        y = K.linear_w4a4(x, q.qdata, q.scale, q.global_scale, "nvfp4", None, scale,
                          path="prefill", prepared=prepared)
        assert_within_one_bf16_rounding(y, exact_product(x.float(), q, "nvfp4", scale=scale))

    for scale in (act, 0.004, torch.tensor(0.004)):
        check(scale)
    q.global_scale.mul_(2)
    check(act)
    act.mul_(2)
    check(act)
    assert prepared.alpha(static=True, sources=(K.scale_source(q.global_scale),
                                                K.scale_source(act))) is None


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_prefill_path_can_take_its_activations_from_tensor_cores(fmt, monkeypatch):
    """``PREFILL_PRODUCT = PRODUCT_BF16X3`` (opt-in): the prefill path's activation kernel
    multiplies each block's transform split into bf16 parts (split once per transform), and
    where every term is exact (signed permutations) the linear is within one bf16 rounding of
    the exact product; the decode path keeps the chain (no split)."""
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    d = block(fmt)
    k, n = 4 * d, 32
    x, q = decode_operands(fmt, 20, n, k, seed=5)
    t = make_transform("signed_permutation", k, d, seed=6)
    splits = []

    def split(columns):
        splits.append(columns.shape)
        return exact.split_bf16x3(columns)

    monkeypatch.setattr(tk, "split_bf16x3", split)
    monkeypatch.setattr(tk, "PREFILL_PRODUCT", tk.PRODUCT_BF16X3)
    for _ in range(2):
        y = K.linear_w4a4(x, q.qdata, q.scale, q.global_scale, fmt, t, None, path="prefill")
        assert_within_one_bf16_rounding(y, exact_product(x.float(), q, fmt, t))
    assert splits == [(k // d, d, d)]
    K.linear_w4a4(x[:3], q.qdata, q.scale, q.global_scale, fmt, t.clone(), None, path="decode")
    assert len(splits) == 1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_a_wider_bias_is_rounded_once_with_the_sum(fmt):
    """bf16 activations, an FP32 bias (a layer kept in FP32 beside bf16 activations): each
    output is the exact sum rounded once to bf16 on every path and product, except where the
    exact value lies within the FP32 accumulation's error of a rounding boundary."""
    needs_kernels()
    k, n = 4 * block(fmt), 64
    x, q = decode_operands(fmt, 20, n, k, seed=3, scale=0.01)
    bias = 1 + torch.rand(n, generator=torch.Generator().manual_seed(4))  # it sets the ulp
    ref = exact_product(x.float(), q, fmt, bias=bias.double())
    want = ref.to(torch.bfloat16)
    for path, product in (("decode", "auto"), ("tiled", "auto"), ("prefill", "auto"),
                          ("prefill", "cublas"), ("prefill", "triton")):
        y = K.linear_w4a4(x, q.qdata, q.scale, q.global_scale, fmt, None, None, bias,
                          path=path, prefill_product=product)
        boundary = (y.double() + want.double()) / 2
        off = (y != want) & ((ref - boundary).abs() > 1e-6 * ref.abs().max())
        assert y.dtype == torch.bfloat16 and not off.any(), (path, product, int(off.sum()))


def test_paths_by_rows_and_errors():
    needs_kernels()
    assert [K.choose_path(m, "nvfp4") for m in (1, 16, 17, 1023, 1024)] == [
        "decode", "decode", "decode", "decode", "prefill"]
    assert [K.choose_path(m, fmt) for m, fmt in ((255, "mxfp4"), (256, "mxfp4_even"),
                                                 (256, "nvfp4"))] == [
        "decode", "prefill", "decode"]
    x, q = decode_operands("nvfp4", 17, 8, 32)
    with pytest.raises(ValueError, match="path must be one of"):
        K.linear_w4a4(x, q.qdata, q.scale, q.global_scale, "nvfp4", path="fast")
    other = K.prepare_weight(q.qdata[:4], q.scale[:4], q.global_scale, "nvfp4")
    with pytest.raises(ValueError, match="prepared is for other weights"):
        K.linear_w4a4(x[:2], q.qdata, q.scale, q.global_scale, "nvfp4", prepared=other)


def test_host_arithmetic_is_tritons_and_device_scalars_pass_through():
    """The launchers' plain-Python cdiv / next_power_of_2 give Triton's integers, and a scale
    already an FP32 0-d tensor on the device is used as it is (no conversion per call)."""
    pytest.importorskip("triton")
    import triton

    from kbbq_pl.kernels import host

    for a in range(0, 70):
        assert host.next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64):
            assert host.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert host.next_power_of_2(5000) == triton.next_power_of_2(5000) == 8192
    scale = torch.tensor(0.5)
    assert K._device_scalar(scale, scale.device, "s") is scale
    for other in (torch.tensor([0.5]), torch.tensor(0.5, dtype=torch.float64), 0.5):
        converted = K._device_scalar(other, torch.device("cpu"), "s")
        assert converted is not other and converted.dtype == torch.float32
        assert converted.shape == () and float(converted) == 0.5


def test_w4a4_layer_dispatches_by_rows_and_keeps_its_prepared_weight():
    """A W4A4Weight on a kernel device (the CPU under the interpreter, standing in for CUDA)
    takes the decode path for a few rows and the prefill path for many, through one
    prepared weight per codes tensor; the emulation (the CPU's path) is untouched."""
    needs_kernels()
    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.layers import w4a4_weight

    torch.manual_seed(0)
    layer = nn.Linear(64, 24).to(torch.bfloat16)
    t = make_transform("hadamard", 64, 16)
    weight = w4a4_weight(layer, "nvfp4", t, act_scale="dynamic", name="probe")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        emulated = layer(x)
        calls = []
        real = K.linear_w4a4

        def spy(*args, **kwargs):
            calls.append(K.choose_path(args[0].reshape(-1, args[0].shape[-1]).shape[0],
                                       args[4]))
            return real(*args, **kwargs)

        with mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)), \
                mock.patch.dict(K.PREFILL_MIN_M, e4m3=32, e8m0=32), \
                mock.patch.object(K, "linear_w4a4", spy):
            few = layer(x[:2])
            many = layer(x)
            again = layer(x[:2])
    assert calls == ["decode", "prefill", "decode"]
    assert torch.equal(few, again)
    assert len([k for k in w4a4._prepared if k is layer.weight.qdata]) == 1
    bias = layer.bias.detach().float()

    def ref(rows, weight=weight):  # dynamic scales: each call's own amax
        return K.reference_linear_w4a4(rows.float(), weight.qdata, weight.scale,
                                       weight.global_scale, "nvfp4", t, None, bias).double()

    assert_within_one_bf16_rounding(many, ref(x))
    assert_within_one_bf16_rounding(few, ref(x[:2]))
    assert float((emulated.float() - many.float()).abs().max()) <= float(
        ref(x).abs().max()) * 2**-7
    # the prepared weight holds nothing of the codes: the cache lets them go with the layer
    import gc
    import weakref

    codes = weakref.ref(layer.weight.qdata)
    del layer, weight
    gc.collect()
    assert codes() is None


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_fast_paths_match_the_exact_product(fmt):
    device = torch.device("cuda")
    needs_kernels(device)
    d = block(fmt)
    n, k = 2048, 4096
    t = make_transform("random", k, d, seed=3).to(device)
    for m in (1, 16, 100, 1024):
        x, q = decode_operands(fmt, m, n, k, seed=m)
        ref = exact_product(x, q, fmt, t.cpu()).to(device)
        qd = [v.to(device) if v is not None else None for v in (q.qdata, q.scale, q.global_scale)]
        for path, product in ((None, "auto"),) + (((None, "triton"), ("decode", "auto"))
                                                   if m >= 1024 else ()):
            y = K.linear_w4a4(x.to(device), *qd, fmt, t, path=path, prefill_product=product)
            assert_within_one_bf16_rounding(y, ref)
        if m == 1:  # the opt-in one-row DP4A product: its PTX on the device, K a multiple
            # of its tiles and not (masked loads)
            from kbbq_pl.kernels import skinny as S

            with mock.patch.object(S, "ONE_ROW_PRODUCT", S.PRODUCT_DP4A):
                assert_within_one_bf16_rounding(K.linear_w4a4(x.to(device), *qd, fmt, t), ref)
                x2, q2 = decode_operands(fmt, 1, 96, k - 32, seed=5)
                t2 = t[: (k - 32) // d]
                y2 = K.linear_w4a4(x2.to(device), q2.qdata.to(device), q2.scale.to(device),
                                   None if q2.global_scale is None
                                   else q2.global_scale.to(device), fmt, t2)
                assert_within_one_bf16_rounding(y2, exact_product(x2, q2, fmt, t2.cpu())
                                                .to(device))
        values, _ = K.quantize_activation_values(x.to(device), t, fmt, dtype=torch.bfloat16)
        want, _ = reference_values(x, t.cpu(), fmt, dtype=torch.bfloat16)
        mismatch = float((values.cpu().view(torch.int16) != want.view(torch.int16))
                         .float().mean())
        assert mismatch == 0, f"{fmt} M={m}: value mismatch rate {mismatch:.3g}"
    assert math.isfinite(float(y.float().abs().max()))


SM90_COMPILE = """
import sys
sys.path.insert(0, {bench!r})
import triton
from triton.backends.compiler import GPUTarget
import gpu_compile as G
from kbbq_pl.kernels import skinny as S, triton_kernels as tk

target = GPUTarget("cuda", 90, 32)
import re
DECODE_FORMATS = ((16, tk.SCALE_E4M3, S.VALUES_FP16, "*fp16"),
                  (32, tk.SCALE_E8M0, S.VALUES_BF16, "*bf16"))


def count_ops(ops, *names):
    return sum(op.startswith(names) for op in ops)


def decode_tile(d, kind, values, a_type, rows=16, cols=64, depth=256, **extra):
    # the tensor-core decode GEMM compiled as it launches on sm_90 (MX shift 0)
    config = triton.Config({{"BLOCK_M": rows, "BLOCK_N": cols, "BLOCK_K": depth,
                            "PRODUCT": S.PRODUCT_DOT}}, num_warps=4, num_stages=3)
    return G.compile_decode_gemm(target, d, kind, config, **extra)
"""
"""The compile checks' first lines: the bench's compile helpers, the kernels, sm_90, the
decode GEMM's tile."""

DECODE_COMPILE_CHECK = SM90_COMPILE + """
for (d, kind, values, a_type), (rows, cols, depth) in zip(
        DECODE_FORMATS, ((16, 64, 256), (64, 128, 128))):  # a decode step's tile; more rows'
    compiled = decode_tile(d, kind, values, a_type, rows, cols, depth)
    found = G.analyse(compiled, cols * depth / 128)
    assert found["wgmma"] > 0, found
    assert found["stack"] == 0, found
    assert found["ptx_v4"] > 0 and found["ldg128"] > 0, found
    assert float(found["per_element"]) <= 5.0, found
    assert found["div_approx"] == 0 and found["ftz"] == 0, found
    print(d, found["per_element"])
    # the product reads no clock; the probe (a diagnostic) reads them where it stands
    assert not re.search(r"SR_CLOCK|SR_GLOBALTIMER", G.cuobjdump(compiled.asm["cubin"], "-sass"))
probed = G.cuobjdump(decode_tile(*DECODE_FORMATS[0], PROBE=True).asm["cubin"], "-sass")
assert all(register in probed for register in ("SR_GLOBALTIMERLO", "SR_CLOCKLO", "SMID"))
# a decode step's tile, both formats (MX's decode shift 0), one layer or three siblings: the
# decoded weights reach the tensor cores in registers, no shared-memory stores and at most two
# barriers in the loop, 16-byte weight loads; the siblings' loop as long as one layer's
for d, kind, values, a_type in DECODE_FORMATS:
    loops = []
    for groups in (1, 3):
        compiled = decode_tile(d, kind, values, a_type, GROUPS=groups)
        found = G.analyse(compiled, 64 * 256 / 128)
        loop = G.main_loop(G.sass_ops(compiled.asm["cubin"]))
        stores = sum(op.startswith("STS") for op in loop)
        barriers = sum(op.startswith("BAR") for op in loop)
        assert stores == 0 and barriers <= 2, (d, groups, stores, barriers)
        assert found["stack"] == 0 and found["ldg128"] > 0, found
        loops.append(len(loop))
    assert loops[1] <= loops[0] + 16, (d, loops)
    # the same tile reading tile_major's layout (the stream section's diagnostic): the same loop
    # but its addresses, no spills, 16-byte loads
    compiled = decode_tile(d, kind, values, a_type, TILED=True)
    found = G.analyse(compiled, 64 * 256 / 128)
    loop = G.main_loop(G.sass_ops(compiled.asm["cubin"]))
    assert found["stack"] == 0 and found["ldg128"] > 0 and found["wgmma"] > 0, found
    assert not any(op.startswith("STS") for op in loop), loop
    assert abs(len(loop) - loops[0]) <= 8, (d, len(loop), loops)
    # and without its decode (decode=False): the same loads and products, no decode
    raw = G.main_loop(G.sass_ops(decode_tile(d, kind, values, a_type, RAW=True).asm["cubin"]))
    assert count_ops(raw, "HMUL2") == 0 and len(raw) < 0.6 * loops[0], (d, len(raw), loops)
    assert count_ops(raw, "HGMMA") == count_ops(loop, "HGMMA") > 0, raw
    assert count_ops(raw, "LDGSTS") == count_ops(loop, "LDGSTS") > 0, raw
# the activation kernel's decode-step tile, for three siblings in one launch: no spills, as
# long as one layer's but the pointers
constants = dict(D=16, SCALE_KIND=tk.SCALE_E4M3, ROUNDING=0, GAIN=1.0, HAS_T=True, STATIC=True,
                 AMAX_ONLY=False, PRODUCT=tk.PRODUCT_FMA_CHAIN, WRITE_CODES=False,
                 WRITE_VALUES=True, WORD_ORDER=True, PARTS_FIRST=tk.PARTS_FIRST,
                 **tk.FEW_ROWS_TILES[16])
warps = constants.pop("num_warps")
compiled = G.compile_kernel(tk._quantize_activations_kernel,
                            dict(G.ACT_SIGNATURE, values_ptr="*fp16"), constants, target,
                            num_warps=warps, enable_fp_fusion=True)
sass = len(G.sass_ops(compiled.asm["cubin"]))
compiled = G.compile_kernel(tk._quantize_activations_kernel,
                            dict(G.ACT_SIGNATURE, values_ptr="*fp16"), dict(constants, GROUPS=3),
                            target, num_warps=warps, enable_fp_fusion=True)
assert G.analyse(compiled, 16)["stack"] == 0
assert len(G.sass_ops(compiled.asm["cubin"])) <= sass + 32, sass
# --tune compiles the tiles bench/gpu.py's tune section times, both products
import gpu
tiles = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps,
          c.num_stages, c.kwargs["PRODUCT"]) for c in G.tune_configs()]
assert tiles == ([t + (S.PRODUCT_DOT,) for t in gpu.TUNE_TILES]
                 + [t + (S.PRODUCT_DP4A,) for t in gpu.TUNE_DP4A_TILES]), tiles
print("ok")
"""


def test_decode_gemm_compiles_for_hopper_without_a_gpu():
    """The decode GEMM compiled for sm_90 (its PTX multiply included), at a decode step's tile
    (NVFP4) and at a 64-row tile (MXFP4): Hopper's wgmma, 16-byte loads of the codes, no
    spills, at most 5 SASS per weight in its loop (3.3 to 4.9 seen with Triton 3.6 and 3.9),
    every division correctly rounded; at a decode step's tile
    the decoded weights of both formats reach the tensor cores in registers (with a runtime
    MX shift in the loop, Triton 3.6 staged them through shared memory: 16 stores and 9
    barriers a step instead of 0 and 2; 3.9 did not, so only 3.6 tells).  The shipped kernel
    reads no clock; with the diagnostic probe it reads the global timer, the SM clock and the
    SM's number.  Reading ``tile_major``'s layout its loop is the same but for its addresses;
    without its decode (a diagnostic) it keeps its loads and products."""
    run_compile_check(DECODE_COMPILE_CHECK)


DP4A_COMPILE_CHECK = SM90_COMPILE + """
# the one-row DP4A product: byte permutes and integer dot products, 16-byte loads, no spills
# (alone and as three siblings in one launch)
for d, kind in ((16, tk.SCALE_E4M3), (32, tk.SCALE_E8M0)):
    for config, groups in [(c, g) for c in S._DP4A_CONFIGS for g in (1, 3)]:
        constants = dict(D=d, SCALE_KIND=kind, GAIN2=1.0, HAS_GLOBAL=kind == tk.SCALE_E4M3,
                         HAS_BIAS=True, VALUES=S.VALUES_FP32, EXPLICIT_BF16=False, EVEN_K=True,
                         SHIFTED=False, GROUPS=groups, **config.kwargs)
        compiled = G.compile_kernel(S._skinny_kernel, dict(G.SKINNY_SIGNATURE, a_ptr="*i8"),
                                    constants, target, num_warps=config.num_warps,
                                    num_stages=config.num_stages, enable_fp_fusion=True)
        per_thread = config.kwargs["BLOCK_N"] * config.kwargs["BLOCK_K"] / (32 * config.num_warps)
        found = G.analyse(compiled, per_thread)
        loop = G.main_loop(G.sass_ops(compiled.asm["cubin"]))
        assert loop.count("IDP.4A.S8.S8") == per_thread // 2 and "PRMT" in loop, found
        assert found["stack"] == 0 and found["ldg128"] > 0, found
        assert float(found["per_element"]) <= 3.2, found
        print(d, "dp4a", groups, found["per_element"])
# the activation kernel's int8 output (2q, FP32 block scales: the product's operand), MX's
# one-row tile
constants = dict(D=32, SCALE_KIND=tk.SCALE_E8M0, ROUNDING=0, GAIN=1.0, HAS_T=True,
                 STATIC=False, AMAX_ONLY=False, PRODUCT=tk.PRODUCT_FMA_CHAIN,
                 WRITE_CODES=False, WRITE_VALUES=True, WORD_ORDER=False,
                 PARTS_FIRST=tk.PARTS_FIRST, **tk.FEW_ROWS_TILES[32])
warps = constants.pop("num_warps")
compiled = G.compile_kernel(tk._quantize_activations_kernel,
                            dict(G.ACT_SIGNATURE, values_ptr="*i8", scales_ptr="*fp32"),
                            constants, target, num_warps=warps, enable_fp_fusion=True)
assert G.analyse(compiled, 32)["stack"] == 0
print("ok")
"""


@pytest.mark.slow  # an opt-in product (ONE_ROW_PRODUCT), half of the decode GEMM's compile
# checks' time; scripts/gpu_session.sh image-check runs it before a GPU session
def test_dp4a_product_compiles_for_hopper_without_a_gpu():
    """The one-row DP4A product's tiles compiled for sm_90: two ``dp4a`` (``IDP.4A``) per four
    weights in the loop, byte permutes, 16-byte loads, no spills, at most 3.2 SASS per weight
    (2.1 to 3.0 seen with Triton 3.6), alone and for three sibling layers; the activation
    kernel's int8 output beside it, without spills."""
    run_compile_check(DP4A_COMPILE_CHECK)
