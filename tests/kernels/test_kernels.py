"""The W4A4 Triton kernels (kbbq_pl.kernels) against their CPU reference.

On CPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
they are imported); the shapes are small because the interpreter is slow.  Activation codes and
scales must be bit-identical to ``reference_quantize_activations``; the GEMM must be within FP32
accumulation round-off of the float64 product of the dequantized operands.  The tests marked
``gpu`` repeat this on real shapes on a CUDA device.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import signal
import subprocess
import sys
import warnings
from fractions import Fraction
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.torch_version import TorchVersion

from kbbq_pl import formats as F
from kbbq_pl import kernels as K
from kbbq_pl.kernels import exact
from kbbq_pl.kernels.interpret import interpreting
from kbbq_pl.kernels.reference import fma_f32
from kbbq_pl.transforms.fit import hadamard, transform_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = ["nvfp4", "mxfp4", "mxfp4_no_clip", "mxfp4_ceil", "mxfp4_even", "mxfp4_rceil"]
CPU = torch.device("cpu")


def needs_kernels(device: torch.device = CPU):
    if not K.available(device):
        pytest.skip(f"kbbq_pl.kernels do not run on {device} here (triton or interpreter absent)")


@functools.cache
def interpreter_rounds_fma_once() -> bool:
    """Whether Triton's interpreter rounds ``tl.fma`` once, as a GPU does (3.6's multiplies,
    rounds, adds and rounds again: a transform's chain then differs in its last bits)."""
    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(a_ptr, out_ptr):
        a = tl.load(a_ptr)
        tl.store(out_ptr, tl.fma(a, a, -1.0))

    a = torch.tensor([1 + 2**-12], dtype=torch.float32)  # a * a = 1 + 2^-11 + 2^-24: 25 bits
    out = torch.empty(1)
    fma_kernel[(1,)](a, out)
    return out.item() == 2**-11 + 2**-24


def needs_exact_chain() -> None:
    if interpreting() and not interpreter_rounds_fma_once():
        pytest.skip("this Triton's interpreter rounds tl.fma twice (Triton 3.6; GPUs and 3.9's "
                    "interpreter round once): a random transform's T x differs in its last bits")


def block(fmt: str) -> int:
    return F.get_format(fmt).block_size


