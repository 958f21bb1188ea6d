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
from collections.abc import Iterable, Iterator, Mapping, Sequence
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


def _aligned(x: Tensor, positions: Tensor) -> Tensor | None:
    """``positions`` as a mask over ``x``'s leading dimensions (flattened), or None where
    ``x`` does not line up with the batch."""
    batch, seq = positions.shape
    lead = tuple(x.shape[:-1])
    if lead == (batch, seq) or (x.dim() == 2 and x.shape[0] == batch * seq):
        return positions.reshape(-1)
    if len(lead) > 2 and lead[0] == batch and lead[-1] == seq:  # [batch, ..., seq]: MLA's
        # kv_b_proj reads [batch, 1, seq, rank], attention may read [batch, heads, seq, dim]
        shape = (batch,) + (1,) * (len(lead) - 2) + (seq,)
        return positions.reshape(shape).expand(lead).reshape(-1)
    return None


def token_rows(x: Tensor, layer: str = "") -> Tensor:
    """A layer's input or output ``[..., features]`` as ``[tokens, features]``: flattened, the
    running batch's padded positions left out (:func:`calibrating`).  The positions apply where
    ``x`` lines up with the batch: its leading dimensions ``[batch, seq]``, ``[batch, ...,
    seq]`` or their product (experts reading every token, flattened); otherwise every row is
    kept, with a warning naming ``layer``."""
    rows = x.reshape(-1, x.shape[-1])
    positions = _running.get()
    if positions is None:
        return rows
    mask = _aligned(x, positions)
    if mask is not None:
        return rows[mask.to(rows.device)]
    key = (layer, tuple(x.shape[:-1]), tuple(positions.shape))
    if key not in _unaligned:
        _unaligned.add(key)
        log.warning("%s reads inputs of shape %s that do not line up with the batch's "
                    "attention_mask %s: its padded positions are calibrated on as tokens",
                    layer or "a calibrated layer", list(x.shape), list(positions.shape))
    return rows


def warn_unknown_padding(batches: Sequence[Mapping[str, Any]]) -> None:
    """Warn of the ``batches`` whose ``attention_mask`` is not 2-D (a 4-D additive or boolean
    mask): their padding cannot be told from their tokens."""
    unknown = sum(isinstance(b.get("attention_mask"), Tensor) and b["attention_mask"].dim() != 2
                  for b in batches)
    if unknown:
        log.warning("%d of %d calibration batches hold an attention_mask that is not 2-D "
                    "([batch, seq]): any padding in them is calibrated on as tokens (pass the "
                    "2-D mask; the model builds its own)", unknown, len(batches))
