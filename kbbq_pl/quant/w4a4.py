"""The W4A4 weight: a :class:`~kbbq_pl.formats.QuantizedTensor` that owns ``F.linear``.

:class:`W4A4Weight` holds what the product ``y = Q(W T^-1) Q(T x) + b`` needs: the FP4 codes,
block scales and per-tensor scale of ``W T^-1`` (``[out, K]``, ``K`` the input width padded to
whole blocks), and the activation side: the online transform ``T`` (None, one ``d x d`` matrix
per block ``[K/d, d, d]`` or dense ``[K, K]``, FP32), the NVFP4 activation per-tensor scale
(``static``: calibrated, stored; ``dynamic``: ``amax / (448 * 6)`` of each call) and the
unpadded ``in_features``.  Following torchao's ``NVFP4Tensor``, the linear is implemented on the
weight (``implements_torch_function(F.linear)`` and ``implements(aten.linear.default)``), so a
plain ``nn.Linear`` whose weight is a ``W4A4Weight`` computes the quantized product::

    linear.weight = nn.Parameter(w4a4_weight, requires_grad=False)
    y = linear(x)                                  # = F.linear(x, w4a4_weight, linear.bias)

Where it runs:

* on CUDA, when the project's Triton kernels are present and run there
  (``kbbq_pl.kernels.available(device)``), through ``kbbq_pl.kernels.linear_w4a4``, which
  takes the decode path below 1,024 rows (NVFP4; 256 MX) and the prefill path from there on
  (the weight's prepared form, ``kbbq_pl.kernels.prepare_weight``, is made at its first
  product on a device and kept with it);
  (a gradient to the input or bias goes through the operator below, whose backward is the
  emulation's straight-through one);
* everywhere else, exact emulation: the padded input is upcast to FP32 and transformed there,
  its FP4 rounding is :func:`kbbq_pl.formats.fake_quantize` (straight-through under autograd),
  the weight is decoded from its codes in every call (no dense copy is kept) and the product is
  accumulated in FP32; the result is cast to the input's dtype.

:func:`cache_decoded_weights` is the opt-in for evaluation speed: inside it the emulation keeps
each weight's decoded FP32 copy (4 bytes per weight element) until the block ends.

Under ``torch.compile`` (and ``torch.export``) the product is one custom operator,
``torch.ops.kbbq_pl.w4a4_linear`` (:func:`compiled_linear`), that runs the above eagerly, with
or without a gradient; Inductor's pass of :mod:`kbbq_pl.quant.siblings` replaces siblings'
operators on one input by ``torch.ops.kbbq_pl.w4a4_linear_siblings`` (:func:`grouped_linears`).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from .._compat import TorchAOBaseTensor, tracing
from ..formats import Format, QuantizedTensor, fake_quantize, ste_fake_quantize
from ..kernels.reference import supports_format
from ..transforms.fit import transform_inputs
from .act_scale import ActScale, check_act_scale, effective_act_scale

KERNEL_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
"""Device types whose products go through ``kbbq_pl.kernels`` when it is available there (the
CPU runs the kernels only under Triton's interpreter, far slower than the emulation)."""
_KERNEL_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_F32 = torch.float32


class W4A4Weight(QuantizedTensor):
    """The quantized weight ``W T^-1`` of a W4A4 linear layer with its activation side.

    A subclass of :class:`~kbbq_pl.formats.QuantizedTensor` rather than optional fields on it:
    ``QuantizedTensor`` is the container of any format's codes (FP8 rows, INT4 groups,
    quantized activations, GPTQ's results), and only the weight of a block-FP4 linear layer has
    an activation side and a product to define.  As a subclass it keeps the codes' fields,
    layout and :meth:`dequantize`, so code that reads codes (export, DDP, reports) reads these.
    Every field is in torchao's tensor-data / attribute lists, so ``nn.Parameter``, ``.to()``,
    ``.clone()``, ``state_dict`` and ``torch.save`` keep them.

    Attributes (beyond ``QuantizedTensor``'s; ``last_dim`` is the padded input width ``K``):
        in_features: the layer's unpadded input width (``K - d < in_features <= K``).
        act_scale: ``static`` or ``dynamic`` NVFP4 activation per-tensor scale.
        transform: None, ``[K/d, d, d]`` blocks or dense ``[K, K]``, FP32.
        act_global_scale: the static activation scale (FP32 ``[]``), None when dynamic or not
            calibrated yet.
        layer_name: the layer's name, for error messages.
    """

    # torchao's constructor order: tensor data, attributes, optional data, optional attributes
    tensor_data_names = QuantizedTensor.tensor_data_names
    tensor_attribute_names = [*QuantizedTensor.tensor_attribute_names, "in_features", "act_scale"]
    optional_tensor_data_names = [*QuantizedTensor.optional_tensor_data_names, "transform",
                                  "act_global_scale"]
    optional_tensor_attribute_names = ["layer_name"]

    def __new__(
        cls,
        qdata: Tensor,
        scale: Tensor,
        fmt: Format,
        orig_dtype: torch.dtype,
        last_dim: int,
        in_features: int,
        act_scale: ActScale,
        global_scale: Tensor | None = None,
        transform: Tensor | None = None,
        act_global_scale: Tensor | None = None,
        layer_name: str | None = "",
    ):
        self = super().__new__(cls, qdata, scale, fmt, orig_dtype, last_dim, global_scale)
        self.in_features = in_features
        self.act_scale = act_scale
        self.transform = transform
        self.act_global_scale = act_global_scale
        self.layer_name = layer_name or ""
        _check_fields(self)
        return self

    # F.linear reaches the weight at the torch-function level (it would decompose into
    # aten.t + aten.addmm before __torch_dispatch__); QuantizedTensor disables torch functions.
    __torch_function__ = classmethod(TorchAOBaseTensor.__torch_function__.__func__)

    @classmethod
    def from_quantized(
        cls,
        codes: QuantizedTensor,
        *,
        in_features: int,
        transform: Tensor | None = None,
        act_scale: str = "dynamic",
        act_global_scale: Tensor | None = None,
        layer_name: str = "",
    ) -> W4A4Weight:
        """The codes of ``W T^-1`` (``[out, K]``, from :func:`kbbq_pl.formats.quantize` or
        GPTQ) with their activation side; ``act_scale`` ``static`` becomes ``dynamic`` for
        formats without a per-tensor scale."""
        act_scale = effective_act_scale(codes.fmt, act_scale)
        return cls(
            codes.qdata, codes.scale, codes.fmt, codes.orig_dtype, codes.last_dim, in_features,
            act_scale, codes.global_scale,
            None if transform is None else transform.detach().to(_F32),
            None if act_global_scale is None or act_scale == "dynamic"
            else act_global_scale.detach().to(_F32).reshape(()),
            layer_name,
        )

    def replace(self, **fields: Any) -> W4A4Weight:
        """A ``W4A4Weight`` sharing this one's tensors with the given fields changed."""
        names = (*self.tensor_data_names, *self.tensor_attribute_names,
                 *self.optional_tensor_data_names, *self.optional_tensor_attribute_names)
        unknown = set(fields) - set(names)
        if unknown:
            raise TypeError(f"W4A4Weight has no field(s) {sorted(unknown)}")
        return W4A4Weight(*(fields.get(n, getattr(self, n)) for n in names))

    @property
    def padded_in(self) -> int:
        return self.last_dim

    def __repr__(self) -> str:
        kind = "none" if self.transform is None else (
            "dense" if self.transform.dim() == 2 else f"blocks of {self.transform.shape[-1]}")
        return (f"W4A4Weight(fmt={self.fmt.name}, shape={tuple(self.shape)}, "
                f"in_features={self.in_features}, transform={kind}, act_scale={self.act_scale}, "
                f"orig_dtype={self.orig_dtype}, device={self.qdata.device}"
                + (f", layer_name={self.layer_name!r})" if self.layer_name else ")"))


# checkpoints holding W4A4Weight parameters load with torch.load(weights_only=True)
torch.serialization.add_safe_globals([W4A4Weight])


def _label(weight: W4A4Weight) -> str:
    return weight.layer_name or f"W4A4Weight{tuple(weight.shape)}"


def _check_fields(weight: W4A4Weight) -> None:
    fmt = weight.fmt
    label = _label(weight)
    if fmt.element != "e2m1" or fmt.granularity != "block":
        raise ValueError(f"{label}: a W4A4 weight needs a block FP4 format, got {fmt.name}")
    if weight.qdata.dim() != 2:
        raise ValueError(f"{label}: a W4A4 weight is [out, in], got codes of shape "
                         f"{tuple(weight.qdata.shape)}")
    block = fmt.block_size
    assert block is not None
    k = weight.last_dim
    if k % block or not k - block < weight.in_features <= k:
        raise ValueError(f"{label}: in_features {weight.in_features} does not pad to the codes' "
                         f"width {k} (whole {fmt.name} blocks of {block})")
    check_act_scale(weight.act_scale, f"{label}: act_scale")
    if effective_act_scale(fmt, weight.act_scale) != weight.act_scale:
        raise ValueError(f"{label}: {fmt.name} has no per-tensor activation scale to calibrate")
    t = weight.transform
    if t is not None and not (t.shape == (k, k) or (
            t.dim() == 3 and t.shape[1] == t.shape[2] and t.shape[0] * t.shape[1] == k)):
        raise ValueError(f"{label}: transform must be [{k}, {k}] or [{k}/d, d, d] for the "
                         f"padded width {k}, got shape {tuple(t.shape)}")
    scale = weight.act_global_scale
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"{label}: act_global_scale must be a scalar, got shape "
                         f"{tuple(scale.shape)}")


