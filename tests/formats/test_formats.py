"""Number formats: bit-exact against torchao, ties, properties, bad input, containers."""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kbbq_pl import formats as F
from kbbq_pl._compat import quiet_loggers
from kbbq_pl.formats.rounding import NVFP4_MIN_GLOBAL_SCALE

with quiet_loggers("torchao", "torch.utils._pytree"):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
MX_MODES = {
    "mxfp4": ScaleCalculationMode.FLOOR,
    "mxfp4_ceil": ScaleCalculationMode.CEIL,
    "mxfp4_even": ScaleCalculationMode.EVEN,
    "mxfp4_rceil": ScaleCalculationMode.RCEIL,
}
ALL_FORMATS = [
    "nvfp4", "mxfp4", "mxfp4_ceil", "mxfp4_even", "mxfp4_rceil", "mxfp4_no_clip",
    "fp8_e4m3", "fp8_e4m3_row", "int4", "int8", "int8_row", "e2m1_b64_fp32", "e2m1_b8_e4m3",
    "e2m1_b16_e8m0",
]


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes, so that equality is bit equality (NaN == NaN, -0 != 0)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def adversarial_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    rand = torch.randn(64, 128, generator=g)
    outlier = rand.clone()
    outlier[3, 17] = 1.0e4
    mixed = rand.clone()
    mixed[:8] *= 1e-6  # blocks far below the tensor amax: E4M3 block scales hit their floor
    # exact ties for NVFP4: tensor amax 2688 * 2^-4 makes the per-tensor scale 2^-4, block
    # amax 6 * 2^-4 * 2^m makes every block scale 2^m, so grid midpoints stay exact
    nv_ties = torch.zeros(8, 32)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for row in range(8):
        m = row - 3
        block_scale = 2.0**-4 * 2.0**m
        nv_ties[row, :7] = mids * block_scale
        nv_ties[row, 7:14] = -mids * block_scale
        nv_ties[row, 15] = 6.0 * block_scale
        nv_ties[row, 16:23] = mids * block_scale / 2
        nv_ties[row, 31] = 6.0 * block_scale
    nv_ties[0, 0] = 2688 * 2.0**-4
    # exact ties for MX: block amax 6 * 2^k gives the floor exponent k, midpoints exact
    mx_ties = torch.zeros(8, 32)
    for row in range(8):
        k = row - 4
        mx_ties[row, :7] = mids * 2.0**k
        mx_ties[row, 7:14] = -mids * 2.0**k
        mx_ties[row, 31] = 6.0 * 2.0**k
    return {
        "randn": rand,
        "tiny": rand * 1e-30,
        "huge": rand * 1e30,
        "zeros": torch.zeros(4, 64),
        "zero_blocks": torch.cat([rand[:, :64], torch.zeros(64, 64)], dim=1),
        "outlier": outlier,
        "subnormal_scales": mixed,
        "nvfp4_ties": nv_ties,
        "mx_ties": mx_ties,
        "heavy_tail": torch.distributions.StudentT(2.0).sample((32, 64)),
        "negative_zero": -torch.zeros(2, 32),
    }


ADVERSARIAL = adversarial_tensors()


def torchao_nvfp4(x: torch.Tensor) -> NVFP4Tensor:
    scale = per_tensor_amax_to_scale(x.abs().amax())
    return NVFP4Tensor.to_nvfp4(x.contiguous(), per_tensor_scale=scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(set(ADVERSARIAL) - {"zeros", "negative_zero"}))
def test_nvfp4_matches_torchao_bit_for_bit(case, dtype):
    x = ADVERSARIAL[case].to(dtype)
    ref = torchao_nvfp4(x)
    q = F.quantize(x, "nvfp4")
    assert torch.equal(q.qdata, ref.qdata), "packed codes differ from torchao"
    assert torch.equal(bits(q.scale), bits(ref.scale)), "E4M3 block scales differ"
    assert torch.equal(bits(q.global_scale), bits(ref.per_tensor_scale))
    assert torch.equal(bits(q.dequantize()), bits(ref.dequantize(dtype)))
    assert torch.equal(bits(F.fake_quantize(x, "nvfp4")), bits(ref.dequantize(dtype)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MX_MODES))