def make_transform(kind: str | None, k: int, d: int, seed: int = 0) -> torch.Tensor | None:
    if kind is None:
        return None
    if kind == "hadamard":
        return hadamard(d, torch.float32).expand(k // d, d, d).contiguous()
    gen = torch.Generator().manual_seed(seed)
    if kind == "signed_permutation":  # every product term exact, whatever the summation
        order = torch.stack([torch.randperm(d, generator=gen) for _ in range(k // d)])
        signs = torch.where(torch.rand(k // d, d, generator=gen) < 0.5, -1.0, 1.0)
        return torch.zeros(k // d, d, d).scatter_(2, order[:, :, None], signs[:, :, None])
    return torch.randn(k // d, d, d, generator=gen) / math.sqrt(d)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def assert_same_quantization(got, want, what: str) -> None:
    codes, scales, pts = got
    ref_codes, ref_scales, ref_pts = want
    bad_codes = int((codes != ref_codes).sum())
    bad_scales = int((bits(scales) != bits(ref_scales)).sum())
    assert bad_codes == 0 and bad_scales == 0, (
        f"{what}: {bad_codes} of {codes.numel()} code bytes and {bad_scales} of {scales.numel()} "
        "scales differ from the reference")
    assert scales.dtype == ref_scales.dtype or scales.dtype == torch.uint8
    if ref_pts is None:
        assert pts is None
    else:
        assert torch.equal(bits(pts.reshape(1)), bits(ref_pts.reshape(1))), (pts, ref_pts)


def quantize_both(x, transform, fmt, global_scale=None, config=None):
    got = K.quantize_activations(x, transform, fmt, global_scale, config=config)
    want = K.reference_quantize_activations(x, transform, fmt, global_scale)
    return got, want


# --------------------------------------------------------------------------- reference pieces


def exact_fp32(value: Fraction) -> float:
    """The FP32 nearest to an exact rational, ties to even (no double rounding)."""
    guess = torch.tensor(float(value), dtype=torch.float32)
    candidates = [torch.nextafter(guess, torch.tensor(-math.inf)), guess,
                  torch.nextafter(guess, torch.tensor(math.inf))]
    best = min(candidates, key=lambda c: (abs(Fraction(float(c)) - value),
                                          int(c.view(torch.int32)) & 1))
    return float(best)


def test_fma_f32_rounds_once():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(400, generator=gen)
    b = torch.randn(400, generator=gen) * 2.0 ** torch.randint(-30, 30, (400,), generator=gen)
    c = torch.randn(400, generator=gen) * 2.0 ** torch.randint(-30, 30, (400,), generator=gen)
    # double rounding through float64 fails here: a * b = 2^-24 + 2^-60 and c = 1
    a = torch.cat([a, torch.tensor([(2**12 + 1) * 2.0**-60])])
    b = torch.cat([b, torch.tensor([float(2**24 - 2**12 + 1)])])
    c = torch.cat([c, torch.tensor([1.0])])
    got = fma_f32(a, b, c)
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        assert r == exact_fp32(Fraction(x) * Fraction(y) + Fraction(z)), (x, y, z)
    naive = (a.double() * b.double() + c.double()).float()
    assert naive[-1] != got[-1]  # the case above does catch double rounding


def test_fma_f32_rounds_once_at_every_kind_of_midpoint():
    """Where the float64 sum lands on an FP32 midpoint, the only place one rounding and two
    differ: above and below the midpoint, among normal numbers, FP32 subnormals and at the
    overflow threshold; then signed zeros, infinities and NaN, as ``fma.rn.f32`` gives them."""
    cases = [  # (a, b, c): a * b exact, a * b + c within 2^-36 of a midpoint of c's neighbours
        ((2**12 + 1) * 2.0**-60, float(2**24 - 2**12 + 1), 1.0),  # 1 + 2^-24 + 2^-60: up
        ((2**18 - 1) * 2.0**-30, (2**18 + 1) * 2.0**-30, 1.0 + 2.0**-23),  # midpoint - 2^-60
        ((2**20 - 1) * 2.0**-95, (2**20 + 1) * 2.0**-95, (2**20 + 1) * 2.0**-149),  # subnormal
        ((2**12 + 1) * 2.0**-93, float(2**24 - 2**12 + 1) * 2.0**-93, 2.0**-130),  # subnormal
        ((2**20 - 1) * 2.0**31, (2**20 + 1) * 2.0**32, (2 - 2.0**-23) * 2.0**127),  # < overflow
        (float(2**24 - 2**12 + 1), (2**12 + 1) * 2.0**67, (2 - 2.0**-23) * 2.0**127),  # inf
    ]
    a, b, c = (torch.tensor(column, dtype=torch.float32) for column in zip(*cases))
    assert all(float(x) == y for x, y in zip(a, (case[0] for case in cases)))  # exact FP32
    got = fma_f32(a, b, c)
    naive = (a.double() * b.double() + c.double()).float()
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        top = (2 - Fraction(2) ** -23) * Fraction(2) ** 127  # FP32's largest finite
        want = (exact_fp32(exact) if abs(exact) <= top else float(top) if exact < top + Fraction(
            2) ** 103 else math.inf)  # positive here: overflow from halfway past the largest
        assert r == want, (x, y, z, r, want)
    # two roundings get each wrong but the last (ties to even overflow there too)
    assert (naive != got).tolist() == [True] * 5 + [False], (naive, got)
    inf, nan = math.inf, math.nan
    special = torch.tensor([[-0.0, 1.0, -0.0], [0.0, -1.0, 0.0], [inf, 1.0, -1.0],
                            [inf, 0.0, 1.0], [1.0, 1.0, nan], [inf, 1.0, -inf],
                            [2.0**-100, 2.0**-100, -0.0]])
    got = fma_f32(special[:, 0], special[:, 1], special[:, 2]).tolist()
    assert [str(v) for v in got] == ["-0.0", "0.0", "inf", "nan", "nan", "nan", "0.0"], got


def test_reference_transform_is_t_times_x():
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    t = make_transform("random", 64, 16)
    expected = transform_inputs(x.double(), t.double())
    got = K.reference_transform(x, t)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(K.reference_transform(x, None), x.float())


# --------------------------------------------------------------------------- activations


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", [None, "random"])
def test_activation_codes_bit_identical(fmt, kind):
    needs_kernels()
    if kind == "random":
        needs_exact_chain()
    d = block(fmt)
    k = 4 * d
    x = (torch.randn(20, k) * 3).to(torch.bfloat16)  # 20 rows: a masked row tile
    got, want = quantize_both(x, make_transform(kind, k, d), fmt)
    assert_same_quantization(got, want, f"{fmt} transform={kind}")
    codes, scales, pts = got
    assert codes.shape == (20, k // 2) and codes.dtype == torch.uint8
    expected_scale = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    assert scales.shape == (20, 4) and scales.dtype == expected_scale
    assert (pts is not None) == (fmt == "nvfp4")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_activation_dtypes_with_hadamard(fmt, dtype):
    needs_kernels()
    d = block(fmt)
    x = (torch.randn(17, 2 * d) * 5).to(dtype)
    got, want = quantize_both(x, make_transform("hadamard", 2 * d, d), fmt)
    assert_same_quantization(got, want, f"{fmt} {dtype}")


def test_static_nvfp4_scale_float_tensor_and_saturation():
    needs_kernels()
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    t = make_transform("random", 64, 16, seed=3)
    for scale in (0.01, torch.tensor(0.01), 1e-5):  # 1e-5: most blocks saturate at 448 * 6
        got, want = quantize_both(x, t, "nvfp4", scale)
        assert_same_quantization(got, want, f"static scale {scale}")
        assert got[2].dtype == torch.float32
        assert float(got[2]) == float(torch.tensor(float(scale), dtype=torch.float32))
    saturated = got[1].float()
    assert (saturated == 448).float().mean() > 0.5


def test_tiles_do_not_change_the_bits():
    needs_kernels()
    x = torch.randn(33, 96, dtype=torch.bfloat16)  # 6 blocks of 16: NB = 4 leaves a partial tile
    t = make_transform("random", 96, 16, seed=5)
    want = K.reference_quantize_activations(x, t, "nvfp4")
    for config in ({"BLOCK_M": 32, "NB": 4}, {"BLOCK_M": 16, "NB": 1},
                   {"BLOCK_M": 8, "NB": 4, "TILES": 3}, {"BLOCK_M": 16, "NB": 2, "TILES": 2}):
        got = K.quantize_activations(x, t, "nvfp4", config=config)
        assert_same_quantization(got, want, f"config {config}")


def test_row_tiles_a_program_takes_leave_every_sm_busy():
    """Up to the tile's most, while four programs an SM remain: a prefill of 4,096 rows takes
    four tiles a program, 1,024 rows three, a short batch one."""
    needs_kernels()
    from kbbq_pl.kernels.triton_kernels import tiles_per_program

    sms, columns = 132, 8192 // 16
    assert tiles_per_program(4096 // 256 * columns, 4, sms) == 4
    assert tiles_per_program(1024 // 256 * columns, 4, sms) == 3
    assert tiles_per_program(256 // 256 * columns, 4, sms) == 1
    assert tiles_per_program(10**6, 2, sms) == 2 and tiles_per_program(0, 4, sms) == 1


ROW_TILE_FORMATS = ["nvfp4", "mxfp4",
                    *(pytest.param(fmt, marks=pytest.mark.slow) for fmt in FORMATS[2:])]
"""The loop over row tiles is the same for every E8M0 rounding: MXFP4's other roundings run
with the slow tests."""


@pytest.mark.parametrize("fmt", ROW_TILE_FORMATS)
def test_row_tiles_taken_in_turn_give_the_same_values(fmt):
    """A program that takes several row tiles in turn (``TILES``, the next one's activations
    loaded while one is computed; the last group short, its last tile partial) writes the
    values, in word order too, that one tile a program writes."""
    needs_kernels()
    d = block(fmt)
    x = torch.randn(37, 4 * d, dtype=torch.bfloat16)  # 5 tiles of 8 rows, the last of 5
    t = make_transform("random", 4 * d, d, seed=9)  # two programs of 2 blocks (NB) a row tile
    ones = []
    for word_order in (False, True):
        one = K.quantize_activation_values(x, t, fmt, word_order=word_order,
                                           config={"BLOCK_M": 8, "NB": 2})
        ones.append(one[0])
        for tiles in (2, 3, 8):
            got = K.quantize_activation_values(x, t, fmt, word_order=word_order,
                                               config={"BLOCK_M": 8, "NB": 2, "TILES": tiles})
            assert torch.equal(got[0], one[0]), (tiles, word_order)
    assert torch.equal(ones[1], exact.word_order(ones[0]))  # NVFP4: half a chunk, zeros after


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN where NaN."""
    return torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m", [1, 5])
def test_decode_step_tile_gives_the_register_tiles_bits(fmt, m):
    """Up to 16 rows the activation kernel loads ``x_j`` and column ``j`` of ``T`` from memory,
    one output of a block a lane (``FROM_MEMORY``, the GPU's tile): its codes, scales and
    values (word order, and the DP4A product's 2q with FP32 block scales) are the bits of the
    register tile (``REGISTER_FEW_ROWS_TILES``), of the interpreter's default tile and of the
    reference (with a transform, where the interpreter rounds ``tl.fma`` once); the first
    block's chain rounds differently in any other order, nine blocks leave a partial block
    tile, five rows a partial row tile, an infinity makes a non-finite block, a dynamic NVFP4
    scale runs both passes."""
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    d = block(fmt)
    k = 9 * d
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3).to(torch.bfloat16)
    x[-1, d + 3] = math.inf
    t = make_transform("random", k, d, seed=m)
    # block 0 tells the chain's order: x = 1, odd outputs 2^24 + 1 - 2^24 = 0 in increasing
    # j (2^24 + 1 rounds to 2^24), 1 in decreasing j; output 0 is 6 (the block's scale 1)
    x[:, :d] = 1.0
    t[0] = 0.0
    t[0, 0, 0] = 6.0
    t[0, 1::2, :3] = torch.tensor([2.0**24, 1.0, -2.0**24])
    registers = tk.REGISTER_FEW_ROWS_TILES[d]
    decode = tk.FEW_ROWS_TILES[d]  # as a GPU runs it (the interpreter's default: 8 blocks)
    assert decode["FROM_MEMORY"]
    for transform in (t, None):
        got = K.quantize_activations(x, transform, fmt, config=decode)
        if transform is None or interpreter_rounds_fma_once():
            assert_same_quantization(got, K.reference_quantize_activations(x, transform, fmt),
                                     f"{fmt} m={m} transform={transform is not None}")
        for config in (registers, None):
            assert_same_quantization(got, K.quantize_activations(x, transform, fmt,
                                                                 config=config), str(config))
        for word_order in (False, True):
            values = K.quantize_activation_values(x, transform, fmt, word_order=word_order,
                                                  config=decode)[0]
            want = K.quantize_activation_values(x, transform, fmt, word_order=word_order,
                                                config=registers)[0]
            assert same_values(values, want), (fmt, m, word_order)
    if m == 1:
        kind, rounding, gain = K._scale_meta(F.get_format(fmt))
        gs = torch.tensor(0.01) if fmt == "nvfp4" else None
        doubled = [tk.quantize_activations(x[:, :8 * d], t[:8], d, kind, rounding, gain, gs,
                                           values_dtype=torch.int8, codes=False, config=config)
                   for config in (decode, registers)]
        assert torch.equal(doubled[0][3], doubled[1][3])
        assert same_values(doubled[0][1], doubled[1][1])


def test_decode_step_tile_rows():
    """A decode step's tile is as tall as the rows' next power of two up to its ``BLOCK_M``:
    one row computes no masked rows; other tiles are left as they are, and a product other
    than the FMA chain runs on one of them."""
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    tile = tk.FEW_ROWS_TILES[32]
    assert [tk.few_rows_tile(tile, m)["BLOCK_M"] for m in (1, 2, 3, 16)] == [1, 2, 4, 4]
    assert tk.few_rows_tile({"BLOCK_M": 16, "NB": 2}, 1) == {"BLOCK_M": 16, "NB": 2}
    # a product other than the chain keeps a tile it runs on (the decode-step tile is the chain)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    got = tk.quantize_activations(x, make_transform("random", 64, 32), 32, tk.SCALE_E8M0, 0, 1.0,
                                  None, product=tk.PRODUCT_FMA_DOT)
    assert got[0].shape == (3, 32) and got[1].shape == (3, 2)


def ties_rows(d: int) -> torch.Tensor:
    """Blocks (fp32) holding 6 and then every E2M1 rounding boundary, the FP32 numbers next to
    each, their negatives and signed zeros: with the scale 2^0 (MX floor, even, rceil; NVFP4
    with a per-tensor scale of 1) the elements are rounded exactly at the boundaries."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = torch.cat([mids, torch.nextafter(mids, torch.tensor(math.inf)),
                      torch.nextafter(mids, torch.tensor(-math.inf))])
    values = torch.cat([near, -near, torch.tensor([0.0, -0.0])])
    chunks = values.split(d - 1)
    blocks = [torch.cat([torch.tensor([6.0]), c, torch.zeros(d - 1 - len(c))]) for c in chunks]
    return torch.cat(blocks).reshape(1, -1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_adversarial_inputs(fmt):
    needs_kernels()
    d = block(fmt)
    k = 2 * d
    rows = [
        torch.zeros(k),                                     # an all-zero row
        torch.full((k,), -0.0),                             # negative zeros keep their sign bit
        torch.linspace(-3e38, 3e38, k),                     # amax near FP32's largest
        torch.linspace(-1e-38, 1e-38, k),                   # subnormal amax
        torch.tensor([1e30] + [1e-30] * (k - 1)),           # one huge element per row
    ]
    for kind in (None, "random"):  # with T: zero blocks give signed zeros, overflow gives NaN
        got, want = quantize_both(torch.stack(rows), make_transform(kind, k, d), fmt)
        assert_same_quantization(got, want, f"{fmt} adversarial, transform {kind}")
    scale = 1.0 if fmt == "nvfp4" else None
    got, want = quantize_both(ties_rows(d), None, fmt, scale)
    assert_same_quantization(got, want, f"{fmt} ties")
    if fmt in ("nvfp4", "mxfp4", "mxfp4_even", "mxfp4_rceil"):  # block scale 1: exact ties
        assert (bits(got[1]) == (0x38 if fmt == "nvfp4" else 127)).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_activation_block_parts_either_side(fmt, monkeypatch):
    """The activation kernel puts a block's parts first or last by Triton's version
    (``PARTS_FIRST``, a question of speed only): both give the reference's codes and values,
    with a transform and without, across masked rows and blocks (the GPU runs one of them)."""
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    d = block(fmt)
    k = 5 * d  # three tiles of two blocks under the interpreter: the last one half masked
    x = (torch.randn(20, k) * 3).to(torch.bfloat16)
    for parts_first in (False, True):
        monkeypatch.setattr(tk, "PARTS_FIRST", parts_first)
        for kind in (None, "random"):
            t = make_transform(kind, k, d, seed=3)
            got, want = quantize_both(x, t, fmt)
            assert_same_quantization(got, want, f"{fmt} parts first={parts_first} T={kind}")
            values, _ = K.quantize_activation_values(x, t, fmt)
            expected, _ = K.reference_activation_values(x, t, fmt, dtype=torch.bfloat16)
            assert torch.equal(bits(values), bits(expected)), (fmt, parts_first, kind)
    t.mul_(-0.5)  # in place: the kernel's transposed copy of it is made again
    got, want = quantize_both(x, t, fmt)
    assert_same_quantization(got, want, f"{fmt} transform changed in place")


def test_gpu_product_path_runs_under_the_interpreter():
    """The GPU's FMA-dot product, interpreted by numpy (another summation order), lands within
    a few codes of the exact chain: its indexing is right."""
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    x = torch.randn(32, 128, dtype=torch.bfloat16)
    t = make_transform("random", 128, 32, seed=2)
    want = K.reference_quantize_activations(x, t, "mxfp4")
    got = tk.quantize_activations(x, t, 32, tk.SCALE_E8M0, 0, 1.0, None,
                                  product=tk.PRODUCT_FMA_DOT)
    codes = float((got[0] != want[0]).float().mean())
    scales = float((got[1] != want[1]).float().mean())
    print(f"the FMA dot under the interpreter: code-byte mismatch rate {codes:.3g}, scale "
          f"mismatch rate {scales:.3g} against the exact FMA chain")
    assert codes < 0.01
    assert scales < 0.05


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_bf16x3_product_multiplies_by_each_block_transform(fmt, monkeypatch):
    """The tensor-core product (bench only: x in bf16 times T as three bf16 parts) reads each
    block's own transform, transposed, and all three parts: with signed permutations (every
    term exact, whatever the summation) its codes and scales are the reference's; with random
    transforms (the parts sum to T) it rounds as the chain does up to a few boundary cases;
    both sides of ``PARTS_FIRST``.  bf16 activations only."""
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    d = block(fmt)
    k = 6 * d
    kind, rounding, gain = K._scale_meta(F.get_format(fmt))
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(48, k, generator=gen) * 3).to(torch.bfloat16)
    permutations = make_transform("signed_permutation", k, d, seed=6)
    random = make_transform("random", k, d, seed=4)
    for parts_first in (False, True):
        monkeypatch.setattr(tk, "PARTS_FIRST", parts_first)
        for t, most in ((permutations, 0.0), (random, 1e-3)):
            got = tk.quantize_activations(x, t, d, kind, rounding, gain, None,
                                          product=tk.PRODUCT_BF16X3)
            want = K.reference_quantize_activations(x, t, fmt)
            codes = float((got[0] != want[0]).float().mean())
            scales = float((bits(got[1]) != bits(want[1])).float().mean())
            assert codes <= most and scales <= most, (fmt, parts_first, most, codes, scales)
    with pytest.raises(ValueError, match="bf16 activations"):
        tk.quantize_activations(x.half(), random, d, kind, rounding, gain, None,
                                product=tk.PRODUCT_BF16X3)


def test_tiny_dynamic_scale_quantizes_to_zeros():
    needs_kernels()
    x = torch.full((3, 32), 1e-35)  # amax / (448 * 6) < 2^-121: unusable, codes are zeros
    got, want = quantize_both(x, None, "nvfp4")
    assert_same_quantization(got, want, "tiny amax")
    assert torch.equal(got[0], torch.zeros_like(got[0])) and float(got[2]) == 1.0


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_nonfinite_blocks_get_nan_scales(fmt):
    needs_kernels()
    d = block(fmt)
    x = torch.randn(3, 2 * d)
    x[0, 1] = float("nan")
    x[2, d + 3] = float("inf")
    t = make_transform("random", 2 * d, d)
    got, want = quantize_both(x, t, fmt)
    assert_same_quantization(got, want, f"{fmt} non-finite")
    nan_code = 0x7F if fmt == "nvfp4" else 0xFF
    scales = bits(got[1]).reshape(3, 2)
    assert scales[0, 0] == nan_code and scales[2, 1] == nan_code and scales[1, 0] != nan_code


def test_empty_inputs():
    needs_kernels()
    codes, scales, pts = K.quantize_activations(torch.randn(0, 64), None, "nvfp4")
    assert codes.shape == (0, 32) and scales.shape == (0, 4) and float(pts) == 1.0
    q = F.quantize(torch.randn(8, 64), "nvfp4")
    y = K.w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, "nvfp4")
    assert y.shape == (0, 8)


def test_activation_argument_errors():
    needs_kernels()
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="not a multiple of the nvfp4 block 16"):
        K.quantize_activations(torch.randn(4, 40), None, "nvfp4")
    with pytest.raises(ValueError, match=r"transform must be \[K/d, d, d\] = \[4, 16, 16\]"):
        K.quantize_activations(x, torch.randn(2, 16, 16), "nvfp4")
    with pytest.raises(ValueError, match="mxfp4 has no per-tensor scale"):
        K.quantize_activations(x, None, "mxfp4", 0.5)
    with pytest.raises(ValueError, match="not supported by the W4A4 kernels"):
        K.quantize_activations(x, None, "int4")
    for name in ("e2m1_b8_e8m0", "e2m1_b64_e8m0", "e2m1_b128_e4m3"):  # tiles of 16 or 32
        with pytest.raises(ValueError, match=f"{name}.*blocks of 16 or 32"):
            K.quantize_activations(torch.randn(4, 256), None, name)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        K.quantize_activations(x.double(), None, "nvfp4")
    with pytest.raises(ValueError, match="positive and finite"):
        K.quantize_activations(x, None, "nvfp4", 0.0)
    q = F.quantize(torch.randn(8, 64), "nvfp4")
    for bad in (0.0, -0.5, float("nan"), float("inf")):  # a host tensor is read to check it
        with pytest.raises(ValueError, match=rf"linear_w4a4: global_scale must be positive and "
                                             rf"finite, got {bad!r}"):
            K.linear_w4a4(x, q.qdata, q.scale, q.global_scale, "nvfp4", None, torch.tensor(bad))
        with pytest.raises(ValueError, match="linear_w4a4: weight_global must be positive"):
            K.linear_w4a4(x, q.qdata, q.scale, torch.tensor(bad), "nvfp4")


# --------------------------------------------------------------------------- GEMM


def operands(fmt, m, n, k, transform=None, seed=0, device="cpu"):
    """Activations quantized by the kernels on ``device`` and a weight quantized on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * 0.05
    q = F.quantize(w, fmt)
    a = K.quantize_activations(x.to(device), transform, fmt)
    return a, q


def gemm_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


def assert_within_one_bf16_rounding(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Each output is the exact value rounded once to bf16 (half an ulp, at most 2^-8 of the
    value), up to the FP32 accumulation error (far below it)."""
    slack = 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()
    excess = (y.double() - ref).abs() - slack
    assert float(excess.max()) <= 0, f"{int((excess > 0).sum())} outputs beyond one bf16 rounding"


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp4_no_clip"])
@pytest.mark.parametrize("m", [3, 40])  # 3: the decode variant (M <= 16), 40: the tiled path
def test_gemm_matches_float64_product(fmt, m):
    needs_kernels()
    n, k = 24, 192  # N and K are not multiples of the interpreter's 16 x 64 tile
    (codes, scales, pts), q = operands(fmt, m, n, k, make_transform("random", 192, block(fmt)))
    bias = torch.randn(n)
    ref = K.reference_w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, fmt, bias)
    y = K.w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, fmt, bias,
                      torch.float32)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert gemm_error(y, ref) <= 1e-5
    y16 = K.w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, fmt, bias)
    assert y16.dtype == torch.bfloat16
    assert_within_one_bf16_rounding(y16, ref)


def test_gemm_split_k_fp16_no_bias_and_tile_configs():
    needs_kernels()
    (codes, scales, pts), q = operands("nvfp4", 5, 40, 256)
    ref = K.reference_w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, "nvfp4")
    args = (codes, scales, pts, q.qdata, q.scale, q.global_scale, "nvfp4")
    split = K.w4a4_matmul(*args, None, torch.float32, split_k=3)
    assert gemm_error(split, ref) <= 1e-5
    whole = K.w4a4_matmul(*args, None, torch.float32)
    assert torch.allclose(split, whole, rtol=1e-6, atol=1e-6)
    tiled = K.w4a4_matmul(*args, None, torch.float32,
                          config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1})
    assert gemm_error(tiled, ref) <= 1e-5
    half = K.w4a4_matmul(*args, None, torch.float16)
    assert half.dtype == torch.float16 and gemm_error(half, ref) <= 2.0**-10


@pytest.mark.parametrize("m", [1, 40])  # the decode variant and the tiled path
def test_gemm_per_tensor_scales_do_not_overflow_a_finite_product(m):
    """NVFP4 activations near 1e35 against weights near 0.1: a finite product (~1e35) whose
    per-tensor scales, multiplied into the sums the larger first, overflowed FP32."""
    needs_kernels()
    k, n = 64, 16
    q = F.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.1, "nvfp4")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)) * 1e35
    codes, scales, pts = K.quantize_activations(x, None, "nvfp4")
    ref = K.reference_w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, "nvfp4")
    y = K.w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, "nvfp4", None,
                      torch.float32)
    assert torch.isfinite(ref).all() and torch.isfinite(y).all()
    assert gemm_error(y, ref) <= 1e-5


