"""Format specifications and the registry of formats by name.

A :class:`Format` says which grid the elements are rounded onto, how many elements share a
scale, how that scale is stored, and whether a per-tensor FP32 scale sits above the block
scales.  Every number format of kbbq-pl is one instance; the math that rounds onto it lives in
:mod:`kbbq_pl.formats.rounding`.

Names accepted by :func:`get_format`:

``nvfp4``
    E2M1 elements, blocks of 16, E4M3 block scales, FP32 per-tensor scale ``amax / (448 * 6)``.
``mxfp4`` (= ``mxfp4_floor``), ``mxfp4_no_clip``, ``mxfp4_ceil``, ``mxfp4_even``, ``mxfp4_rceil``
    E2M1 elements, blocks of 32, E8M0 shared scale with the named exponent rounding
    (see :data:`E8M0_ROUNDINGS`).
``fp8_e4m3`` (per tensor), ``fp8_e4m3_row`` (per row)
    E4M3 elements with an FP32 scale ``amax / 448``.
``int4``, ``int8`` (groups of 32), ``int4_g128``, ``int8_row``, ...
    Symmetric restricted-range integers ``q in [-(2^(b-1) - 1), 2^(b-1) - 1]`` with an FP32
    scale ``amax / (2^(b-1) - 1)`` per group.
``e2m1_b{B}_{fp32|e4m3|e8m0}``
    The generic E2M1 grid with any block size and scale kind, so the noise law can vary
    granularity; ``e2m1_b16_e4m3`` is ``nvfp4`` and ``e2m1_b32_e8m0`` is ``mxfp4``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Literal

Element = Literal["e2m1", "e4m3", "int4", "int8"]
ScaleKind = Literal["fp32", "e4m3", "e8m0"]
Granularity = Literal["block", "row", "tensor"]

E8M0_ROUNDINGS = ("floor", "ceil", "even", "rceil", "no_clip")
"""Exponent rounding of an E8M0 block scale, with ``amax`` the block's largest magnitude:

* ``floor``: ``2^(floor(log2 amax) - 2)``, the OCP MX v1.0 rule; amax maps into [4, 8) and the
  top of the block clips to 6.