@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
def test_mxfp4_matches_torchao_bit_for_bit(case, name, dtype):
    x = ADVERSARIAL[case].to(dtype)
    ref = MXTensor.to_mx(x.contiguous(), torch.float4_e2m1fn_x2, 32, scaling_mode=MX_MODES[name])
    q = F.quantize(x, name)
    assert torch.equal(q.qdata, ref.qdata), "packed codes differ from torchao"
    assert torch.equal(bits(q.scale), bits(ref.scale)), "E8M0 scales differ"
    assert torch.equal(bits(q.dequantize()), bits(ref.dequantize(dtype)))
    assert torch.equal(bits(F.fake_quantize(x, name)), bits(ref.dequantize(dtype)))


def test_nvfp4_all_zero_tensor_gives_zeros_where_torchao_gives_nan():
    x = torch.zeros(4, 32)
    assert torch.isnan(torchao_nvfp4(x).dequantize(torch.float32)).all()
    assert torch.equal(F.fake_quantize(x, "nvfp4"), x)
    assert torch.equal(F.quantize(x, "nvfp4").dequantize(), x)


def test_mx_below_e8m0_floor_is_self_consistent():
    # amax 2^-128: the shared exponent clamps to 2^-127; torchao quantizes with 2^-126 there
    # (0.25, a tie that rounds to 0) but dequantizes with 2^-127; we use 2^-127 both ways and
    # keep the value (0.5 on the grid)
    x = torch.full((1, 32), 2.0**-128)
    q = F.quantize(x, "mxfp4")
    assert int(q.scale.view(torch.uint8)) == 0
    assert torch.equal(q.dequantize(), F.fake_quantize(x, "mxfp4"))
    assert torch.equal(q.dequantize(), x)
    ref = MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32, scaling_mode=ScaleCalculationMode.FLOOR)
    assert torch.equal(ref.dequantize(torch.float32), torch.zeros_like(x))


def test_nvfp4_tensor_below_representable_range_quantizes_to_zeros():
    x = torch.full((2, 16), 1e-36)
    out = F.fake_quantize(x, "nvfp4")
    assert torch.equal(out, torch.zeros_like(x))
    assert torch.isfinite(F.quantize(x, "nvfp4").dequantize()).all()


def test_nvfp4_at_the_smallest_usable_global_scale_stays_finite():
    # the smallest block scale (2^-6) under the smallest per-tensor scale: the reciprocal
    # (1 / pts) / 2^-6 must stay finite, or a zero element times it is NaN
    least = torch.tensor(NVFP4_MIN_GLOBAL_SCALE)
    x = torch.zeros(2, 32)
    x[0, :16] = 6 * 448 * NVFP4_MIN_GLOBAL_SCALE
    out = F.fake_quantize(x, "nvfp4", global_scale=least)
    assert torch.equal(out, x)
    assert torch.equal(F.quantize(x, "nvfp4", global_scale=least).dequantize(), x)


def test_nvfp4_static_global_scale_saturates_like_torchao():
    x = ADVERSARIAL["randn"]
    scale = torch.tensor(0.5 / 2688)  # calibrated for amax 0.5: most blocks saturate
    ref = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale)
    q = F.quantize(x, "nvfp4", global_scale=scale)
    assert torch.equal(q.qdata, ref.qdata)
    assert torch.equal(bits(q.scale), bits(ref.scale))
    assert torch.equal(q.dequantize(), ref.dequantize(torch.float32))
    assert F.fake_quantize(x, "nvfp4", global_scale=scale).abs().max() <= 0.5 * 448 / 448 + 1e-6


def test_e2m1_ties_round_to_even_codes():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])  # the even (code) neighbour
    assert torch.equal(F.round_e2m1(mids), expected)
    # the same ties through a whole format, with exact power-of-two scales
    x = torch.zeros(1, 32)
    x[0, :7] = mids
    x[0, 7:14] = -mids
    x[0, 31] = 6.0
    out = F.fake_quantize(x, "mxfp4")
    assert torch.equal(out[0, :7], expected)
    assert torch.equal(out[0, 7:14], -expected)


