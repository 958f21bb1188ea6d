"""Fidelity, perplexity and KL as torchmetrics metrics: accumulate batch by batch, sync across
processes, log from a LightningModule.

* :class:`TokenPerplexity`: ``exp`` of the mean next-token negative log-likelihood (nats);
* :class:`TokenKL`: the mean (and max) over positions of ``KL(p_ref || p)`` of next-token
  distributions, ``p_ref`` the full-precision (reference) model's;
* :class:`CosineFidelity`: the mean (and min) row-wise cosine similarity of embeddings to the
  full-precision model's.

Each keeps a few scalar states registered with ``add_state(..., dist_reduce_fx=...)`` (sums
and counts with ``"sum"``, the max with ``"max"``, the min with ``"min"``), so ``compute()``
gives the same value on any number of processes, each updating on its share of the batches
(torchmetrics gathers every rank's states first): counts, max and min exactly, the float64
sums to rounding (each rank's sum, then the ranks' sums, in place of one running sum).
Each update's figures are computed where its inputs are and added to the states on the
metric's device (nothing moves when the metric sits with the model, as a LightningModule
attribute does).  ``compute()`` returns the metric's one headline number (a 0-d float64
tensor), which is what ``LightningModule.log`` takes; ``summary()`` returns every figure as
Python numbers, from the states of all processes, as :func:`~kbbq_pl.eval.evaluation.perplexity`,
:func:`~kbbq_pl.eval.lm_metrics.lm_metrics` and :func:`~kbbq_pl.eval.evaluation.cosine_summary`
report them.  In a LightningModule::

    self.val_ppl = TokenPerplexity()            # an attribute: Lightning moves and resets it
    ...
    def validation_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"]).logits
        self.val_ppl.update(logits[:, :-1], batch["input_ids"][:, 1:])
        self.log("val_ppl", self.val_ppl)         # computed and reset at the end of the epoch

Why not torchmetrics' own ``Perplexity``, ``KLDivergence`` and ``CosineSimilarity`` (1.x):
they compute other numbers than kbbq-pl reports.  ``Perplexity`` takes ``log`` of ``softmax``
(underflow to ``-inf`` where ``log_softmax`` stays finite) and sums in float32;
``KLDivergence`` sums the per-position KL in float32 and has no max; ``CosineSimilarity``
casts to float32, has no min, and keeps every embedding as a list state (gathered whole across
processes) where three scalars suffice.  The metrics here sum in float64, in the order of the
updates, so on one process they give the figures kbbq-pl computed by hand before them bit for
bit (``tests/eval/test_metrics.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric

__all__ = ["CosineFidelity", "TokenKL", "TokenPerplexity", "perplexity_summary", "row_cosine",
           "token_kl", "token_nll_sum"]


# ---------------------------------------------------------------------------------------------
# The arithmetic: small pure functions
# ---------------------------------------------------------------------------------------------

def token_kl(reference_log_probs: Tensor, logits: Tensor) -> Tensor:
    """``KL(p_ref || p)`` per position (nats, float64): ``sum_v p_ref (log p_ref - log p)``
    with ``p = softmax(logits)``, computed in float32; both ``[..., vocab]``, the result
    ``[...]`` (Kullback and Leibler 1951; the fidelity metric of LLM quantization beside
    perplexity)."""
    if reference_log_probs.shape != logits.shape:
        raise ValueError(f"reference log-probabilities {tuple(reference_log_probs.shape)} and "
                         f"logits {tuple(logits.shape)} differ in shape")
    ref = reference_log_probs.float()
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return (ref.exp() * (ref - log_p)).sum(-1).double()


def token_nll_sum(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """The summed negative log-likelihood (nats) of ``targets`` ``[...]`` under ``logits``
    ``[..., vocab]``: ``F.cross_entropy(..., reduction="sum")`` (its ``log_softmax`` and sum
    in float32, or float64 for float64 logits: bf16 or fp16 logits are upcast first), returned
    as a 0-d float64 tensor; targets equal to ``ignore_index`` are not scored."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not predict targets "
                         f"{tuple(targets.shape)} (expected logits [..., vocab], targets [...])")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction="sum").double()


def row_cosine(embeddings: Tensor, reference: Tensor) -> Tensor:
    """The cosine similarity of each row of ``embeddings`` ``[n, dim]`` to the same row of
    ``reference``, in float64 (``torch.nn.functional.cosine_similarity``)."""
    if embeddings.shape != reference.shape:
        raise ValueError(f"embeddings {tuple(embeddings.shape)} and reference "
                         f"{tuple(reference.shape)} differ in shape")
    return F.cosine_similarity(embeddings.to(torch.float64), reference.to(torch.float64), dim=1)


def perplexity_summary(nll_sum: float, count: int) -> dict[str, float | int]:
    """``{"perplexity": exp(mean), "nll": mean, "n_tokens": count}`` of a summed NLL."""
    if count < 1:
        raise ValueError("no token was scored")
    mean = nll_sum / count
    return {"perplexity": math.exp(mean), "nll": mean, "n_tokens": count}


def _float64(value: float) -> Tensor:
    return torch.tensor(value, dtype=torch.float64)


def _count() -> Tensor:
    return torch.tensor(0, dtype=torch.int64)


class _Summary(Metric):
    """A metric with :meth:`summary`: its figures from the states of every process."""

    is_differentiable = False
    full_state_update = False

    def summary(self) -> dict[str, Any]:
        """Every figure of the metric (Python numbers), from the states summed (max, min) over
        all processes, which stay this process's own afterwards (as after ``compute()``)."""
        with self.sync_context(dist_sync_fn=self.dist_sync_fn, should_sync=self._to_sync):
            return self._summary()

    def _summary(self) -> dict[str, Any]:
        raise NotImplementedError


