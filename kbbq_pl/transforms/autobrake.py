"""Auto-brake: choose KBBQ's lambda per layer from calibration data alone (``lam: auto``).

The paper picks one global lambda by sweeping downstream benchmarks (Table lambda_grid); a user
can rarely afford that, and tuning on the evaluation tasks overfits them.  Instead, per linear
layer:

1. the calibration sequences are split, deterministically, into a fitting part and a held-out
   selection part (:func:`split_sequences`);
2. the lambda-independent part of KBBQ (Cholesky and eigendecomposition of every block,
   :func:`~kbbq_pl.transforms.kbbq_basis`) is fitted once on the fitting part's statistics, and
   every lambda of the grid only changes the diagonal power ``Lambda^(-lambda/4)`` (Eq. kbbq);
3. each candidate is scored by its realized output error on the held-out tokens, both operands
   rounded exactly as deployed (:func:`realized_output_error`), and the smallest wins.

Scoring on the tokens the transform was fitted on would reward fitting noise in the second
moment; the held-out split is what makes the choice honest (the report of the auto-brake issue
measures the difference).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..formats import Format, fake_quantize, get_format
from ..formats.rounding import NVFP4_MIN_GLOBAL_SCALE
from .fit import DEFAULT_DAMPING, KBBQBasis, kbbq_basis, transform_inputs, transform_weight

DEFAULT_GRID: tuple[float, ...] = (0.0, 0.25, 0.5, 0.625, 0.75, 0.875, 1.0)


class _PooledRows:
    """The rows (sequences) of all calibration batches, pooled, to be re-batched by index.

    Sequences may differ in length from batch to batch (e.g. one sentence per batch, unpadded):
    a new batch then starts wherever the length changes, so no sequence is padded or cut."""

    def __init__(self, batches: Sequence[Mapping[str, Tensor]]) -> None:
        self.keys = list(batches[0].keys()) if batches else []
        if not self.keys:
            raise ValueError("the calibration set is empty: no batches")
        self.pooled = [{k: b[k][i:i + 1] for k in self.keys}
                       for b in batches for i in range(len(b[self.keys[0]]))]
        self.rows = len(self.pooled)
        self.batch_size = len(batches[0][self.keys[0]])

    def permutation(self, seed: int) -> Tensor:
        return torch.randperm(self.rows, generator=torch.Generator().manual_seed(seed))

    def rebatch(self, index: Tensor) -> list[dict[str, Tensor]]:
        """The rows ``index`` in their original order, in batches of the original size (one
        more batch wherever the sequence length changes)."""
        groups: list[list[dict[str, Tensor]]] = []
        for i in index.sort().values.tolist():
            row = self.pooled[i]
            last = groups[-1] if groups else None
            if (last is None or len(last) == self.batch_size
                    or any(last[0][k].shape != row[k].shape for k in self.keys)):
                groups.append([row])
            else:
                last.append(row)
        return [{k: torch.cat([row[k] for row in group]) for k in self.keys} for group in groups]


def split_sequences(
    batches: Sequence[Mapping[str, Tensor]], holdout_fraction: float = 0.5, seed: int = 0
) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """Split the calibration sequences into a fitting part and a held-out part.

    The rows of all batches are pooled and a seeded permutation sends
    ``round(holdout_fraction * n)`` of them (at least one, at most ``n - 1``) to the held-out
    part; both parts are re-batched with the original batch size, in their original order.
    """
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction lies in (0, 1), got {holdout_fraction}")
    rows = _PooledRows(batches)
    if rows.rows < 2:
        raise ValueError(f"auto lambda needs at least 2 calibration sequences, got {rows.rows}")
    held = min(rows.rows - 1, max(1, round(holdout_fraction * rows.rows)))
    order = rows.permutation(seed)
    return rows.rebatch(order[held:]), rows.rebatch(order[:held])


def fold_sequences(
    batches: Sequence[Mapping[str, Tensor]], folds: int, seed: int = 0
) -> list[list[dict[str, Tensor]]]:
    """Deal the calibration sequences into ``folds`` parts for cross-fitting.

    The rows of all batches are pooled, a seeded permutation deals them round-robin into the
    folds (sizes differ by at most one), and each fold is re-batched with the original batch
    size, its rows in their original order.
    """
    if folds < 2:
        raise ValueError(f"cross-fitting needs at least 2 folds, got {folds}")
    rows = _PooledRows(batches)
    if rows.rows < folds:
        raise ValueError(f"autobrake.folds {folds} needs at least {folds} calibration "
                         f"sequences, got {rows.rows}")
    order = rows.permutation(seed)
    return [rows.rebatch(order[fold::folds]) for fold in range(folds)]


def _identity(t: Tensor) -> Tensor:
    return t


def static_scale(h: Tensor, fmt: Format, reduce_max=_identity) -> Tensor | None:
    """The NVFP4 per-tensor activation scale calibration would give for inputs ``h``."""
    if not fmt.global_scale:
        return None
    amax = reduce_max(h.abs().max().float())
    return (amax / (448.0 * 6.0)).clamp(min=NVFP4_MIN_GLOBAL_SCALE)


def realized_output_error(
    weight: Tensor, x: Tensor, transform: Tensor | None, fmt: str | Format,
    act_scale: str = "static", reduce_sum=_identity, reduce_max=_identity,
) -> float:
    """Relative output error ``E||y_hat - y||^2 / E||y||^2`` of a layer with weight
    ``[out, D]`` on inputs ``x [n, D]``, with ``y_hat = Q(W T^-1) Q(T x)`` rounded as deployed
    (static NVFP4 activation scale from these inputs, or dynamic).  With data-parallel ranks,
    ``reduce_sum`` / ``reduce_max`` pool the energies and the amax so every rank agrees."""
    fmt = get_format(fmt)
    w_hat = fake_quantize(transform_weight(weight.float(), transform), fmt)
    return quantized_output_error(weight, w_hat, x, transform, fmt, act_scale, reduce_sum,
                                  reduce_max)


def quantized_output_error(
    weight: Tensor, w_hat: Tensor, x: Tensor, transform: Tensor | None, fmt: str | Format,
    act_scale: str = "static", reduce_sum=_identity, reduce_max=_identity,
    y: Tensor | None = None,
) -> float:
    """:func:`realized_output_error` for a weight already quantized in the transformed
    coordinates: ``w_hat`` (float32 ``[out, D]``), e.g. GPTQ's ``Q(W T^-1)``; ``y``: the exact
    outputs ``x W^T`` when the caller scores several candidates on the same inputs."""
    error, energy = output_error_energies(weight, w_hat, x, transform, fmt, act_scale,
                                          reduce_max, y)
    return float(reduce_sum(error) / reduce_sum(energy))


def output_error_energies(
    weight: Tensor, w_hat: Tensor, x: Tensor, transform: Tensor | None, fmt: str | Format,
    act_scale: str = "static", reduce_max=_identity, y: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The two sums of :func:`quantized_output_error`: ``sum ||y_hat - y||^2`` and
    ``sum ||y||^2`` over the inputs ``x`` (float64 scalars), to pool over folds or ranks."""
    fmt = get_format(fmt)
    if y is None:
        y = x.float() @ weight.float().T  # float32 products: their error is ~1e-6 of FP4's
    h = transform_inputs(x.float(), transform)
    scale = static_scale(h, fmt, reduce_max) if act_scale == "static" else None
    h_q = fake_quantize(h, fmt, global_scale=scale)
    residual = torch.addmm(y, h_q, w_hat.float().T, beta=-1).flatten()  # h_q w_hat^T - y
    flat = y.flatten()
    return torch.dot(residual, residual).double(), torch.dot(flat, flat).double()


