"""Whether Triton runs the kernels interpreted (read by the dispatcher and the kernels)."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs kernels interpreted (``TRITON_INTERPRET``, as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
