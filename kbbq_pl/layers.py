"""The W4A4 quantized linear layer and swapping it into a model.

``QuantizedLinear`` computes ``y = Q(W T^-1) Q(T x) + b``: the input is zero-padded to whole
blocks when ``in_features`` is not a multiple of the block, transformed online by ``T``
(:mod:`kbbq_pl.transforms`), quantized per token in blocks along the input dimension (NVFP4's
per-tensor scale calibrated-static or dynamic per call), and multiplied by the stored
quantized weight (a :class:`~kbbq_pl.formats.QuantizedTensor`).

The arithmetic is exact emulation: the operands are rounded exactly as the format says and the
product is accumulated in the activation dtype, on CPU and on GPUs without FP4 units.  On a
GPU with FP4 tensor cores (compute capability 10.x) and NVFP4, :func:`hardware_fp4_available`
is true and the product goes through torchao's NVFP4 kernel instead.

For fine-tuning, ``trainable=True`` keeps a high-precision master copy of ``W T^-1`` as the
parameter and rounds it (and the activations) in every forward with a straight-through
estimator, so gradients reach the master weight; :meth:`QuantizedLinear.freeze` turns it back
into stored codes.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .formats import (
    Format,
    QuantizedTensor,
    fake_quantize,
    get_format,
    quantize,
    ste_fake_quantize,
)
from .modules import linear_weight, parent_and_attr
from .transforms import transform_inputs, transform_weight

log = logging.getLogger(__name__)

ActScale = Literal["static", "dynamic"]


def hardware_fp4_available(device: torch.device, fmt: Format) -> bool:
    """Whether ``device`` multiplies NVFP4 operands natively (Blackwell, through torchao)."""
    if device.type != "cuda" or fmt.name != "nvfp4" or not torch.cuda.is_available():
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major == 10


def to_torchao_nvfp4(q: QuantizedTensor):
    """The same NVFP4 bits as a torchao ``NVFP4Tensor`` (codes, E4M3 scales and per-tensor
    scale have one layout in both libraries), for torchao's kernels."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    if q.fmt.name != "nvfp4" or q.last_dim != q.qdata.shape[-1] * 2:
        raise ValueError(f"only unpadded nvfp4 tensors convert to torchao, got {q.fmt.name}")
    return NVFP4Tensor(q.qdata, q.scale, 16, q.orig_dtype, per_tensor_scale=q.global_scale)


