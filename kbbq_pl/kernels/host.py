"""Host-side helpers of the kernel launchers, in plain Python: integer arithmetic and the
Triton version.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions (3.6 on): called
from the host each costs about 1.5 us, and an eager decode-path linear worked out half a dozen
of them per call.  These give the same integers."""

from __future__ import annotations

from torch.torch_version import TorchVersion


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, ``b > 0``."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (0 for 0, as Triton's)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def triton_version() -> TorchVersion:
    """The installed Triton's version: it compares with tuples (``>= (3, 6)``) and prints as
    Triton spells it (torch's version string, which is not torch's own only)."""
    import triton

    return TorchVersion(triton.__version__)