@dataclass
class LambdaChoice:
    """The chosen lambda of one layer and the held-out error of every candidate."""

    lam: float
    errors: dict[float, float]

    @property
    def errors_db(self) -> dict[float, float]:
        return {lam: 10 * math.log10(e) if e > 0 else float("-inf")
                for lam, e in self.errors.items()}


def best_lambda(errors: Mapping[float, float]) -> LambdaChoice:
    """The candidate with the smallest held-out error (the first in grid order on a tie)."""
    order = list(errors)
    best = min(errors, key=lambda lam: (errors[lam], order.index(lam)))
    return LambdaChoice(best, dict(errors))


def model_lambda(choices: Mapping[str, LambdaChoice]) -> tuple[float, dict[float, float]]:
    """One lambda for every layer (``autobrake.scope: model``): the candidate whose held-out
    output error in dB, averaged over the layers, is the smallest (the first in grid order on
    a tie); returns it and every candidate's mean in dB.

    The per-layer minimum wins a fraction of a dB per layer that does not reach the model's
    output: on SmolLM2 the layer choices lose to the best single lambda, which the mean over
    layers finds (docs/results/2026-11-25-autobrake-scope.md).  Averaging dB weighs every
    layer's relative error alike, whatever its output energy."""
    (best,), means = model_finalists(choices, 1)
    return best, means