def test_fp8_and_int_ties_round_to_even():
    # per-tensor E4M3 with amax 448: scale 1, so values are rounded as they stand
    x = torch.tensor([[448.0, 1.0625, 1.1875, 17.0, 19.0, -1.0625]])
    out = F.fake_quantize(x, "fp8_e4m3")
    assert out.tolist() == [[448.0, 1.0, 1.25, 16.0, 20.0, -1.0]]
    # int8 per row with amax 127: scale 1
    y = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5]])
    assert F.fake_quantize(y, "int8_row").tolist() == [[127.0, 0.0, 2.0, 2.0, -0.0, -2.0]]


def test_grid_tables_and_packing_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = F.pack_nibbles(codes.reshape(2, 8))
    assert packed.shape == (2, 4)
    assert int(packed[0, 0]) == 0x10  # element 0 in the low nibble, element 1 in the high
    assert torch.equal(F.unpack_nibbles(packed), codes.reshape(2, 8))
    from kbbq_pl.formats.rounding import e2m1_code_magnitude, e2m1_magnitude_code

    assert torch.equal(e2m1_code_magnitude(torch.arange(8)), E2M1_GRID)
    assert torch.equal(e2m1_magnitude_code(E2M1_GRID), torch.arange(8, dtype=torch.float32))


def test_e2m1_encode_search_is_the_arithmetic_bit_for_bit():
    """Encoding by binary search over the code boundaries gives the code of rounding first and
    mapping the rounded magnitude (the compiled path), ties and both zeros included."""
    from kbbq_pl.formats.rounding import (
        E2M1_MIDPOINTS,
        e2m1_magnitude_code,
        encode_e2m1,
        round_e2m1,
    )

    points = torch.cat([torch.tensor(E2M1_MIDPOINTS + (7.0, 1e30, 2.0**-149)), E2M1_GRID])
    ulps = torch.arange(-300, 301, dtype=torch.int32)
    near = (points.view(torch.int32)[:, None] + ulps).reshape(-1).view(torch.float32).abs()
    y = torch.cat([near, -near, torch.linspace(-8, 8, 100_001), torch.tensor([0.0, -0.0])])
    y = y[torch.isfinite(y)]
    arithmetic = (e2m1_magnitude_code(round_e2m1(y.abs())).to(torch.uint8)
                  | (torch.signbit(y).to(torch.uint8) << 3))
    assert torch.equal(encode_e2m1(y), arithmetic)
    # the CPU's comparisons give torch.bucketize's index, which the GPU path takes, NaN and
    # Inf included (code 7, with their sign)
    from kbbq_pl.formats.rounding import e2m1_code_bounds

    y = torch.cat([y, torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])])
    search = (torch.bucketize(y.abs(), e2m1_code_bounds(), out_int32=True).to(torch.uint8)
              | (torch.signbit(y).to(torch.uint8) << 3))
    assert torch.equal(encode_e2m1(y), search)
    # the rounding by counted codes (eager CPU) is the arithmetic's, Inf and huge included
    from kbbq_pl.formats.rounding import round_e2m1_fast

    magnitudes = y.abs()[~torch.isnan(y)]
    assert torch.equal(round_e2m1_fast(magnitudes), round_e2m1(magnitudes))