# ---------------------------------------------------------------------- the product


def padded_input(x: Tensor, in_features: int, padded_in: int) -> Tensor:
    """Inputs ``x [..., in_features]`` as ``[tokens, padded_in]``, zero-padded to whole blocks."""
    h = x.reshape(-1, in_features)
    return F.pad(h, (0, padded_in - in_features)) if padded_in != in_features else h


def transformed_input(x: Tensor, in_features: int, padded_in: int,
                      transform: Tensor | None) -> Tensor:
    """``T x`` in FP32 for inputs ``x [..., in_features]``: ``[tokens, padded_in]``, the input
    zero-padded to whole blocks and upcast (exactly) before the product (Sec. Transforms)."""
    return transform_inputs(padded_input(x, in_features, padded_in).to(_F32), transform)


_decoded: WeakIdKeyDictionary | None = None


@dataclass
class _RoundedInput:
    """The last emulated layer's rounded input ``Q(x)`` (a layer without a transform) and what
    it was rounded from."""

    source: weakref.ref[Tensor]  # x (not kept alive); its version tells an in-place refill
    version: int
    key: tuple[int, Format, float | None]  # padded width, format, static scale (None: dynamic)
    value: Tensor


_rounded: list[_RoundedInput] = []  # at most one entry, inside cache_decoded_weights


