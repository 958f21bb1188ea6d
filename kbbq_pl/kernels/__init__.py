"""W4A4 on GPUs: the project's Triton kernels for FP4 activations and the FP4 x FP4 GEMM.

The interface (checked arguments, clear errors; ``K`` is the reduction length, ``d`` the block:
16 for NVFP4, 32 for MXFP4):

``available(device) -> bool``
    Whether the kernels run on ``device``: CUDA with Triton :data:`MIN_TRITON` or later (torch
    2.10 on ships it), or the CPU under Triton's interpreter (``TRITON_INTERPRET=1`` set before
    this package's kernels are first used).  Older Triton: a warning, once, and False.
``quantize_activations(x, transform, fmt, global_scale=None) -> (codes, scales, pts)``
    ``x [M, K]`` (bf16, fp16 or fp32), ``transform`` None or ``[K/d, d, d]`` (one matrix per
    block, applied as ``T_b x_b``; Hadamard is one such tensor).  Returns packed E2M1 codes
    ``uint8 [M, K/2]`` (element ``2i`` in the low nibble), block scales ``[M, K/d]``
    (``float8_e4m3fn`` for NVFP4; uint8 biased E8M0 exponents for MX, viewable as
    ``float8_e8m0fnu``) and the NVFP4 per-tensor scale (FP32 ``[]`` on ``x``'s device; None for
    MX).  Bit for bit :func:`~kbbq_pl.kernels.reference.reference_quantize_activations`.
``w4a4_matmul(a_codes, a_scales, a_global, w_codes, w_scales, w_global, fmt, bias=None,
out_dtype=torch.bfloat16) -> [M, N]``
    Both operands packed along K with their block scales: activations from
    ``quantize_activations``, weights ``[N, K/2]`` as :func:`kbbq_pl.formats.quantize` stores
    them (``QuantizedTensor.qdata``, ``.scale``, ``.global_scale``).  The per-tensor scales
    (NVFP4; None for MX) and the bias are applied in the epilogue.
``linear_w4a4(x, weight_codes, weight_scales, weight_global, fmt, transform=None,
act_global_scale=None, bias=None, *, prepared=None, path=None, prefill_product="auto") -> y``
    ``Q(W T^-1) Q(T x) + b`` for ``x [..., K]`` (zero-padded when its last dimension falls
    short of the weights' padded ``K`` by less than a block), ``y [..., N]`` in ``x``'s dtype;
    ``act_global_scale`` None is the dynamic NVFP4 scale.  The path follows the rows ``M`` and
    the format (:func:`choose_path`): ``decode`` below :data:`PREFILL_MIN_M` (the activations'
    values, then the decode GEMM of :mod:`kbbq_pl.kernels.skinny` on the weights as stored),
    ``prefill`` from it on (bf16 values and decoded weights, one cuBLAS or Triton product);
    ``tiled`` (``quantize_activations`` then ``w4a4_matmul``) where the decode GEMM cannot
    decode the weights exactly, or when asked for.
``linear_w4a4_siblings(x, layers, fmt) -> [y, ...]``
    ``linear_w4a4`` of layers that read the same ``x`` (q/k/v, gate/up; each a
    :class:`SiblingLinear` of its own weights, transform, scales and bias), in two launches
    for all of them on the decode path.
``quantize_activation_values(x, transform, fmt, global_scale=None, *, dtype=bf16,
word_order=False) -> (values, pts)``
    The rounded activations as their values ``q * s`` (exact in bf16, and in fp16 for NVFP4),
    bit for bit :func:`~kbbq_pl.kernels.reference.reference_activation_values`.
``decode_weight(codes, scales, fmt) -> bf16 [N, K]``, ``prepare_weight(codes, scales,
global_scale, fmt, act_global_scale=None, *, keep_decoded=False, prefill_product="auto")
-> PreparedWeight``
    The prefill path's weight operand; what a layer works out once per weight and device
    (:mod:`kbbq_pl.kernels.prepared`).

Numerics.  Activations: ``h = T x`` in FP32 from the exactly upcast input (an FMA chain per
output, :mod:`kbbq_pl.kernels.reference`), then exactly the arithmetic of
:mod:`kbbq_pl.formats.rounding` (every division correctly rounded, E4M3 and E2M1 rounded to
nearest even).  Dynamic NVFP4 needs the amax of ``T x`` over the whole tensor before the first
block scale, so it runs two passes: the first computes ``T x`` and folds its amax into one FP32
scalar on the device (an atomic max: order-free, hence deterministic; no host sync, so CUDA
graphs can capture it), the second recomputes ``T x`` and quantizes.  Recomputing costs a
second read of ``x`` and is cheaper than writing ``T x`` (FP32, twice ``x``'s bytes) and reading
it back; a static ``global_scale`` is one pass.

GEMM: each E2M1 value times its block scale is exact in bf16 (E2M1 has 2 significant bits, an
E4M3 scale 4, an E8M0 scale 1, together at most 6 of bf16's 8; E2M1 x E4M3 lies in
[2^-10, 2688], within bf16's range), so the kernel decodes in registers and multiplies on bf16
tensor cores with FP32 accumulation; the per-tensor scales, the MX ``no_clip`` gain (1/0.75 per
operand) and the bias come in the epilogue.  At extreme E8M0 exponents: a decoded value above
bf16's largest (|q| 2^e >= 2^128, i.e. ``ceil``/``even``/``rceil`` blocks with amax near FP32's
largest) is infinite, as it is in FP32 :func:`kbbq_pl.formats.dequantize`; values down to
0.5 * 2^-127 stay exact (bf16 subnormals), but products below FP32's subnormal range (both
operands' exponents near -127) vanish in the FP32 accumulator.  A NaN block scale (a non-finite
input block) makes its outputs NaN.  Up to 16 rows (:data:`~.triton_kernels.SMALL_M`) the GEMM
streams the packed weights with the activations decoded in the loop, K split across programs
when the column tiles alone would not fill the GPU (partials summed in a fixed order); above
it the activations are decoded to bf16 once and the weights in the loop.

The decode and prefill paths multiply decoded values where each is exact in the type the
product takes (:mod:`kbbq_pl.kernels.exact`), so they too give the exact product of the codes
rounded once, up to FP32 accumulation.  So does the opt-in FP8 prefill product of MX
operands (:func:`kbbq_pl.kernels.exact.fold_mx_to_e4m3`), up to the accumulation of the FP8
tensor cores within each chunk of 128.

On compute capability 10.x (Blackwell) NVFP4 goes through ``torch._scaled_mm``'s FP4 path
(:mod:`kbbq_pl.kernels.blackwell`, untested here: no such GPU).

The reference functions (:mod:`kbbq_pl.kernels.reference`) are pure torch and import without
triton; the Triton module is imported on first use.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.torch_version import TorchVersion

from ..formats import Format
from .exact import FP8_CHUNK, word_order_index
from .host import triton_version as _triton_version
from .interpret import interpreting as _interpreting
from .prepared import PreparedWeight, scale_source
from .prepared import prepare_weight as _prepare_weight
from .reference import (
    INPUT_DTYPES,
    fp4_format,
    pad_input,
    reference_activation_values,
    reference_linear_w4a4,
    reference_quantize_activations,
    reference_transform,
    reference_w4a4_matmul,
)

__all__ = [
    "MIN_TRITON",
    "PREFILL_MIN_M",
    "MAX_SIBLINGS",
    "PreparedWeight",
    "SiblingLinear",
    "available",
    "choose_path",
    "decode_weight",
    "fp8_product_applies",
    "linear_w4a4",
    "linear_w4a4_siblings",
    "prepare_weight",
    "quantize_activation_values",
    "reference_activation_values",
    "quantize_activations",
    "reference_linear_w4a4",
    "reference_quantize_activations",
    "reference_transform",
    "reference_w4a4_matmul",
    "w4a4_matmul",
]

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


MIN_TRITON = TorchVersion("3.6")
"""The oldest Triton that compiles the kernels to their bits: 3.5 compiles ``tl.div_rn`` to
``div.rn.ftz.f32``, which flushes subnormal operands and quotients to zero."""


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _triton_recent() -> bool:
    if _triton_version() >= MIN_TRITON:
        return True
    warnings.warn(f"kbbq_pl.kernels need Triton {MIN_TRITON} or later (torch 2.10 on ships "
                  f"it); found {_triton_version()}, whose divisions flush subnormals: W4A4 "
                  "layers run the exact emulation instead", RuntimeWarning, stacklevel=3)
    return False


def _backend():
    from . import triton_kernels

    return triton_kernels


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels run on ``device`` (module docstring)."""
    device = torch.device(device)
    if not _triton_installed() or not _triton_recent():
        return False
    if _interpreting():
        return device.type == "cpu"
    return device.type == "cuda" and torch.cuda.is_available()


