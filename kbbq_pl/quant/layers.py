"""The W4A4 quantized linear layer and swapping it into a model.

``QuantizedLinear`` computes ``y = Q(W T^-1) Q(T x) + b``.  With stored codes its forward is
``F.linear(x, self.weight, self.bias)``: the weight is a :class:`~kbbq_pl.quant.w4a4.W4A4Weight`,
which holds the codes, the scales, the online transform ``T``, the activation scale and the
padding of an ``in_features`` that is not a multiple of the block, and computes the product
(the project's kernels on GPUs, exact emulation elsewhere, no dense copy of the weight kept).
The module adds what the tensor cannot: construction from an ``nn.Linear`` or ``Conv1D``
(:meth:`QuantizedLinear.from_linear`), a trainable master weight for fine-tuning, and the
layer's name and sizes for reports, checkpoints and GPTQ.

For fine-tuning, ``trainable=True`` keeps a high-precision master copy of ``W T^-1`` as the
parameter (with ``T`` and the activation scale in buffers); the forward is the same
``F.linear``, on the master weight's :class:`~kbbq_pl.quant.w4a4.MasterWeight` view, which
rounds it (and the activations) in every call with a straight-through estimator, so gradients
reach the master weight; :meth:`QuantizedLinear.freeze` turns it into stored codes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..formats import Format, QuantizedTensor, get_format, quantize, ste_fake_quantize
from ..formats.padding import pad_features
from ..transforms.fit import transform_weight
from .act_scale import ActScale, effective_act_scale
from .modules import Quantized, fused_groups, linear_weight, parent_and_attr
from .scales import fused_weight_scales
from .w4a4 import MasterWeight, W4A4Weight

log = logging.getLogger(__name__)


def w4a4_weight(
    module: nn.Module,
    fmt: str | Format,
    transform: Tensor | None = None,
    *,
    act_scale: ActScale = "dynamic",
    act_global_scale: Tensor | None = None,
    name: str = "",
    quantized_weight: QuantizedTensor | None = None,
) -> W4A4Weight:
    """The :class:`~kbbq_pl.quant.w4a4.W4A4Weight` of an ``nn.Linear`` or ``Conv1D``: its weight
    zero-padded to whole blocks, ``W T^-1`` rounded to nearest (or the given
    ``quantized_weight`` of ``W T^-1``, e.g. from GPTQ), with the activation side."""
    fmt = get_format(fmt)
    weight = linear_weight(module).detach()
    in_features = weight.shape[1]
    if quantized_weight is None:
        padded = pad_features(weight, fmt)
        quantized_weight = quantize(transform_weight(padded, transform), fmt,
                                    name=f"{name}.weight")
    return W4A4Weight.from_quantized(quantized_weight, in_features=in_features,
                                     transform=transform, act_scale=act_scale,
                                     act_global_scale=act_global_scale, layer_name=name)


class QuantizedLinear(nn.modules.linear.NonDynamicallyQuantizableLinear, Quantized):
    """W4A4 linear layer (see the module docstring).

    An ``nn.Linear`` (as bitsandbytes' 4-bit layer is, and as torchao leaves a layer it
    quantizes), so that what picks a model's linear layers by their class picks it too: peft's
    ``target_modules="all-linear"``.  Of the subclass that torch's dynamic quantization and
    torchao's ``quantize_`` (its default filter) leave, as kbbq-pl's own selection of the
    layers to quantize does (:func:`~kbbq_pl.quant.modules.is_linear`): it is quantized
    already.

    Args:
        in_features, out_features: the original layer's sizes.
        fmt: the FP4 format of weights and activations.
        weight: the quantized ``W T^-1`` (``[out, padded_in]``; a ``W4A4Weight`` is taken as
            it is, plain codes get the activation side given here), or, with ``trainable``,
            its high-precision master copy.
        bias: the original bias or None.
        transform: ``None``, dense ``[D, D]`` or blocks ``[D/d, d, d]`` (stored as float32).
        act_scale: NVFP4 activations' per-tensor scale: ``static`` (calibrated, in
            ``act_global_scale``) or ``dynamic`` (``amax / (448 * 6)`` of each call).

    ``transform``, ``act_global_scale`` and ``act_scale`` read the weight's fields (stored
    codes) or the module's buffers (a trainable master weight, which also holds
    ``weight_global_scale``: see :func:`share_fused_scales`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str | Format,
        weight: QuantizedTensor | Tensor,
        bias: Tensor | None = None,
        transform: Tensor | None = None,
        act_scale: ActScale = "dynamic",
        act_global_scale: Tensor | None = None,
        trainable: bool = False,
        name: str = "",
    ) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a dense weight
        self.fmt = get_format(fmt)
        self.in_features = in_features
        self.out_features = out_features
        self.name = name
        scale_mode = effective_act_scale(self.fmt, act_scale)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        if trainable:
            self.weight = nn.Parameter(weight, requires_grad=True)
            self._master_act_scale = scale_mode
            # registered under the names of the properties below, which read them
            self._buffers["transform"] = None if transform is None else transform.float()
            self._buffers["act_global_scale"] = act_global_scale
            # NVFP4's per-tensor scale shared with the fused siblings (share_fused_scales);
            # None: the master weight's own, amax / (448 * 6) of each call
            self._buffers["weight_global_scale"] = None
        else:
            if not isinstance(weight, W4A4Weight):
                if not isinstance(weight, QuantizedTensor):
                    raise TypeError(f"{name or 'QuantizedLinear'}: stored weights are "
                                    f"QuantizedTensor codes, got {type(weight).__name__}; pass "
                                    "trainable=True for a master weight")
                weight = W4A4Weight.from_quantized(
                    weight, in_features=in_features, transform=transform, act_scale=scale_mode,
                    act_global_scale=act_global_scale, layer_name=name)
            self.weight = nn.Parameter(weight, requires_grad=False)

    def reset_parameters(self) -> None:
        """Nothing to reset: the weight is the quantized layer's (nn.Linear's would draw a
        random dense one over it)."""

    # ------------------------------------------------------------------ the activation side

    @property
    def trainable(self) -> bool:
        """Whether the weight is a high-precision master copy (else stored codes)."""
        return not isinstance(self.weight, W4A4Weight)

    @property
    def padded_in(self) -> int:
        return self.weight.shape[-1]

    @property
    def transform(self) -> Tensor | None:
        if self.trainable:
            return self._buffers["transform"]
        return self.weight.transform

    @property
    def act_scale(self) -> ActScale:
        return self._master_act_scale if self.trainable else self.weight.act_scale

    @property
    def act_global_scale(self) -> Tensor | None:
        if self.trainable:
            return self._buffers["act_global_scale"]
        return self.weight.act_global_scale

    @act_global_scale.setter
    def act_global_scale(self, value: Tensor | None) -> None:
        # reached for stored codes only: a trainable layer's buffer is set by nn.Module
        self.weight = nn.Parameter(self.weight.replace(act_global_scale=value),
                                   requires_grad=False)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_linear(
        cls,
        module: nn.Module,
        fmt: str | Format,
        transform: Tensor | None = None,
        *,
        act_scale: ActScale = "dynamic",
        act_global_scale: Tensor | None = None,
        trainable: bool = False,
        name: str = "",
        quantized_weight: QuantizedTensor | None = None,
    ) -> QuantizedLinear:
        """Quantize an ``nn.Linear`` or ``Conv1D`` with round-to-nearest (or take the given
        ``quantized_weight`` of ``W T^-1``, e.g. from GPTQ)."""
        fmt = get_format(fmt)
        weight = linear_weight(module).detach()
        out_features, in_features = weight.shape
        padded_in = in_features + (-in_features % (fmt.block_size or 1))
        if padded_in != in_features:
            log.info("%s: in_features %d is not a multiple of the %s block %d; zero-padded to %d",
                     name or type(module).__name__, in_features, fmt.name, fmt.block_size,
                     padded_in)
        stored: QuantizedTensor | Tensor
        if trainable and quantized_weight is None:
            stored = transform_weight(pad_features(weight, fmt), transform).clone()
        else:
            stored = w4a4_weight(module, fmt, transform, act_scale=act_scale,
                                 act_global_scale=act_global_scale, name=name,
                                 quantized_weight=quantized_weight)
        bias = getattr(module, "bias", None)
        return cls(in_features, out_features, fmt, stored, bias, transform, act_scale,
                   act_global_scale, trainable=trainable and quantized_weight is None, name=name)

    # ------------------------------------------------------------------ forward

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.product_weight(), self.bias)

    def product_weight(self) -> W4A4Weight | MasterWeight:
        """The weight ``F.linear`` multiplies by: the stored codes, or the trainable master
        weight's :class:`~kbbq_pl.quant.w4a4.MasterWeight` view (rounded in every call)."""
        if not self.trainable:
            return self.weight
        return MasterWeight.of(self.weight, self.fmt, in_features=self.in_features,
                               transform=self.transform, act_scale=self.act_scale,
                               act_global_scale=self.act_global_scale,
                               weight_global_scale=self._buffers["weight_global_scale"],
                               layer_name=self.name)

    def dequantized_weight(self, dtype: torch.dtype) -> Tensor:
        """``Q(W T^-1)`` as a dense ``[out, padded_in]`` tensor, decoded on request (for
        reports and tests; the forward does not call it for stored codes).  A trainable master
        weight is rounded anew in every call, with a straight-through gradient."""
        if self.trainable:
            return ste_fake_quantize(self.weight, self.fmt,
                                     global_scale=self._buffers["weight_global_scale"],
                                     name=f"{self.name}.weight").to(dtype)
        return self.weight.dequantize(dtype)

    def codes(self) -> QuantizedTensor:
        """The FP4 codes of ``W T^-1``: the stored ones, or the trainable master weight rounded
        as the forward rounds it."""
        if not self.trainable:
            return self.weight
        return quantize(self.weight.detach(), self.fmt,
                        global_scale=self._buffers["weight_global_scale"],
                        name=f"{self.name}.weight")

    # ------------------------------------------------------------------ state

    def freeze(self) -> None:
        """Round a trainable master weight into stored codes (end of fine-tuning; a model's
        layers: :func:`freeze_layers`)."""
        if not self.trainable:
            return
        codes = self.codes()
        self._buffers.pop("weight_global_scale")
        transform = self._buffers.pop("transform")
        scale = self._buffers.pop("act_global_scale")
        self.weight = nn.Parameter(W4A4Weight.from_quantized(
            codes, in_features=self.in_features, transform=transform,
            act_scale=self._master_act_scale, act_global_scale=scale, layer_name=self.name),
            requires_grad=False)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Stored codes replace the weight (their scales, format and activation side travel
        # with them).  Format 1 (and Lightning checkpoints of its time) held plain
        # QuantizedTensor codes beside ``transform`` and ``act_global_scale`` buffers: they
        # are combined here into the W4A4Weight.
        key = prefix + "weight"
        value = state_dict.get(key)
        side = {name: state_dict.get(prefix + name)
                for name in ("transform", "act_global_scale", "weight_global_scale")}
        if isinstance(value, QuantizedTensor):
            mismatch = self._loaded_codes_mismatch(key, value)
            if mismatch:
                error_msgs.append(mismatch)
            else:
                if not isinstance(value, W4A4Weight):
                    value = W4A4Weight.from_quantized(
                        value, in_features=self.in_features, transform=side["transform"],
                        act_scale=self.act_scale, act_global_scale=side["act_global_scale"],
                        layer_name=self.name)
                for buffer in side:
                    self._buffers.pop(buffer, None)
                if not local_metadata.get("assign_to_params_buffers", False):
                    value = value.to(self.weight.device)
                self.weight = nn.Parameter(value, requires_grad=False)
            dropped = {key, *(prefix + name for name in side)}
            state_dict = {k: v for k, v in state_dict.items() if k not in dropped}
        else:
            for buffer, loaded in side.items():
                # an optional buffer takes the loaded shape (or appears) before the copy
                if loaded is not None and buffer in self._buffers:
                    self._buffers[buffer] = loaded.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if isinstance(value, QuantizedTensor) and key in missing_keys:
            missing_keys.remove(key)

    def _loaded_codes_mismatch(self, key: str, codes: QuantizedTensor) -> str | None:
        """Why stored ``codes`` loaded under ``key`` do not fit this layer (torch's wording for
        a dense parameter's size mismatch), or None."""
        if codes.fmt != self.fmt:
            return (f"format mismatch for {key}: copying {codes.fmt.name} codes from checkpoint, "
                    f"the format in current model is {self.fmt.name}.")
        in_features = getattr(codes, "in_features", self.in_features)
        if codes.shape != self.weight.shape or in_features != self.in_features:
            return (f"size mismatch for {key}: copying codes of shape {tuple(codes.shape)} "
                    f"(in_features {in_features}) from checkpoint, the shape in current model "
                    f"is {tuple(self.weight.shape)} (in_features {self.in_features}).")
        return None

    def extra_repr(self) -> str:
        kind = "none" if self.transform is None else (
            "dense" if self.transform.dim() == 2 else f"blocks of {self.transform.shape[-1]}")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.fmt.name}, transform={kind}, act_scale={self.act_scale}, "
                f"bias={self.bias is not None}, trainable={self.trainable}")