def test_e2m1_decode_table_is_the_arithmetic_bit_for_bit():
    """Decoding by table lookup gives both codes of every byte their sign and magnitude (code 8
    is -0) exactly as sign times :func:`e2m1_code_magnitude` times the group's multiplier."""
    from kbbq_pl.formats.rounding import e2m1_code_magnitude, e2m1_decode_groups

    packed = torch.arange(256, dtype=torch.uint8).reshape(32, 8)  # every byte, 16 codes a group
    multiplier = torch.tensor([1.0, 0.375, 2.0**-9, 448.0 * 6]).repeat(8)
    values = e2m1_decode_groups(packed, multiplier, no_clip=False, out_dtype=torch.float32)
    codes = F.unpack_nibbles(packed)
    magnitude = e2m1_code_magnitude(codes & 0x7)
    expected = torch.where((codes & 0x8) > 0, -magnitude, magnitude) * multiplier[:, None]
    assert torch.equal(values.view(torch.int32), expected.view(torch.int32))
    assert torch.signbit(values[codes == 8]).all() and (values[codes == 8] == 0).all()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_all_finite_sees_any_nonfinite_value(value):
    from kbbq_pl.formats.rounding import all_finite

    x = torch.randn(64, 48)
    assert all_finite(x) and all_finite(x[:0]) and all_finite(x.double())
    x[17, 5] = value
    assert not all_finite(x) and not all_finite(x.bfloat16())


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_all_zero_blocks_give_zeros(name):
    x = ADVERSARIAL["zero_blocks"]
    fmt = F.get_format(name)
    out = F.fake_quantize(x, fmt)
    assert torch.isfinite(out).all()
    if fmt.granularity == "block":
        assert torch.equal(out[:, 64:], torch.zeros(64, 64))
    assert torch.equal(F.fake_quantize(torch.zeros(3, 64), fmt), torch.zeros(3, 64))