def test_gemm_nan_scale_propagates():
    needs_kernels()
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    codes, scales, pts = K.quantize_activations(x, None, "mxfp4")
    q = F.quantize(torch.randn(8, 64), "mxfp4")
    y = K.w4a4_matmul(codes, scales, None, q.qdata, q.scale, None, "mxfp4", None, torch.float32)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()


def test_gemm_argument_errors():
    needs_kernels()
    (codes, scales, pts), q = operands("nvfp4", 2, 8, 64)
    with pytest.raises(ValueError, match="K differs: activations 64"):
        K.w4a4_matmul(codes, scales, pts, q.qdata[:, :16], q.scale[:, :2], q.global_scale, "nvfp4")
    with pytest.raises(ValueError, match="needs both per-tensor scales"):
        K.w4a4_matmul(codes, scales, None, q.qdata, q.scale, q.global_scale, "nvfp4")
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        K.w4a4_matmul(codes, scales, pts, q.qdata, q.scale, q.global_scale, "nvfp4",
                      torch.zeros(7))
    with pytest.raises(ValueError, match="weight scales must be one byte each"):
        K.w4a4_matmul(codes, scales, pts, q.qdata, q.scale.float(), q.global_scale, "nvfp4")
    (codes, scales, _), q = operands("mxfp4", 2, 8, 64)
    with pytest.raises(ValueError, match="mxfp4 has no per-tensor scales"):
        K.w4a4_matmul(codes, scales, 1.0, q.qdata, q.scale, None, "mxfp4")