def swap_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Replace the submodule ``name`` of ``model`` with ``new``; returns the old module."""
    parent, attr = parent_and_attr(model, name)
    old = getattr(parent, attr)
    setattr(parent, attr, new)
    return old


def quantized_linears(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


FusedGroup = dict[str, QuantizedLinear]
"""Trainable layers that vLLM runs as one fused linear, by qualified name."""


def fused_trainable_groups(layers: Mapping[str, QuantizedLinear]) -> list[FusedGroup]:
    """The trainable NVFP4 layers among ``layers`` (qualified name -> layer) that vLLM runs as
    one fused linear (q/k/v, gate/up: :func:`~kbbq_pl.quant.modules.fused_groups`) under one
    transform, grouped.  Comparing the transforms reads the device: pick the groups once (the
    transforms do not train), then :func:`share_fused_scales` as the weights move."""
    trainable = {name: layer for name, layer in layers.items() if layer.trainable}
    groups = []
    for names in fused_groups(trainable):
        first = trainable[names[0]]
        if first.fmt.global_scale and all(
                trainable[name].fmt == first.fmt
                and _same_transform(trainable[name].transform, first.transform)
                for name in names):
            groups.append({name: trainable[name] for name in names})
    return groups


def share_fused_scales(groups: list[FusedGroup]) -> None:
    """Give each group (:func:`fused_trainable_groups`) one NVFP4 per-tensor scale, the largest
    of its master weights' own (:func:`~kbbq_pl.quant.scales.fused_weight_scales`), as
    ``quantize_model`` gives stored codes: the forward and :meth:`QuantizedLinear.codes` round
    them under it (the ``weight_global_scale`` buffer) until the next call.  The ``KBBQ``
    callback calls it when training starts, after every training batch (before a checkpoint
    is saved) and before validation, and :func:`freeze_layers` at the end; a training loop of
    your own calls it after each optimizer step."""
    for group in groups:
        first = next(iter(group.values()))
        scales = fused_weight_scales({name: layer.weight.detach()
                                      for name, layer in group.items()}, first.fmt, [list(group)])
        for name, layer in group.items():
            layer.weight_global_scale = scales[name]


def freeze_layers(layers: Mapping[str, QuantizedLinear]) -> None:
    """Round the trainable master weights among ``layers`` (qualified name -> layer) into
    stored codes, the end of fine-tuning, the fused layers under their shared per-tensor
    scale (:func:`share_fused_scales`, from the final master weights)."""
    share_fused_scales(fused_trainable_groups(layers))
    for layer in layers.values():
        layer.freeze()


def exclude_quantized_from_ddp_sync(model: nn.Module) -> list[str]:
    """Leave the stored FP4 codes out of DDP's start-up broadcast of the parameters: name them
    in ``model._ddp_params_and_buffers_to_ignore``, torch's switch for it, relative to ``model``,
    the module ``DistributedDataParallel`` wraps (a peft model too: call it after
    ``get_peft_model``, before transformers' ``Trainer`` or ``DistributedDataParallel`` wraps
    it).  A collective cannot carry a packed tensor subclass, and every rank already holds the
    same codes (loaded from one folder, or quantized with the statistics reduced across ranks
    and GPTQ's results broadcast); they train on no rank.  The ``KBBQ`` callback calls it.
    Returns the names."""
    names = {name for name, tensor in (*model.named_parameters(), *model.named_buffers())
             if isinstance(tensor, QuantizedTensor)}
    if names:
        ignored = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        model._ddp_params_and_buffers_to_ignore = sorted(ignored | names)
    return sorted(names)


def _same_transform(a: Tensor | None, b: Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
