"""Rounding that does not depend on the device or the backend, checked on the CPU.

A GPU divides differently from a CPU: Triton (``torch.compile`` on CUDA) emits the approximate
``div.full.f32`` for an FP32 ``/``, and eager CUDA divides by a Python number as
``a * (1 / b)``.  The rounding kernels must give the same bits whatever the division does, so
:class:`GpuLikeDivision` runs them with every FP32 (or lower) quotient one ulp off and every
FP64 quotient by a number formed as a product with the reciprocal, and the bits must not move.
The arithmetic is also checked against an independent IEEE FP32 reference in numpy, and the
compiled CPU kernels against the eager ones (tests/formats/test_formats.py);
tests/kernels/test_gpu.py repeats the comparisons on a CUDA device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_formats import ALL_FORMATS, adversarial_tensors, bits
from torch.utils._python_dispatch import TorchDispatchMode

from kbbq_pl import formats as F
from kbbq_pl.formats import rounding as K

pytestmark = pytest.mark.usefixtures("one_thread")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_DIVISIONS = (torch.ops.aten.div, torch.ops.aten.reciprocal, torch.ops.aten.true_divide)


class GpuLikeDivision(TorchDispatchMode):
    """Divide as GPU backends may (module docstring); counts the divisions done below FP64."""

    def __init__(self) -> None:
        super().__init__()
        self.low_precision = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket not in _DIVISIONS or kwargs:
            return func(*args, **kwargs)
        a = args[0]
        b = args[1] if len(args) > 1 else None
        out = func(*args)
        if not out.is_floating_point():
            return out
        if out.dtype != torch.float64:  # an approximate quotient: one ulp up
            self.low_precision += 1
            return torch.nextafter(out, torch.full_like(out, float("inf")))
        if isinstance(b, (int, float)):  # eager CUDA: a * (1 / b) in the operands' precision
            return a * (1.0 / b)
        return out


def _cases() -> dict[str, torch.Tensor]:
    cases = adversarial_tensors()
    g = torch.Generator().manual_seed(7)
    # every element in [-8, 8) on a fine grid: scaled values sit on and beside grid midpoints
    cases["midpoints"] = (torch.arange(-1024, 1024, dtype=torch.float32) / 128).reshape(16, 128)
    # block amax near the smallest E4M3 block scale and the FP32 subnormals
    cases["subnormal"] = torch.randn(8, 128, generator=g) * 2.0**-140
    cases["max_finite"] = torch.randn(8, 128, generator=g).clamp(-1, 1) * 3.0e38
    del cases["negative_zero"], cases["zeros"]
    return {k: v.repeat(1, 128 // v.shape[-1]) for k, v in cases.items()}  # 128 wide


CASES = _cases()


def _all_outputs(x: torch.Tensor, name: str) -> list[torch.Tensor]:
    q = F.quantize(x, name)
    out = [F.fake_quantize(x, name), q.qdata, q.scale, F.dequantize(q)]
    if q.global_scale is not None:
        out.append(q.global_scale)
    fmt = F.get_format(name)
    if fmt.global_scale:  # a static per-tensor scale, as calibrated activations use
        out.append(F.fake_quantize(x, name, global_scale=torch.tensor(0.01)))
    return out


@pytest.mark.parametrize("name", ALL_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_does_not_depend_on_how_a_device_divides(name, dtype):
    mode = GpuLikeDivision()
    for case, x in CASES.items():
        x = x.to(dtype)
        if not torch.isfinite(x).all():  # beyond fp16's range
            continue
        expected = _all_outputs(x, name)
        with mode:
            got = _all_outputs(x, name)
        for e, g in zip(expected, got):
            assert torch.equal(bits(e), bits(g)), f"{name} {dtype} {case}"
    assert mode.low_precision == 0, "an FP32 division in the rounding kernels"


# ------------------------------------------------------ an IEEE FP32 reference in numpy


def _np_round_e2m1(a: np.ndarray) -> np.ndarray:
    a = np.minimum(a, np.float32(6))
    return np.where(a < 2, np.round(a * 2) / 2, np.where(a < 4, np.round(a), np.round(a / 2) * 2))


def _e4m3(a: np.ndarray) -> np.ndarray:
    return torch.from_numpy(a).to(torch.float8_e4m3fn).float().numpy()


def _reference(x: np.ndarray, name: str) -> np.ndarray:
    """Fake quantization of FP32 ``x`` with numpy FP32 arithmetic (IEEE, correctly rounded)."""
    f32 = np.float32
    fmt = F.get_format(name)
    g = x.reshape(-1, fmt.block_size) if fmt.granularity == "block" else (
        x.reshape(-1, x.shape[-1]) if fmt.granularity == "row" else x.reshape(1, -1))
    amax = np.abs(g).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if fmt.element == "e2m1" and fmt.scale_kind == "e4m3":
            pts = amax.max() / f32(448 * 6)
            usable = pts >= f32(K.NVFP4_MIN_GLOBAL_SCALE)  # else the reciprocal overflows:
            pts = pts if usable else f32(1)  # the kernel gives (signed) zeros
            block = _e4m3(np.clip((amax / f32(6)) / pts, f32(2**-6), f32(448)))
            y = g * ((f32(1) / pts) / block) * f32(usable)
            values = np.copysign(_np_round_e2m1(np.abs(y)), y) * (pts * block)
        elif fmt.element == "e2m1":  # FP32 block scales
            scale = amax / f32(6)
            scale = np.where(scale > 0, scale, f32(1))
            y = g / scale
            values = np.copysign(_np_round_e2m1(np.abs(y)), y) * scale
        elif fmt.element == "e4m3":
            scale = amax / f32(448)
            scale = np.where(scale > 0, scale, f32(1))
            values = _e4m3(np.clip(g / scale, f32(-448), f32(448))) * scale
        else:
            qmax = f32(fmt.element_max)
            scale = amax / qmax
            scale = np.where(scale > 0, scale, f32(1))
            values = np.clip(np.round(g / scale), -qmax, qmax) * scale + f32(0)  # no -0
    return values.astype(np.float32).reshape(x.shape)


REFERENCE_FORMATS = ["nvfp4", "e2m1_b8_e4m3", "e2m1_b64_fp32", "fp8_e4m3", "fp8_e4m3_row",
                     "int4", "int8", "int8_row"]


@pytest.mark.parametrize("name", REFERENCE_FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_matches_an_ieee_fp32_reference(name, dtype):
    for case, x in CASES.items():
        x = x.to(dtype)
        if not torch.isfinite(x).all():
            continue
        expected = _reference(x.float().numpy(), name)
        got = F.fake_quantize(x, name, dtype=torch.float32).numpy()
        assert np.array_equal(expected.view(np.uint32), got.view(np.uint32)), (
            f"{name} {dtype} {case}: {int((expected != got).sum())} elements differ")


def test_div_rn_is_the_correctly_rounded_fp32_quotient():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(1 << 16, generator=g) * torch.exp2(torch.randint(-140, 120, (1 << 16,),
                                                                     generator=g).float())
    b = torch.randn(1 << 16, generator=g).abs() + 2.0**-20
    expected = a.numpy() / b.numpy()
    assert np.array_equal(K.div_rn(a, b).numpy().view(np.uint32), expected.view(np.uint32))
    for c in (6.0, 7.0, 127.0, 448.0, 2688.0, 0.75):
        with GpuLikeDivision():
            got = K.div_rn(a, c)
        assert np.array_equal(got.numpy().view(np.uint32),
                              (a.numpy() / np.float32(c)).view(np.uint32)), c