class TokenPerplexity(_Summary):
    """Perplexity ``exp(sum NLL / tokens)`` of next-token predictions, the NLL of each update
    summed in float64 (:func:`token_nll_sum`).

    ``update(logits, targets)``: ``logits [..., vocab]`` predicting ``targets [...]`` (already
    shifted: the logits of position ``t`` against the token at ``t + 1``); targets equal to
    ``ignore_index`` (cross-entropy's ``-100``) are skipped.  ``compute()``: the perplexity;
    ``summary()``: ``{"perplexity", "nll" (mean, nats), "n_tokens"}``.

    A subclass of ``torchmetrics.Metric`` rather than ``torchmetrics.text.Perplexity``, which
    takes ``log(softmax)`` and sums in float32 (see the module's docstring).
    """

    higher_is_better = False
    nll_sum: Tensor
    count: Tensor

    def __init__(self, ignore_index: int = -100, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("nll_sum", default=_float64(0.0), dist_reduce_fx="sum")
        self.add_state("count", default=_count(), dist_reduce_fx="sum")

    def update(self, logits: Tensor, targets: Tensor) -> None:
        self.nll_sum += token_nll_sum(logits, targets, self.ignore_index).to(self.device)
        self.count += (targets != self.ignore_index).sum().to(self.device)

    def compute(self) -> Tensor:
        return torch.exp(self.nll_sum / self.count)

    def _summary(self) -> dict[str, Any]:
        return perplexity_summary(self.nll_sum.item(), int(self.count.item()))


class TokenKL(_Summary):
    """Mean over positions of ``KL(p_ref || p)`` (nats, :func:`token_kl`), ``p_ref`` the
    reference (full-precision) model's next-token distribution and ``p`` the model's, with
    the largest per-position KL; summed in float64.

    ``update(reference_log_probs, logits, mask=None)``: both ``[..., vocab]``, the reference as
    log-probabilities (``log_softmax`` of its logits, or cached ones), the model as logits;
    ``mask [...]`` (bool, e.g. a padded batch's attention mask) keeps the positions scored, as
    ``TokenPerplexity``'s ``ignore_index`` does.  ``compute()``: the mean KL; ``summary()``:
    ``{"kl", "kl_max", "n_tokens"}``.  The max starts at 0 (KL is never negative; a rounding
    below 0 reports 0).

    A subclass of ``torchmetrics.Metric`` rather than ``torchmetrics.regression.KLDivergence``,
    which sums in float32 and keeps no max (see the module's docstring).
    """

    higher_is_better = False
    kl_sum: Tensor
    kl_max: Tensor
    count: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("kl_sum", default=_float64(0.0), dist_reduce_fx="sum")
        self.add_state("kl_max", default=_float64(0.0), dist_reduce_fx="max")
        self.add_state("count", default=_count(), dist_reduce_fx="sum")

    def update(self, reference_log_probs: Tensor, logits: Tensor,
               mask: Tensor | None = None) -> None:
        per_token = token_kl(reference_log_probs, logits)
        if mask is not None:
            if mask.shape != per_token.shape:
                raise ValueError(f"mask {tuple(mask.shape)} does not cover the positions "
                                 f"{tuple(per_token.shape)} of the logits")
            per_token = per_token[mask.to(per_token.device, torch.bool)]
        per_token = per_token.reshape(-1).to(self.device)
        if per_token.numel():
            self.kl_sum += per_token.sum()
            self.kl_max = torch.maximum(self.kl_max, per_token.max())
        self.count += per_token.numel()

    def compute(self) -> Tensor:
        return self.kl_sum / self.count

    def _summary(self) -> dict[str, Any]:
        count = int(self.count.item())
        if count < 1:
            raise ValueError("no token was scored")
        return {"kl": self.kl_sum.item() / count, "kl_max": self.kl_max.item(),
                "n_tokens": count}


class CosineFidelity(_Summary):
    """Mean (and min) cosine similarity of embeddings to the full-precision model's, row by row
    (:func:`row_cosine`, float64): 1.0 means identical directions.

    ``update(embeddings, reference)``: two ``[n, dim]`` matrices, row ``i`` of each the same
    input.  ``compute()``: the mean cosine; ``summary()``: ``{"mean_cosine", "min_cosine",
    "n_sentences"}``.

    A subclass of ``torchmetrics.Metric`` rather than
    ``torchmetrics.regression.CosineSimilarity``, which computes in float32, has no min and
    keeps every row (see the module's docstring).
    """

    higher_is_better = True
    cosine_sum: Tensor
    cosine_min: Tensor
    count: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("cosine_sum", default=_float64(0.0), dist_reduce_fx="sum")
        self.add_state("cosine_min", default=_float64(math.inf), dist_reduce_fx="min")
        self.add_state("count", default=_count(), dist_reduce_fx="sum")

    def update(self, embeddings: Tensor, reference: Tensor) -> None:
        cosine = row_cosine(embeddings, reference).to(self.device)
        if cosine.numel():
            self.cosine_sum += cosine.sum()
            self.cosine_min = torch.minimum(self.cosine_min, cosine.min())
        self.count += cosine.numel()

    def compute(self) -> Tensor:
        return self.cosine_sum / self.count

    def _summary(self) -> dict[str, Any]:
        count = int(self.count.item())
        if count < 1:
            raise ValueError("no sentence was scored")
        return {"mean_cosine": self.cosine_sum.item() / count,
                "min_cosine": self.cosine_min.item(), "n_sentences": count}