# --------------------------------------------------------------------------- linear


@pytest.mark.parametrize("fmt,static", [("nvfp4", False), ("nvfp4", True), ("mxfp4_rceil", False)])
def test_linear_w4a4_matches_reference(fmt, static):
    needs_kernels()
    d = block(fmt)
    k, n = 4 * d, 24
    t = make_transform("random", k, d, seed=7)
    w = torch.randn(n, k) * 0.1
    q = F.quantize(w, fmt)
    x = torch.randn(2, 5, k - 3, dtype=torch.bfloat16)  # zero-padded to K
    scale = torch.tensor(0.002) if static else None
    bias = torch.randn(n, dtype=torch.bfloat16)
    y = K.linear_w4a4(x, q.qdata, q.scale, q.global_scale, fmt, t, scale, bias)
    ref = K.reference_linear_w4a4(x, q.qdata, q.scale, q.global_scale, fmt, t, scale, bias)
    assert y.shape == (2, 5, n) and y.dtype == torch.bfloat16
    exact = K.reference_linear_w4a4(x.float(), q.qdata, q.scale, q.global_scale, fmt, t, scale,
                                    bias.float())
    assert_within_one_bf16_rounding(y.reshape(-1, n), exact.double().reshape(-1, n))
    assert float((y.float() - ref.float()).abs().max()) <= float(ref.float().abs().max()) * 2**-7
    with pytest.raises(ValueError, match=f"does not match the weights' K = {k}"):
        K.linear_w4a4(torch.randn(3, 40), q.qdata, q.scale, q.global_scale, fmt)


def test_available_and_blackwell_gate():
    from kbbq_pl.kernels.blackwell import blackwell_nvfp4_available

    needs_kernels()
    assert K.available("cpu")
    assert not blackwell_nvfp4_available(CPU, F.get_format("nvfp4"))
    if not torch.cuda.is_available():
        assert not K.available("cuda")


def test_an_older_triton_is_not_used(monkeypatch):
    """Triton 3.5 compiles ``tl.div_rn`` to ``div.rn.ftz.f32`` (subnormals flushed): with it
    the kernels say they are unavailable (W4A4 layers emulate), warn once and name the
    version in their error."""
    needs_kernels()
    monkeypatch.setattr(K, "_triton_version", lambda: TorchVersion("3.5.1"))
    K._triton_recent.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=r"need Triton 3\.6 or later .* found 3\.5\.1"):
            assert not K.available("cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not K.available("cpu")  # said once
            with pytest.raises(RuntimeError, match=r"Triton 3\.5\.1 is older than 3\.6"):
                K.quantize_activations(torch.randn(2, 32), None, "mxfp4")
    finally:
        monkeypatch.undo()
        K._triton_recent.cache_clear()
    assert K.available("cpu")


def test_package_imports_without_triton(tmp_path):
    """kbbq_pl.kernels and its CPU reference work with triton absent."""
    import subprocess

    script = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "import kbbq_pl.kernels as K\n"
        "assert not K.available('cpu')\n"
        "x = torch.randn(2, 32)\n"
        "codes, scales, pts = K.reference_quantize_activations(x, None, 'mxfp4')\n"
        "assert codes.shape == (2, 16)\n"
        "try:\n"
        "    K.quantize_activations(x, None, 'mxfp4')\n"
        "except RuntimeError as error:\n"
        "    assert 'triton is not installed' in str(error)\n"
        "else:\n"
        "    raise AssertionError('no error without triton')\n"
        "assert 'kbbq_pl.kernels.triton_kernels' not in sys.modules\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


COMPILE_CHECK = """
import re, sys
sys.path.insert(0, {bench!r})
import triton.language as tl
from triton.backends.compiler import GPUTarget
import gpu_compile as G
from kbbq_pl.kernels import triton_kernels as tk

target = GPUTarget("cuda", 90, 32)
tile = dict(tk.ACT_TILES[16])
warps = tile.pop("num_warps")
for values in (False, True):
    act = dict(D=16, SCALE_KIND=tk.SCALE_E4M3, ROUNDING=0, GAIN=1.0, HAS_T=True, STATIC=False,
               AMAX_ONLY=False, PRODUCT=tk.PRODUCT_FMA_CHAIN, WRITE_CODES=not values,
               WRITE_VALUES=values, PARTS_FIRST=tk.PARTS_FIRST, **tile)
    compiled = G.compile_kernel(tk._quantize_activations_kernel, G.ACT_SIGNATURE, act, target,
                                num_warps=warps, enable_fp_fusion=True)
    ptx = compiled.asm["ptx"]
    per_thread = tile["BLOCK_M"] * tile["NB"] * 16 // (32 * warps)
    assert len(re.findall(r"fma\\.rn\\.f32", ptx)) == per_thread * 16, "not an FMA chain"
    assert re.search(r"div\\.(full|approx)", ptx) is None and "div.rn.f32" in ptx
    assert ".ftz" not in ptx
    if values:  # what the decode and prefill paths run
        assert G.resources(compiled.asm["cubin"])["stack"] == 0, "activation values spill"
for small, config, mma in ((True, (16, 64, 128, 4, 5), "mma.sync"),
                           (False, (128, 128, 64, 8, 3), "wgmma.mma_async")):
    signature = dict(G.GEMM_SIGNATURE, **({{}} if small else {{"a_ptr": "*bf16"}}))
    bm, bn, bk, warps, stages = config
    gemm = dict(D=16, SCALE_KIND=tk.SCALE_E4M3, GAIN2=1.0, A_PACKED=small, HAS_GLOBAL=True,
                HAS_BIAS=True, DOT_DTYPE=tl.bfloat16, EXPLICIT_BF16=False, BLOCK_M=bm,
                BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
    compiled = G.compile_kernel(tk._w4a4_kernel, signature, gemm, target, num_warps=warps,
                                num_stages=stages, enable_fp_fusion=True)
    assert mma in compiled.asm["ptx"], mma
    assert G.resources(compiled.asm["cubin"])["stack"] == 0, "register spills"
print("ok")
"""


def run_compile_check(script: str) -> None:
    """Run a compile check (``script``, with ``{bench}`` for the bench folder, which holds
    ``gpu_compile``) in a fresh interpreter without ``TRITON_INTERPRET``: it must print "ok";
    skipped where triton's ptxas is missing."""
    import os
    import subprocess

    pytest.importorskip("triton")
    bench = str(Path(__file__).resolve().parents[2] / "bench")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script.format(bench=bench)],
                            capture_output=True, text=True, env=env, timeout=300, check=False)
    if "ptxas" in result.stderr and "not found" in result.stderr:
        pytest.skip("triton's ptxas is not available on this machine")
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


