"""How far a quantized model's outputs are from the full-precision model's.

:func:`token_kl` is the per-position ``KL(p_ref || p)`` of next-token distributions (the
evaluation's KL metric, :mod:`kbbq_pl.eval.metrics`, and the auto-brake's comparison of whole
models); :func:`held_out_divergence` runs models on calibration batches and averages it
(``autobrake.scope: best``, :mod:`kbbq_pl.quant.pipeline`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .config import Batches, ReduceFn, _identity

__all__ = ["held_out_divergence", "token_kl"]


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


@torch.no_grad()
def held_out_divergence(reference: nn.Module, candidates: Mapping[str, nn.Module],
                        batches: Batches, reduce_sum: ReduceFn = _identity
                        ) -> dict[str, tuple[float, str]]:
    """How far each candidate's outputs on ``batches`` are from ``reference``'s (which runs
    once per batch), summed over ranks: the mean per-token ``KL(p_ref || p)`` of the next-token
    distributions (``"kl"``, :func:`token_kl`) for a model with logits, else the relative
    squared error of the last hidden state (``"relative_error"``); positions the
    ``attention_mask`` masks are not counted."""
    sums = {name: [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)]
            for name in candidates}
    metric = "kl"
    device = next(reference.parameters()).device
    for batch in batches:
        batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        want = reference(**batch)
        mask = batch.get("attention_mask")
        if getattr(want, "logits", None) is not None:
            log_probs = torch.log_softmax(want.logits.float(), -1)
        else:
            metric = "relative_error"
            hidden = want[0].double()
        for name, candidate in candidates.items():
            got = candidate(**batch)
            total = sums[name]
            if metric == "kl":
                per_token = token_kl(log_probs, got.logits)
                weight = torch.ones_like(per_token) if mask is None else mask.double()
                total[0] += (per_token * weight).sum().cpu()
                total[1] += weight.sum().cpu()
            else:
                weight = 1.0 if mask is None else mask.double()[..., None]
                total[0] += (((got[0].double() - hidden) ** 2) * weight).sum().cpu()
                total[1] += ((hidden ** 2) * weight).sum().cpu()
    return {name: (float(reduce_sum(error) / reduce_sum(count)), metric)
            for name, (error, count) in sums.items()}
