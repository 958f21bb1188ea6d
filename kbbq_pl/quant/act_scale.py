"""The NVFP4 activations' per-tensor scale: ``static`` (calibrated once, stored with the layer)
or ``dynamic`` (``amax / (448 * 6)`` of each call).  One rule: a static scale exists only where
the format has a per-tensor scale (NVFP4); other formats (MX) are always ``dynamic``."""

from __future__ import annotations

from typing import Literal

from ..formats import Format

ActScale = Literal["static", "dynamic"]
ACT_SCALES: tuple[str, ...] = ("static", "dynamic")

__all__ = ["ACT_SCALES", "ActScale", "check_act_scale", "effective_act_scale"]


def check_act_scale(act_scale: str, what: str = "act_scale") -> ActScale:
    """``act_scale``, which must be ``static`` or ``dynamic`` (``what`` names it in the error)."""
    if act_scale not in ACT_SCALES:
        raise ValueError(f"{what} must be 'static' or 'dynamic', got {act_scale!r}")
    return act_scale  # type: ignore[return-value]


def effective_act_scale(fmt: Format, act_scale: str) -> ActScale:
    """``act_scale`` checked; formats without a per-tensor scale (MX) are always ``dynamic``."""
    check_act_scale(act_scale)
    return "static" if act_scale == "static" and fmt.global_scale else "dynamic"