def test_kernels_compile_for_hopper_without_a_gpu():
    """The GPU code paths (FMA chain, wgmma) compile for sm_90 with the ptxas in triton's wheel:
    the transform is a chain of FP32 FMAs (one per output and block element), divisions are
    correctly rounded, nothing flushes subnormals, the GEMMs use the tensor cores, no spills."""
    run_compile_check(COMPILE_CHECK)


DECODE_STEP_COMPILE_CHECK = """
import re, sys
sys.path.insert(0, {bench!r})
from triton.backends.compiler import GPUTarget
import gpu_compile as G
from kbbq_pl.kernels import triton_kernels as tk

target = GPUTarget("cuda", 90, 32)
for d, kind, values in ((16, tk.SCALE_E4M3, "*fp16"), (32, tk.SCALE_E8M0, "*bf16")):
    sizes = {{}}
    for name, tile in (("memory", tk.few_rows_tile(tk.FEW_ROWS_TILES[d], 1)),
                       ("registers", tk.REGISTER_FEW_ROWS_TILES[d])):
        tile = dict(tile)
        warps = tile.pop("num_warps")
        constants = dict(D=d, SCALE_KIND=kind, ROUNDING=0, GAIN=1.0, HAS_T=True, STATIC=True,
                         AMAX_ONLY=False, PRODUCT=tk.PRODUCT_FMA_CHAIN, WRITE_CODES=False,
                         WRITE_VALUES=True, WORD_ORDER=True, PARTS_FIRST=tk.PARTS_FIRST,
                         **tile)
        compiled = G.compile_kernel(tk._quantize_activations_kernel,
                                    dict(G.ACT_SIGNATURE, values_ptr=values), constants, target,
                                    num_warps=warps, enable_fp_fusion=True)
        assert G.resources(compiled.asm["cubin"])["stack"] == 0, (d, name, "spills")
        sizes[name] = len(G.sass_ops(compiled.asm["cubin"]))
        if name == "memory":  # one output a lane: a chain of d multiply-adds
            assert len(re.findall(r"fma\\.rn\\.f32", compiled.asm["ptx"])) == d, d
    assert sizes["memory"] * (1.5 if d == 16 else 4) < sizes["registers"], sizes
    tile = dict(tk.FEW_ROWS_TILES[d])  # up to 16 rows: the shipped tile, 4 rows a program
    warps = tile.pop("num_warps")
    for codes in (False, True):
        constants.update(tile, WRITE_CODES=codes, WRITE_VALUES=not codes, WORD_ORDER=not codes)
        compiled = G.compile_kernel(tk._quantize_activations_kernel,
                                    dict(G.ACT_SIGNATURE, values_ptr=values), constants, target,
                                    num_warps=warps, enable_fp_fusion=True)
        assert G.resources(compiled.asm["cubin"])["stack"] == 0, (d, tile, "spills")
    print(d, sizes, file=sys.stderr)
print("ok")
"""


def test_decode_step_tile_compiles_to_a_short_program():
    """The decode step's activation kernel at one row, compiled for sm_90: one chain of ``d``
    FP32 multiply-adds a lane, no spills (nor at its four rows, codes or values), well under
    the instructions of the register tile (SASS instructions, Triton 3.6: 352 against 632 for
    NVFP4, 360 against 1,992 for MX; 3.9: 344 against 728 and 360 against 2,232)."""
    run_compile_check(DECODE_STEP_COMPILE_CHECK)


def gpu_bench():
    """bench/gpu.py as a module."""
    path = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["bench_gpu"]
    return module


def test_gpu_bench_traces_name_the_module_that_launched_each_kernel(tmp_path):
    """The model section's traces hold a span for each module's forward (``module_spans``), and
    ``gpu_report`` places each kernel in the innermost span around its launch.  A CPU trace has
    no kernels: each operator of a real one stands here for a kernel it launched (a launch call
    at its start, the kernel correlated to it)."""
    from torch.profiler import ProfilerActivity, profile

    module = gpu_bench()
    model = module.llama(module.TINY, "cpu")
    ids = torch.randint(0, module.TINY["vocab"], (1, 5), generator=torch.Generator().manual_seed(0))
    module.quantize_for_kernels(model, "nvfp4", ids)

    def hooks() -> int:
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    before = hooks()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof, \
            module.module_spans(model):
        model(input_ids=ids, use_cache=False)
    assert hooks() == before  # the spans' hooks came off
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"]
    operators = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    for i, op in enumerate(operators):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                       "ts": op["ts"], "dur": 0.0, "pid": op["pid"], "tid": op["tid"],
                       "args": {"correlation": i}})
        events.append({"ph": "X", "cat": "kernel", "name": op["name"], "ts": 0.0, "dur": 1.0,
                       "args": {"correlation": i}})
    found: dict[str, set[str]] = {}  # the modules of each operator
    launched: dict[str, set[str]] = {}  # the operators of each module
    for kernel, name in module.gpu_report.launching_modules(trace):
        found.setdefault(kernel["name"], set()).add(name)
        launched.setdefault(name, set()).add(kernel["name"])
    assert found["aten::rsqrt"] == found["aten::pow"] == {"LlamaRMSNorm"}
    assert launched["LlamaDecoderLayer"] == {"aten::add"}  # its own: the residual sums
    assert "aten::linear" in launched["Linear"]  # the bf16 head, a span of its own
    assert "Linear W4A4" in launched
    assert module.gpu_report.NO_MODULE not in launched
    shares = module.gpu_report.module_shares(module.gpu_report.by_module(trace))
    assert shares.startswith("Linear W4A4 ")  # the emulated product's operators, most of all
    # the summary's line, from gpu_report's own small trace (a norm, a linear, a layer)
    run = module.Run(module.TINY, torch.device("cpu"), ["nvfp4"], 60.0)
    module.module_line(run, module.gpu_report.tiny_trace(tmp_path), "model nvfp4: one step")
    assert run.summary == [["model nvfp4: one step, kernel time by module (share, launches)",
                            "Linear W4A4 84% (3), LlamaRMSNorm 6% (1), (no module) 3% (1), "
                            "LlamaDecoderLayer 3% (1)", "", ""]]


