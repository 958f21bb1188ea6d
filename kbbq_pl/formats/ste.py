"""Fake quantization with a straight-through gradient, for fine-tuning through FP4 rounding."""

from __future__ import annotations

import torch
from torch import Tensor

from .qtensor import fake_quantize
from .spec import Format, get_format


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, fmt: Format, global_scale: Tensor | None, name: str) -> Tensor:
        return fake_quantize(x, fmt, global_scale=global_scale, name=name)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


def ste_fake_quantize(
    x: Tensor, fmt: str | Format, *, global_scale: Tensor | None = None, name: str = "tensor"
) -> Tensor:
    """:func:`~kbbq_pl.formats.fake_quantize` in the forward pass, identity gradient in the
    backward pass (the straight-through estimator used by QAT in torchao and FP-Quant)."""
    return _StraightThrough.apply(x, get_format(fmt), global_scale, name)
