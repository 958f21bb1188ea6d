"""What a W4A4 layer's weights need, prepared once per device for the kernels' fast paths.

:class:`PreparedWeight` holds the weights as stored (codes ``[N, K/2]``, scale bytes, the NVFP4
per-tensor scale: the decode path reads them as they are, see :mod:`kbbq_pl.kernels.skinny`)
and what is worked out once instead of per call: the MX decode shift
(:func:`kbbq_pl.kernels.exact.mx_shift`), host copies of the static scales (so the prefill
path can hand cuBLAS one FP32 ``alpha`` without a device-to-host copy per call) and, opt-in,
the weights decoded to bf16 (:attr:`PreparedWeight.decoded`, 2 bytes a weight: the prefill
path's decode then costs nothing per call, at 3.6 to 3.8 times the packed weights' memory).
Pure torch; the decode itself is the Triton kernel of :mod:`kbbq_pl.kernels.triton_kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..formats import Format
from .exact import mx_shift


@dataclass
class PreparedWeight:
    """A weight's fields for :func:`kbbq_pl.kernels.linear_w4a4` (see the module docstring).

    Attributes:
        codes: packed E2M1 codes ``uint8 [N, K/2]`` (element ``2i`` in the low nibble).
        scales: block scales, one byte each ``[N, K/d]`` (E4M3 bits or biased E8M0 exponents).
        global_scale: the NVFP4 per-tensor scale (FP32 ``[]`` on the device), None for MX.
        fmt: the format.
        host_global: ``float(global_scale)`` (NVFP4), read once; None if not read.
        host_act_scale: the static NVFP4 activation scale as a float, when the layer has one.
        decoded: ``q * s`` in bf16 ``[N, K]`` (without the per-tensor scale), or None.
    """

    codes: Tensor
    scales: Tensor
    global_scale: Tensor | None
    fmt: Format
    host_global: float | None = None
    host_act_scale: float | None = None
    decoded: Tensor | None = None
    _shift: int | None = None

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def shift(self) -> int | None:
        """The MX decode shift (:func:`~kbbq_pl.kernels.exact.mx_shift`; 0 for NVFP4), read
        from the exponents on the first use; None where no shift decodes the weights exactly
        in bf16 (the decode path then leaves them to the tiled GEMM)."""
        if self._shift is None:
            try:
                self._shift = mx_shift(self.scales) if self.fmt.scale_kind == "e8m0" else 0
            except ValueError:
                self._shift = -1
        return None if self._shift < 0 else self._shift

    def alpha(self, static: bool) -> float | None:
        """The product's FP32 multiplier known on the host (per-tensor scales, the MX
        ``no_clip`` gain), or None when it depends on the call (dynamic NVFP4 activations) or
        was not read."""
        if self.fmt.scale_kind == "e4m3":
            if not static or self.host_act_scale is None or self.host_global is None:
                return None
            return self.host_global * self.host_act_scale
        gain = 0.75 if self.fmt.e8m0_rounding == "no_clip" else 1.0
        return 1.0 / (gain * gain)


def prepare_weight(codes: Tensor, scales: Tensor, global_scale: Tensor | None, fmt: Format,
                   act_global_scale: Tensor | float | None = None, *,
                   keep_decoded: bool = False, decode=None,
                   host_scalars: bool = True) -> PreparedWeight:
    """A :class:`PreparedWeight` for these codes.  ``host_scalars`` reads the per-tensor scales
    to the host now (one device-to-host copy each, once; MX reads its exponents' range too);
    ``decode(codes, scales)`` (the Triton decode) fills :attr:`PreparedWeight.decoded` when
    ``keep_decoded``."""
    scale_bytes = scales.contiguous().view(torch.uint8)
    prepared = PreparedWeight(codes.contiguous(), scale_bytes, global_scale, fmt)
    if host_scalars:
        prepared.host_global = None if global_scale is None else float(global_scale)
        prepared.host_act_scale = None if act_global_scale is None else float(act_global_scale)
        prepared.shift  # noqa: B018 - read once now rather than in the first product
    if keep_decoded:
        if decode is None:
            raise ValueError("keep_decoded needs the decode function")
        prepared.decoded = decode(prepared.codes, prepared.scales)
    return prepared