class QuantizedLinear(nn.Module):
    """W4A4 linear layer (see the module docstring).

    Args:
        in_features, out_features: the original layer's sizes.
        fmt: the FP4 format of weights and activations.
        weight: the quantized ``W T^-1`` (``[out, padded_in]``), or, with ``trainable``, its
            high-precision master copy.
        bias: the original bias or None.
        transform: ``None``, dense ``[D, D]`` or blocks ``[D/d, d, d]`` (stored as float32).
        act_scale: NVFP4 activations' per-tensor scale: ``static`` (calibrated, in
            ``act_global_scale``) or ``dynamic`` (``amax / (448 * 6)`` of each call).
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
        super().__init__()
        self.fmt = get_format(fmt)
        self.in_features = in_features
        self.out_features = out_features
        self.padded_in = weight.shape[-1]
        self.name = name
        if act_scale not in ("static", "dynamic"):
            raise ValueError(f"act_scale must be 'static' or 'dynamic', got {act_scale!r}")
        self.act_scale = act_scale if self.fmt.global_scale else "dynamic"
        self.trainable = trainable
        self.weight = nn.Parameter(weight, requires_grad=trainable)
        self.bias = nn.Parameter(bias.detach().clone()) if bias is not None else None
        self.register_buffer("transform", None if transform is None else transform.float())
        self.register_buffer("act_global_scale", act_global_scale)
        self.observing = False
        self.register_buffer("observed_amax", None, persistent=False)
        self._dense: Tensor | None = None  # the dequantized weight, kept for emulation

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_linear(
        cls,
        module: nn.Module,
        fmt: str | Format,
        transform: Tensor | None = None,
        *,
        act_scale: ActScale = "dynamic",
        trainable: bool = False,
        name: str = "",
        quantized_weight: QuantizedTensor | None = None,
    ) -> QuantizedLinear:
        """Quantize an ``nn.Linear`` or ``Conv1D`` with round-to-nearest (or take the given
        ``quantized_weight`` of ``W T^-1``, e.g. from GPTQ)."""
        fmt = get_format(fmt)
        weight = linear_weight(module).detach()
        out_features, in_features = weight.shape
        padded = pad_features(weight, fmt)
        if padded.shape[1] != in_features:
            log.info("%s: in_features %d is not a multiple of the %s block %d; zero-padded to %d",
                     name or type(module).__name__, in_features, fmt.name, fmt.block_size,
                     padded.shape[1])
        if quantized_weight is None:
            transformed = transform_weight(padded, transform)
            stored: QuantizedTensor | Tensor = (
                transformed.clone() if trainable
                else quantize(transformed, fmt, name=f"{name}.weight")
            )
        else:
            stored = quantized_weight
        bias = getattr(module, "bias", None)
        return cls(in_features, out_features, fmt, stored, bias, transform, act_scale,
                   trainable=trainable, name=name)

    # ------------------------------------------------------------------ forward

    def _pad_input(self, x: Tensor) -> Tensor:
        extra = self.padded_in - self.in_features
        return F.pad(x, (0, extra)) if extra else x

    def quantized_input(self, x: Tensor) -> Tensor:
        """The activations as the GEMM sees them: padded, transformed, rounded."""
        h = transform_inputs(self._pad_input(x.reshape(-1, self.in_features)), self.transform)
        if self.observing:
            amax = h.detach().abs().max().float()
            self.observed_amax = amax if self.observed_amax is None else torch.maximum(
                self.observed_amax, amax)
        use_static = self.act_scale == "static" and not self.observing
        static = self.act_global_scale if use_static else None
        name = f"{self.name}.input" if self.name else "input"
        if self.training and torch.is_grad_enabled():
            return ste_fake_quantize(h, self.fmt, global_scale=static, name=name)
        return fake_quantize(h, self.fmt, global_scale=static, name=name)

    def dequantized_weight(self, dtype: torch.dtype) -> Tensor:
        """``Q(W T^-1)`` as a dense ``[out, padded_in]`` tensor.

        Stored codes are decoded once and the dense copy is kept (exact emulation trades that
        memory for not decoding in every forward); a trainable master weight is rounded anew
        in every call, with a straight-through gradient.
        """
        if not isinstance(self.weight, QuantizedTensor):
            return ste_fake_quantize(self.weight, self.fmt, name=f"{self.name}.weight").to(dtype)
        dense = self._dense
        if dense is None or dense.dtype != dtype or dense.device != self.weight.device:
            dense = self._dense = self.weight.dequantize(dtype)
        return dense

    def _apply(self, fn, recurse: bool = True):
        self._dense = None  # .to() / .cuda() / .half(): decode again where the codes go
        return super()._apply(fn, recurse)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":
            self.__dict__["_dense"] = None
        super().__setattr__(name, value)

    def forward(self, x: Tensor) -> Tensor:
        if self.act_scale == "static" and self.act_global_scale is None and not self.observing:
            raise RuntimeError(f"{self.name or 'QuantizedLinear'}: static activation scale not "
                               "calibrated; run calibration or use act_scale='dynamic'")
        h = self.quantized_input(x)
        if isinstance(self.weight, QuantizedTensor) and hardware_fp4_available(h.device, self.fmt):
            y = self._hardware_linear(h)
        else:
            y = F.linear(h, self.dequantized_weight(h.dtype), None)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _hardware_linear(self, h: Tensor) -> Tensor:  # pragma: no cover - needs Blackwell
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

        scale = self.act_global_scale if self.act_scale == "static" else None
        if scale is None:
            scale = h.abs().max().float() / (448.0 * 6.0)
        activation = NVFP4Tensor.to_nvfp4(h.contiguous(), per_tensor_scale=scale)
        return F.linear(activation, to_torchao_nvfp4(self.weight))

    # ------------------------------------------------------------------ state

    def freeze(self) -> None:
        """Round a trainable master weight into stored codes (end of fine-tuning)."""
        if isinstance(self.weight, QuantizedTensor):
            return
        codes = quantize(self.weight.detach(), self.fmt, name=f"{self.name}.weight")
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.trainable = False

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # A QuantizedTensor is replaced, not copied into: its scales and format travel with it.
        key = prefix + "weight"
        value = state_dict.get(key)
        if isinstance(value, QuantizedTensor):
            device = self.weight.device
            self.weight = nn.Parameter(value.to(device), requires_grad=False)
            self.trainable = False
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        for buffer in ("transform", "act_global_scale"):
            # an optional buffer takes the loaded shape (or appears) before the copy
            if prefix + buffer in state_dict:
                setattr(self, buffer, state_dict[prefix + buffer].detach().clone())
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if isinstance(value, QuantizedTensor) and key in missing_keys:
            missing_keys.remove(key)

    def extra_repr(self) -> str:
        kind = "none" if self.transform is None else (
            "dense" if self.transform.dim() == 2 else f"blocks of {self.transform.shape[-1]}")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.fmt.name}, transform={kind}, act_scale={self.act_scale}, "
                f"bias={self.bias is not None}, trainable={self.trainable}")


def pad_features(weight: Tensor, fmt: Format) -> Tensor:
    """``weight [out, in]`` with zero columns up to a multiple of the format's block."""
    block = fmt.block_size or 1
    extra = -weight.shape[1] % block
    return F.pad(weight, (0, extra)) if extra else weight


def swap_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Replace the submodule ``name`` of ``model`` with ``new``; returns the old module."""
    parent, attr = parent_and_attr(model, name)
    old = getattr(parent, attr)
    setattr(parent, attr, new)
    return old


def quantized_linears(model: nn.Module) -> dict[str, QuantizedLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}