@contextlib.contextmanager
def cache_decoded_weights() -> Iterator[None]:
    """Keep the decoded FP32 copy of every W4A4 weight the emulation multiplies by, until the
    block ends (opt-in: without it each call decodes the codes anew and keeps nothing).

    For evaluating many batches on the CPU: the decode is then paid once per weight, at the
    price of 4 bytes per weight element held for the duration.  The weights must not change
    inside the block.  Nested blocks share the outer cache.  Kernel products do not decode.
    Inside the block, layers without a transform that read one tensor in a row (q/k/v,
    gate/up) with the same activation scale also share its rounding (the same bits).
    """
    global _decoded
    outer = _decoded
    if outer is None:
        _decoded = WeakIdKeyDictionary()
    try:
        yield
    finally:
        if outer is None:
            _decoded = None
            _rounded.clear()


def decoded_weight(weight: QuantizedTensor) -> Tensor:
    """``Q(W T^-1)`` as a dense FP32 ``[out, K]`` tensor (cached only inside
    :func:`cache_decoded_weights`, per codes tensor with its scales: the weights that share
    them, as :meth:`W4A4Weight.replace` and a compiled graph's operator make, share it)."""
    if _decoded is None:
        return weight.dequantize(_F32)
    entry = _decoded.get(weight.qdata)
    if entry is None or entry[0] is not weight.scale or entry[1] is not weight.global_scale:
        entry = _decoded[weight.qdata] = (weight.scale, weight.global_scale,
                                          weight.dequantize(_F32))
    return entry[2]