* ``ceil``: ``2^(ceil(log2 amax) - 2)``; nothing clips, small values lose a bit.
* ``even``: ``floor`` applied to amax rounded to one mantissa bit (torchao's EVEN).
* ``rceil``: ``2^ceil(log2(amax / 6))``, the cuBLAS / Blackwell hardware rule.
* ``no_clip``: the FP-Quant / WUSH convention: the stored exponent is ``floor``'s and the elements
  are multiplied by a constant 3/4, so amax maps into [3, 6) and nothing clips.
"""

ELEMENT_MAX = {"e2m1": 6.0, "e4m3": 448.0, "int4": 7.0, "int8": 127.0}
"""Largest magnitude on each element grid (restricted-range symmetric for the integers)."""

MANTISSA_BITS = {"e2m1": 1, "e4m3": 3}
"""Explicit mantissa bits ``p`` of the floating-point element grids (paper Eq. sigmafmt)."""

E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E2M1_MAX = 6.0


@dataclass(frozen=True)
class Format:
    """A quantization format: element grid, scale granularity and scale storage.

    Attributes:
        name: registry name (used in configs, reports and checkpoints).
        element: the element grid.
        granularity: ``block`` (one scale per ``block_size`` elements of the last dimension),
            ``row`` (one scale per row of the last dimension) or ``tensor`` (one scale).
        block_size: elements per scale when ``granularity == "block"``.
        scale_kind: how block scales are stored (``fp32``, ``e4m3`` or ``e8m0``).
        global_scale: whether a per-tensor FP32 scale sits above E4M3 block scales (NVFP4).
        e8m0_rounding: exponent rounding for ``e8m0`` scales, one of :data:`E8M0_ROUNDINGS`.
    """

    name: str
    element: Element
    granularity: Granularity = "block"
    block_size: int | None = None
    scale_kind: ScaleKind = "fp32"
    global_scale: bool = False
    e8m0_rounding: str = "floor"

    def __post_init__(self) -> None:
        if self.element not in ELEMENT_MAX:
            raise ValueError(f"format {self.name!r}: unknown element grid {self.element!r}")
        if self.granularity not in ("block", "row", "tensor"):
            raise ValueError(f"format {self.name!r}: unknown granularity {self.granularity!r}")
        if self.granularity == "block":
            if self.block_size is None or self.block_size < 1:
                raise ValueError(f"format {self.name!r}: block granularity needs block_size >= 1")
            if self.element in ("e2m1", "int4") and self.block_size % 2:
                raise ValueError(
                    f"format {self.name!r}: 4-bit elements pack two per byte, "
                    f"so block_size must be even, got {self.block_size}"
                )
        elif self.block_size is not None:
            raise ValueError(f"format {self.name!r}: block_size is only for block granularity")
        if self.scale_kind not in ("fp32", "e4m3", "e8m0"):
            raise ValueError(f"format {self.name!r}: unknown scale kind {self.scale_kind!r}")
        if self.scale_kind != "fp32" and (self.element != "e2m1" or self.granularity != "block"):
            raise ValueError(f"format {self.name!r}: {self.scale_kind} scales are for E2M1 blocks")
        if self.global_scale and self.scale_kind != "e4m3":
            raise ValueError(f"format {self.name!r}: a global scale goes with e4m3 block scales")
        if self.e8m0_rounding not in E8M0_ROUNDINGS:
            raise ValueError(
                f"format {self.name!r}: e8m0_rounding must be one of {E8M0_ROUNDINGS}, "
                f"got {self.e8m0_rounding!r}"
            )

    @property
    def is_float(self) -> bool:
        """Whether the element grid is floating point (the multiplicative noise profile)."""
        return self.element in MANTISSA_BITS

    @property
    def mantissa_bits(self) -> int:
        """Explicit mantissa bits ``p`` of a floating-point element grid."""
        if not self.is_float:
            raise ValueError(f"format {self.name!r} has an integer grid, no mantissa")
        return MANTISSA_BITS[self.element]

    @property
    def element_max(self) -> float:
        return ELEMENT_MAX[self.element]

    @property
    def packed(self) -> bool:
        """Whether codes are stored two per byte (the 4-bit grids)."""
        return self.element in ("e2m1", "int4")

    @property
    def bits(self) -> int:
        return 4 if self.packed else 8

    def bits_per_element(self) -> float:
        """Storage cost per element including block scales (not the per-tensor scale)."""
        if self.granularity != "block":
            return float(self.bits)
        scale_bits = 32 if self.scale_kind == "fp32" else 8
        assert self.block_size is not None
        return self.bits + scale_bits / self.block_size

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "element": self.element,
            "granularity": self.granularity,
            "block_size": self.block_size,
            "scale_kind": self.scale_kind,
            "global_scale": self.global_scale,
            "e8m0_rounding": self.e8m0_rounding,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Format:
        return cls(**data)


_REGISTRY: dict[str, Format] = {}


def register_format(fmt: Format, *, overwrite: bool = False) -> Format:
    """Add ``fmt`` to the registry under ``fmt.name``."""
    if fmt.name in _REGISTRY and not overwrite and _REGISTRY[fmt.name] != fmt:
        raise ValueError(f"format {fmt.name!r} is already registered as {_REGISTRY[fmt.name]}")
    _REGISTRY[fmt.name] = fmt
    return fmt


def list_formats() -> list[str]:
    """Names of the registered formats (the generic names of :func:`get_format` also work)."""
    return sorted(_REGISTRY)


_GENERIC = re.compile(r"^e2m1_b(\d+)_(fp32|e4m3|e8m0)(?:_(floor|ceil|even|rceil|no_clip))?$")
_INT = re.compile(r"^int(4|8)(?:_g(\d+)|_(row|tensor))?$")


def get_format(spec: str | Format) -> Format:
    """Return the :class:`Format` named ``spec`` (a registered or generic name), or ``spec``."""
    if isinstance(spec, Format):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a format is a name or a Format, got {type(spec).__name__}")
    name = spec.strip().lower()
    if name in _REGISTRY:
        return _REGISTRY[name]
    match = _GENERIC.match(name)
    if match:
        block, kind, rounding = int(match.group(1)), match.group(2), match.group(3)
        if rounding and kind != "e8m0":
            raise ValueError(f"format {spec!r}: a rounding suffix goes with e8m0 scales")
        return Format(
            name=name,
            element="e2m1",
            block_size=block,
            scale_kind=kind,  # type: ignore[arg-type]
            global_scale=kind == "e4m3",
            e8m0_rounding=rounding or "floor",
        )
    match = _INT.match(name)
    if match:
        element = f"int{match.group(1)}"
        if match.group(2):
            return Format(name, element, "block", int(match.group(2)))  # type: ignore[arg-type]
        return Format(name, element, match.group(3))  # type: ignore[arg-type]
    raise ValueError(
        f"unknown format {spec!r}; registered: {', '.join(list_formats())}; generic: "
        "e2m1_b<B>_<fp32|e4m3|e8m0>, int<4|8>_g<G>, int<4|8>_row"
    )


def with_block_size(fmt: Format, block_size: int) -> Format:
    """The same format with another block size (renamed generically)."""
    if fmt.granularity != "block":
        raise ValueError(f"format {fmt.name!r} has no blocks")
    if fmt.element == "e2m1":
        suffix = f"_{fmt.e8m0_rounding}" if fmt.scale_kind == "e8m0" else ""
        name = f"e2m1_b{block_size}_{fmt.scale_kind}{suffix}"
    else:
        name = f"{fmt.element}_g{block_size}"
    return replace(fmt, name=name, block_size=block_size)


def _register_builtins() -> None:
    register_format(Format("nvfp4", "e2m1", "block", 16, "e4m3", global_scale=True))
    for rounding in E8M0_ROUNDINGS:
        register_format(Format(f"mxfp4_{rounding}", "e2m1", "block", 32, "e8m0", False, rounding))
    register_format(Format("mxfp4", "e2m1", "block", 32, "e8m0", False, "floor"))
    register_format(Format("fp8_e4m3", "e4m3", "tensor"))
    register_format(Format("fp8_e4m3_row", "e4m3", "row"))
    register_format(Format("int4", "int4", "block", 32))
    register_format(Format("int8", "int8", "block", 32))


_register_builtins()

LOG_UNIFORM_INV_M2 = 3.0 / (8.0 * math.log(2.0))
"""E[1/m^2] for a mantissa m log-uniform on [1, 2): 3 / (8 ln 2) = 0.541 (paper Eq. sigmafmt)."""
