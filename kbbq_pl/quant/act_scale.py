"""The NVFP4 activations' per-tensor scale: ``static`` (calibrated once, stored with the layer)
or ``dynamic`` (``amax / (448 * 6)`` of each call).  One rule: a static scale exists only where
the format has a per-tensor scale (NVFP4); other formats (MX) are always ``dynamic``."""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from ..formats import Format
from ..formats.rounding import NVFP4_MIN_GLOBAL_SCALE, nvfp4_tensor_scale

ActScale = Literal["static", "dynamic"]
ACT_SCALES: tuple[str, ...] = ("static", "dynamic")

__all__ = ["ACT_SCALES", "ActScale", "check_act_scale", "effective_act_scale", "static_act_scale"]


def check_act_scale(act_scale: str, what: str = "act_scale") -> ActScale:
    """``act_scale``, which must be ``static`` or ``dynamic`` (``what`` names it in the error)."""
    if act_scale not in ACT_SCALES:
        raise ValueError(f"{what} must be 'static' or 'dynamic', got {act_scale!r}")
    return act_scale  # type: ignore[return-value]


def effective_act_scale(fmt: Format, act_scale: str) -> ActScale:
    """``act_scale`` checked; formats without a per-tensor scale (MX) are always ``dynamic``."""
    check_act_scale(act_scale)
    return "static" if act_scale == "static" and fmt.global_scale else "dynamic"


def static_act_scale(amax: Tensor) -> Tensor:
    """A static (calibrated) NVFP4 activation scale from the calibration inputs' amax: the
    per-tensor scale rule (:func:`~kbbq_pl.formats.rounding.nvfp4_tensor_scale`), raised to the
    smallest usable scale so that a layer calibrated on all-zero inputs still scales later
    ones; a 0-d FP32 tensor."""
    return nvfp4_tensor_scale(amax).clamp(min=NVFP4_MIN_GLOBAL_SCALE).reshape(())