@pytest.mark.parametrize("name", ALL_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_dequantize_equals_fake_quantize_and_keeps_dtype(name, dtype):
    x = (ADVERSARIAL["heavy_tail"] * 0.1).to(dtype)
    q = F.quantize(x, name)
    fake = F.fake_quantize(x, name)
    assert fake.dtype == dtype and q.dtype == dtype and q.shape == x.shape
    assert torch.equal(bits(q.dequantize()), bits(fake))
    assert F.fake_quantize(x, name, dtype=torch.float32).dtype == torch.float32


COMPILED_BY_DEFAULT = {"nvfp4", "mxfp4", "mxfp4_no_clip", "mxfp4_rceil", "fp8_e4m3", "int4"}
"""The formats whose compiled kernels the default run checks: W4A4's, and one of each other
kernel branch (a scale's rounding, FP8, integers); the rest (10 s each) only with
``KBBQ_PL_SLOW=1``."""


@pytest.mark.parametrize("name", [
    name if name in COMPILED_BY_DEFAULT else pytest.param(name, marks=pytest.mark.slow)
    for name in ALL_FORMATS])
def test_compiled_kernels_match_eager_bit_for_bit(name):
    if not F.dispatch._backend_available("cpu"):
        pytest.skip("no C++ compiler for torch.compile on this machine")
    cases = ("randn", "outlier", "subnormal_scales", "nvfp4_ties", "mx_ties", "tiny", "huge")
    xs = [ADVERSARIAL[c].repeat(1, 128 // ADVERSARIAL[c].shape[-1]) for c in cases]
    xs += [ADVERSARIAL["heavy_tail"].bfloat16(), ADVERSARIAL["heavy_tail"].half()]
    eager = [(F.fake_quantize(x, name), F.quantize(x, name)) for x in xs]
    # the compiled decode is one kernel for every block format: checked on those W4A4 uses
    decodes = name in ("nvfp4", "mxfp4", "mxfp4_no_clip")
    decoded = [F.dequantize(q) for _, q in eager] if decodes else []
    F.set_compile(True)
    try:
        compiled = [(F.fake_quantize(x, name), F.quantize(x, name)) for x in xs]
        decoded_compiled = [F.dequantize(q) for _, q in eager] if decodes else []
    finally:
        F.set_compile("0")
    assert not F.dispatch._broken, "torch.compile failed and fell back to eager"
    for values, values_compiled in zip(decoded, decoded_compiled):
        assert torch.equal(bits(values), bits(values_compiled))
    for (fe, qe), (fc, qc) in zip(eager, compiled):
        assert torch.equal(bits(fe), bits(fc))
        assert torch.equal(bits(qe.qdata), bits(qc.qdata))
        assert torch.equal(bits(qe.scale), bits(qc.scale))


def test_auto_compiles_a_kernel_once_its_eager_calls_have_taken_compile_after_s(monkeypatch):
    """``auto`` on the CPU: each kernel (one set of static options) runs eagerly until its calls
    have taken ``COMPILE_AFTER_S`` in the process, then compiled; ``1`` compiles at once, ``0``
    never; the values are the same throughout.  The clock and ``torch.compile`` are stand-ins
    (each eager call takes 0.5 s; the compiled kernel is the Python one): this checks the rule,
    the bits of real compiled kernels are checked above."""
    seconds = iter(0.5 * i for i in range(1000))
    compiled = []

    def compile_stand_in(fn, **options):
        compiled.append(fn.__name__)
        return fn

    monkeypatch.setattr(F.dispatch, "perf_counter", lambda: next(seconds))
    monkeypatch.setattr(F.dispatch, "_cache", {})
    monkeypatch.setattr(F.dispatch, "_eager_s", {})
    monkeypatch.setattr(F.dispatch, "_backend_available", lambda device_type: True)
    monkeypatch.setattr(F.dispatch.torch, "compile", compile_stand_in)
    monkeypatch.setattr(F.dispatch, "COMPILE_AFTER_S", 2.0)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    expected = F.fake_quantize(x, "nvfp4")
    F.set_compile("auto")
    try:
        values, compiled_after = [], []
        for _ in range(6):
            values.append(F.fake_quantize(x, "nvfp4"))
            compiled_after.append(len(compiled))
        fake_compiled = list(compiled)
        F.quantize(x, "nvfp4")  # another kernel: its own account, still eager
        codes_compiled = list(compiled)
        F.set_compile(True)
        F.quantize(x, "mxfp4")  # "1": compiled at its first call
        always = list(compiled)
        F.set_compile("0")
        F.quantize(x, "nvfp4", global_scale=1.0)
    finally:
        F.set_compile("0")
    assert compiled_after == [0, 0, 0, 0, 1, 1]  # four calls of 0.5 s, compiled at the fifth
    assert fake_compiled == codes_compiled
    assert len(always) == 2 and compiled == always
    for v in values:
        assert torch.equal(bits(v), bits(expected))


def test_compiled_decode_does_not_recompile_per_shape():
    """Weights of many shapes decoded with compiled kernels (GPTQ's column blocks, a model's
    layers): the per-block scales follow the number of blocks, so one graph serves them all.
    Were the scales' size static, each new shape would recompile until dynamo's limit (8) sent
    every kernel of the process back to eager (slower evaluation from then on)."""
    if not F.dispatch._backend_available("cpu"):
        pytest.skip("no C++ compiler for torch.compile on this machine")
    torch.manual_seed(0)
    qs = [F.quantize(torch.randn(rows, 64), "nvfp4") for rows in range(24, 24 + 8 * 11, 8)]
    eager = [F.dequantize(q) for q in qs]
    torch._dynamo.utils.counters.clear()
    F.set_compile(True)
    try:
        compiled = [F.dequantize(q) for q in qs]
    finally:
        F.set_compile("0")
    assert not F.dispatch._broken, "torch.compile hit its recompile limit and fell back to eager"
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2, dict(
        torch._dynamo.utils.counters["stats"])
    for values, values_compiled in zip(eager, compiled):
        assert torch.equal(bits(values), bits(values_compiled))


# ---------------------------------------------------------------- properties (hypothesis)

finite_floats = st.floats(
    min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32
)
blocks = st.lists(finite_floats, min_size=32, max_size=32 * 4).filter(lambda v: len(v) % 32 == 0)
PROPERTY_FORMATS = ["nvfp4", "mxfp4", "mxfp4_even", "mxfp4_no_clip", "fp8_e4m3", "int4"]


def local_half_step(y: torch.Tensor) -> torch.Tensor:
    """Half the E2M1 grid spacing around the scaled magnitude ``y``."""
    a = y.abs()
    return torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))


@settings(max_examples=60, deadline=None)
@given(values=blocks, name=st.sampled_from(PROPERTY_FORMATS))
def test_sign_symmetry(values, name):
    x = torch.tensor(values).reshape(-1, 32)
    assert torch.equal(F.fake_quantize(-x, name), -F.fake_quantize(x, name))


@settings(max_examples=60, deadline=None)
@given(values=blocks, name=st.sampled_from(sorted(set(PROPERTY_FORMATS) - {"mxfp4_no_clip"})))
def test_requantizing_keeps_codes(values, name):
    # (mxfp4_no_clip is not idempotent by design: its grid top 6 * 2^(e-2) / 0.75 = 2^(e+1)
    # lies in the next binade, so a second pass picks a larger exponent)
    x = torch.tensor(values).reshape(-1, 32)
    q = F.quantize(x, name)
    again = F.quantize(q.dequantize(), name)
    assert torch.equal(again.qdata, q.qdata)
    assert torch.equal(bits(again.scale), bits(q.scale))
    fq = F.fake_quantize(x, name)
    if name.startswith("mxfp4"):  # power-of-two scales: exactly idempotent
        assert torch.equal(F.fake_quantize(fq, name), fq)
    else:  # an FP32 scale derived from amax can move by an ulp
        torch.testing.assert_close(F.fake_quantize(fq, name), fq, rtol=2**-21, atol=0)


@settings(max_examples=60, deadline=None)
@given(values=blocks, name=st.sampled_from(["nvfp4", "mxfp4", "mxfp4_even", "mxfp4_rceil",
                                             "mxfp4_no_clip"]))
def test_outputs_on_grid_and_error_within_half_step(values, name):
    x = torch.tensor(values).reshape(-1, 32)
    q = F.quantize(x, name)
    fmt = q.fmt
    scale = F.block_dequant_scale(q).to(torch.float64)
    if fmt.e8m0_rounding == "no_clip":
        scale = scale / 0.75
    scale = scale.repeat_interleave(fmt.block_size, dim=-1)
    out = q.dequantize().to(torch.float64)
    ratio = out / scale
    nearest = E2M1_GRID.to(torch.float64)[(ratio.abs().unsqueeze(-1) - E2M1_GRID.double()).abs()
                                           .argmin(-1)]
    assert torch.allclose(ratio.abs(), nearest, rtol=2**-20, atol=0), "value off the grid"
    y = x.to(torch.float64) / scale
    inside = y.abs() <= 6.0
    err = (out - x.to(torch.float64)).abs()[inside]
    bound = (local_half_step(y) * scale)[inside] * (1 + 2**-20)
    assert (err <= bound).all(), "rounding error above half a grid step"
    # saturated elements clip to the top of the grid
    assert torch.equal(ratio.abs()[~inside].round(), torch.full_like(ratio[~inside], 6.0))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "fp8_e4m3", "int4"])
