"""The auto-brake: KBBQ's lambda chosen per layer from calibration data alone (``lam: auto``).

The paper picks one global lambda by sweeping downstream benchmarks (Table lambda_grid); a user
can rarely afford that, and tuning on the evaluation tasks overfits them.  Instead, per linear
layer:

1. the pipeline splits the calibration sequences, deterministically, into a fitting part and a
   held-out part (:func:`kbbq_pl.quant.sequential.split_calibration`);
2. every lambda of the grid gives a candidate fitted on the fitting part alone: its transform
   ``T`` and its quantized weight ``Q(W T^-1)`` (round to nearest: one KBBQ basis shared by
   every lambda, which only changes the diagonal power ``Lambda^(-lambda/4)`` of Eq. kbbq;
   GPTQ: one GPTQ run per lambda);
3. :func:`choose_lambda` scores each candidate by its realized output error on the held-out
   tokens, both operands rounded as deployed (:func:`output_error`), and keeps the smallest;
4. the weight quantizer refits the chosen lambda on every token.

Scoring on the tokens the transform was fitted on would reward fitting noise in the second
moment; the held-out split is what makes the choice honest.  Choosing one lambda for a whole
model is a sweep of fixed-lambda recipes compared end to end: ``kbbq-pl compare --lams``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..formats import Format, fake_quantize, get_format
from ..transforms.fit import transform_inputs
from .act_scale import effective_act_scale, static_act_scale

__all__ = ["DEFAULT_GRID", "Candidate", "LambdaChoice", "choice_histogram", "choose_lambda",
           "output_error"]

DEFAULT_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 0.625, 0.75, 0.875, 1.0)

Candidate = tuple[Tensor, Tensor | None]
"""A candidate of one lambda: its quantized weight ``Q(W T^-1)`` as float32 values ``[out, D]``
and its transform ``T`` (None for the identity)."""


@dataclass
class LambdaChoice:
    """The chosen lambda of one layer and the held-out error of every candidate."""

    lam: float
    errors: dict[float, float]

    @property
    def errors_db(self) -> dict[float, float]:
        """The errors in dB: ``-inf`` for an exact candidate, NaN where the held-out outputs
        have no energy (the relative error is undefined)."""
        return {lam: e if math.isnan(e) else 10 * math.log10(e) if e > 0 else float("-inf")
                for lam, e in self.errors.items()}


def output_error(weight: Tensor, w_hat: Tensor, x: Tensor, transform: Tensor | None,
                 fmt: str | Format, act_scale: str = "static", y: Tensor | None = None) -> float:
    """Relative output error ``sum ||y_hat - y||^2 / sum ||y||^2`` of a layer with weight
    ``[out, D]`` on inputs ``x [n, D]``: ``y = x W^T`` and ``y_hat = Q(T x) w_hat^T`` with
    ``w_hat = Q(W T^-1)``, the activations rounded as deployed (a static NVFP4 scale from these
    inputs' amax, or dynamic).  ``y``: the exact outputs, when the caller scores several
    candidates on the same inputs.  NaN where ``y`` has no energy (the layer's outputs on
    these inputs are all zero)."""
    fmt = get_format(fmt)
    if y is None:
        y = x.float() @ weight.float().T  # float32 products: their error is ~1e-6 of FP4's
    h = transform_inputs(x.float(), transform)
    static = effective_act_scale(fmt, act_scale) == "static"
    scale = static_act_scale(h.abs().max()) if static else None
    h_q = fake_quantize(h, fmt, global_scale=scale)
    residual = torch.addmm(y, h_q, w_hat.float().T, beta=-1).flatten()  # h_q w_hat^T - y
    flat = y.flatten()
    error, energy = torch.dot(residual, residual).double(), torch.dot(flat, flat).double()
    return float(error / energy) if energy > 0 else float("nan")


def choose_lambda(weight: Tensor, x_held_out: Tensor, candidate: Callable[[float], Candidate],
                  fmt: str | Format, grid: Sequence[float] = DEFAULT_GRID,
                  act_scale: str = "static") -> LambdaChoice:
    """The lambda of ``grid`` whose candidate (``candidate(lam)``, fitted without the held-out
    tokens) has the smallest :func:`output_error` on ``x_held_out [n, D]`` (the first in grid
    order on a tie, or where no error is defined: held-out outputs without energy); with
    several ranks, ``x_held_out`` is every rank's scored tokens,
    gathered, so that every rank chooses the same."""
    if x_held_out.numel() == 0:
        raise ValueError("no held-out tokens to choose lambda on")
    y = x_held_out.float() @ weight.float().T
    errors = {}
    for lam in map(float, grid):
        w_hat, transform = candidate(lam)
        errors[lam] = output_error(weight, w_hat, x_held_out, transform, fmt, act_scale, y=y)
    order = list(errors)

    def rank(lam: float) -> tuple[bool, float, int]:  # undefined errors last
        undefined = math.isnan(errors[lam])
        return undefined, 0.0 if undefined else errors[lam], order.index(lam)

    best = min(errors, key=rank)
    return LambdaChoice(best, errors)


def choice_histogram(choices: Mapping[str, LambdaChoice], grid: Sequence[float]) -> str:
    """A text histogram of the chosen lambdas (one bar per grid point) for report.md."""
    counts = {float(lam): 0 for lam in grid}
    for choice in choices.values():
        counts[choice.lam] = counts.get(choice.lam, 0) + 1
    width = max(counts.values()) if counts else 1
    lines = [f"lambda {lam:<6g} {'#' * round(30 * n / max(width, 1)):<30} {n}"
             for lam, n in counts.items()]
    return "\n".join(lines)