@pytest.mark.slow  # 140 s on 2 cores; run before each GPU session (gpu_session.sh image-check)
def test_gpu_bench_tiny_run(capsys, tmp_path):
    """bench/gpu.py's every section on tiny shapes under the interpreter, its summary last, no
    section failing (the device script cannot rot between GPU sessions)."""
    needs_kernels()
    module = gpu_bench()
    module.main(["--tiny", "--formats", "nvfp4"])
    out = capsys.readouterr().out
    summary = out[out.index("## summary"):]
    for row in ("bit for bit the CPU reference | 1/1", "within one bf16 rounding of the exact "
                "product | 7/7", "one-row DP4A product (opt-in) within one bf16 rounding of the "
                "exact product, alone and as siblings | 2/2", "linear M=1 nvfp4",
                "activation nvfp4 16x16 blocks, exact",
                "decode-step activation kernel nvfp4: time of 'fma dot, 4 warps'",
                "model nvfp4: decode batch 2", "model nvfp4: prefill",
                "rows from which prefill beats decode, nvfp4", "peers: skipped",
                "model nvfp4 compiled: decode batch 1 x bf16 compiled",
                "model nvfp4, each linear on its own compiled: decode batch 1 x bf16 compiled",
                "model nvfp4, one-row DP4A compiled: decode batch 1 x bf16 compiled",
                "model nvfp4 compiled batch 1: tok/s on the one-row DP4A product over the "
                "default's",
                "model nvfp4, each linear on its own compiled: one batch-1 step's kernel time, "
                "launches and span (us), against the step's",
                "model nvfp4: decode batch 1 x bf16, one-row DP4A product (opt-in)",
                "model nvfp4: decode batch 1 x bf16, each linear launched on its own",
                "model nvfp4: decode batch 1 x bf16, both without a CUDA graph",
                "linear M=4096 nvfp4, KBBQ blocks, activations on tensor cores (opt-in)"):
        assert row in summary, row
    assert "; one-row DP4A " in summary  # the linear at M = 1 with the opt-in product
    assert "| x bf16, one-row DP4A | DP4A within one |" in out
    # the decode path's fixed cost and rate fitted over the shapes (one shape here: no fit)
    assert "| 1 | nvfp4 | decode GEMM | 1 | nan | nan |" in out
    assert ("launch floors in a CUDA graph, us a call (M = 1, 512 -> 64, nvfp4) | "
            "empty kernel ") in out
    # the model's W4A4 layers run on the kernels (the interpreter), as on a GPU: MX's decode
    # steps through the decode path (q/k/v and gate/up grouped), its first block's linears
    # against the emulation
    with mock.patch.object(K, "_decode_path", wraps=K._decode_path) as decode_path, \
            mock.patch.object(K, "linear_w4a4_siblings", wraps=K.linear_w4a4_siblings) as grouped:
        module.main(["--tiny", "--formats", "mxfp4", "--sections", "model"])
    out = capsys.readouterr().out
    assert decode_path.call_count > 0 and grouped.call_count > 0
    model_row = next(line for line in out.splitlines() if line.startswith("| mxfp4 | ")
                     and line.count("|") == 15)
    assert float(model_row.split("|")[12]) < 1e-2, model_row
    # compiled, the sibling pass runs q/k/v and gate/up as one operator each (then the same on
    # the one-row DP4A product, one launch for each group's siblings too; then, the pass off,
    # each linear alone)
    from kbbq_pl.kernels import skinny
    from kbbq_pl.quant import siblings

    made, dp4a_groups = [], []

    def merge(graph):
        made.append(real_merge(graph))
        return made[-1]

    def decode_gemm(*args, **kwargs):
        if kwargs.get("a_scales") is not None:
            dp4a_groups.append(len(args[2]) if isinstance(args[2], list) else 1)
        return real_gemm(*args, **kwargs)

    real_merge, real_gemm = siblings.merge_sibling_linears, skinny.skinny_matmul
    # compiled afresh: a graph Inductor cached (this test's first run made it) skips the pass
    with mock.patch.object(siblings, "merge_sibling_linears", merge), \
            mock.patch.object(K, "linear_w4a4_siblings", wraps=K.linear_w4a4_siblings) as grouped, \
            mock.patch.object(skinny, "skinny_matmul", decode_gemm), \
            torch._inductor.config.patch(force_disable_caches=True):
        module.main(["--tiny", "--formats", "mxfp4", "--sections", "compiled"])
    compiled_out = capsys.readouterr().out
    assert 2 in made and grouped.call_count > 0, made
    assert "| mxfp4, each linear on its own | " in compiled_out
    assert "| mxfp4, one-row DP4A | " in compiled_out and "FAILED" not in compiled_out
    assert "trace_mxfp4_one-row-DP4A_compiled.json.gz: kernels by launch shape" in compiled_out
    assert {2, 3} <= set(dp4a_groups), dp4a_groups  # gate/up and q/k/v on DP4A, grouped
    # a goal missed (every speed goal, on the CPU) says by how much
    assert "| 0.35 | 0/1; worst " in summary and "x from the target |" in summary
    assert "FAILED" not in summary
    # the opt-in tune section: a tile and its K splits against the launch as shipped
    module.main(["--tiny", "--formats", "nvfp4", "--sections", "tune"])
    out = capsys.readouterr().out
    summary = out.split("## summary")[1]
    assert "tune 128->32 nvfp4: best tile (copy fraction; x as shipped)" in summary
    assert "| 128->32 | nvfp4 | DP4A as shipped | auto |" in out
    assert "FAILED" not in summary
    # MX's opt-in FP8 prefill product: checked and timed in the gemm and rows sections
    module.main(["--tiny", "--formats", "mxfp4", "--sections", "check,gemm,rows"])
    out = capsys.readouterr().out
    summary = out[out.index("## summary"):]
    assert "within one bf16 rounding of the exact product | 8/8" in summary
    assert "mxfp4 on FP8 tensor cores (opt-in, eager): x bf16" in summary
    assert "rows from which the FP8 product (graph, no host read) beats decode" in summary
    assert "| fp8 (graph, no host read) |" in out
    assert "ran; yes; differ 0" in out and "FAILED" not in summary
    # an opt-in row that raises costs its section nothing else: noted, not tried again (the
    # checks in this process, as their child process runs them)
    record = tmp_path / "check.json"
    with mock.patch.object(K, "_fp8_product", side_effect=RuntimeError("no FP8 here")):
        module.main(["--tiny", "--formats", "mxfp4", "--check-child", str(tmp_path / "step"),
                     "--json", str(record)])
    found = json.loads(record.read_text())
    assert "MX on FP8 tensor cores: FAILED (RuntimeError: no FP8 here); the run goes on " \
           "without it" in found["notes"]
    assert ["every path within one bf16 rounding of the exact product", "7/7", "all",
            "yes"] in found["summary"]
    assert (tmp_path / "step").read_text() == "done"


def test_gemlite_nvfp4_peers_skipped_where_triton_cannot_compile_them():
    """GemLite's NVFP4 layers (``tl.dot_scaled`` with E4M3 scales) do not compile for sm_90
    before Triton 3.8: the bench skips them there, with a note, instead of failing every row."""
    compiles = gpu_bench().gemlite_compiles
    assert not compiles("nvfp4", "3.6.0", 9) and not compiles("nvfp4", "3.7.1+git", 9)
    assert compiles("nvfp4", "3.8.0", 9) and compiles("nvfp4", "3.6.0", 10)
    assert compiles("mxfp4", "3.6.0", 9) and compiles("nvfp4", "3.6.0", None)


GEMLITE_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


class GemLiteWeightOnlyStandIn(torch.nn.Module):
    """What GemLite 0.6's weight-only FP4 layer computes, as its source reads (it imports only
    with CUDA): codes ``[N, K/2]`` with element ``2i`` in the low nibble
    (``pack_weights_over_cols``), indices into its E2M1 table (``quant_utils.fp4_values``), one
    scale per group along K, the FP32 sum times ``meta_scale`` for NVFP4 (group 16), rounded to
    bf16.  ``high_first`` swaps the nibbles: a layout that is not GemLite's, which the bench's
    check must catch.  Its MX scales are what GemLite's ``pack`` makes of them (converted
    ``.to(torch.float8_e8m0fnu)``)."""

    def __init__(self, packed, scales, group: int, high_first: bool = False):
        super().__init__()
        nibbles = [packed & 15, packed >> 4]
        if high_first:
            nibbles.reverse()
        codes = torch.stack(nibbles, -1).flatten(-2).long()
        self.weight = GEMLITE_E2M1[codes] * scales.float().repeat_interleave(group, -1)
        self.group = group
        self.meta_scale = torch.nn.Parameter(torch.tensor(0.0), requires_grad=False)

    def forward(self, x):
        acc = x.float() @ self.weight.T
        return (acc * self.meta_scale if self.group == 16 else acc).to(torch.bfloat16)


def gemlite_stand_in(high_first: bool = False):
    """``gemlite.helper``'s two weight-only classes, with its ``from_packed_weights`` signatures."""

    class A16W4_NVFP:  # noqa: N801 - GemLite's names
        def __init__(self, device, dtype):
            assert dtype == torch.bfloat16

        def from_packed_weights(self, weight_packed, bias=None, scales=None, meta_scale=None):
            assert weight_packed.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
            return GemLiteWeightOnlyStandIn(weight_packed, scales, 16, high_first)

    class A16W4_MXFP:  # noqa: N801
        def __init__(self, device, dtype):
            assert dtype == torch.bfloat16

        def from_packed_weights(self, W_q_packed, scales, bias=None):  # noqa: N803
            assert W_q_packed.dtype == torch.uint8
            # GemLite's pack: scales.to(float8_e8m0fnu), which converts uint8 bytes by value
            exponents = scales.to(torch.float8_e8m0fnu).view(torch.uint8)
            return GemLiteWeightOnlyStandIn(W_q_packed, torch.exp2(exponents.float() - 127), 32,
                                            high_first)

    return type("helper", (), dict(A16W4_NVFP=A16W4_NVFP, A16W4_MXFP=A16W4_MXFP))