def test_nonfinite_raises_with_name_and_count(name):
    x = torch.randn(4, 64)
    x[0, 3] = float("nan")
    x[2, 5] = float("inf")
    message = r"layers\.0\.q_proj.*2 non-finite values \(1 NaN, 1 Inf\)"
    with pytest.raises(ValueError, match=message):
        F.fake_quantize(x, name, name="layers.0.q_proj")
    with pytest.raises(ValueError, match="non-finite"):
        F.quantize(x, name)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "fp8_e4m3", "int8"])
def test_float64_values_beyond_float32_are_named_or_treated_as_inf(name):
    """The rounding computes in float32: a finite float64 value beyond its range is an error
    naming it under ``raise`` and an Inf under the other policies (its group NaN or zeroed)."""
    x = torch.ones(2, 32, dtype=torch.float64)
    x[1, 3] = -1e39
    with pytest.raises(ValueError, match=r"w: 1 float64 values of 64 lie beyond float32's "
                                         r"range \(largest magnitude 1e\+39\)"):
        F.quantize(x, name, name="w")
    inf = x.clone()
    inf[1, 3] = float("-inf")
    for policy in ("zero", "propagate"):
        assert torch.equal(F.fake_quantize(x, name, nonfinite=policy).isnan(),
                           F.fake_quantize(inf, name, nonfinite=policy).isnan())
    assert F.fake_quantize(x, name, nonfinite="propagate")[1].isnan().any()


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "e2m1_b16_fp32", "int8"])
def test_nonfinite_policies(name):
    x = torch.randn(4, 64)
    x[1, 40] = float("nan")
    fmt = F.get_format(name)
    zeroed = F.fake_quantize(x, name, nonfinite="zero")
    clean = x.clone()
    clean[1, 40] = 0.0
    assert torch.equal(zeroed, F.fake_quantize(clean, name))
    propagated = F.fake_quantize(x, name, nonfinite="propagate")
    first = 40 // fmt.block_size * fmt.block_size
    bad_block = slice(first, first + fmt.block_size)
    assert torch.isnan(propagated[1, bad_block]).all()
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[1, bad_block] = False
    assert torch.equal(propagated[mask], zeroed[mask])
    assert torch.isnan(F.quantize(x, name, nonfinite="propagate").dequantize()[1, bad_block]).all()
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        F.fake_quantize(x, name, nonfinite="ignore")


