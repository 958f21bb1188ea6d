"""Which positions of a calibration batch are tokens.

A batch of sequences of different lengths is padded, and its ``attention_mask`` marks the
padding with 0.  Padded positions are not text: their hidden states are whatever the model
computes for a pad token attending to nothing, and counted as tokens they would bias every
statistic the calibration gathers (second moments, Hessians, activation amax, token counts,
kept samples).  So the code that runs the model on a batch names the batch's token positions
(:func:`calibrating`), and the hooks on its linear layers keep the rows of their inputs and
outputs that are tokens (:func:`token_rows`), as sparseml's SparseGPT and llm-compressor's
masked calibration leave padding out of their Hessians and statistics.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

from torch import Tensor

log = logging.getLogger(__name__)

_running: ContextVar[Tensor | None] = ContextVar("kbbq_pl_token_positions", default=None)
_unaligned: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()


def token_positions(batch: Mapping[str, Any]) -> Tensor | None:
    """The token positions ``[batch, seq]`` (bool) of a batch whose ``attention_mask`` (2-D,
    the shape of its ``input_ids``) marks padding with 0; None where every position is a
    token (no mask, a 4-D mask, or no padding)."""
    mask, ids = batch.get("attention_mask"), batch.get("input_ids")
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        return None
    if isinstance(ids, Tensor) and ids.shape != mask.shape:
        return None
    tokens = mask != 0
    return None if bool(tokens.all()) else tokens


def count_tokens(batches: Iterable[Mapping[str, Any]]) -> int:
    """The calibration tokens of ``batches``: the elements of their ``input_ids`` less the
    padded positions (:func:`token_positions`); a batch without an ``input_ids`` tensor counts
    none."""
    total = 0
    for batch in batches:
        if not isinstance(batch.get("input_ids"), Tensor):
            continue
        positions = token_positions(batch)
        total += int(batch["input_ids"].numel() if positions is None else positions.sum())
    return total


@contextlib.contextmanager
def calibrating(positions: Tensor | None) -> Iterator[None]:
    """Within it, the model runs on a batch whose token positions are ``positions``
    (:func:`token_positions`; None: every position)."""
    reset = _running.set(positions)
    try:
        yield
    finally:
        _running.reset(reset)


def token_rows(x: Tensor) -> Tensor:
    """A layer's input or output ``[..., features]`` as ``[tokens, features]``: flattened, the
    running batch's padded positions left out (:func:`calibrating`).  The positions apply where
    ``x`` lines up with the batch: its leading dimensions ``[batch, seq]``, or their product
    (experts reading every token, flattened); otherwise every row is kept, with a warning."""
    rows = x.reshape(-1, x.shape[-1])
    positions = _running.get()
    if positions is None:
        return rows
    if tuple(x.shape[:-1]) == tuple(positions.shape) or (
            x.dim() == 2 and x.shape[0] == positions.numel()):
        return rows[positions.reshape(-1).to(rows.device)]
    key = (tuple(x.shape[:-1]), tuple(positions.shape))
    if key not in _unaligned:
        _unaligned.add(key)
        log.warning("a calibrated layer reads inputs of shape %s that do not line up with the "
                    "batch's attention_mask %s: its padded positions are calibrated on as "
                    "tokens", list(x.shape), list(positions.shape))
    return rows