def _kernels() -> ModuleType | None:
    """``kbbq_pl.kernels`` when installed (imported on first use), else None."""
    try:
        return importlib.import_module("kbbq_pl.kernels")
    except ImportError:
        return None


def uses_kernels(x: Tensor, weight: W4A4Weight) -> bool:
    """Whether ``F.linear(x, weight)`` runs on ``kbbq_pl.kernels`` (module docstring): a device
    of :data:`KERNEL_DEVICE_TYPES` where the kernels run, a kernel format and dtype, and block
    transforms matched to the format's block (or none)."""
    if x.device.type not in KERNEL_DEVICE_TYPES or x.dtype not in _KERNEL_INPUT_DTYPES:
        return False
    t = weight.transform
    if t is not None and (t.dim() != 3 or t.shape[-1] != weight.fmt.block_size):
        return False
    if not supports_format(weight.fmt):
        return False
    kernels = _kernels()
    return kernels is not None and bool(kernels.available(x.device))


def _rounded_input(h: Tensor, fmt: Format, global_scale: Tensor | None,
                   layer_name: str) -> Tensor:
    """The transformed activations rounded to ``fmt``: straight-through while a gradient
    reaches them (the same values either way)."""
    name = f"{layer_name}.input" if layer_name else "input"
    if torch.is_grad_enabled() and h.requires_grad:
        return ste_fake_quantize(h, fmt, global_scale=global_scale, name=name)
    return fake_quantize(h, fmt, global_scale=global_scale, name=name)


def _shared_rounded_input(x: Tensor, weight: W4A4Weight,
                          act_global_scale: Tensor | None) -> Tensor:
    """``Q(T x)`` of :func:`_emulated_linear`; inside :func:`cache_decoded_weights`, for layers
    without a transform, reused by the next layer reading the same ``x`` in the same format,
    width and scale.  A layer's own transform is never shared: its rounded input is not kept
    past its product (it is activation-sized)."""
    # no graph to split; an inference tensor has no version counter to tell an in-place change
    if (_decoded is None or weight.transform is not None or torch.is_grad_enabled()
            or x.is_inference()):
        _rounded.clear()
        h = transformed_input(x, x.shape[-1], weight.last_dim, weight.transform)
        return _rounded_input(h, weight.fmt, act_global_scale, weight.layer_name)
    key = (weight.last_dim, weight.fmt,
           None if act_global_scale is None else float(act_global_scale))
    if _rounded:
        last = _rounded[0]
        if last.source() is x and last.version == x._version and last.key == key:
            return last.value
    h = transformed_input(x, x.shape[-1], weight.last_dim, None)
    h = _rounded_input(h, weight.fmt, act_global_scale, weight.layer_name)
    _rounded[:] = [_RoundedInput(weakref.ref(x), x._version, key, h)]
    return h


def _emulated_linear(x: Tensor, weight: W4A4Weight, bias: Tensor | None,
                     act_global_scale: Tensor | None) -> Tensor:
    h = _shared_rounded_input(x, weight, act_global_scale)
    y = F.linear(h, decoded_weight(weight))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def w4a4_linear(x: Tensor, weight: W4A4Weight, bias: Tensor | None = None, *,
                dynamic: bool = False) -> Tensor:
    """``Q(W T^-1) Q(T x) + b`` for ``x [..., in_features]`` (or already padded to ``K``):
    ``[..., out]`` in ``x``'s dtype.  ``dynamic`` takes the activation scale of this call even
    when the weight has a static one (calibration)."""
    if x.shape[-1] not in (weight.in_features, weight.last_dim):
        raise ValueError(f"{_label(weight)}: input of shape {tuple(x.shape)} on {x.device} does "
                         f"not match in_features {weight.in_features}")
    if weight.qdata.device != x.device:
        raise ValueError(f"{_label(weight)}: input on {x.device}, weight on "
                         f"{weight.qdata.device}")
    static = weight.act_scale == "static" and not dynamic
    if static and weight.act_global_scale is None:
        raise RuntimeError(f"{_label(weight)}: static activation scale not calibrated; run "
                           "calibration or use act_scale='dynamic'")
    scale = weight.act_global_scale if static else None
    if uses_kernels(x, weight):
        if torch.is_grad_enabled() and (x.requires_grad or bias is not None
                                        and bias.requires_grad):
            return compiled_linear(x, weight, bias)  # the kernels' forward, its backward
        if sibling_scopes.stack and not dynamic and not x.is_inference():
            y = sibling_scopes.stack[-1].output(x, weight, bias)
            if y is not None:
                return y
        kernels = _kernels()
        assert kernels is not None
        return kernels.linear_w4a4(x, weight.qdata, weight.scale, weight.global_scale,
                                   weight.fmt, weight.transform, scale, bias,
                                   prepared=_prepared_weight(kernels, weight, scale),
                                   prefill_product=PREFILL_PRODUCT)
    return _emulated_linear(x, weight, bias, scale)