@pytest.mark.parametrize("name", ["nvfp4", "fp8_e4m3"])
def test_a_scalar_is_refused_by_quantize_and_kept_by_fake_quantize(name):
    """A QuantizedTensor's codes have a last dimension: a 0-d input is an error naming it, not
    a tensor of shape (1,); ``fake_quantize`` keeps the shape (per-tensor formats)."""
    with pytest.raises(ValueError, match=rf"scale: a 0-d tensor has no last dimension .*{name}"):
        F.quantize(torch.tensor(1.5), name, name="scale")
    if name == "fp8_e4m3":
        assert F.fake_quantize(torch.tensor(1.5), name).shape == ()


def test_last_dim_not_multiple_of_block_raises_or_pads():
    x = torch.randn(3, 172)  # the FFN width of the real tiny Llama
    with pytest.raises(ValueError, match=r"mlp\.down_proj: last dimension 172 .* block size 16"):
        F.fake_quantize(x, "nvfp4", name="mlp.down_proj")
    with pytest.raises(ValueError, match="pad=True"):
        F.quantize(x, "mxfp4")
    padded = torch.nn.functional.pad(x, (0, 4))
    out = F.fake_quantize(x, "nvfp4", pad=True)
    assert out.shape == x.shape
    assert torch.equal(out, F.fake_quantize(padded, "nvfp4")[:, :172])
    q = F.quantize(x, "mxfp4", pad=True)
    assert q.shape == x.shape and q.qdata.shape == (3, 96)
    assert torch.equal(q.dequantize(), F.fake_quantize(x, "mxfp4", pad=True))


def test_bad_dtype_format_and_global_scale():
    with pytest.raises(TypeError, match="int64"):
        F.fake_quantize(torch.arange(32).reshape(1, 32), "nvfp4")
    with pytest.raises(ValueError, match="unknown format 'nvfp5'"):
        F.get_format("nvfp5")
    with pytest.raises(ValueError, match="global_scale must be finite"):
        F.fake_quantize(torch.randn(2, 16), "nvfp4", global_scale=0.0)
    with pytest.raises(ValueError, match="no per-tensor scale"):
        F.fake_quantize(torch.randn(2, 32), "mxfp4", global_scale=1.0)
    with pytest.raises(ValueError, match="block_size must be even"):
        F.get_format("e2m1_b15_fp32")


def test_empty_tensor():
    x = torch.empty(0, 32)
    assert F.fake_quantize(x, "nvfp4").shape == (0, 32)
    assert F.quantize(x, "nvfp4").dequantize().shape == (0, 32)


