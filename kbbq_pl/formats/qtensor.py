"""Quantize, dequantize and fake-quantize; :class:`QuantizedTensor`, the container of codes.

``QuantizedTensor`` is a torchao-style tensor subclass (built on ``TorchAOBaseTensor``, as
torchao's own ``NVFP4Tensor`` and ``MXTensor`` are) so that ``nn.Parameter``, ``.to()``,
``.clone()``, ``state_dict`` and ``torch.save`` keep every field: the packed codes, the block
scales, the per-tensor scale, the format, the original dtype and the unpadded last dimension.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple, NoReturn

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import return_and_correct_aliasing

from .._compat import TorchAOBaseTensor, tracing
from . import rounding
from .dispatch import run_kernel
from .spec import Format, get_format

NonFinitePolicy = Literal["raise", "propagate", "zero"]
"""What to do with NaN/Inf inputs: ``raise`` (default) a ValueError naming the tensor and the
count; ``propagate``: every scale group holding one gets a NaN scale (the OCP MX rule), so it
dequantizes to NaN; ``zero``: quantize them as zeros."""

_POLICIES = ("raise", "propagate", "zero")
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class QuantizedTensor(TorchAOBaseTensor):
    """A tensor stored in a kbbq-pl format.

    Attributes:
        qdata: element codes: uint8 with two 4-bit codes per byte (E2M1, INT4),
            ``float8_e4m3fn`` (FP8) or int8 (INT8); the last dimension padded to whole blocks.
        scale: per-group scales: ``float8_e4m3fn`` (NVFP4), ``float8_e8m0fnu`` (MX) or FP32,
            shaped ``[..., groups]`` for blocks, ``[..., 1]`` for rows, ``[]`` for a tensor.
        global_scale: the FP32 per-tensor scale above E4M3 block scales (NVFP4), else None.
        fmt: the :class:`~kbbq_pl.formats.Format`.
        orig_dtype: dtype of the quantized input; :meth:`dequantize` returns it by default.
        last_dim: unpadded length of the last dimension.
    """

    tensor_data_names = ["qdata", "scale"]
    tensor_attribute_names = ["fmt", "orig_dtype", "last_dim"]
    optional_tensor_data_names = ["global_scale"]

    def __new__(
        cls,
        qdata: Tensor,
        scale: Tensor,
        fmt: Format,
        orig_dtype: torch.dtype,
        last_dim: int,
        global_scale: Tensor | None = None,
    ):
        shape = (*qdata.shape[:-1], last_dim)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=orig_dtype, device=qdata.device, requires_grad=False
        )
        self.qdata = qdata
        self.scale = scale
        self.fmt = fmt
        self.orig_dtype = orig_dtype
        self.last_dim = last_dim
        self.global_scale = global_scale
        return self

    def __init__(self, *args, **kwargs) -> None:
        pass

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        """torchao's dispatch to the operations implemented for the class; any other is an
        error that names the layer and what to call instead (torchao's names only the op)."""
        implementation = cls._ATEN_OP_TABLE.get(cls, {}).get(func)
        if implementation is None:
            raise NotImplementedError(_unsupported(func, args))
        return implementation(func, types, args, kwargs or {})

    def dequantize(self, output_dtype: torch.dtype | None = None) -> Tensor:
        """The represented values in ``output_dtype`` (default: the original dtype)."""
        return dequantize(self, output_dtype)

    def _stable_hash_for_caching(self) -> str:
        """This tensor's key in ``torch.compile``'s AOTAutograd cache: what its flattening
        keeps besides tensor data (the format and attributes, each inner tensor's dtype, shape,
        strides and device), hashed the same in every process (torch's default for wrapper
        subclasses, which warns that a subclass should say it)."""
        names, metadata = self.__tensor_flatten__()
        inner = tuple((name, t.dtype, tuple(t.shape), t.stride(), str(t.device))
                      for name in names for t in [getattr(self, name)])
        payload = (type(self).__qualname__, tuple(self.shape), self.requires_grad,
                   sorted(metadata.items()), inner)
        return hashlib.blake2b(repr(payload).encode(), digest_size=16).hexdigest()

    def __reduce_ex__(self, protocol: int) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its inner tensors and attributes (``__tensor_flatten__``), rebuilt by
        :func:`_rebuild_quantized`: plain tensors, so ``torch.load`` relocates them with any
        ``map_location``, a callable too (Lightning's checkpoint loading passes one, which torch
        refuses for the wrapper subclasses it pickles itself)."""
        names, attributes = self.__tensor_flatten__()
        return _rebuild_quantized, (type(self), {name: getattr(self, name) for name in names},
                                    attributes, tuple(self.shape), tuple(self.stride()),
                                    isinstance(self, torch.nn.Parameter))

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(fmt={self.fmt.name}, shape={tuple(self.shape)}, "
            f"orig_dtype={self.orig_dtype}, device={self.qdata.device})"
        )


def _described(codes: QuantizedTensor, kind: str | None = None) -> str:
    """``codes`` as its errors name it: its layer (where it knows it), format, ``kind`` (default:
    its class), shape and device."""
    layer = getattr(codes, "layer_name", "")
    return (f"{layer + ': ' if layer else ''}a {codes.fmt.name} {kind or type(codes).__name__} "
            f"of shape {tuple(codes.shape)} on {codes.device}")


def _unsupported(func: Any, args: Any) -> str:
    """The error of an operation a :class:`QuantizedTensor` does not run (its dispatch)."""
    codes = next(t for t in torch.utils._pytree.tree_leaves(args)
                 if isinstance(t, QuantizedTensor))
    return (f"{_described(codes)} holds packed codes and does not run {func} (it runs "
            "F.linear, device and dtype moves, copies): code that reads it as a "
            "dense tensor (peft's DoRA, which reads the base layer's weight) needs "
            ".dequantize() (the codes' values, before any transform) or model.dequantize() "
            "(the dense weight-only model)")


def _rebuild_quantized(cls: type[QuantizedTensor], tensors: dict[str, Tensor],
                       attributes: dict[str, Any], shape: tuple[int, ...],
                       stride: tuple[int, ...], parameter: bool = False) -> QuantizedTensor:
    """A :class:`QuantizedTensor` (or subclass) from what its ``__reduce_ex__`` pickled (an
    ``nn.Parameter`` again where it was one)."""
    rebuilt = cls.__tensor_unflatten__(tensors, attributes, shape, stride)
    return torch.nn.Parameter(rebuilt, requires_grad=False) if parameter else rebuilt


@QuantizedTensor.implements(torch.ops.aten.empty_like.default)
def _empty_like(func: Any, types: Any, args: Any, kwargs: Any) -> QuantizedTensor:
    """Uninitialized storage of the same layout, on ``device`` where given (``to_empty``
    materializes a model built or moved on the meta device): each inner tensor's own dtype."""
    device = (kwargs or {}).get("device")  # None: each inner tensor's own
    return args[0]._apply_fn_to_data(lambda t: torch.empty_like(t, device=device))


@QuantizedTensor.implements(torch.ops.aten.view.default)
def _view(func: Any, types: Any, args: Any, kwargs: Any) -> NoReturn:
    """No view: the codes are packed (two a byte) beside their block scales.  Flattening one
    into a buffer with other tensors is what DDP's start-up broadcast of the parameters does,
    so a one-dimensional view's error says how to leave the codes out of it."""
    source, shape = args[0], list(args[1])
    hint = ("; DDP's start-up broadcast flattens every parameter: call "
            "kbbq_pl.exclude_quantized_from_ddp_sync(model) on the module that "
            "DistributedDataParallel wraps (a peft model too) before wrapping it"
            if len(shape) == 1 else "")
    raise NotImplementedError(f"{_described(source, 'QuantizedTensor')} holds packed codes and "
                              f"has no view of shape {shape}{hint}")


_LABELS = ("orig_dtype", "layer_name")
"""Fields a copy leaves as the target's: the dtype it presents (as a copy into a dense tensor
casts) and its layer's name."""


def _layout_differences(target: QuantizedTensor, source: QuantizedTensor) -> list[str]:
    """How ``source``'s layout differs from ``target``'s (torchao's ``_same_metadata``, bar
    :data:`_LABELS`), each as ``"field source's, not target's"``."""
    if type(source) is not type(target):
        return [f"class {type(source).__name__}, not {type(target).__name__}"]
    differences = []
    if source.shape != target.shape:
        differences.append(f"shape {tuple(source.shape)}, not {tuple(target.shape)}")
    for name in (*target.tensor_attribute_names,
                 *getattr(target, "optional_tensor_attribute_names", ())):
        ours, theirs = getattr(target, name), getattr(source, name)
        if name not in _LABELS and ours != theirs:
            differences.append(f"{name} {getattr(theirs, 'name', theirs)}, "
                               f"not {getattr(ours, 'name', ours)}")
    for name in (*target.tensor_data_names, *target.optional_tensor_data_names):
        ours, theirs = getattr(target, name), getattr(source, name)
        if (ours is None) != (theirs is None) or (ours is not None
                                                  and ours.shape != theirs.shape):
            shown = [None if t is None else tuple(t.shape) for t in (theirs, ours)]
            differences.append(f"{name} {shown[0]}, not {shown[1]}")
    return differences


@QuantizedTensor.implements(torch.ops.aten.copy_.default)
def _copy_(func: Any, types: Any, args: Any, kwargs: Any) -> QuantizedTensor:
    """Codes into codes of the same layout (the inner tensors copied, as torchao's copy; the
    target keeps its presented dtype and its layer's name: ``load_state_dict`` between models
    whose layers were named differently).  Codes of another layout, and codes and a dense
    tensor (``load_state_dict`` across a quantized and a full-precision model), do not copy
    into each other: an error says what differs, or which model takes which."""
    target, source = args[0], args[1]
    if isinstance(target, QuantizedTensor) and isinstance(source, QuantizedTensor):
        differences = _layout_differences(target, source)
        if differences:
            raise ValueError(f"{_described(target)} does not take the codes of "
                             f"{_described(source)}, of another layout: "
                             + "; ".join(differences))
        for name in target.__tensor_flatten__()[0]:
            getattr(target, name).copy_(getattr(source, name))
        return target
    codes = source if isinstance(source, QuantizedTensor) else target
    dense = target if codes is source else source
    where = _described(codes, "QuantizedTensor")
    if codes is source:
        raise TypeError(f"{where} holds FP4 codes (of W T^-1 where a transform T is applied), "
                        f"not the dense weight of shape {tuple(dense.shape)} it is copied into: "
                        "load a quantized state dict into a quantized model "
                        "(kbbq_pl.from_pretrained, or kbbq_pl.callbacks.restore_quantized in a "
                        "LightningModule); model.dequantize() gives a dense model")
    raise TypeError(f"{where} takes codes of its own layout, not a dense tensor of shape "
                    f"{tuple(dense.shape)} and dtype {dense.dtype}: load a full-precision state "
                    "dict into the full-precision model, then quantize it")


@QuantizedTensor.implements(torch.ops.aten._to_copy.default)
def _to_copy(func: Any, types: Any, args: Any, kwargs: Any) -> QuantizedTensor:
    """``.to(device)`` moves the inner tensors; ``.to(dtype)`` (``Module.to(dtype)``,
    ``.half()``) changes the dtype the tensor presents and dequantizes to, not its codes, as
    torchao's ``NVFP4Tensor`` and ``MXTensor`` do."""
    source = args[0]
    to = source._get_to_kwargs(*args[1:], **(kwargs or {}))
    dtype = to["dtype"]
    if dtype not in _INPUT_DTYPES:
        raise TypeError(f"a {source.fmt.name} QuantizedTensor of shape {tuple(source.shape)} "
                        f"on {source.device} dequantizes to a floating dtype (fp32, bf16, fp16 "
                        f"or fp64), not {dtype}")
    moved = source._apply_fn_to_data(
        lambda t: t.to(to["device"], non_blocking=to["non_blocking"]))
    if dtype != source.orig_dtype:
        names, attributes = moved.__tensor_flatten__()
        moved = type(moved).__tensor_unflatten__(
            {name: getattr(moved, name) for name in names}, {**attributes, "orig_dtype": dtype},
            moved.shape, moved.stride())
    return return_and_correct_aliasing(func, args, kwargs, moved)


# checkpoints holding QuantizedTensor weights load with torch.load(weights_only=True)
torch.serialization.add_safe_globals([QuantizedTensor, Format, _rebuild_quantized])


def _check_policy(nonfinite: str) -> None:
    if nonfinite not in _POLICIES:
        raise ValueError(f"nonfinite must be one of {_POLICIES}, got {nonfinite!r}")


def _raise_nonfinite(x: Tensor, name: str) -> None:
    nan = int(torch.isnan(x).sum())
    inf = int(torch.isinf(x).sum())
    raise ValueError(
        f"{name}: {nan + inf} non-finite values ({nan} NaN, {inf} Inf) of {x.numel()} "
        f"in a tensor of shape {tuple(x.shape)}; pass nonfinite='zero' or 'propagate' "
        "to quantize it anyway"
    )


def _groups(x: Tensor, fmt: Format, pad: bool, name: str) -> tuple[Tensor, int]:
    """The 2-D group view of ``x`` for ``fmt`` and the padding added to the last dimension."""
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"{name}: cannot quantize dtype {x.dtype}; use fp32, bf16, fp16 or fp64")
    if fmt.granularity == "tensor":
        return x.reshape(1, -1), 0
    if x.dim() == 0:
        raise ValueError(f"{name}: a 0-d tensor has no last dimension to group ({fmt.name})")
    length = x.shape[-1]
    if fmt.granularity == "row":
        return x.reshape(-1, length), 0
    block = fmt.block_size
    assert block is not None
    extra = -length % block
    if extra:
        if not pad:
            raise ValueError(
                f"{name}: last dimension {length} of shape {tuple(x.shape)} is not a multiple "
                f"of the {fmt.name} block size {block}; pass pad=True to zero-pad it to "
                f"{length + extra}"
            )
        x = F.pad(x, (0, extra))
    return x.reshape(-1, block), extra