@pytest.mark.slow  # 70 s on 2 cores; run before each GPU session (gpu_session.sh image-check)
def test_gpu_bench_gemlite_on_our_operands(capsys):
    """The peers section builds GemLite's weight-only layers from the codes and scales as we
    store them (NVFP4 with both per-tensor scales as its epilogue's factor), feeds them our
    activation values, and says whether that is our product: yes for GemLite's layout (a
    stand-in, on the CPU), NO for a layout with the nibbles swapped."""
    needs_kernels()
    module = gpu_bench()
    for high_first, verdict in ((False, "1/1"), (True, "0/1")):
        with mock.patch.object(module, "gemlite_helper",
                               return_value=gemlite_stand_in(high_first)):
            module.main(["--tiny", "--formats", "nvfp4,mxfp4", "--sections", "peers"])
        out = capsys.readouterr().out
        summary = out[out.index("## summary"):]
        for fmt in ("nvfp4", "mxfp4"):
            assert f"GemLite A16W4 on our operands, {fmt} M=1: its time / ours, min/median/max " \
                   f"(same product {verdict}, deterministic 1/1)" in summary, summary
        assert ("| yes | yes |" in out) != high_first and ("| NO (" in out) == high_first
        assert "| GemLite A16W4_NVFP |" in out and "| GemLite A16W4_MXFP |" in out  # as peers
        assert "FAILED" not in summary and "peers: skipped" not in summary


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_stream_reads_every_byte_of_its_slice(splits):
    """The stream diagnostic (``bench/_gpu_stream.py``) XORs every word of codes (and every
    scale byte, where given) of each K slice, read as stored and from the tile-by-tile copies
    (``skinny.tile_major``): torch's XOR every way; a wrong tile order fails."""
    needs_kernels()
    from kbbq_pl.kernels import skinny

    stream = gpu_bench()._bench_module("_gpu_stream")
    gen = torch.Generator().manual_seed(splits)
    codes = torch.randint(0, 256, (64, 512), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=gen)  # D = 16
    tiled = skinny.tile_major(codes, scales, 32, 128)
    for with_scales in (None, scales):
        expected = stream.stream_reference(codes, splits, with_scales)
        for layout in (None, tiled):
            got = stream.stream_words(codes, splits, 32, 128, with_scales, layout)
            assert torch.equal(got, expected), (with_scales is None, layout is None)
    assert not torch.equal(expected, stream.stream_reference(codes, splits))  # scales count
    if splits > 1:  # each column tile's trips in the wrong order
        swapped = tuple(part.flip(1).contiguous() for part in tiled)
        assert not torch.equal(stream.stream_words(codes, splits, 32, 128, scales, swapped),
                               expected)
    with pytest.raises(ValueError, match="N a multiple of 32 and K of 128 x 16 splits"):
        stream.stream_words(codes, 16, 32, 128)


@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # raw bits: inf, NaN
def test_gpu_bench_stream_section(capsys):
    """``--sections stream`` times the decode GEMM beside its weight reads alone, as stored
    and tile by tile, each read checked against torch's, and beside itself on the tiles (the
    same bits) and without its decode, and says it in the summary."""
    needs_kernels()
    gpu_bench().main(["--tiny", "--formats", "nvfp4,mxfp4", "--sections", "stream"])
    out = capsys.readouterr().out
    summary = out[out.index("## summary"):]
    for fmt in ("nvfp4", "mxfp4"):
        for what in ("decode GEMM", "codes rows, s=2", "weights rows, s=2",
                     "weights tiles, s=2", "weights rows, s=4", "weights tiles, s=4",
                     "decode GEMM tiles", "decode GEMM, no decode"):
            assert f"| 128->32 | {fmt} | {what} | 1 |" in out, (fmt, what)
        assert (f"stream 128->32 {fmt}: copy fraction of the weights read as stored / tile by "
                "tile (s=2); the codes alone as stored; the decode GEMM's as stored / tile by "
                "tile / without its decode") in summary
    assert out.count("| yes |") == 10 and out.count("| same bits |") == 2
    assert "| NO |" not in out
    assert "FAILED" not in summary


STREAM_COMPILE_CHECK = """
import sys
sys.path.insert(0, {bench!r})
from triton.backends.compiler import GPUTarget
import gpu_compile as G, _gpu_stream
from kbbq_pl.kernels import skinny as S

config = S._CONFIGS[0]  # the decode step's tile: the stream reads as its loop does
block_n, block_k = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
signature = {{"w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": "*i32", "K_WORDS": "i32",
             "stride_wn": "i32", "stride_sn": "i32"}}
for tiled in (False, True):
    for d in (0, 16, 32):
        smem = []
        for stages in (config.num_stages, 2 * config.num_stages):
            compiled = G.compile_kernel(
                _gpu_stream._stream_kernel, signature,
                dict(TILED=tiled, D=d, BLOCK_N=block_n, BLOCK_C=block_k // 8, STAGES=stages),
                GPUTarget("cuda", 90, 32), num_warps=config.num_warps)
            loop = G.main_loop(G.sass_ops(compiled.asm["cubin"]))
            assert any(op.startswith("LDGSTS") and ".128" in op for op in loop), loop
            assert not any(op.startswith("LDG.") for op in loop), loop
            smem.append(compiled.metadata.shared)
        # a stage of the tile's codes and scale bytes in shared memory for each stage but the
        # one in use
        trip = block_n * block_k // 2 + (block_n * block_k // d if d else 0)
        assert smem[1] - smem[0] == config.num_stages * trip, (tiled, d, smem)
# bench/gpu_compile.py --kernels stream: every row compiles, nothing spills
rows = G.stream_rows(GPUTarget("cuda", 90, 32))
assert len(rows) == 16 and all(row["stack"] == 0 for row in rows), rows
print("ok")
"""


def test_stream_compiles_to_the_decode_gemms_loads():
    """Compiled for sm_90, the stream's loop loads through ``cp.async`` (16-byte ``LDGSTS``, no
    loads to registers), a stage of its tile's codes and scale bytes in shared memory for every
    stage of its depth but one, as the decode GEMM's loop does: what it times is that loop's
    reads; ``bench/gpu_compile.py --kernels stream`` compiles every row."""
    run_compile_check(STREAM_COMPILE_CHECK)


COMPILES_CHECK = """
import importlib.util, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
sys.path.insert(0, {bench!r})
import gpu_compile as G
from kbbq_pl.kernels import skinny as S

spec = importlib.util.spec_from_file_location("bench_gpu", {bench!r} + "/gpu.py")
module = importlib.util.module_from_spec(spec)
sys.modules["bench_gpu"] = module
spec.loader.exec_module(module)
triton.knobs.cache.dir = tempfile.mkdtemp()  # nothing compiled before
run = module.Run(module.TINY, None, ["nvfp4"], 100.0)
triton.knobs.compilation.listener = run.compiles
for _ in range(2):  # compiled, then found in the cache
    with module.section(run, "stream"):
        G.compile_decode_gemm(GPUTarget("cuda", 90, 32), 16, G.tk.SCALE_E4M3, S._CONFIGS[0])
first, second = [r for r in run.rows if r["section"] == "compiles"]
counts = [(row["kernels"], row["hits"]) for row in (first, second)]
assert counts == [(1, 0), (0, 1)], run.rows
assert 0 < first["compile_s"] <= first["wall_s"] and second["compile_s"] == 0, run.rows
assert run.notes[0].startswith("stream: ") and "(compiling 1 Triton kernel: " in run.notes[0]
assert run.notes[1].endswith("(compiling 0 Triton kernels: 0 s; 1 from the cache)"), run.notes
print("ok")
"""


def test_gpu_bench_counts_its_compiles_and_cache_hits():
    """``bench/gpu.py`` counts Triton's compiles through its listener: each section's note and
    row say how many kernels it compiled, in how many seconds, and how many came from the
    cache (a GPU session carries the cache to the next); compiled for sm_90 here."""
    run_compile_check(COMPILES_CHECK)


def test_gpu_bench_peers_stop_for_time(capsys):
    """A peer row that would start with less than its reserve of the budget left is not
    started (GemLite compiles for minutes on a new shape): said once in the summary."""
    needs_kernels()
    module = gpu_bench()
    with (mock.patch.object(module, "gemlite_helper", return_value=gemlite_stand_in()),
          mock.patch.object(module, "PEER_RESERVE_S", 100.0)):
        module.main(["--tiny", "--formats", "nvfp4", "--sections", "peers", "--budget-s", "100"])
    summary = capsys.readouterr().out.split("## summary")[1]
    assert "peers: stopped for time before GemLite A16W4_NVFP at 128->48 M=1" in summary
    assert summary.count("stopped for time") == 1 and "GemLite A16W4 on our operands" not in summary


CHECK_CHILD_STAND_IN = """
import argparse, json, pathlib, sys, time
scenario = sys.argv[1]
parser = argparse.ArgumentParser()
for flag in ("--budget-s", "--json", "--check-child", "--off"):
    parser.add_argument(flag)
args = parser.parse_args(sys.argv[2:])
off = [step for step in args.off.split(",") if step]
with open(pathlib.Path(args.json).parent.parent / "runs", "a") as runs:
    runs.write(",".join(off) + ";")
record = dict(rows=[dict(section="check", kind="stand-in")], notes=["child note"],
              summary=[["child row", "1/1", "all", "yes"]], off=off, failed=[])
step = {"direct": "direct", "dp4a": "dp4a", "paths": "paths", "hang": "siblings",
        "slow": "dp4a"}.get(scenario)
if scenario == "start":
    sys.exit(1)
if step is not None and step not in off:
    pathlib.Path(args.check_child).write_text(step)
    pathlib.Path(args.json).write_text(json.dumps(record))  # what a failed child leaves
    if scenario in ("hang", "slow"):
        time.sleep(60)
    sys.exit(3)
pathlib.Path(args.check_child).write_text("done")
if scenario == "differs":  # the child turned a switch off, an opt-in row failed there
    record.update(off=off + ["siblings"], failed=["MX on FP8 tensor cores"])
pathlib.Path(args.json).write_text(json.dumps(record))
"""


