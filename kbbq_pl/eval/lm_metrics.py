"""Causal-LM fidelity: rolling-window perplexity and the KL divergence of next-token
distributions from the full-precision model, on the same text.

:func:`lm_metrics` scores a (quantized) causal LM on a token stream with the windows of
:func:`kbbq_pl.eval.evaluation.rolling_windows` (``context`` tokens read, the next ``stride``
positions scored, every position scored exactly once) and reports

* ``perplexity`` ``= exp(mean NLL)`` of the text;
* ``kl``: the mean over scored positions of ``KL(p_ref || p)`` (nats), ``p_ref`` the
  reference (full-precision) model's next-token distribution and ``p`` the model's, on the
  same context (:func:`kbbq_pl.eval.metrics.token_kl`): the fidelity metric LLM quantizers
  report beside perplexity, zero only when the two models predict identically.

The figures accumulate window by window in :class:`~kbbq_pl.eval.metrics.TokenPerplexity`
and :class:`~kbbq_pl.eval.metrics.TokenKL` (torchmetrics metrics, which a LightningModule can
log during ``fit``).  The reference's log-probabilities can be computed once
(:func:`reference_log_probs`, ``[n scored, vocab]``, float32 or bfloat16 on the CPU) and
passed to every quantized variant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .evaluation import prepare_stream, rolling_windows, window_logits, window_shape

__all__ = ["ReferenceLogProbs", "default_text", "lm_metrics", "reference_log_probs"]

WIKITEXT2_TEST = Path("wikitext2") / "test.txt"


def default_text(data_dir: str | Path) -> Path:
    """The text ``kbbq-pl eval``/``compare`` score (``ppl``, ``kl``) without ``--text``:
    ``data_dir/wikitext2/test.txt`` when that file exists, else the beginning of it that
    kbbq-pl ships (:func:`kbbq_pl.resources.eval_text`: its first 24 KB, cut at a line
    boundary, about 5,800 SmolLM2 tokens).  The excerpt's tokens are the full file's first
    tokens, so the default window (the first 2048 tokens) scores the same text on either."""
    from ..resources import eval_text

    full = Path(data_dir) / WIKITEXT2_TEST
    return full if full.is_file() else eval_text()


@dataclass
class ReferenceLogProbs:
    """The reference model's next-token log-probabilities on a stream, for :func:`lm_metrics`:
    ``log_probs[i]`` belongs to the i-th scored position (windows in order), with the stream
    and window shape they were computed on (a different stream or shape is refused)."""

    log_probs: Tensor
    ids: list[int]
    context: int
    stride: int


def _windows(model: nn.Module, tokenizer: Any, source: Any, context: int | None,
             stride: int | None, max_tokens: int | None, add_bos: bool):
    ids = prepare_stream(model, tokenizer, source, max_tokens, add_bos=add_bos)
    context, stride = window_shape(model, context, stride)
    return ids, context, stride, rolling_windows(len(ids), context, stride)


def reference_log_probs(
    model: nn.Module, tokenizer: Any, source: str | Path | Tensor | Sequence[int], *,
    context: int | None = None, stride: int | None = None, max_tokens: int | None = None,
    add_bos: bool = True, batch_size: int = 4, dtype: torch.dtype = torch.float32,
) -> ReferenceLogProbs:
    """The full-precision model's log-probabilities on every scored position of ``source``
    (the windows :func:`lm_metrics` uses with the same arguments), on the CPU in ``dtype``
    (float32; a bfloat16 cache halves the memory but its rounded distributions no longer sum
    to one, which biases the KL: a model against itself no longer gives 0)."""
    ids, context, stride, windows = _windows(model, tokenizer, source, context, stride,
                                             max_tokens, add_bos)
    rows = [torch.log_softmax(logits, dim=-1).to("cpu", dtype)
            for _, _, logits in window_logits(model, ids, windows, batch_size)]
    return ReferenceLogProbs(torch.cat(rows), ids, context, stride)


def lm_metrics(
    model: nn.Module, tokenizer: Any, source: str | Path | Tensor | Sequence[int], *,
    reference: nn.Module | ReferenceLogProbs | None = None,
    context: int | None = None, stride: int | None = None, max_tokens: int | None = None,
    add_bos: bool = True, batch_size: int = 4,
) -> dict[str, Any]:
    """Perplexity of ``model`` on ``source`` (a text file, tokenized whole without special
    tokens, or a 1-D stream of ids) and, with a ``reference`` (the full-precision model, or
    its :func:`reference_log_probs`), the mean KL of its next-token distributions from the
    reference's.  ``context`` defaults to the model's ``max_position_embeddings``, ``stride``
    to half of ``context``; ``max_tokens`` keeps the first tokens of the text.

    Returns ``{"perplexity", "nll", "kl" (None without a reference), "kl_max" (the largest
    per-position KL), "n_tokens" (scored), "n_windows", "context", "stride"}``."""
    from .metrics import TokenKL, TokenPerplexity

    ids, context, stride, windows = _windows(model, tokenizer, source, context, stride,
                                             max_tokens, add_bos)
    cached = reference if isinstance(reference, ReferenceLogProbs) else None
    if cached is not None and (cached.ids != ids or (cached.context, cached.stride)
                               != (context, stride)):
        raise ValueError(
            f"the reference log-probabilities were computed on another stream or window shape "
            f"({len(cached.ids)} tokens, context {cached.context}, stride {cached.stride}; "
            f"here {len(ids)} tokens, context {context}, stride {stride})")
    reference_windows = (window_logits(reference, ids, windows, batch_size)
                         if isinstance(reference, nn.Module) else None)
    # the whole stream is scored here: no other process holds a share of it
    nll = TokenPerplexity(sync_on_compute=False)
    kl = TokenKL(sync_on_compute=False) if reference is not None else None
    count = 0
    for _, targets, logits in window_logits(model, ids, windows, batch_size):
        nll.update(logits, targets)
        if kl is not None:
            if cached is not None:
                ref = cached.log_probs[count : count + len(targets)].to(logits.device)
            else:
                assert reference_windows is not None
                ref = torch.log_softmax(next(reference_windows)[2], dim=-1).to(logits.device)
            kl.update(ref, logits)
        count += len(targets)
    scores = nll.summary()
    kls = kl.summary() if kl is not None else {"kl": None, "kl_max": None}
    return {"perplexity": scores["perplexity"], "nll": scores["nll"], "kl": kls["kl"],
            "kl_max": kls["kl_max"], "n_tokens": scores["n_tokens"], "n_windows": len(windows),
            "context": context, "stride": stride}