def _require(device: torch.device, what: str) -> None:
    if available(device):
        return
    if not _triton_installed():
        reason = "triton is not installed"
    elif not _triton_recent():
        reason = (f"Triton {_triton_version()} is older than {MIN_TRITON}, whose divisions "
                  "keep the kernels' bits")
    elif _interpreting():
        reason = "TRITON_INTERPRET=1 runs the kernels on the CPU only"
    else:
        reason = "the kernels need a CUDA device (or TRITON_INTERPRET=1 for the CPU)"
    raise RuntimeError(f"{what}: cannot run on {device}: {reason}; "
                       "kbbq_pl.kernels.reference_* compute the same on any device")


def _scale_meta(fmt: Format) -> tuple[int, int, float]:
    from .triton_kernels import ROUNDING_CODES, SCALE_E4M3, SCALE_E8M0

    if fmt.scale_kind == "e4m3":
        return SCALE_E4M3, 0, 1.0
    gain = 0.75 if fmt.e8m0_rounding == "no_clip" else 1.0
    return SCALE_E8M0, ROUNDING_CODES[fmt.e8m0_rounding], gain


def _device_scalar(value: Tensor | float, device: torch.device, name: str,
                   checked: bool = False) -> Tensor:
    """An FP32 0-d tensor on ``device`` (a tensor already there is used as is: no host sync).
    ``checked`` (a caller's scale, not a kernel's output): where it is held on the host (a
    number, a CPU tensor) it must be positive and finite; one on a GPU is not read back."""
    if (isinstance(value, Tensor) and value.dim() == 0 and value.dtype == torch.float32
            and value.device == device and not (checked and value.device.type == "cpu")):
        return value  # what the conversions below return for it, without their host time
    tensor = torch.as_tensor(value, dtype=torch.float32)
    if tensor.numel() != 1:
        raise ValueError(f"{name} must be a scalar, got shape {tuple(tensor.shape)}")
    if checked and tensor.device.type == "cpu" and not 0 < float(tensor) < math.inf:
        raise ValueError(f"{name} must be positive and finite, got {float(tensor)!r}")
    return tensor.reshape(()).to(device).contiguous()


