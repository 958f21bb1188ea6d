"""Number formats: NVFP4, MXFP4, FP8 E4M3, integer grids and the generic E2M1 block grid.

``quantize(x, fmt)`` returns a :class:`QuantizedTensor` (codes packed two FP4 per byte, block
scales, per-tensor scale), ``dequantize(q)`` the values it represents, and
``fake_quantize(x, fmt)`` both in one fused pass (the hot path).  Formats are looked up by name
(:func:`get_format`, :func:`list_formats`); see :mod:`kbbq_pl.formats.spec` for the names and
:mod:`kbbq_pl.formats.rounding` for the rounding conventions.
"""

from .dispatch import compile_enabled, compile_rule, set_compile
from .noise import measure_sigma2, sigma2_fmt
from .qtensor import (
    DeferredChecks,
    NonFinitePolicy,
    QuantizedTensor,
    block_dequant_scale,
    deferred_checks,
    dequantize,
    fake_quantize,
    quantize,
)
from .rounding import pack_nibbles, round_e2m1, unpack_nibbles
from .spec import (
    E8M0_ROUNDINGS,
    LOG_UNIFORM_INV_M2,
    Format,
    get_format,
    list_formats,
    register_format,
    with_block_size,
)
from .ste import ste_fake_quantize

__all__ = [
    "E8M0_ROUNDINGS",
    "LOG_UNIFORM_INV_M2",
    "DeferredChecks",
    "Format",
    "NonFinitePolicy",
    "QuantizedTensor",
    "block_dequant_scale",
    "compile_enabled",
    "compile_rule",
    "deferred_checks",
    "dequantize",
    "fake_quantize",
    "get_format",
    "list_formats",
    "measure_sigma2",
    "pack_nibbles",
    "quantize",
    "register_format",
    "round_e2m1",
    "set_compile",
    "sigma2_fmt",
    "ste_fake_quantize",
    "unpack_nibbles",
    "with_block_size",
]