@pytest.mark.parametrize("scenario, stopped, now_off", [
    ("direct", "stopped in step 'direct' (exit code 3); direct launches off", ["direct"]),
    ("dp4a", "stopped in step 'dp4a' (exit code 3); the one-row DP4A", ["dp4a"]),
    ("hang", "stopped in step 'siblings' (no end in 2 s); sibling linears", ["siblings"]),
    ("paths", "stopped in step 'paths' (exit code 3); the run goes on", []),
    ("slow", "stopped in step 'dp4a' (out of the run's time); the run goes on", []),
    ("differs", None, ["siblings"]),
    ("start", "began no step (exit code 1); the checks run in this process", []),
])
def test_gpu_bench_checks_in_a_child_process(tmp_path, monkeypatch, scenario, stopped, now_off):
    """bench/gpu.py's checks run in a child process (a stand-in here), so that a fault of a kernel
    or launch path no GPU has run cannot take the rest of the run with it: a child that fails
    or stays in a step with a switch has that switch turned off here and runs again without it
    (the opt-in DP4A product: its rows are not run); a failure in the kernels themselves, or
    the run's time running out, is noted, with what the child found before; what the child
    turned off, and the opt-in rows that failed there, are off here; its rows, summary lines
    and notes join the run's; a child that began no step is replaced by the checks here."""
    from kbbq_pl.kernels import direct_launch

    module = gpu_bench()
    for path, attribute, _, _ in module.SWITCHES.values():
        if path is not None:  # restored after the test
            monkeypatch.setattr(importlib.import_module(path), attribute,
                                getattr(importlib.import_module(path), attribute))
    monkeypatch.setattr(module, "CHECK_STEP_S", 30.0 if scenario == "slow" else 2.0)
    monkeypatch.setattr(module.tempfile, "tempdir", str(tmp_path))
    here = []
    monkeypatch.setattr(module, "run_checks", here.append)
    script = tmp_path / "child.py"
    script.write_text(CHECK_CHILD_STAND_IN)
    run = module.Run(module.TINY, torch.device("cpu"), ["nvfp4"],
                     3.0 if scenario == "slow" else 100.0)
    module.check_in_child(run, [sys.executable, str(script), scenario])
    assert module.switched_off(run) == now_off
    assert (direct_launch.DIRECT, K.MAX_SIBLINGS >= 2) == tuple(
        step not in now_off for step in ("direct", "siblings"))
    tried = []
    assert module.attempt(run, "a DP4A row", lambda: tried.append(1), "not run",
                          step="dp4a") == ("not run" if "dp4a" in now_off else None)
    assert tried == ([] if "dp4a" in now_off else [1])
    assert stopped is None or any(stopped in note for note in run.notes), run.notes
    assert here == ([run] if scenario == "start" else [])
    runs = (tmp_path / "runs").read_text().split(";")[:-1]
    assert runs == (["", now_off[0]] if stopped and now_off else [""])
    if scenario == "start":
        assert run.rows == [] and run.summary == []
        return
    assert run.rows == [dict(section="check", kind="stand-in")]
    assert "child note" in run.notes
    assert run.failed == ({"MX on FP8 tensor cores"} if scenario == "differs" else set())
    if now_off or scenario == "differs":
        assert run.summary == [["child row", "1/1", "all", "yes"]]
    else:  # noted, with what the child found before
        step = stopped.split("'")[1]
        assert run.summary == [["child row", "1/1", "all", "yes"],
                               ["checks (a child process)", f"stopped in {step!r}", "all", "NO"]]


def test_gpu_bench_check_steps_run_each_launch_path_first_alone(tmp_path, monkeypatch, capsys):
    """The check's child (here in this process) runs the products without the direct launch
    (a fault there is named by its own step), leaves out a step turned off (--off) and reports
    it off; a step's fault in the device's earlier work is raised before the step is named.
    Each step's seconds and compiles are a row, and a note (none compile under the
    interpreter)."""
    from kbbq_pl.kernels import direct_launch

    module = gpu_bench()
    monkeypatch.setattr(direct_launch, "DIRECT", True)
    launches = []

    def checked(y, ref):
        launches.append(direct_launch.DIRECT)
        return within(y, ref)

    within = module.within_one_rounding
    monkeypatch.setattr(module, "within_one_rounding", checked)
    record, progress = tmp_path / "check.json", tmp_path / "step"
    module.main(["--tiny", "--formats", "nvfp4", "--check-child", str(progress), "--off",
                 "dp4a", "--json", str(record)])
    out = capsys.readouterr().out
    found = json.loads(record.read_text())
    assert found["off"] == ["dp4a"] and progress.read_text() == "done"
    steps = re.findall(r"^\(check step: (\w+), at \d+ s\)$", out, re.MULTILINE)
    assert steps == ["codes", "paths", "siblings", "direct", "done"], steps
    timed = [r["step"] for r in found["rows"] if r["section"] == "compiles"]
    assert timed == ["check: codes", "check: paths", "check: siblings", "check: direct"], timed
    assert re.search(r"check steps, s .*: codes \d+ \(0; 0, 0\), paths .* direct \d+ "
                     r"\(0; 0, 0\)$", "\n".join(found["notes"]), re.MULTILINE), found["notes"]
    # 5 paths and 2 x 3 siblings (the DP4A step off), none launched directly
    assert len(launches) == 11 and set(launches) == {False}, launches
    assert direct_launch.DIRECT  # as shipped after the checks
    run = module.Run(module.TINY, torch.device("cuda"), ["nvfp4"], 100.0, progress=progress)
    with mock.patch.object(torch.cuda, "synchronize", side_effect=RuntimeError("fault")), \
            pytest.raises(RuntimeError, match="fault"):
        run.step("next")
    assert progress.read_text() == "done"


def test_gpu_bench_runs_no_dp4a_row_once_its_check_is_off(capsys):
    """With the ``dp4a`` check step off (its child faulted there), the tune section times no
    DP4A tile and compiles no int8 activations; the other tiles are still timed."""
    needs_kernels()
    module = gpu_bench()
    with mock.patch.object(K, "_activation_kernel", wraps=K._activation_kernel) as activations:
        module.main(["--tiny", "--formats", "nvfp4", "--sections", "tune", "--off", "dp4a"])
    out = capsys.readouterr().out
    assert "| 128->32 | nvfp4 | as shipped | auto |" in out and "DP4A" not in out.split(
        "## tune")[1].split("## summary")[0]
    assert all(call.kwargs.get("values_dtype") != torch.int8
               for call in activations.call_args_list)


def test_gpu_bench_summary_survives_the_time_limit(tmp_path):
    """SIGTERM (the device call's ``timeout``) mid-section: the run still writes its JSON and
    prints the summary, naming the section the limit stopped."""
    needs_kernels()
    bench = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
    out = tmp_path / "bench.json"
    process = subprocess.Popen([sys.executable, "-u", str(bench), "--tiny", "--formats", "nvfp4",
                                "--sections", "gemm", "--json", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("## gemm"):
            process.send_signal(signal.SIGTERM)
            break
    lines.append(process.communicate(timeout=120)[0])
    printed = "".join(lines)
    assert process.returncode != 0
    assert "## summary" in printed and "gemm: STOPPED by the time limit" in printed, printed
    assert "gemm: STOPPED by the time limit" in json.loads(out.read_text())["notes"][-1]


# --------------------------------------------------------------------------- GPU


GPU_SHAPES = [1, 16, 512, 4096]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_activation_codes_equal_cpu_reference(fmt):
    device = torch.device("cuda")
    needs_kernels(device)
    d, k = block(fmt), 2048
    t = make_transform("random", k, d, seed=11)
    for m in GPU_SHAPES:
        x = (torch.randn(m, k) * 4).to(torch.bfloat16)
        got = K.quantize_activations(x.to(device), t.to(device), fmt)
        got = tuple(None if v is None else v.cpu() for v in got)
        want = K.reference_quantize_activations(x, t, fmt)
        codes, ref_codes = got[0], want[0]
        rate = float((codes != ref_codes).float().mean())
        print(f"{fmt} M={m}: code-byte mismatch rate {rate:.3g}")
        assert_same_quantization(got, want, f"GPU {fmt} M={m} (code mismatch rate {rate:.3g})")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_gpu_gemm_accuracy(fmt):
    device = torch.device("cuda")
    needs_kernels(device)
    n = k = 2048
    for m in GPU_SHAPES:
        (codes, scales, pts), q = operands(fmt, m, n, k, seed=m, device=device)
        args = [v.to(device) if v is not None else None
                for v in (codes, scales, pts, q.qdata, q.scale, q.global_scale)]
        bias = torch.randn(n, device=device)
        ref = K.reference_w4a4_matmul(*args, fmt, bias)
        y = K.w4a4_matmul(*args, fmt, bias, torch.float32)
        assert gemm_error(y, ref) <= 1e-5, (fmt, m, gemm_error(y, ref))
        assert_within_one_bf16_rounding(K.w4a4_matmul(*args, fmt, bias), ref)