def grouped_linears(x: Tensor, weights: Sequence[W4A4Weight],
                    biases: Sequence[Tensor | None]) -> list[Tensor] | None:
    """``[F.linear(x, w, b) for w, b in zip(weights, biases)]`` for sibling layers reading one
    input (q/k/v, gate/up), computed together by :func:`kbbq_pl.kernels.linear_w4a4_siblings`
    where they all run on the kernels in one format and width and ``x``'s rows take the decode
    path; else None (each then runs :func:`w4a4_linear` on its own).  No gradient: the eager
    hooks (:mod:`kbbq_pl.quant.siblings`) and the compiled operator call it outside autograd."""
    first = weights[0]
    if not all(_runs_with(x, w, first) for w in weights):
        return None
    kernels = _kernels()
    assert kernels is not None  # uses_kernels said so
    if kernels.choose_path(x.numel() // x.shape[-1], first.fmt) != "decode":
        return None
    layers = []
    for weight, bias in zip(weights, biases):
        scale = weight.act_global_scale if weight.act_scale == "static" else None
        layers.append(kernels.SiblingLinear(weight.qdata, weight.scale, weight.global_scale,
                                            weight.transform, scale, bias,
                                            _prepared_weight(kernels, weight, scale)))
    return kernels.linear_w4a4_siblings(x, layers, first.fmt)


def _runs_with(x: Tensor, weight: object, first: W4A4Weight) -> bool:
    """Whether sibling ``weight`` runs on the kernels for ``x`` in the first's format and
    width, its static activation scale (if any) calibrated."""
    return (isinstance(weight, W4A4Weight) and weight.fmt == first.fmt
            and weight.last_dim == first.last_dim
            and x.shape[-1] in (weight.in_features, weight.last_dim)
            and weight.qdata.device == x.device and uses_kernels(x, weight)
            and (weight.act_scale != "static" or weight.act_global_scale is not None))


class _SiblingScopes(threading.local):
    """Per thread, the parent modules running now whose sibling linears run together
    (:mod:`kbbq_pl.quant.siblings` pushes and pops them on ``stack``), innermost last."""

    def __init__(self) -> None:
        self.stack: list = []


sibling_scopes = _SiblingScopes()


PREFILL_PRODUCT = "auto"
"""The product of the kernels' prefill path for every W4A4 layer (``prefill_product`` of
:func:`kbbq_pl.kernels.linear_w4a4`): ``auto``, bf16 tensor cores on the exactly decoded
operands, by default; ``fp8`` multiplies MX layers on FP8 tensor cores where their operands
fold exactly (opt-in; not inside a CUDA graph: docs/kernels.md)."""
KEEP_DECODED_WEIGHTS = False
"""Whether the kernels keep each weight as the prefill product takes it: decoded to bf16 (2
bytes a weight on the device, 3.6x the packed codes) or, with ``PREFILL_PRODUCT = "fp8"``, an
MX weight folded to E4M3 (1.03 bytes a weight); the default decodes or folds per call:
docs/kernels.md."""
_prepared: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _prepared_weight(kernels: ModuleType, weight: W4A4Weight, act_scale: Tensor | None):
    """The kernels' prepared form of ``weight`` on its device (``kernels.prepare_weight``: the
    products choose their path by the number of rows), made at its first product there and
    kept while its codes live unchanged.  The first product reads the static scales to the
    host: warm a layer up before capturing it in a CUDA graph."""
    key = (weight.qdata._version, weight.scale._version, KEEP_DECODED_WEIGHTS, PREFILL_PRODUCT,
           kernels.scale_source(weight.global_scale), kernels.scale_source(act_scale))
    entry = _prepared.get(weight.qdata)
    if entry is None or entry[0] != key:
        prepared = kernels.prepare_weight(weight.qdata, weight.scale, weight.global_scale,
                                          weight.fmt, act_scale,
                                          keep_decoded=KEEP_DECODED_WEIGHTS,
                                          prefill_product=PREFILL_PRODUCT)
        entry = _prepared[weight.qdata] = (key, prepared)
    return entry[1]


def _linear_arguments(args: tuple, kwargs: dict,
                      kind: type = QuantizedTensor) -> tuple[Tensor, Any, Tensor | None]:
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not isinstance(weight, kind) or isinstance(x, kind):
        raise NotImplementedError(f"{kind.__name__} multiplies only as the weight of "
                                  "F.linear(x, w, b)")
    if not x.is_floating_point():  # nn.Linear refuses it too; rounding it would truncate
        name = getattr(weight, "layer_name", "") or f"{kind.__name__}{tuple(weight.shape)}"
        raise TypeError(f"{name}: input of dtype {x.dtype} (shape {tuple(x.shape)} on "
                        f"{x.device}); a quantized layer multiplies floating-point inputs")
    return x, weight, bias


# torch functions (F.linear, torch.ops.aten.linear.default called from Python) and the aten op
# where it reaches __torch_dispatch__ undecomposed
@W4A4Weight.implements_torch_function([F.linear, torch.ops.aten.linear.default])
@W4A4Weight.implements(torch.ops.aten.linear.default)
def _linear(func, types, args, kwargs):
    x, weight, bias = _linear_arguments(args, kwargs or {}, W4A4Weight)
    if tracing():
        return compiled_linear(x, weight, bias)
    return w4a4_linear(x, weight, bias)


# ---------------------------------------------------------------------- under torch.compile


def compiled_linear(x: Tensor, weight: W4A4Weight, bias: Tensor | None = None) -> Tensor:
    """:func:`w4a4_linear` as one custom operator (``torch.ops.kbbq_pl.w4a4_linear``), the form
    in which ``F.linear`` of a ``W4A4Weight`` reaches a graph that ``torch.compile`` traces.

    As torchao and vLLM register their kernels: the compiler sees one opaque operator with a
    fake implementation (the output's shape and dtype) instead of tracing the kernels' Python
    (autotuning, prepared-weight caches, host-side checks), so a model compiles without a graph
    break around its linears, ``mode="reduce-overhead"`` captures them in its CUDA graphs, and
    the compiler fuses the operations between them.  The operator runs :func:`w4a4_linear`
    eagerly on the weight's fields: the same bits as an eager call.  Its backward is the
    emulation's straight-through one (:func:`_w4a4_linear_backward`), so a gradient reaches the
    input and the bias of a frozen quantized layer (an adapter or a norm trained around it)
    through a compiled graph, and through the kernels' forward on a GPU."""
    fmt = weight.fmt
    return torch.ops.kbbq_pl.w4a4_linear(
        x, weight.qdata, weight.scale, weight.global_scale, weight.transform,
        weight.act_global_scale, bias, fmt.name, fmt.block_size, fmt.scale_kind,
        fmt.global_scale, fmt.e8m0_rounding, weight.last_dim, weight.in_features,
        weight.act_scale, weight.layer_name)


@torch.library.custom_op(
    "kbbq_pl::w4a4_linear", mutates_args=(),
    schema="(Tensor x, Tensor qdata, Tensor scale, Tensor? global_scale, Tensor? transform, "
           "Tensor? act_global_scale, Tensor? bias, str fmt_name, int block_size, "
           "str scale_kind, bool has_global_scale, str e8m0_rounding, int last_dim, "
           "int in_features, str act_scale, str layer_name) -> Tensor")
def _w4a4_linear_op(x, qdata, scale, global_scale, transform, act_global_scale, bias, fmt_name,
                    block_size, scale_kind, has_global_scale, e8m0_rounding, last_dim,
                    in_features, act_scale, layer_name):
    fmt = _block_fp4(fmt_name, block_size, scale_kind, has_global_scale, e8m0_rounding)
    weight = W4A4Weight(qdata, scale, fmt, x.dtype, last_dim, in_features, act_scale,
                        global_scale, transform, act_global_scale, layer_name)
    with torch.no_grad():  # the gradient is the registered backward's
        return w4a4_linear(x, weight, bias)


def _block_fp4(name: str, block_size: int, scale_kind: str, has_global_scale: bool,
               e8m0_rounding: str) -> Format:
    """The block-FP4 :class:`Format` the operator's arguments spell out."""
    return Format(name, "e2m1", "block", block_size, scale_kind, has_global_scale, e8m0_rounding)


@_w4a4_linear_op.register_fake
def _w4a4_linear_fake(x, qdata, *args):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


def _w4a4_linear_setup_context(ctx, inputs, output) -> None:
    x, qdata, scale, global_scale, transform, act_global_scale, bias, *fields = inputs
    ctx.save_for_backward(qdata, scale, global_scale, transform)
    ctx.fmt, ctx.last_dim = _block_fp4(*fields[:5]), fields[5]
    ctx.input_shape, ctx.input_dtype = x.shape, x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _w4a4_linear_backward(ctx, grad: Tensor):
    """The emulation's gradients of ``y = Q(W T^-1) Q(T x) + b`` (straight through the
    activations' rounding, as :func:`kbbq_pl.formats.ste_fake_quantize`): ``d/dx`` is the
    transposed product with the decoded weight in FP32, then the transform's own vector-Jacobian
    product (its padding cropped); ``d/db`` the sum over the rows.  The codes get none."""
    qdata, scale, global_scale, transform = ctx.saved_tensors
    rows = grad.reshape(-1, qdata.shape[0]).to(_F32)
    grad_x = grad_bias = None
    if ctx.needs_input_grad[0]:
        weight = QuantizedTensor(qdata, scale, ctx.fmt, _F32, ctx.last_dim, global_scale)
        grad_h = rows @ decoded_weight(weight)
        width = ctx.input_shape[-1]
        shaped = grad.new_empty(ctx.input_shape, dtype=ctx.input_dtype)
        _, transform_vjp = torch.func.vjp(
            lambda v: transformed_input(v, width, ctx.last_dim, transform), shaped)
        (grad_x,) = transform_vjp(grad_h)
    if ctx.needs_input_grad[6]:
        grad_bias = rows.sum(0).to(ctx.bias_dtype)
    return grad_x, None, None, None, None, None, grad_bias, *(None,) * 9


_w4a4_linear_op.register_autograd(_w4a4_linear_backward,
                                  setup_context=_w4a4_linear_setup_context)


@torch.library.custom_op(
    "kbbq_pl::w4a4_linear_siblings", mutates_args=(),
    schema="(Tensor x, Tensor[] qdata, Tensor[] scale, Tensor?[] global_scale, "
           "Tensor?[] transform, Tensor?[] act_global_scale, Tensor?[] bias, str fmt_name, "
           "int block_size, str scale_kind, bool has_global_scale, str e8m0_rounding, "
           "int last_dim, int[] in_features, str[] act_scale, str[] layer_name) -> Tensor[]")
def _w4a4_linear_siblings_op(x, qdata, scale, global_scale, transform, act_global_scale, bias,
                             fmt_name, block_size, scale_kind, has_global_scale, e8m0_rounding,
                             last_dim, in_features, act_scale, layer_name):
    """Sibling ``kbbq_pl::w4a4_linear`` calls on one input as one operator: what the compiler
    pass of :mod:`kbbq_pl.quant.siblings` puts in their place, after autograd (so no backward
    of its own).  Each output is its layer's operator's (:func:`grouped_linears`)."""
    fmt = _block_fp4(fmt_name, block_size, scale_kind, has_global_scale, e8m0_rounding)
    weights = [W4A4Weight(q, s, fmt, x.dtype, last_dim, n, kind, g, t, a, name)
               for q, s, n, kind, g, t, a, name in zip(qdata, scale, in_features, act_scale,
                                                       global_scale, transform,
                                                       act_global_scale, layer_name)]
    with torch.no_grad():
        outputs = grouped_linears(x, weights, bias)
        if outputs is None:
            outputs = [w4a4_linear(x, w, b) for w, b in zip(weights, bias)]
    return outputs


@_w4a4_linear_siblings_op.register_fake
def _w4a4_linear_siblings_fake(x, qdata, *args):
    return [x.new_empty((*x.shape[:-1], q.shape[0])) for q in qdata]


# ---------------------------------------------------------------------- the trainable weight


class MasterWeight(Tensor):
    """A trainable layer's high-precision master copy of ``W T^-1`` (``[out, K]``) as the
    weight of its W4A4 product: ``F.linear(x, master_weight, b)`` rounds the master weight and
    the activations to the format in every call, with straight-through gradients (the QAT
    estimator of torchao and FP-Quant), so ``y = Q(W T^-1) Q(T x) + b`` trains the master copy.

    A view made per call by :meth:`of` around the layer's plain ``nn.Parameter`` (optimizers,
    ``state_dict`` and device moves see an ordinary tensor); it carries the activation side as
    :class:`W4A4Weight` does (``in_features``, ``transform``, ``act_scale``,
    ``act_global_scale``, ``layer_name``).  Every other torch function sees a plain tensor.
    """

    master: Tensor
    fmt: Format
    in_features: int
    transform: Tensor | None
    act_scale: ActScale
    act_global_scale: Tensor | None
    weight_global_scale: Tensor | None
    layer_name: str

    @classmethod
    def of(cls, master: Tensor, fmt: Format, *, in_features: int, transform: Tensor | None,
           act_scale: ActScale, act_global_scale: Tensor | None,
           weight_global_scale: Tensor | None = None, layer_name: str = "") -> MasterWeight:
        """The product's view of ``master`` (its gradient reaches ``master``);
        ``weight_global_scale`` fixes NVFP4's per-tensor scale of the master weight's rounding
        (None: its own, ``amax / (448 * 6)``)."""
        with torch._C.DisableTorchFunctionSubclass():
            view = master.as_subclass(cls)
        view.master, view.fmt, view.in_features = master, fmt, in_features
        view.transform, view.act_scale, view.act_global_scale = transform, act_scale, \
            act_global_scale
        view.weight_global_scale, view.layer_name = weight_global_scale, layer_name
        return view

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.linear, torch.ops.aten.linear.default):
            return master_linear(*_linear_arguments(args, kwargs, MasterWeight))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def master_linear(x: Tensor, weight: MasterWeight, bias: Tensor | None = None) -> Tensor:
    """``Q(W T^-1) Q(T x) + b`` of a trainable master weight, in the input's dtype (no FP32
    upcast: the rounding is :func:`kbbq_pl.formats.ste_fake_quantize` while a gradient is
    recorded, :func:`kbbq_pl.formats.fake_quantize` otherwise, the same values)."""
    label = weight.layer_name or "QuantizedLinear"
    if x.shape[-1] != weight.in_features:
        raise ValueError(f"{label}: input of shape {tuple(x.shape)} on {x.device} does not "
                         f"match in_features {weight.in_features}")
    if weight.act_scale == "static" and weight.act_global_scale is None:
        raise RuntimeError(f"{label}: static activation scale not calibrated; run "
                           "calibration or use act_scale='dynamic'")
    h = transform_inputs(padded_input(x, weight.in_features, weight.shape[-1]),
                         weight.transform)
    static = weight.act_global_scale if weight.act_scale == "static" else None
    h = _rounded_input(h, weight.fmt, static, weight.layer_name)
    w = ste_fake_quantize(weight.master, weight.fmt, global_scale=weight.weight_global_scale,
                          name=f"{weight.layer_name}.weight")
    y = F.linear(h, w.to(h.dtype))
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


__all__ = [
    "KERNEL_DEVICE_TYPES",
    "MasterWeight",
    "W4A4Weight",
    "cache_decoded_weights",
    "compiled_linear",
    "decoded_weight",
    "master_linear",
    "padded_input",
    "transformed_input",
    "uses_kernels",
    "w4a4_linear",
]