def _check_transform(transform: Tensor | None, k: int, d: int, device: torch.device,
                     name: str) -> Tensor | None:
    if transform is None:
        return None
    if transform.shape != (k // d, d, d):
        raise ValueError(f"{name}: transform must be [K/d, d, d] = [{k // d}, {d}, {d}] for "
                         f"K = {k}, got shape {tuple(transform.shape)}")
    if transform.device != device:
        raise ValueError(f"{name}: transform is on {transform.device}, the input on {device}")
    return transform.to(torch.float32).contiguous()


def quantize_activations(
    x: Tensor, transform: Tensor | None, fmt: str | Format,
    global_scale: Tensor | float | None = None, *, config: dict | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Transform and quantize activations ``x [M, K]`` to packed FP4 (module docstring).

    ``global_scale`` fixes the NVFP4 per-tensor scale (a calibrated static scale; values beyond
    it saturate; a device tensor is read on the device, no host sync); None takes
    ``amax(T x) / (448 * 6)``.  ``config`` pins the kernel's tile (``BLOCK_M``, ``NB`` blocks
    per program, ``num_warps``; default: ``triton_kernels.ACT_TILES``, or ``FEW_ROWS_TILES``
    up to 16 rows; ``"autotune"`` autotunes).  Non-finite inputs follow the
    ``propagate`` policy of :mod:`kbbq_pl.formats`: their block gets a NaN scale.
    """
    fmt = fp4_format(fmt)
    codes, scales, pts, _ = _activation_kernel(x, transform, fmt, global_scale,
                                               "quantize_activations", config)
    if fmt.scale_kind == "e4m3":
        scales = scales.view(torch.float8_e4m3fn)
    return codes, scales, pts


def _operand(codes: Tensor, scales: Tensor, d: int, role: str, name: str) -> tuple[Tensor, Tensor]:
    if codes.dtype != torch.uint8 or codes.dim() != 2:
        raise ValueError(f"{name}: {role} codes must be uint8 [rows, K/2], got {codes.dtype} "
                         f"of shape {tuple(codes.shape)}")
    rows, half = codes.shape
    if scales.shape != (rows, 2 * half // d) or scales.element_size() != 1:
        raise ValueError(f"{name}: {role} scales must be one byte each, [{rows}, {2 * half // d}] "
                         f"for codes {tuple(codes.shape)} and block {d}, got {scales.dtype} of "
                         f"shape {tuple(scales.shape)}")
    return codes.contiguous(), scales.contiguous().view(torch.uint8)


def w4a4_matmul(
    a_codes: Tensor, a_scales: Tensor, a_global: Tensor | float | None,
    w_codes: Tensor, w_scales: Tensor, w_global: Tensor | float | None,
    fmt: str | Format, bias: Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
    *, config: dict | None = None, split_k: int | None = None,
) -> Tensor:
    """``(A W^T) + bias`` of packed FP4 operands, ``[M, N]`` in ``out_dtype`` (module docstring).

    ``config`` pins the tile (``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``GROUP_M``, ``num_warps``,
    ``num_stages``) instead of autotuning; ``split_k`` the number of K splits (default: chosen
    for the GPU when M <= 16, else 1).
    """
    fmt = fp4_format(fmt)
    d = fmt.block_size
    name = "w4a4_matmul"
    a_codes, a_scales = _operand(a_codes, a_scales, d, "activation", name)
    w_codes, w_scales = _operand(w_codes, w_scales, d, "weight", name)
    if a_codes.shape[1] != w_codes.shape[1]:
        raise ValueError(f"{name}: K differs: activations {2 * a_codes.shape[1]} (codes "
                         f"{tuple(a_codes.shape)}), weights {2 * w_codes.shape[1]} (codes "
                         f"{tuple(w_codes.shape)})")
    device = w_codes.device
    if a_codes.device != device:
        raise ValueError(f"{name}: activations on {a_codes.device}, weights on {device}")
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{name}: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    n = w_codes.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.device != device):
        raise ValueError(f"{name}: bias must be [{n}] on {device}, got shape "
                         f"{tuple(bias.shape)} on {bias.device}")
    if fmt.global_scale:
        if a_global is None or w_global is None:
            raise ValueError(f"{name}: {fmt.name} needs both per-tensor scales "
                             "(a_global, w_global)")
        a_global = _device_scalar(a_global, device, "a_global")
        w_global = _device_scalar(w_global, device, "w_global")
    elif a_global is not None or w_global is not None:
        raise ValueError(f"{name}: format {fmt.name} has no per-tensor scales; pass None")
    _require(device, name)
    if split_k is not None and split_k < 1:
        raise ValueError(f"{name}: split_k must be >= 1, got {split_k}")
    if a_codes.shape[0] == 0 or n == 0:
        return torch.empty(a_codes.shape[0], n, dtype=out_dtype, device=device)
    from .blackwell import blackwell_nvfp4_available, blackwell_nvfp4_matmul

    if config is None and blackwell_nvfp4_available(device, fmt):  # pragma: no cover - Blackwell
        return blackwell_nvfp4_matmul(a_codes, a_scales, a_global, w_codes, w_scales, w_global,
                                      bias, out_dtype)
    scale_kind, _, gain = _scale_meta(fmt)
    if bias is not None:
        bias = bias.contiguous()
    return _backend().w4a4_matmul(a_codes, a_scales, a_global, w_codes, w_scales, w_global, d,
                                  scale_kind, gain, bias, out_dtype, config, split_k)


def _check_activations(x: Tensor, fmt: Format, global_scale, name: str) -> Tensor | None:
    d = fmt.block_size
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}: x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[1] % d:
        raise ValueError(f"{name}: K = {x.shape[1]} (x of shape {tuple(x.shape)}) is not a "
                         f"multiple of the {fmt.name} block {d}")
    _require(x.device, name)
    if global_scale is not None and not fmt.global_scale:
        raise ValueError(f"{name}: format {fmt.name} has no per-tensor scale to set")
    return None if global_scale is None else _device_scalar(global_scale, x.device,
                                                            f"{name}: global_scale", checked=True)


def _activation_kernel(x: Tensor, transform: Tensor | None, fmt: Format, global_scale,
                       name: str, config: dict | None, **options: Any
                       ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The checks of ``x``, the transform and the per-tensor scale, then the backend's
    activation kernel (``options``: what it returns besides the codes and scales):
    ``(codes, scales, pts, values)``."""
    gs = _check_activations(x, fmt, global_scale, name)
    t = _check_transform(transform, x.shape[1], fmt.block_size, x.device, name)
    if x.stride(-1) != 1:
        x = x.contiguous()
    scale_kind, rounding, gain = _scale_meta(fmt)
    return _backend().quantize_activations(x, t, fmt.block_size, scale_kind, rounding, gain, gs,
                                           config, **options)


def quantize_activation_values(
    x: Tensor, transform: Tensor | None, fmt: str | Format,
    global_scale: Tensor | float | None = None, *, dtype: torch.dtype = torch.bfloat16,
    word_order: bool = False, config: dict | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``x [M, K]`` transformed and rounded as :func:`quantize_activations` does, returned as
    the decoded values ``q * s`` (no per-tensor scale) in ``dtype`` (bf16, fp16 or fp32) with
    the NVFP4 per-tensor scale: ``(values [M, K], pts)``.  The values are exact in bf16 and, for
    NVFP4, in fp16 (:mod:`kbbq_pl.kernels.exact`), so they say the same as the codes and scales,
    in one pass that writes 2 bytes an element.  ``word_order`` orders each chunk of 128 as
    :func:`~kbbq_pl.kernels.exact.word_order_index` says (the decode GEMM's order; ``K`` padded
    with zeros to a multiple of 128, as :func:`~kbbq_pl.kernels.exact.word_order` pads).  A
    non-finite input block gives NaN values."""
    fmt = fp4_format(fmt)
    name = "quantize_activation_values"
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: dtype must be bf16, fp16 or fp32, got {dtype}")
    if dtype == torch.float16 and fmt.scale_kind != "e4m3":
        raise ValueError(f"{name}: {fmt.name} values (E8M0 scales) are not exact in fp16")
    _, _, pts, values = _activation_kernel(x, transform, fmt, global_scale, name, config,
                                           values_dtype=dtype, codes=False,
                                           word_order=word_order)
    k = x.shape[-1]
    if values.shape[-1] > k:  # the slots of a partial chunk that no element lands in: the
        # decode GEMM never reads them (it masks K), so the kernel leaves them unwritten
        values[..., word_order_index(torch.arange(k, values.shape[-1], device=values.device))] = 0
    return values, pts


def decode_weight(codes: Tensor, scales: Tensor, fmt: str | Format) -> Tensor:
    """Packed codes ``[N, K/2]`` and their block scales decoded to bf16 ``q * s`` ``[N, K]``
    (exact; the NVFP4 per-tensor scale is not applied): the prefill path's weight operand."""
    fmt = fp4_format(fmt)
    codes, scales = _operand(codes, scales, fmt.block_size, "weight", "decode_weight")
    _require(codes.device, "decode_weight")
    scale_kind, _, _ = _scale_meta(fmt)
    return _backend().decode(codes, scales, fmt.block_size, scale_kind)


def prepare_weight(codes: Tensor, scales: Tensor, global_scale: Tensor | float | None,
                   fmt: str | Format, act_global_scale: Tensor | float | None = None, *,
                   keep_decoded: bool = False, prefill_product: str = "auto") -> PreparedWeight:
    """The weight's :class:`~kbbq_pl.kernels.prepared.PreparedWeight`, worked out once for
    :func:`linear_w4a4` (a W4A4 layer keeps one per device): host copies of the static scales,
    the MX decode shift and, with ``keep_decoded``, the prefill product's weight operand
    (memory for speed: see :mod:`kbbq_pl.kernels.prepared`): the bf16 decode, or for
    ``prefill_product="fp8"`` (where :func:`fp8_product_applies`) the E4M3 fold when every
    chunk folds exactly.  It is a snapshot of the codes and scales: prepare again after
    changing them in place (``W4A4Weight`` does, by their version counters)."""
    fmt = fp4_format(fmt)
    codes, scale_bytes = _operand(codes, scales, fmt.block_size, "weight", "prepare_weight")
    if prefill_product not in PREFILL_PRODUCTS:
        raise ValueError(f"prepare_weight: prefill_product must be one of {PREFILL_PRODUCTS}, "
                         f"got {prefill_product!r}")
    gs = None if global_scale is None else _device_scalar(global_scale, codes.device,
                                                          "global_scale")

    def decode(c: Tensor, s: Tensor) -> Tensor:
        return decode_weight(c, s, fmt)

    def fold(c: Tensor, s: Tensor) -> tuple[Tensor, Tensor] | None:
        _require(c.device, "prepare_weight")
        inexact = torch.zeros(1, dtype=torch.int32, device=c.device)
        folded = _fold_weight(c, s, fmt, inexact)
        return None if int(inexact.item()) else folded

    folds = (prefill_product == "fp8"
             and fp8_product_applies(fmt, 2 * codes.shape[1], codes.shape[0], None,
                                     torch.bfloat16, codes.device))
    return _prepare_weight(codes, scale_bytes, gs, fmt, act_global_scale,
                           keep_decoded=keep_decoded, decode=decode,
                           fold=fold if folds else None,
                           scale_sources=(scale_source(global_scale),
                                          scale_source(act_global_scale)))


PREFILL_MIN_M = {"e4m3": 1024, "e8m0": 256}
"""From this many rows on, by the format's scale kind (NVFP4's ``e4m3``, MX's ``e8m0``),
:func:`linear_w4a4` takes the prefill path (weights decoded to bf16 once per call or kept, one
matrix product); below, the decode path (:mod:`.skinny`).  Where ``bench/gpu.py``'s ``rows``
section found prefill the faster on an H200 at both of its shapes: from 1,024 rows for NVFP4,
from 256 for MX (at 256 rows the prefill path took 0.55 to 0.63 of the decode path's time,
when MX's decode GEMM still staged its bf16 operand through shared memory; ``rows``
re-measures it)."""
PATHS = ("decode", "tiled", "prefill")
PREFILL_PRODUCTS = ("auto", "cublas", "triton", "fp8")


def choose_path(m: int, fmt: str | Format) -> str:
    """The path :func:`linear_w4a4` takes for ``m`` rows of ``fmt``: ``prefill`` from its
    scale kind's :data:`PREFILL_MIN_M` on, ``decode`` below."""
    return "prefill" if m >= PREFILL_MIN_M[fp4_format(fmt).scale_kind] else "decode"


def _decode_operand_dtype(m: int, scale_kind: int) -> torch.dtype:
    """The activation kernel's output a decode GEMM of ``m`` rows reads: int8 ``2q`` where it
    runs the DP4A product (one row, :data:`kbbq_pl.kernels.skinny.ONE_ROW_PRODUCT`), else the
    values its tensor cores multiply."""
    from . import skinny

    if m == 1 and skinny.ONE_ROW_PRODUCT == skinny.PRODUCT_DP4A:
        return torch.int8
    return skinny.activation_dtype(scale_kind)


def _decode_path(x2: Tensor, codes: Tensor, scales: Tensor, w_global: Tensor | None,
                 prepared: PreparedWeight, t: Tensor | None, act_gs, bias,
                 out_dtype: torch.dtype) -> Tensor:
    from . import skinny

    fmt = prepared.fmt
    scale_kind, _, gain = _scale_meta(fmt)
    m = x2.shape[0]
    operand = _decode_operand_dtype(m, scale_kind)
    dp4a = operand == torch.int8
    _, a_scales, pts, values = _activation_kernel(
        x2, t, fmt, act_gs, "linear_w4a4", None, values_dtype=operand, codes=False,
        word_order=not dp4a)
    return skinny.skinny_matmul(values, m, codes, scales, pts, w_global, fmt.block_size,
                                scale_kind, gain, prepared.shift(scales), bias, out_dtype,
                                a_scales=a_scales if dp4a else None)


def _prefill_path(x2: Tensor, codes: Tensor, scales: Tensor, w_global: Tensor | None,
                  prepared: PreparedWeight, t: Tensor | None, act_gs, bias,
                  out_dtype: torch.dtype, product: str, sources: tuple[Any, Any]) -> Tensor:
    fmt = prepared.fmt
    scale_kind, _, gain = _scale_meta(fmt)
    if product == "fp8":  # where it does not apply or a chunk does not fold: as "auto"
        if fp8_product_applies(fmt, x2.shape[1], codes.shape[0], bias, out_dtype, x2.device):
            y = _fp8_product(x2, t, codes, scales, prepared)
            if y is not None:
                return y
        product = "auto"
    a, pts = quantize_activation_values(x2, t, fmt, act_gs, dtype=torch.bfloat16)
    w = prepared.decoded
    if w is None:
        w = decode_weight(codes, scales, fmt)
    alpha = prepared.alpha(static=act_gs is not None, sources=sources)
    # cuBLAS rounds once where the bias is already bf16 (a wider one would be rounded twice)
    one_rounding = (alpha is not None and out_dtype == torch.bfloat16
                    and (bias is None or bias.dtype == torch.bfloat16))
    if product == "auto":
        product = "cublas" if one_rounding else "triton"
    if product == "triton":
        return _backend().decoded_matmul(a, w, pts, w_global, scale_kind, gain, bias,
                                         out_dtype)
    if one_rounding:
        # cuBLAS scales the FP32 sum, adds the bias and rounds once
        if bias is None:
            return torch.addmm(a.new_empty(()), a, w.T, beta=0, alpha=alpha)  # input unread
        return torch.addmm(bias, a, w.T, alpha=alpha)
    # scales only on the device, another output or bias dtype: the FP32 product, one rounding
    acc = _fp32_product(a, w)
    if pts is not None:  # the smaller scale first, as the kernels' epilogue
        acc = acc * torch.minimum(pts, w_global) * torch.maximum(pts, w_global)
    if gain != 1.0:
        acc = acc / (gain * gain)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


def fp8_product_applies(fmt: Format, k: int, n: int, bias: Tensor | None,
                        out_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the prefill product ``fp8`` multiplies on FP8 tensor cores: MX (an NVFP4 value
    ``q * s`` needs up to 6 significant bits, E4M3 has 4), ``K`` a multiple of
    :data:`~kbbq_pl.kernels.exact.FP8_CHUNK`, ``N`` of 16 (cuBLAS's FP8 layouts), a bf16
    output and no bias (cuBLAS rounds its scaled sum once to the output; a bias added after
    would round twice), on Hopper (compute capability 9.x: cuBLAS's 1 x 128 block scaling is
    Hopper's) outside a CUDA graph's capture (the product reads its fold check on the host),
    or on the CPU under Triton's interpreter.  Elsewhere it runs the bf16 product."""
    if device.type == "cuda":
        on_device = (torch.cuda.get_device_capability(device)[0] == 9
                     and not torch.cuda.is_current_stream_capturing())
    else:
        on_device = device.type == "cpu"
    return (on_device and fmt.scale_kind == "e8m0" and k % FP8_CHUNK == 0 and n % 16 == 0
            and bias is None and out_dtype == torch.bfloat16)


def _fp8_product(x2: Tensor, t: Tensor | None, codes: Tensor, exponents: Tensor,
                 prepared: PreparedWeight) -> Tensor | None:
    """``Q(T x) Q(W T^-1)^T`` of MX operands on FP8 tensor cores, bf16 ``[M, N]``; None where a
    chunk of either operand does not fold exactly into E4M3 (:func:`~kbbq_pl.kernels.exact.
    fold_mx_to_e4m3`; read on the host: one device-to-host copy a call).

    The activation kernel rounds ``T x`` and folds it to E4M3 with one FP32 scale per 128
    along K; the weights are folded the same way (kept by :func:`prepare_weight`, or here:
    :func:`_fold_weight`); cuBLAS's 1 x 128 block-scaled FP8 product (Hopper) sums each chunk
    on the tensor cores and adds it times its two scales to an FP32 accumulator
    (:func:`_block_scaled_fp8_mm`)."""
    fmt = prepared.fmt
    inexact = torch.zeros(1, dtype=torch.int32, device=codes.device)
    a8, a_scales, _, _ = _activation_kernel(x2, t, fmt, None, "linear_w4a4", None,
                                            e4m3_inexact=inexact)
    w8, w_scales = prepared.folded or _fold_weight(codes, exponents, fmt, inexact)
    if int(inexact.item()):
        return None
    return _block_scaled_fp8_mm(a8, a_scales, w8, w_scales)


def _fold_weight(codes: Tensor, exponents: Tensor, fmt: Format,
                 inexact: Tensor) -> tuple[Tensor, Tensor]:
    """An MX weight folded to E4M3 for the FP8 product, the ``no_clip`` gain ``1 / gain^2`` of
    the product in its scales; its inexact chunks added to ``inexact``."""
    gain = _scale_meta(fmt)[2]
    return _backend().fold_e4m3(codes, exponents, fmt.block_size, inexact, 1.0 / (gain * gain))


def _block_scaled_fp8_mm(a8: Tensor, a_scales: Tensor, w8: Tensor, w_scales: Tensor) -> Tensor:
    """cuBLAS's 1 x 128 block-scaled FP8 product ``(a8 * a_scales) (w8 * w_scales)^T`` in bf16:
    ``a8 [M, K]``, ``w8 [N, K]`` E4M3, the scales FP32 ``[M, K/128]`` and ``[N, K/128]`` with
    strides ``(1, M)`` and ``(1, N)``, as :func:`torch.nn.functional.scaled_mm` takes them
    (``torch._scaled_mm`` on a torch without it); on the CPU (Triton's interpreter) the same
    sum in FP32."""
    if a8.device.type == "cpu":
        def unfold(v: Tensor, s: Tensor) -> Tensor:
            return v.float() * s.repeat_interleave(FP8_CHUNK, dim=1)

        return (unfold(a8, a_scales) @ unfold(w8, w_scales).T).to(torch.bfloat16)
    if hasattr(F, "scaled_mm"):
        from torch.nn.functional import ScalingType

        return F.scaled_mm(a8, w8.T, a_scales, ScalingType.BlockWise1x128, w_scales,
                           ScalingType.BlockWise1x128, output_dtype=torch.bfloat16)
    return torch._scaled_mm(a8, w8.T, a_scales, w_scales.T, out_dtype=torch.bfloat16)


def _fp32_product(a: Tensor, w: Tensor) -> Tensor:
    """``a @ w.T`` of bf16 operands with FP32 output (cuBLAS's bf16 product with an FP32
    result on CUDA; on the CPU the FP32 product of the exactly upcast operands)."""
    if a.is_cuda:
        return torch.mm(a, w.T, out_dtype=torch.float32)
    return a.float() @ w.float().T


def _layer_operands(device: torch.device, k: int, fmt: Format, weight_codes: Tensor,
                    weight_scales: Tensor, weight_global, transform: Tensor | None,
                    bias: Tensor | None, prepared: PreparedWeight | None,
                    name: str = "linear_w4a4"):
    """One layer's checked operands for the decode and prefill paths: ``(codes, scale bytes,
    per-tensor scale on the device, prepared weight, transform, bias)``."""
    codes, scale_bytes = _operand(weight_codes, weight_scales, fmt.block_size, "weight", name)
    w_global = (None if weight_global is None
                else _device_scalar(weight_global, device, f"{name}: weight_global",
                                    checked=True))
    if prepared is None:
        prepared = _prepare_weight(codes, scale_bytes, w_global, fmt, host_scalars=False)
    elif prepared.shape != tuple(codes.shape) or prepared.fmt != fmt:
        raise ValueError(f"{name}: prepared is for other weights ({prepared.shape} "
                         f"{prepared.fmt.name})")
    n = codes.shape[0]
    if fmt.global_scale and w_global is None:
        raise ValueError(f"{name}: {fmt.name} needs the weights' per-tensor scale")
    if bias is not None and (bias.shape != (n,) or bias.device != device):
        raise ValueError(f"{name}: bias must be [{n}] on {device}, got shape "
                         f"{tuple(bias.shape)} on {bias.device}")
    if bias is not None:
        bias = bias.contiguous()
    t = _check_transform(transform, k, fmt.block_size, device, name)
    return codes, scale_bytes, w_global, prepared, t, bias


def linear_w4a4(
    x: Tensor, weight_codes: Tensor, weight_scales: Tensor, weight_global: Tensor | float | None,
    fmt: str | Format, transform: Tensor | None = None,
    act_global_scale: Tensor | float | None = None, bias: Tensor | None = None, *,
    prepared: PreparedWeight | None = None, path: str | None = None,
    prefill_product: str = "auto",
) -> Tensor:
    """``Q(W T^-1) Q(T x) + b`` on the kernels: ``x [..., K]`` to ``[..., N]`` in ``x``'s dtype.

    The path follows the number of rows ``M`` and the format (:func:`choose_path`; ``path``
    forces one):

    * ``decode`` (``M <`` :data:`PREFILL_MIN_M`: 1024 NVFP4, 256 MX): the activations rounded
      to their values in word order, then the decode GEMM of :mod:`kbbq_pl.kernels.skinny` on
      the weights as stored (16-row tiles up to 16 rows, 32 to 128 above);
    * ``tiled``: :func:`quantize_activations` then :func:`w4a4_matmul` (what the decode path
      falls back to where an MX weight's exponents span too many binades to decode exactly);
    * ``prefill`` (from there on): the activations rounded to bf16 values, the weights decoded
      to bf16 (per call, or kept by :func:`prepare_weight`), one product.  ``prefill_product``
      ``cublas`` hands it to ``torch.addmm`` with the per-tensor scales in its FP32 ``alpha``
      (where they are known on the host: MX, static NVFP4, a bf16 output), else an FP32
      product rounded once after the scales; ``triton`` uses the project's GEMM, whose
      epilogue reads the scales on the device; ``auto`` is ``cublas`` where ``alpha`` is
      known, else ``triton``; ``fp8`` (opt-in, MX) folds both operands to E4M3 with one
      scale per 128 along K and multiplies on FP8 tensor cores where every chunk folds
      exactly (checked on the host each call; inside a CUDA graph's capture it runs as
      ``auto``), else as ``auto`` (:func:`fp8_product_applies`).

    Every path gives each output within one rounding (to ``x``'s dtype) of the exact product
    of the same codes.  ``prepared`` (from :func:`prepare_weight`, for these weights) spares
    the per-call host reads (the MX decode shift, the static scales); without it the MX
    decode path reads the exponents' range on the host every call.
    """
    fmt = fp4_format(fmt)
    k = weight_codes.shape[-1] * 2
    lead = x.shape[:-1]
    x2 = pad_input(x, k, fmt.block_size, "linear_w4a4").reshape(-1, k)
    out_dtype = x.dtype if x.dtype in _OUT_DTYPES else torch.float32
    m = x2.shape[0]
    path = path or choose_path(m, fmt)
    if path not in PATHS:
        raise ValueError(f"linear_w4a4: path must be one of {PATHS}, got {path!r}")
    if prefill_product not in PREFILL_PRODUCTS:
        raise ValueError(f"linear_w4a4: prefill_product must be one of {PREFILL_PRODUCTS}, "
                         f"got {prefill_product!r}")
    if path == "tiled" or m == 0:
        codes, scales, pts = quantize_activations(x2, transform, fmt, act_global_scale)
        y = w4a4_matmul(codes, scales, pts, weight_codes, weight_scales, weight_global, fmt,
                        bias, out_dtype)
        return y.reshape(*lead, weight_codes.shape[0])
    codes, scale_bytes, w_global, prepared, t, bias = _layer_operands(
        x.device, k, fmt, weight_codes, weight_scales, weight_global, transform, bias, prepared)
    n = codes.shape[0]
    if path == "decode" and prepared.shift(scale_bytes) is None:  # MX exponents too far apart
        path = "tiled"
    if path == "tiled":
        a_codes, a_scales, pts = quantize_activations(x2, transform, fmt, act_global_scale)
        y = w4a4_matmul(a_codes, a_scales, pts, weight_codes, weight_scales, weight_global, fmt,
                        bias, out_dtype)
    elif path == "decode":
        y = _decode_path(x2, codes, scale_bytes, w_global, prepared, t, act_global_scale, bias,
                         out_dtype)
    else:
        y = _prefill_path(x2, codes, scale_bytes, w_global, prepared, t, act_global_scale, bias,
                          out_dtype, prefill_product,
                          (scale_source(weight_global), scale_source(act_global_scale)))
    return y.reshape(*lead, n)


class SiblingLinear(NamedTuple):
    """One of the layers of :func:`linear_w4a4_siblings`: the arguments of
    :func:`linear_w4a4` that are a layer's own."""

    weight_codes: Tensor
    weight_scales: Tensor
    weight_global: Tensor | float | None = None
    transform: Tensor | None = None
    act_global_scale: Tensor | float | None = None
    bias: Tensor | None = None
    prepared: PreparedWeight | None = None


MAX_SIBLINGS = 3
"""The most layers :func:`linear_w4a4_siblings` launches together (q, k and v)."""


def linear_w4a4_siblings(x: Tensor, layers: Sequence[SiblingLinear],
                         fmt: str | Format) -> list[Tensor]:
    """``[linear_w4a4(x, *layer, fmt) for layer in layers]`` for layers that read the same
    input (q/k/v, gate/up), each output as that call gives it (``[..., N_g]`` in ``x``'s
    dtype, within one rounding of the exact product of its codes), in two launches for all of
    them where they take the decode path together: one activation launch rounds ``x`` under
    each layer's transform and scale (each the bits of its own call), one decode GEMM streams
    every layer's weights (:func:`kbbq_pl.kernels.skinny.skinny_matmul` with siblings), where
    the layers would launch two (three: dynamic NVFP4) each.  A decode step's linears are
    short (a few microseconds), so their launches are much of its time.

    Together means: 2 or 3 layers (:data:`MAX_SIBLINGS`) of one ``K``, all with a transform or
    none, a static activation scale or none, a bias (of one dtype) or none, MX weights of one
    decode shift, rows below :data:`PREFILL_MIN_M`.  Otherwise each layer runs
    :func:`linear_w4a4` on its own.  The grouped decode GEMM (the opt-in DP4A product's too,
    at one row) chooses its tile and K splits for all the siblings' columns together: where
    they are a layer's own (as in the CPU tests), its output has that call's bits; else it is
    within the same one rounding of the exact product."""
    fmt = fp4_format(fmt)
    if not layers:
        raise ValueError("linear_w4a4_siblings: no layers")
    layers = [SiblingLinear(*layer) for layer in layers]
    k = layers[0].weight_codes.shape[-1] * 2
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0

    def each() -> list[Tensor]:
        return [linear_w4a4(x, layer.weight_codes, layer.weight_scales, layer.weight_global,
                            fmt, layer.transform, layer.act_global_scale, layer.bias,
                            prepared=layer.prepared) for layer in layers]

    from . import skinny

    if (not 2 <= len(layers) <= MAX_SIBLINGS or m == 0 or choose_path(m, fmt) != "decode"
            or any(layer.weight_codes.shape[-1] * 2 != k for layer in layers)
            or any(len({getattr(layer, field) is None for layer in layers}) > 1
                   for field in ("transform", "act_global_scale", "bias"))
            or len({layer.bias.dtype for layer in layers if layer.bias is not None}) > 1):
        return each()
    lead = x.shape[:-1]
    x2 = pad_input(x, k, fmt.block_size, "linear_w4a4_siblings").reshape(-1, k)
    out_dtype = x.dtype if x.dtype in _OUT_DTYPES else torch.float32
    name = "linear_w4a4_siblings"
    operands = [_layer_operands(x.device, k, fmt, layer.weight_codes, layer.weight_scales,
                                layer.weight_global, layer.transform, layer.bias,
                                layer.prepared, name) for layer in layers]
    shifts = {prepared.shift(scale_bytes) for _, scale_bytes, _, prepared, _, _ in operands}
    if len(shifts) > 1 or None in shifts:
        return each()
    act_scales = [_check_activations(x2, fmt, layer.act_global_scale, name) for layer in layers]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    scale_kind, rounding, gain = _scale_meta(fmt)
    operand = _decode_operand_dtype(x2.shape[0], scale_kind)
    dp4a = operand == torch.int8
    _, a_scales, pts, values = _backend().quantize_activations(
        x2, [t for *_, t, _ in operands], fmt.block_size, scale_kind, rounding, gain,
        None if act_scales[0] is None else act_scales, None, values_dtype=operand,
        codes=False, word_order=not dp4a)
    outs = skinny.skinny_matmul(
        values, x2.shape[0], [op[0] for op in operands], [op[1] for op in operands], pts,
        [op[2] for op in operands], fmt.block_size, scale_kind, gain, shifts.pop(),
        [op[5] for op in operands], out_dtype, a_scales=a_scales if dp4a else None)
    return [y.reshape(*lead, y.shape[1]) for y in outs]
