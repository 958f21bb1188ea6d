"""MX on FP8 tensor cores (issue 45's stretch): the fold of MX operands into E4M3 with one scale
per 128 along K, and the opt-in prefill product ``fp8`` of ``kbbq_pl.kernels.linear_w4a4``.

The fold (kbbq_pl.kernels.exact.fold_mx_to_e4m3) must give back every MX value exactly, for
every E2M1 code at every shift it allows, and flag the chunks it cannot fold; the Triton fold
(under the interpreter) must give the reference's bytes, scales and count; the product must be
within one bf16 rounding of the exact product, and fall back to the bf16 product where a chunk
does not fold.  On the CPU the product of the folded operands is formed in FP32; the ``gpu``
test runs cuBLAS's block-scaled FP8 product.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from test_fast_paths import E2M1_ALL, decode_operands, exact_product, needs_kernels
from test_kernels import assert_within_one_bf16_rounding, make_transform, run_compile_check

from kbbq_pl import formats as F
from kbbq_pl import kernels as K
from kbbq_pl.kernels import exact

pytestmark = pytest.mark.usefixtures("one_thread")

def spans_operand(spans: list[int], second_block_codes: torch.Tensor | None = None):
    """One row per span ``s``: a chunk of four MX blocks, the first at exponent 10 holding
    6.0, the second ``s`` binades under it holding every code twice (or the given codes), the
    last two zero blocks at the smallest exponent."""
    codes = torch.zeros(len(spans), 128, dtype=torch.uint8)
    codes[:, :32] = 7
    codes[:, 32:64] = (torch.arange(32) % 16 if second_block_codes is None
                       else second_block_codes).to(torch.uint8)
    exponents = torch.zeros(len(spans), 4, dtype=torch.uint8)
    exponents[:, 0] = 127 + 10
    exponents[:, 1] = torch.tensor([127 + 10 - s for s in spans], dtype=torch.uint8)
    return F.pack_nibbles(codes), exponents


def decoded(packed: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    codes = F.unpack_nibbles(packed).long()
    e = exponents.to(torch.float64) - 127
    scale = torch.where(exponents == 255, float("nan"), torch.exp2(e))
    return E2M1_ALL[codes] * scale.repeat_interleave(packed.shape[1] * 2 // exponents.shape[1],
                                                     dim=1)


def test_every_e2m1_value_folds_exactly_at_every_allowed_shift():
    """Shifts 6 down to -8 (spans 0 to 14 binades under the chunk's largest block): every code,
    signed zero included, gives back ``q * 2^e`` exactly; at 15 binades the chunk is inexact;
    zero blocks do not count, whatever their exponent."""
    packed, exponents = spans_operand(list(range(15)))
    values, scales, inexact = exact.fold_mx_to_e4m3(packed, exponents)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (15, 128)
    assert scales.shape == (15, 1) and not inexact.any()
    assert torch.equal(scales[:, 0], torch.full((15,), 2.0**4))  # 2^(10 - FP8_HEADROOM)
    unfolded = values.double() * scales.double()
    assert torch.equal(unfolded, decoded(packed, exponents))
    negative_zero = values[:, 32 + 8].view(torch.uint8)  # code 8: -0
    assert torch.equal(negative_zero, torch.full((15,), 0x80, dtype=torch.uint8))
    _, _, inexact = exact.fold_mx_to_e4m3(*spans_operand([15]))
    assert inexact.all()
    zeros = spans_operand([40], torch.zeros(32))  # a zero block far under: exact
    assert not exact.fold_mx_to_e4m3(*zeros)[2].any()


def test_fold_of_random_mx_operands_and_nan_blocks():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 512, generator=gen) * torch.logspace(-4, 4, 24)[:, None]
    w[5, 64:96] = 0.0
    q = F.quantize(w, "mxfp4")
    exponents = q.scale.view(torch.uint8).clone()
    exponents[7, 2] = 255  # a non-finite block: NaN throughout
    exponents[9, 5] -= 20  # 20 binades under its neighbours: its chunk does not fold
    values, scales, inexact = exact.fold_mx_to_e4m3(q.qdata, exponents)
    assert inexact.nonzero().tolist() == [[9, 1]]
    unfolded = values.double() * scales.double().repeat_interleave(128, dim=1)
    want = decoded(q.qdata, exponents)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(unfolded), nan) and int(nan.sum()) == 32
    folds = ~inexact.repeat_interleave(128, dim=1) & ~nan
    assert torch.equal(unfolded[folds], want[folds])


def test_triton_fold_gives_the_reference_bytes_scales_and_count():
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(13, 768, generator=gen) * torch.logspace(-3, 3, 13)[:, None]
    q = F.quantize(w, "mxfp4")
    exponents = q.scale.view(torch.uint8).clone()
    exponents[2, 0] = 255
    exponents[4, 9] -= 30
    exponents[6, 20] -= 15
    packed, spans = spans_operand(list(range(16)))
    for codes, exps in ((q.qdata, exponents), (packed, spans)):
        want_values, want_scales, want_inexact = exact.fold_mx_to_e4m3(codes, exps)
        counter = torch.zeros(1, dtype=torch.int32)
        values, scales = tk.fold_e4m3(codes, exps, 32, counter)
        assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
        assert torch.equal(scales, want_scales) and scales.stride() == (1, codes.shape[0])
        assert int(counter) == int(want_inexact.sum()) > 0
    shifted = []  # the same codes and exponents in views that do not start on a word
    for t in (q.qdata, exponents):
        buffer = torch.zeros(t.numel() + 1, dtype=torch.uint8)
        shifted.append(buffer[1:].view(t.shape))
        shifted[-1].copy_(t)
    counter = torch.zeros(1, dtype=torch.int32)
    values, scales = tk.fold_e4m3(*shifted, 32, counter)
    want_values, want_scales, want_inexact = exact.fold_mx_to_e4m3(q.qdata, exponents)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales, want_scales) and int(counter) == int(want_inexact.sum())
    counter = torch.zeros(1, dtype=torch.int32)
    _, scaled = tk.fold_e4m3(q.qdata, q.scale.view(torch.uint8), 32, counter, 1 / 0.5625)
    assert torch.equal(scaled, exact.fold_mx_to_e4m3(q.qdata, q.scale)[1] * (1 / 0.5625))


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp4_no_clip"])
@pytest.mark.parametrize("kind", ["random", None])
def test_activation_kernel_folds_as_the_reference_folds_its_codes(fmt, kind):
    """The activation kernel's E4M3 output (the FP8 product's activations) is the reference
    fold of the reference codes, byte for byte, with its chunk scales and inexact count: rows
    not a multiple of the tile, a zero block, a NaN, a block far under its chunk."""
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(37, 384, generator=gen) * torch.logspace(-2, 2, 384)).to(torch.bfloat16)
    x[3, 96:128] = 0
    x[5, 200] = float("nan")
    x[7, 0:32] *= 1e-6
    t = make_transform(kind, 384, 32, seed=6) if kind else None
    codes, scales, _ = K.reference_quantize_activations(x, t, fmt)
    want_values, want_scales, want_inexact = exact.fold_mx_to_e4m3(codes, scales)
    counter = torch.zeros(1, dtype=torch.int32)
    kind_, rounding, gain = K._scale_meta(F.get_format(fmt))
    values, chunk_scales, _, _ = tk.quantize_activations(
        x, None if t is None else t.contiguous(), 32, kind_, rounding, gain, None,
        e4m3_inexact=counter)
    assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(chunk_scales, want_scales) and chunk_scales.stride() == (1, 37)
    assert int(counter) == int(want_inexact.sum()) >= 1


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp4_no_clip"])
def test_fp8_prefill_product_is_within_one_rounding(fmt):
    needs_kernels()
    k, n = 256, 32
    t = make_transform("random", k, 32, seed=5)
    x, q = decode_operands(fmt, 20, n, k, seed=8)
    ref = exact_product(x, q, fmt, t)
    with mock.patch.object(K, "_fp8_product", wraps=K._fp8_product) as fp8:
        y = K.linear_w4a4(x, q.qdata, q.scale, q.global_scale, fmt, t, path="prefill",
                          prefill_product="fp8")
    assert fp8.call_count == 1 and y.dtype == torch.bfloat16
    assert_within_one_bf16_rounding(y, ref)


def test_fp8_product_falls_back_where_a_chunk_does_not_fold_or_it_does_not_apply():
    needs_kernels()
    k, n = 256, 16
    x, q = decode_operands("mxfp4", 12, n, k, seed=9)
    exponents = q.scale.view(torch.uint8).clone()
    exponents[3, 1] -= 20  # the weights' row 3: one block 20 binades under its chunk
    codes, scales, _ = K.reference_quantize_activations(x, None, "mxfp4", None)
    ref = K.reference_w4a4_matmul(codes, scales, None, q.qdata, exponents, None, "mxfp4")
    returned = []

    def spy(*args):
        returned.append(K_fp8_product(*args))
        return returned[-1]

    K_fp8_product = K._fp8_product
    with mock.patch.object(K, "_fp8_product", spy):
        y = K.linear_w4a4(x, q.qdata, exponents, None, "mxfp4", path="prefill",
                          prefill_product="fp8")
    assert len(returned) == 1 and returned[0] is None
    assert torch.equal(y, K.linear_w4a4(x, q.qdata, exponents, None, "mxfp4", path="prefill"))
    assert_within_one_bf16_rounding(y, ref)
    # not MX, K not a multiple of 128, a bias, another output dtype: the bf16 product
    fmt = F.get_format("mxfp4")
    cpu = torch.device("cpu")
    assert K.fp8_product_applies(fmt, 256, 48, None, torch.bfloat16, cpu)
    assert not K.fp8_product_applies(F.get_format("nvfp4"), 256, 48, None, torch.bfloat16, cpu)
    assert not K.fp8_product_applies(fmt, 96, 48, None, torch.bfloat16, cpu)
    assert not K.fp8_product_applies(fmt, 256, 40, None, torch.bfloat16, cpu)
    assert not K.fp8_product_applies(fmt, 256, 48, torch.zeros(48), torch.bfloat16, cpu)
    assert not K.fp8_product_applies(fmt, 256, 48, None, torch.float32, cpu)
    for capability, capturing, applies in (((9, 0), False, True), ((9, 0), True, False),
                                           ((8, 0), False, False), ((10, 0), False, False)):
        with mock.patch.object(torch.cuda, "get_device_capability", return_value=capability), \
                mock.patch.object(torch.cuda, "is_current_stream_capturing",
                                  return_value=capturing):
            assert K.fp8_product_applies(fmt, 256, 48, None, torch.bfloat16,
                                         torch.device("cuda")) == applies
    xn, qn = decode_operands("nvfp4", 12, n, k, seed=9)
    with mock.patch.object(K, "_fp8_product") as fp8:
        y = K.linear_w4a4(xn, qn.qdata, qn.scale, qn.global_scale, "nvfp4", path="prefill",
                          prefill_product="fp8")
    assert fp8.call_count == 0
    assert torch.equal(y, K.linear_w4a4(xn, qn.qdata, qn.scale, qn.global_scale, "nvfp4",
                                        path="prefill"))


def test_weights_kept_folded_give_the_same_bits():
    """``prepare_weight(..., keep_decoded=True, prefill_product="fp8")`` keeps an MX weight
    folded to E4M3 (the fold checked once), and the product with it gives the bits of the
    per-call fold without folding the weights again; a weight that does not fold keeps its
    bf16 decode instead; NVFP4 and the default product keep the bf16 decode."""
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    k, n = 256, 32
    x, q = decode_operands("mxfp4_no_clip", 20, n, k, seed=4)
    per_call = K.linear_w4a4(x, q.qdata, q.scale, None, "mxfp4_no_clip", path="prefill",
                             prefill_product="fp8")
    kept = K.prepare_weight(q.qdata, q.scale, None, "mxfp4_no_clip", keep_decoded=True,
                            prefill_product="fp8")
    assert kept.decoded is None and kept.folded is not None
    assert kept.folded[0].dtype == torch.float8_e4m3fn and kept.folded[0].shape == (n, k)
    with mock.patch.object(tk, "fold_e4m3", wraps=tk.fold_e4m3) as fold:
        y = K.linear_w4a4(x, q.qdata, q.scale, None, "mxfp4_no_clip", path="prefill",
                          prefill_product="fp8", prepared=kept)
    assert fold.call_count == 0  # the activation kernel folds the activations
    assert torch.equal(y, per_call)
    exponents = q.scale.view(torch.uint8).clone()
    exponents[3, 1] -= 20
    unfolded = K.prepare_weight(q.qdata, exponents, None, "mxfp4", keep_decoded=True,
                                prefill_product="fp8")
    assert unfolded.folded is None and unfolded.decoded is not None
    for fmt, product in (("nvfp4", "fp8"), ("mxfp4", "auto")):
        _, qf = decode_operands(fmt, 1, n, k)
        prepared = K.prepare_weight(qf.qdata, qf.scale, qf.global_scale, fmt,
                                    keep_decoded=True, prefill_product=product)
        assert prepared.folded is None and prepared.decoded is not None
    with pytest.raises(ValueError, match="prefill_product must be one of"):
        K.prepare_weight(q.qdata, q.scale, None, "mxfp4", prefill_product="fp4")


def test_layers_take_the_fp8_product_when_asked():
    """``kbbq_pl.quant.w4a4.PREFILL_PRODUCT = "fp8"``: an MX W4A4 layer (no bias) on a kernel
    device multiplies its prefill rows on FP8; the default leaves it to the bf16 product."""
    needs_kernels()
    from torch import nn

    from kbbq_pl.quant import w4a4
    from kbbq_pl.quant.layers import w4a4_weight

    torch.manual_seed(1)
    layer = nn.Linear(256, 32, bias=False).to(torch.bfloat16)
    t = make_transform("hadamard", 256, 32)
    weight = w4a4_weight(layer, "mxfp4", t, name="probe")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    x = torch.randn(40, 256, dtype=torch.bfloat16)
    outputs = {}
    with torch.no_grad(), mock.patch.object(w4a4, "KERNEL_DEVICE_TYPES", ("cpu",)), \
            mock.patch.dict(K.PREFILL_MIN_M, e4m3=32, e8m0=32):
        for product, keep in (("auto", False), ("fp8", False), ("fp8", True)):
            with mock.patch.object(w4a4, "PREFILL_PRODUCT", product), \
                    mock.patch.object(w4a4, "KEEP_DECODED_WEIGHTS", keep), \
                    mock.patch.object(K, "_fp8_product", wraps=K._fp8_product) as fp8:
                outputs[product, keep] = layer(x)
            assert fp8.call_count == (product == "fp8")
            prepared = w4a4._prepared[layer.weight.qdata][1]
            assert (prepared.folded is not None) == keep
    assert torch.equal(outputs["fp8", False], outputs["fp8", True])
    ref = K.reference_linear_w4a4(x.float(), weight.qdata, weight.scale, None, "mxfp4",
                                  t).double()
    for y in outputs.values():
        assert_within_one_bf16_rounding(y, ref)


def test_folded_operands_are_what_torch_scaled_mm_takes(monkeypatch):
    """The fold's outputs (shapes, strides, dtypes) pass torch's own checks of the 1 x 128
    block-scaled product, run on meta tensors (its shape function: no GPU needed), through
    ``torch.nn.functional.scaled_mm`` and through ``torch._scaled_mm`` (a torch without the
    former); torch 2.14 checks the former's scale layouts in eager only (on a GPU: the test
    below)."""
    needs_kernels()
    from kbbq_pl.kernels import triton_kernels as tk

    x, q = decode_operands("mxfp4", 24, 48, 384, seed=2)
    a_codes, a_exponents, _ = K.quantize_activations(x, None, "mxfp4")
    counter = torch.zeros(1, dtype=torch.int32)
    folded = [*tk.fold_e4m3(a_codes, a_exponents, 32, counter),
              *tk.fold_e4m3(q.qdata, q.scale.view(torch.uint8), 32, counter)]

    def meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    y = K._block_scaled_fp8_mm(*[meta(t) for t in folded])
    assert y.shape == (24, 48) and y.dtype == torch.bfloat16
    if torch.__version__ < (2, 14):  # then its meta infers shapes only (layouts: eager, GPU)
        with pytest.raises(RuntimeError, match="blockwise|scal"):
            K._block_scaled_fp8_mm(*[meta(t.contiguous()) for t in folded])
    monkeypatch.delattr(torch.nn.functional, "scaled_mm")
    y = K._block_scaled_fp8_mm(*[meta(t) for t in folded])
    assert y.shape == (24, 48) and y.dtype == torch.bfloat16


@pytest.mark.gpu
def test_gpu_fp8_product_is_within_one_rounding_and_stays_out_of_graphs():
    device = torch.device("cuda")
    needs_kernels(device)
    if torch.cuda.get_device_capability(device)[0] != 9:
        pytest.skip("cuBLAS's 1 x 128 block-scaled FP8 product runs on Hopper (sm_90) only")
    k, n = 4096, 2048
    t = make_transform("random", k, 32, seed=6).to(device)
    for m in (1024, 2048):
        x, q = decode_operands("mxfp4", m, n, k, seed=m)
        ref = exact_product(x, q, "mxfp4", t.cpu()).to(device)
        with mock.patch.object(K, "_block_scaled_fp8_mm",
                               wraps=K._block_scaled_fp8_mm) as fp8:
            y = K.linear_w4a4(x.to(device), q.qdata.to(device), q.scale.to(device), None,
                              "mxfp4", t, prefill_product="fp8")
        assert fp8.call_count == 1  # on FP8, not the bf16 product
        assert_within_one_bf16_rounding(y, ref)
    # captured in a CUDA graph (no host read there): the bf16 product, its bits
    args = (x.to(device), q.qdata.to(device), q.scale.to(device), None, "mxfp4", t)
    default = K.linear_w4a4(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = K.linear_w4a4(*args, prefill_product="fp8")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, default)


FOLD_COMPILE_CHECK = """
import sys
sys.path.insert(0, {bench!r})
from triton.backends.compiler import GPUTarget
import gpu_compile as G
from kbbq_pl.kernels import triton_kernels as tk

block_r, warps = tk.FOLD_TILE
compiled = G.compile_kernel(tk._fold_e4m3_kernel, G.FOLD_SIGNATURE, dict(D=32, BLOCK_R=block_r),
                            GPUTarget("cuda", 90, 32), num_warps=warps, enable_fp_fusion=True)
ops = [op for _, op, _ in G.sass_ops(compiled.asm["cubin"])]
assert not any(op.startswith(("STL", "LDL")) for op in ops), "local memory"
assert any(op.startswith("F2FP.SATFINITE.E4M3") for op in ops), "no hardware E4M3 conversion"
found = G.analyse(compiled, block_r * 128 / (32 * warps))
assert found["ldg128"] > 0, found  # the codes' words in 16-byte loads
assert float(found["per_element"]) <= 16.0, found
print("ok", found["per_element"])
"""


def test_fold_compiles_for_hopper_without_a_gpu():
    """The fold compiled for sm_90: no local memory, the hardware's FP32-to-E4M3 conversion
    (exact here: every value it converts is an E4M3 value), 16-byte loads of the codes, at
    most 16 SASS an element (13.0 with Triton 3.6, 13.1 with 3.9, 2026-11-28)."""
    run_compile_check(FOLD_COMPILE_CHECK)