def test_registry_and_generic_names():
    generic = F.get_format("e2m1_b16_e4m3").to_dict()
    assert generic | {"name": "nvfp4"} == F.get_format("nvfp4").to_dict()
    mx = F.get_format("mxfp4")
    assert (mx.block_size, mx.scale_kind, mx.e8m0_rounding) == (32, "e8m0", "floor")
    assert F.get_format("int4_g128").block_size == 128
    assert F.get_format("int8_row").granularity == "row"
    assert F.with_block_size(F.get_format("nvfp4"), 64).name == "e2m1_b64_e4m3"
    assert F.Format.from_dict(F.get_format("nvfp4").to_dict()) == F.get_format("nvfp4")
    assert {"nvfp4", "mxfp4", "mxfp4_no_clip", "fp8_e4m3", "int4", "int8"} <= set(F.list_formats())
    assert F.get_format("nvfp4").bits_per_element() == 4.5


def test_mxfp4_no_clip_maps_amax_into_three_to_six():
    x = torch.randn(16, 32) * 5
    q = F.quantize(x, "mxfp4_no_clip")
    scale = F.block_dequant_scale(q).squeeze(-1) / 0.75
    y = x.abs().amax(-1) / scale
    assert ((y >= 3) & (y < 6)).all()
    # nothing clips: the error is within half a step for every element
    err = (q.dequantize() - x).abs()
    assert (err <= scale.unsqueeze(-1)).all()



@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_block_at_the_dtypes_largest_value_overflows_only_where_scales_round_up(dtype):
    """docs/formats.md: NVFP4 and floor MX stay finite at the dtype's largest value; the MX
    modes whose scale rounds up (and no_clip's amax / 0.75) give Inf there, as torchao's do."""
    x = torch.full((1, 32), torch.finfo(dtype).max, dtype=dtype)
    for name in ("nvfp4", "mxfp4"):
        assert F.fake_quantize(x, name).isfinite().all(), name
    for name in ("mxfp4_ceil", "mxfp4_even", "mxfp4_rceil", "mxfp4_no_clip"):
        assert F.fake_quantize(x, name).isinf().all(), name

# ---------------------------------------------------------------- containers


def test_quantized_tensor_survives_parameter_to_clone_state_dict_and_save():
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    q = F.quantize(x, "nvfp4")
    expected = q.dequantize()
    param = torch.nn.Parameter(q, requires_grad=False)
    assert isinstance(param, F.QuantizedTensor)
    for copy in (param.clone(), param.detach(), param.to("cpu"), q.to(torch.device("cpu"))):
        assert torch.equal(copy.dequantize(), expected)
        assert copy.fmt == q.fmt and copy.global_scale is not None
    module = torch.nn.Module()
    module.weight = param
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)["weight"]
    assert isinstance(loaded, F.QuantizedTensor)
    assert torch.equal(loaded.dequantize(), expected)
    assert loaded.fmt == q.fmt and loaded.last_dim == 64 and loaded.orig_dtype == torch.bfloat16


# ---------------------------------------------------------------- sigma^2_fmt


def test_sigma2_prediction_and_measurement():
    assert F.sigma2_fmt("fp8_e4m3") == pytest.approx(7.04e-4, rel=1e-3)
    c_e4m3 = -10 * math.log10(2 * F.sigma2_fmt("fp8_e4m3"))
    assert c_e4m3 == pytest.approx(28.51, abs=0.005)
    assert F.sigma2_fmt("nvfp4") / F.sigma2_fmt("fp8_e4m3") == pytest.approx(16.0)
    with pytest.raises(ValueError, match="integer grid"):
        F.sigma2_fmt("int4")
    # log-uniform operands over six binades, per-tensor E4M3 (all in its normal range)
    g = torch.Generator().manual_seed(0)
    magnitudes = torch.exp2(torch.rand(200_000, generator=g) * 6 - 8)
    signs = torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0)
    x = (magnitudes * signs).reshape(-1, 100)
    x[0, 0] = 1.75 * 2.0**-2  # amax 448 * 2^-10: the per-tensor scale aligns binades (2^-10)
    assert F.measure_sigma2(x, "fp8_e4m3") == pytest.approx(F.sigma2_fmt("fp8_e4m3"), rel=0.02)
    energy = F.measure_sigma2(x, "fp8_e4m3", weighting="energy")
    assert energy == pytest.approx(4.0**-3 / 12 * (2 * math.log(2) / 3), rel=0.02)
