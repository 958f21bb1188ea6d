"""What a W4A4 layer's weights need beyond their codes, worked out once per device.

:class:`PreparedWeight` holds what the fast paths of :func:`kbbq_pl.kernels.linear_w4a4` would
otherwise work out in every call: the MX decode shift (:func:`kbbq_pl.kernels.exact.mx_shift`,
one read of the exponents' range), host copies of the static scales (so the prefill path can
hand cuBLAS one FP32 ``alpha`` without a device-to-host copy per call) and, opt-in, the weights
decoded to bf16 (:attr:`PreparedWeight.decoded`, 2 bytes a weight: the prefill path's decode
then costs nothing per call, at 3.6 to 3.8 times the packed weights' memory) or, for the FP8
product of MX, folded to E4M3 (:attr:`PreparedWeight.folded`, 1.03 bytes a weight).  The codes
and scales themselves are not held: every product is given them (the decode path reads them as
they are stored, see :mod:`kbbq_pl.kernels.skinny`), so a cache of prepared weights keyed
weakly by the codes lets them go.  Pure torch; the decode itself is the Triton kernel of
:mod:`kbbq_pl.kernels.triton_kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from ..formats import Format
from .exact import mx_shift


@dataclass
class PreparedWeight:
    """What :func:`kbbq_pl.kernels.linear_w4a4` works out once for a weight (module docstring).

    Attributes:
        fmt: the format.
        shape: the shape of the codes it was prepared for, ``(N, K/2)``.
        host_global: the NVFP4 per-tensor scale as a float, read once; None if not read.
        host_act_scale: the static NVFP4 activation scale as a float, when the layer has one.
        scale_sources: what the host scales were read from (:func:`scale_source` of the
            per-tensor and activation scales), or None if not read.
        decoded: ``q * s`` in bf16 ``[N, K]`` (without the per-tensor scale), or None.
        folded: for the FP8 prefill product of MX, the weights folded to E4M3 and their FP32
            scales per 128 along K (:func:`kbbq_pl.kernels.exact.fold_mx_to_e4m3`, exact), or
            None.
    """

    fmt: Format
    shape: tuple[int, int]
    host_global: float | None = None
    host_act_scale: float | None = None
    scale_sources: tuple[Any, Any] | None = None
    decoded: Tensor | None = None
    folded: tuple[Tensor, Tensor] | None = None
    _shift: int | None = None

    def shift(self, scales: Tensor) -> int | None:
        """The MX decode shift of these block scales (0 for NVFP4), read from them on the
        first use; None where no shift decodes the weights exactly in bf16 (the decode path
        then leaves them to the tiled GEMM)."""
        if self._shift is None:
            try:
                self._shift = (mx_shift(scales) if self.fmt.scale_kind == "e8m0" else 0)
            except ValueError:
                self._shift = -1
        return None if self._shift < 0 else self._shift

    def alpha(self, static: bool, sources: tuple[Any, Any] | None = None) -> float | None:
        """The product's FP32 multiplier known on the host (per-tensor scales, the MX
        ``no_clip`` gain), or None when it depends on the call (dynamic NVFP4 activations), was
        not read, or was read from other scales than the call's ``sources`` (:func:`
        scale_source` of its per-tensor and activation scales: the product then scales by the
        call's on the device)."""
        if self.fmt.scale_kind == "e4m3":
            if (not static or self.host_act_scale is None or self.host_global is None
                    or sources != self.scale_sources):
                return None
            return self.host_global * self.host_act_scale
        gain = 0.75 if self.fmt.e8m0_rounding == "no_clip" else 1.0
        return 1.0 / (gain * gain)


def scale_source(scale: Tensor | float | None) -> Any:
    """What a per-tensor scale is, without reading a device: a tensor by identity and version
    counter, a number by value."""
    if isinstance(scale, Tensor):
        return id(scale), scale._version
    return None if scale is None else float(scale)


def prepare_weight(codes: Tensor, scales: Tensor, global_scale: Tensor | None, fmt: Format,
                   act_global_scale: Tensor | float | None = None, *,
                   keep_decoded: bool = False, decode=None, fold=None,
                   host_scalars: bool = True, scale_sources: tuple[Any, Any] | None = None
                   ) -> PreparedWeight:
    """A :class:`PreparedWeight` for these codes.  ``host_scalars`` reads the per-tensor scales
    to the host now (one device-to-host copy each, once; MX reads its exponents' range too);
    with ``keep_decoded`` the prefill product's weight operand is kept: ``fold(codes,
    scales)`` (the E4M3 fold, for the FP8 product: ``(values, scales)``, or None where the
    weights do not fold exactly) fills :attr:`PreparedWeight.folded` when given and the
    weights fold, else ``decode(codes, scales)`` (the Triton decode) fills
    :attr:`PreparedWeight.decoded`."""
    prepared = PreparedWeight(fmt, tuple(codes.shape))
    if host_scalars:
        prepared.host_global = None if global_scale is None else float(global_scale)
        prepared.host_act_scale = None if act_global_scale is None else float(act_global_scale)
        prepared.scale_sources = scale_sources
        prepared.shift(scales)
    if keep_decoded:
        if fold is not None:
            prepared.folded = fold(codes, scales)
        if prepared.folded is None:
            if decode is None:
                raise ValueError("keep_decoded needs the decode function")
            prepared.decoded = decode(codes, scales)
    return prepared