def model_finalists(choices: Mapping[str, LambdaChoice], count: int
                    ) -> tuple[list[float], dict[float, float]]:
    """The ``count`` candidates of the smallest held-out error in dB averaged over the layers,
    best first (:func:`model_lambda`'s order: ties in grid order), and every candidate's
    mean (``autobrake.finalists``)."""
    if not choices:
        raise ValueError("no layer scored the auto-brake's candidates")
    grids = {tuple(choice.errors) for choice in choices.values()}
    if len(grids) != 1:
        raise ValueError(f"the layers scored different candidates: {sorted(grids)}")
    (grid,) = grids
    means = {lam: sum(choice.errors_db[lam] for choice in choices.values()) / len(choices)
             for lam in grid}
    ranked = sorted(grid, key=lambda lam: (means[lam], grid.index(lam)))
    return ranked[:count], means


def select_lambda(
    weight: Tensor, basis: KBBQBasis, x_holdout: Tensor, fmt: str | Format,
    grid: Sequence[float] = DEFAULT_GRID, act_scale: str = "static",
) -> LambdaChoice:
    """Score every lambda of ``grid`` on the held-out inputs and keep the smallest error
    (the first in grid order on a tie); with several ranks, ``x_holdout`` is every rank's
    scored tokens, gathered (:meth:`~kbbq_pl.quant.config.Collectives.gather_rows`)."""
    if x_holdout.numel() == 0:
        raise ValueError("no held-out tokens to select lambda on")
    fmt = get_format(fmt)
    y = x_holdout.float() @ weight.float().T
    errors = {}
    for lam in map(float, grid):
        transform = basis.transform(lam)
        w_hat = fake_quantize(transform_weight(weight.float(), transform), fmt)
        errors[lam] = quantized_output_error(weight, w_hat, x_holdout, transform, fmt, act_scale,
                                             y=y)
    return best_lambda(errors)


def cross_fitted_lambda(
    weight: Tensor, fold_sigma_sums: Sequence[Tensor], fold_tokens: Sequence[float],
    fold_inputs: Sequence[Tensor], fmt: str | Format, grid: Sequence[float] = DEFAULT_GRID,
    act_scale: str = "static", damping: float = DEFAULT_DAMPING, reduce_sum=_identity,
    reduce_max=_identity, name: str = "",
) -> LambdaChoice:
    """The lambda of the smallest output error pooled over K folds (cross-fitting).

    Fold ``k``'s candidates are KBBQ(lambda) fitted on the block second moments of the other
    folds (``sum_{j != k} Sigma_j / sum_{j != k} n_j``, one basis per fold shared by every
    lambda) and scored on fold ``k``'s inputs, rounded as deployed; the error and output
    energies are summed over the folds before the ratio.  Each transform sees ``(K - 1) / K``
    of the data, against half with a single held-out split, and every fold is scored: the
    selection is less biased toward braking and less noisy (docs/results, issue 23).
    ``fold_sigma_sums``: float64 ``[D / d, d, d]`` sums per fold; ``fold_inputs``: the scored
    tokens ``[n_k, D]`` of each fold (an empty fold is skipped)."""
    fmt = get_format(fmt)
    total_sum = sum(fold_sigma_sums)
    total_tokens = float(sum(fold_tokens))
    errors = dict.fromkeys(map(float, grid), 0.0)
    energies = dict.fromkeys(map(float, grid), 0.0)
    w = weight.float()
    for sigma_sum, tokens, x in zip(fold_sigma_sums, fold_tokens, fold_inputs):
        if x.numel() == 0 or total_tokens - float(tokens) <= 0:
            continue
        sigma = (total_sum - sigma_sum) / (total_tokens - float(tokens))
        basis = kbbq_basis(weight, sigma, damping, name=name)
        y = x.float() @ w.T
        for lam in errors:
            transform = basis.transform(lam)
            w_hat = fake_quantize(transform_weight(w, transform), fmt)
            error, energy = output_error_energies(weight, w_hat, x, transform, fmt, act_scale,
                                                  reduce_max, y)
            errors[lam] += float(error)
            energies[lam] += float(energy)
    pooled = {}
    for lam in errors:
        energy = float(reduce_sum(torch.tensor(energies[lam], dtype=torch.float64)))
        if energy <= 0:
            raise ValueError(f"{name or 'layer'}: no scored tokens in any fold to select "
                             "lambda on")
        pooled[lam] = float(reduce_sum(torch.tensor(errors[lam], dtype=torch.float64))) / energy
    return best_lambda(pooled)


def choice_histogram(choices: Mapping[str, LambdaChoice], grid: Sequence[float]) -> str:
    """A text histogram of the chosen lambdas (one bar per grid point) for report.md."""
    counts = {float(lam): 0 for lam in grid}
    for choice in choices.values():
        counts[choice.lam] = counts.get(choice.lam, 0) + 1
    width = max(counts.values()) if counts else 1
    lines = [f"lambda {lam:<6g} {'#' * round(30 * n / max(width, 1)):<30} {n}"
             for lam, n in counts.items()]
    return "\n".join(lines)