class _Pending(NamedTuple):
    """A check :class:`DeferredChecks` holds: a device flag and what to say when it is False."""

    ok: Tensor
    name: str
    what: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class DeferredChecks:
    """Input checks of the rounding functions, held on the device and checked together.

    Checking a tensor for NaN/Inf (``nonfinite="raise"``) and a per-tensor scale for its range
    reads a flag back to the host: a synchronization with the GPU in every call, two or three
    per layer in every forward when fine-tuning through FP4.  Inside :func:`deferred_checks` the
    rounding functions compute the same flags and keep them here instead; :meth:`check` reads
    them all back at once (one synchronization) and raises a ValueError for the first failed call,
    naming the tensor, its shape, dtype and device.  Until then the rounding proceeds (what it
    returns for such inputs is meaningless: the check is what tells).  The ``KBBQ`` callback
    checks once per optimizer step during ``fit``, before the weights are updated.
    """

    def __init__(self) -> None:
        self.pending: list[_Pending] = []

    def add(self, ok: Tensor, name: str, what: str, x: Tensor) -> None:
        self.pending.append(_Pending(ok.reshape(()), name, what, tuple(x.shape), x.dtype,
                                     x.device))

    def check(self) -> None:
        """Raise for the first failed check since the last call (one host synchronization)."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        by_device: dict[torch.device, list[int]] = {}
        for index, item in enumerate(pending):
            by_device.setdefault(item.ok.device, []).append(index)
        failed = []
        for indices in by_device.values():
            flags = torch.stack([pending[i].ok for i in indices]).cpu()
            failed += [i for i, ok in zip(indices, flags.tolist()) if not ok]
        if failed:
            item = pending[min(failed)]
            raise ValueError(
                f"{item.name}: {item.what} (a {item.dtype} tensor of shape {item.shape} on "
                f"{item.device}; {len(failed)} of the {len(pending)} rounding calls checked "
                "since the last check failed)")


_deferred: DeferredChecks | None = None


def _held_on_device(ok: Tensor, name: str, what: str, x: Tensor) -> bool:
    """Hand the check ``ok`` (a boolean 0-d tensor: the input ``x`` passes) to the device where
    the caller must not read it to the host: inside a graph ``torch.compile`` traces it is
    asserted when the graph runs (``torch._assert_async``: a ``RuntimeError`` on the CPU, a
    device-side assert on CUDA; reading it would break the graph at every rounding call), and
    inside :func:`deferred_checks` it waits for the block's one read.  False: the caller reads
    it now."""
    if tracing():
        torch._assert_async(ok, f"{name}: {what}")
        return True
    if _deferred is not None:
        _deferred.add(ok, name, what, x)
        return True
    return False


@contextlib.contextmanager
def deferred_checks() -> Iterator[DeferredChecks]:
    """Hold the rounding functions' input checks on the device (:class:`DeferredChecks`);
    they are checked when the block ends (and whenever ``check()`` is called inside it).
    Nested blocks share the outer one."""
    global _deferred
    outer = _deferred
    checks = outer if outer is not None else DeferredChecks()
    _deferred = checks
    try:
        yield checks
        if outer is None:
            checks.check()
    finally:
        _deferred = outer


def _global_scale_arg(fmt: Format, global_scale: Tensor | float | None, name: str):
    if global_scale is None:
        return None
    if not fmt.global_scale:
        raise ValueError(f"{name}: format {fmt.name} has no per-tensor scale to set")
    value = torch.as_tensor(global_scale, dtype=torch.float32)
    if value.numel() != 1:
        raise ValueError(f"{name}: global_scale must be a scalar, got shape {tuple(value.shape)}")
    value = value.reshape(())
    # a positive scale below the smallest usable one quantizes to zeros, as a tensor below the
    # representable range does: a layer calibrated on zeros by kbbq-pl before 2^-121 was that
    # smallest scale holds 2^-122
    what = "global_scale must be finite and positive"
    if _held_on_device(torch.isfinite(value) & (value > 0), name, what, value):
        return value
    scalar = float(value)
    if not (math.isfinite(scalar) and scalar > 0):
        raise ValueError(f"{name}: {what}, got {scalar!r}")
    return value


def _as_float32(x: Tensor, nonfinite: str, name: str) -> Tensor:
    """A float64 input as the rounding computes it, in float32: values beyond float32's range
    are an error (``raise``) or Inf, as the other policies treat Inf."""
    wide = torch.isfinite(x) & (x.abs() > torch.finfo(torch.float32).max)
    if nonfinite == "raise" and bool(wide.any()):
        raise ValueError(
            f"{name}: {int(wide.sum())} float64 values of {x.numel()} lie beyond float32's range "
            f"(largest magnitude {float(x[wide].abs().max()):g}) in a tensor of shape "
            f"{tuple(x.shape)} on {x.device}; the rounding computes in float32: scale the "
            "tensor, or pass nonfinite='zero' or 'propagate' to treat them as Inf")
    return x.to(torch.float32)


def _run(x: Tensor, fmt: Format, global_scale, pad: bool, nonfinite: str, name: str, fake: bool,
         out_dtype: torch.dtype):
    """Group ``x``, run the element kernel of ``fmt``; returns (kernel outputs, padding)."""
    _check_policy(nonfinite)
    if x.dtype == torch.float64:
        x = _as_float32(x, nonfinite, name)
    # detached: the compiled kernels then see one kind of input whether or not x requires grad
    # (a master weight being fine-tuned), instead of compiling a second graph for it
    groups, extra = _groups(x.detach(), fmt, pad, name)
    static = {"nonfinite": nonfinite, "fake": fake, "out_dtype": out_dtype}
    if fmt.element == "e2m1":
        gs = _global_scale_arg(fmt, global_scale, name)
        if gs is not None:
            gs = gs.to(x.device)
        out = run_kernel(
            rounding.e2m1_groups, groups, gs,
            scale_kind=fmt.scale_kind, e8m0_rounding=fmt.e8m0_rounding, **static,
        )
    else:
        if global_scale is not None:
            _global_scale_arg(fmt, global_scale, name)
        dynamic = fmt.granularity != "block"
        if fmt.element == "e4m3":
            out = run_kernel(rounding.e4m3_groups, groups, dynamic_group_len=dynamic, **static)
        else:
            qmax = int(fmt.element_max)
            out = run_kernel(rounding.int_groups, groups, dynamic_group_len=dynamic, qmax=qmax,
                             **static)
    if nonfinite == "raise" and not _held_on_device(
            out[-1], name, "non-finite values (NaN or Inf) to round", x) and not bool(out[-1]):
        _raise_nonfinite(x, name)
    return out[:-1], extra


@torch.no_grad()
def fake_quantize(
    x: Tensor,
    fmt: str | Format,
    *,
    global_scale: Tensor | float | None = None,
    pad: bool = False,
    nonfinite: NonFinitePolicy = "raise",
    dtype: torch.dtype | None = None,
    name: str = "tensor",
) -> Tensor:
    """Round ``x`` onto ``fmt`` and back in one pass: ``dequantize(quantize(x))``, bit for bit.

    Blocks run along the last (reduction) dimension.  ``global_scale`` fixes the NVFP4
    per-tensor scale (a calibrated static scale; values beyond it saturate) instead of the
    dynamic ``amax / (448 * 6)``.  ``pad`` zero-pads a last dimension that is not a multiple of
    the block size (the padding is dropped from the result).  The result has ``x``'s dtype
    unless ``dtype`` is given.  No gradient flows (see :func:`kbbq_pl.formats.ste_fake_quantize`).
    """
    fmt = get_format(fmt)
    out_dtype = dtype or x.dtype
    if x.numel() == 0:
        return x.detach().to(out_dtype, copy=True)
    (values,), extra = _run(x, fmt, global_scale, pad, nonfinite, name, True, out_dtype)
    if fmt.granularity == "tensor" or fmt.granularity == "row":
        return values.reshape(x.shape)
    values = values.reshape(*x.shape[:-1], x.shape[-1] + extra)
    return values[..., : x.shape[-1]] if extra else values


@torch.no_grad()
def quantize(
    x: Tensor,
    fmt: str | Format,
    *,
    global_scale: Tensor | float | None = None,
    pad: bool = False,
    nonfinite: NonFinitePolicy = "raise",
    name: str = "tensor",
) -> QuantizedTensor:
    """Quantize ``x`` to ``fmt``: codes (4-bit codes packed two per byte), scales, global scale.

    Arguments as in :func:`fake_quantize`.
    """
    fmt = get_format(fmt)
    if x.dim() == 0:  # codes are [..., last dim]: a scalar would come back as shape (1,)
        raise ValueError(f"{name}: a 0-d tensor has no last dimension for the codes of a "
                         f"QuantizedTensor ({fmt.name}); quantize x.reshape(1), or use "
                         "fake_quantize, which keeps the shape")
    lead, length = x.shape[:-1], x.shape[-1]
    padded = length + (-length % fmt.block_size if fmt.granularity == "block" else 0)
    if fmt.granularity == "block" and padded != length and not pad:
        _groups(x, fmt, pad, name)  # raises the not-a-multiple error
    if x.numel() == 0:
        return _empty(x, fmt, lead, length, padded)
    out, _ = _run(x, fmt, global_scale, pad, nonfinite, name, False, x.dtype)
    global_value = None
    if fmt.element == "e2m1":
        codes, scales, pts = out
        if fmt.scale_kind == "e8m0":
            scales = scales.view(torch.float8_e8m0fnu)
        if fmt.global_scale:
            global_value = pts
    else:
        codes, scales = out
    codes = codes.reshape(*lead, -1)
    if fmt.granularity == "block":
        scales = scales.reshape(*lead, padded // fmt.block_size)
    elif fmt.granularity == "row":
        scales = scales.reshape(*lead, 1)
    else:
        scales = scales.reshape(())
    return QuantizedTensor(codes, scales, fmt, x.dtype, length, global_value)


def _empty(x: Tensor, fmt: Format, lead, length: int, padded: int) -> QuantizedTensor:
    code_dtype = {"e2m1": torch.uint8, "int4": torch.uint8, "e4m3": torch.float8_e4m3fn,
                  "int8": torch.int8}[fmt.element]
    codes = torch.empty(*lead, padded // 2 if fmt.packed else padded, dtype=code_dtype,
                        device=x.device)
    if fmt.granularity == "block":
        scale_dtype = {"e4m3": torch.float8_e4m3fn, "e8m0": torch.float8_e8m0fnu,
                       "fp32": torch.float32}[fmt.scale_kind]
        scales = torch.empty(*lead, padded // fmt.block_size, dtype=scale_dtype, device=x.device)
    else:
        scales = torch.ones(*lead, 1, device=x.device) if fmt.granularity == "row" else (
            torch.ones((), device=x.device))
    global_value = torch.ones((), device=x.device) if fmt.global_scale else None
    return QuantizedTensor(codes, scales, fmt, x.dtype, length, global_value)


def block_dequant_scale(q: QuantizedTensor) -> Tensor:
    """The FP32 multiplier of each scale group (``pts * s`` for NVFP4, ``2^e`` for MX)."""
    fmt = q.fmt
    if fmt.scale_kind == "e4m3":
        return q.global_scale * q.scale.to(torch.float32)
    if fmt.scale_kind == "e8m0":
        biased = q.scale.view(torch.uint8).to(torch.int32)
        value = rounding._pow2(biased - 127)
        return torch.where(biased == 255, torch.full_like(value, float("nan")), value)
    return q.scale


@torch.no_grad()
def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> Tensor:
    """The values ``q`` represents, in ``dtype`` (default: the dtype that was quantized)."""
    fmt = q.fmt
    out_dtype = dtype or q.orig_dtype
    scale = block_dequant_scale(q)
    if fmt.element == "e2m1":  # blocks: one fused pass where kernels are compiled
        assert fmt.block_size is not None
        values = run_kernel(
            rounding.e2m1_decode_groups, q.qdata.reshape(-1, fmt.block_size // 2),
            scale.reshape(-1), no_clip=fmt.scale_kind == "e8m0" and fmt.e8m0_rounding == "no_clip",
            out_dtype=out_dtype)
        return values.reshape(*q.qdata.shape[:-1], 2 * q.qdata.shape[-1])[..., : q.last_dim]
    if fmt.element == "int4":
        values = rounding.int4_unpack(q.qdata).to(torch.float32)
    else:
        values = q.qdata.to(torch.float32)
    if fmt.granularity == "block":
        groups = values.shape[-1] // fmt.block_size
        grouped = values.reshape(*values.shape[:-1], groups, fmt.block_size)
        out = (grouped * scale.unsqueeze(-1)).reshape(values.shape)[..., : q.last_dim]
    else:
        out = values * scale
    return out.to(out_dtype)
