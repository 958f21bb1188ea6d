"""CUDA: compiled (Triton) rounding kernels and the quantized layer agree with the CPU bit for
bit.  Skipped without a CUDA device (the conftest prints the reason)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF
from torch import nn

from kbbq_pl import formats as F
from kbbq_pl.quant import w4a4
from kbbq_pl.quant.layers import QuantizedLinear, w4a4_weight

pytestmark = pytest.mark.gpu
FORMATS = ["nvfp4", "mxfp4", "mxfp4_no_clip", "fp8_e4m3", "int4"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernels_match_cpu(name, dtype):
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)).to(dtype)
    F.set_compile(True)
    try:
        gpu = F.fake_quantize(x.cuda(), name).cpu()
        q = F.quantize(x.cuda(), name)
    finally:
        F.set_compile("0")
    cpu = F.fake_quantize(x, name)
    assert torch.equal(bits(gpu), bits(cpu))
    assert torch.equal(bits(q.qdata.cpu()), bits(F.quantize(x, name).qdata))


def test_quantized_linear_on_cuda_matches_cpu():
    linear = nn.Linear(64, 32)
    layer = QuantizedLinear.from_linear(linear, "mxfp4", torch.eye(64))
    x = torch.randn(8, 64)
    expected = layer(x)
    layer.cuda()
    torch.testing.assert_close(layer(x.cuda()).cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt, act_scale", [("nvfp4", "static"), ("nvfp4", "dynamic"),
                                            ("mxfp4", "dynamic")])
def test_w4a4_weight_on_cuda_runs_the_kernels(fmt, act_scale):
    if w4a4._kernels() is None:
        pytest.skip("kbbq_pl.kernels is not installed")
    linear = nn.Linear(512, 256)
    block = F.get_format(fmt).block_size
    identity = torch.eye(block).expand(512 // block, block, block)  # T x exact in any order
    weight = w4a4_weight(linear, fmt, identity, act_scale=act_scale,
                         act_global_scale=torch.tensor(0.002))
    x = torch.randn(16, 512)
    expected = TF.linear(x, weight, linear.bias)  # CPU emulation
    on_gpu = weight.to("cuda")
    assert w4a4.uses_kernels(x.cuda(), on_gpu)
    got = TF.linear(x.cuda(), on_gpu, linear.bias.cuda()).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
