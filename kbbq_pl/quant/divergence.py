"""How far a quantized model's outputs are from the full-precision model's.

:func:`token_kl` is the per-position ``KL(p_ref || p)`` of next-token distributions (the
evaluation's KL metric, :mod:`kbbq_pl.eval.metrics`, and the auto-brake's comparison of whole
models); :func:`held_out_divergence` runs models on calibration batches and averages it
(``autobrake.scope: best``, :mod:`kbbq_pl.quant.pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import Batches, ReduceFn, _identity
from .sequential import BlockInput, BlockStep, SequentialRunner, output_from_last_hidden

__all__ = ["HeldOutStreams", "held_out_divergence", "token_kl"]


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


Model = Callable[..., Any]
"""A model's forward: ``model(**batch)``."""


class HeldOutStreams:
    """The held-out calibration sequences carried through the blocks beside the pipeline
    (``autobrake.scope: best``), so whole models are compared without a copy of the model and
    without reading a streamed block twice.

    ``batches``: the held-out sequences; ``before`` names the stream that runs each block as
    it is loaded (the full-precision model), ``after`` the one that runs it once quantized;
    :func:`quantize_model` calls :meth:`start` with its runner, then :meth:`before` and
    :meth:`after` at every block.  One forward of each block per stream, as a whole model's
    forward would run it; :meth:`model` then finishes the forward (final norm, head)."""

    def __init__(self, batches: Batches, before: str | None = None,
                 after: str | None = None) -> None:
        self.batches = list(batches)
        self.names = {"before": before, "after": after}
        self.inputs: dict[str, list[BlockInput]] = {}
        self.blocks_name = ""
        self.returns_tuple = False

    def start(self, runner: SequentialRunner) -> None:
        if runner.whole_model is not None:
            raise ValueError(f"autobrake.scope 'best' compares models block by block; this one "
                             f"runs as one block ({runner.whole_model})")
        self.blocks_name = runner.blocks_name
        inputs = runner.capture(self.batches) if self.batches else []
        for name in self.names.values():
            if name is not None:
                self.inputs[name] = list(inputs)

    def before(self, step: BlockStep) -> None:
        self._advance(self.names["before"], step)

    def after(self, step: BlockStep) -> None:
        self._advance(self.names["after"], step)

    def _advance(self, name: str | None, step: BlockStep) -> None:
        if name is None:
            return
        inputs = self.inputs[name]
        outputs = step.run(inputs=inputs)
        assert outputs is not None
        self.returns_tuple = step.runner.returns_tuple
        self.inputs[name] = [cached.with_hidden(out) for cached, out in zip(inputs, outputs)]

    def model(self, name: str, tail: nn.Module) -> Model:
        """The stream's model, for :func:`held_out_divergence`: ``tail`` (a model of the same
        architecture with its layers outside the blocks) run on the stream's last hidden
        states, one held-out batch per call, in order."""
        hidden = iter([cached.hidden for cached in self.inputs[name]])

        def forward(**batch: Tensor) -> Any:
            return output_from_last_hidden(tail, self.blocks_name, batch, next(hidden),
                                           self.returns_tuple)

        return forward


@torch.no_grad()
def held_out_divergence(reference: Model, candidates: Mapping[str, Model],
                        batches: Batches, reduce_sum: ReduceFn = _identity
                        ) -> dict[str, tuple[float, str]]:
    """How far each candidate's outputs on ``batches`` are from ``reference``'s (each model is
    called once per batch, in order: a module, or :meth:`HeldOutStreams.model`), summed over
    ranks: the mean per-token ``KL(p_ref || p)`` of the next-token
    distributions (``"kl"``, :func:`token_kl`) for a model with logits, else the mean per-token
    cosine distance of the last hidden states (``"cosine_distance"``: one minus the cosine, as
    embeddings are compared, every token alike; it ranks MiniLM's GPTQ models closer to their
    test fidelity than the relative squared error did:
    docs/results/2026-11-27-autobrake-twofold.md); positions the ``attention_mask`` masks are
    not counted."""
    sums = {name: [torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)]
            for name in candidates}
    metric = "kl"
    device = (next(reference.parameters()).device if isinstance(reference, nn.Module)
              else None)  # a HeldOutStreams.model places the batch itself
    for batch in batches:
        if device is not None:
            batch = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
        want = reference(**batch)
        mask = batch.get("attention_mask")
        if getattr(want, "logits", None) is not None:
            log_probs = torch.log_softmax(want.logits.float(), -1)
        else:
            metric = "cosine_distance"
            hidden = want[0].double()
        for name, candidate in candidates.items():
            got = candidate(**batch)
            total = sums[name]
            per_token = (token_kl(log_probs, got.logits) if metric == "kl"
                         else 1 - F.cosine_similarity(got[0].double(), hidden, dim=-1))
            weight = (torch.ones_like(per_token) if mask is None
                      else mask.to(per_token.device).double())
            total[0] += (per_token * weight).sum().cpu()
            total[1] += weight.sum().cpu()
    return {name: (float(reduce_sum(error) / reduce_sum(count)), metric)
            for name, (error, count) in sums.items()}
