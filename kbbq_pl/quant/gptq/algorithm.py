"""GPTQ for the FP4 block formats (NVFP4, MXFP4), the algorithm: pure functions on tensors
(its weight quantizer in the pipeline is :mod:`kbbq_pl.quant.gptq.quantizer`).

GPTQ (Frantar et al. 2023) rounds the columns of a weight ``W [out, D]`` one at a time and
spreads each column's rounding error over the columns not yet rounded, weighted by the inverse
Hessian of the layer-wise loss ``||W x - Q x||^2`` over calibration inputs ``x``.  Here:

* the Hessian is ``H = (2 / n) sum x x^T`` in float32 (:func:`hessian`); input columns with
  ``H_jj = 0`` ("dead": never excited) get ``H_jj = 1`` and a zero weight column;
* damping is relative: ``H + damping * mean(diag H) * I`` (default 0.01); when the Cholesky
  factorization still fails, the damping is raised tenfold (up to :data:`DAMPING_RETRIES`
  times) and finally the layer is rounded to nearest (RTN) with a warning naming it;
* the upper Cholesky factor ``U`` of ``H^-1`` drives the recursion: for column ``j`` the error
  ``e_j = (w_j - q_j) / U_jj`` updates the later columns by ``-e_j U_j,>j``; columns are
  processed in lazy blocks of ``block_size`` (128): rank-1 updates inside a scale group, one
  matrix product for the rest of the block after each group and one for the rest of the matrix
  after each block (the column recursion is the only Python loop);
* act-order processes columns by decreasing ``diag(H)`` (stable sort), and the scale groups
  stay the format's contiguous blocks of the original column order;
* the scale group is the format's block along the input dimension (16 for NVFP4, 32 for MXFP4),
  with the block scales of :mod:`kbbq_pl.quant.scales` (min-max or the ``scale_search="mse"``
  search).  ``static`` group scales are computed once from the weight before the loop
  (FP-Quant, llm-compressor); ``dynamic`` ones from the error-updated columns of a group when
  its first column is reached (the original GPTQ).  NVFP4's per-tensor scale is fixed from the
  weight before the loop.

Rounding uses the format kernels' arithmetic (:mod:`kbbq_pl.formats.rounding`) with the scales
held fixed, so the returned :class:`~kbbq_pl.formats.QuantizedTensor` dequantizes bit for bit
to the weight GPTQ compensated against (``GPTQResult.values``).

Layers reading the same inputs (q/k/v) share ``H``; :func:`gptq_layers` runs them as one GPTQ
on their stacked rows (rows are independent given ``H``), each keeping its own NVFP4 scale.

Transforms (the paper's GPTQ-WUSH and GPTQ-KBBQ, Sec. 5): GPTQ on ``W T^-1`` with the
Hessian of the transformed inputs ``T H T^T`` (:func:`transform_hessian`) is exact for any
invertible ``T`` (``x_hat = T x``).  :func:`gptq_refit` is the variant of the WUSH paper, which
refits every block ``T_b`` on the error-updated weight block inside the loop.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ...formats import Format, QuantizedTensor
from ...formats.rounding import E2M1Scales, all_finite, round_e2m1_counted
from ...transforms.fit import DEFAULT_DAMPING, kbbq_basis, transform_weight
from ..rtn.algorithm import rtn
from ..scales import (
    ScaleSearch,
    assemble,
    check_fp4_format,
    group_scales,
    weight_global_scale,
)

log = logging.getLogger(__name__)

GroupScales = Literal["static", "dynamic"]

DEFAULT_BLOCK_SIZE = 128
"""Columns per lazy batch update."""
DAMPING_RETRIES = 4
"""Relative dampings tried before the RTN fallback: ``damping * 10^k``, ``k < DAMPING_RETRIES``."""

_F32 = torch.float32
_F64 = torch.float64


@dataclass
class GPTQResult:
    """What GPTQ returns for one layer.

    Attributes:
        weight: the quantized weight (codes, block scales, NVFP4 per-tensor scale).
        values: the float32 weight ``[out, D]`` GPTQ compensated against; equal bit for bit to
            ``weight.dequantize(torch.float32)``.
        perm: the order in which columns were rounded (act-order), None for the natural order.
        damping: the relative damping that made ``H`` factorizable; NaN after an RTN fallback.
        fallback: whether the layer was rounded to nearest because ``H`` could not be factored.
        transform: the fitted blocks ``[D / d, d, d]`` (float64) of :func:`gptq_refit`, else None.
    """

    weight: QuantizedTensor
    values: Tensor
    perm: Tensor | None
    damping: float
    fallback: bool
    transform: Tensor | None = None


# ---------------------------------------------------------------------------------- Hessians


HESSIAN_CHUNK = 1 << 22
"""Elements of the float64 sum scaled at once by :func:`hessian`."""


def hessian(sum_xxt: Tensor, tokens: float | Tensor) -> Tensor:
    """``H = (2 / n) sum x x^T`` in float32 from the float64 sum of outer products.

    Scaled a few rows at a time: a whole float64 temporary would double the sum's memory
    (6.6 GB for a 28,672-input ``down_proj``), the same bits either way."""
    n = float(tokens)
    if n <= 0:
        raise ValueError("no calibration tokens: cannot form the Hessian")
    h = torch.empty(sum_xxt.shape, dtype=_F32, device=sum_xxt.device)
    rows = max(1, HESSIAN_CHUNK // max(1, sum_xxt.shape[-1]))
    for start in range(0, sum_xxt.shape[0], rows):
        h[start:start + rows] = sum_xxt[start:start + rows].to(_F64) * (2.0 / n)
    return h


def transform_hessian(h: Tensor, transform: Tensor | None) -> Tensor:
    """``T H T^T`` (float32, computed in float64): the Hessian of the inputs ``x_hat = T x``
    for a dense ``[D, D]`` or block-diagonal ``[D / d, d, d]`` transform."""
    if transform is None:
        return h
    t = transform.to(_F64)
    hd = h.to(_F64)
    if t.dim() == 2:
        return (t @ hd @ t.T).to(_F32)
    blocks, d, _ = t.shape
    size = blocks * d
    if hd.shape != (size, size):
        raise ValueError(f"Hessian {tuple(h.shape)} does not match {blocks} blocks of {d}")
    left = (t @ hd.reshape(blocks, d, size)).reshape(size, blocks, d)        # T_b H_b,:
    both = torch.einsum("mcj,ckj->mck", left, t)                               # (.) T_c^T
    return both.reshape(size, size).to(_F32)


def sigma_blocks_from_hessian(h: Tensor, block: int) -> Tensor:
    """The diagonal ``d x d`` blocks of ``H / 2 = E[x x^T]`` (float64), ``[D / d, d, d]``: the
    calibration statistics the WUSH / KBBQ transforms are fitted from."""
    size = h.shape[0]
    blocks = size // block
    grid = h.to(_F64).reshape(blocks, block, blocks, block)
    index = torch.arange(blocks, device=h.device)
    return grid[index, :, index, :] / 2.0


TRIANGULAR_LEAF = 256
"""Size below which :func:`lower_triangular_inverse` solves against the identity."""


def lower_triangular_inverse(lower: Tensor) -> Tensor:
    """``L^-1`` of a lower-triangular ``L [n, n]``, by halves: with ``L = [[A, 0], [B, C]]``,
    ``L^-1 = [[A^-1, 0], [-C^-1 B A^-1, C^-1]]``.

    torch has no ``trtri``; ``solve_triangular(L, I)`` costs ``n^3`` multiply-adds against the
    ``n^3 / 3`` of the recursion, whose products are matrix products (2.6x faster at n = 2752
    on one CPU thread)."""
    n = lower.shape[0]
    if n <= TRIANGULAR_LEAF:
        eye = torch.eye(n, dtype=lower.dtype, device=lower.device)
        return torch.linalg.solve_triangular(lower, eye, upper=False)
    half = n // 2
    inverse = torch.zeros_like(lower)
    inverse[:half, :half] = lower_triangular_inverse(lower[:half, :half])
    inverse[half:, half:] = lower_triangular_inverse(lower[half:, half:])
    inverse[half:, :half] = -(inverse[half:, half:] @ (lower[half:, :half]
                                                        @ inverse[:half, :half]))
    return inverse


def inverse_hessian_factor(h: Tensor, damping: float = 0.01, name: str = "layer"
                           ) -> tuple[Tensor, float] | None:
    """Upper Cholesky factor ``U`` of ``(H + damping * mean(diag H) * I)^-1`` (``H^-1 = U^T U``)
    and the damping used, raising the damping tenfold while the factorization fails; None when
    it never succeeds (the caller falls back to RTN).

    One factorization, not three (Cholesky, ``cholesky_inverse``, Cholesky again): with ``J``
    the reversal of the indices and ``J H J = L L^T``, ``U = J L^-1 J`` (upper triangular with
    a positive diagonal, hence the Cholesky factor, which is unique)."""
    mean = float(torch.diagonal(h).mean())
    for attempt in range(DAMPING_RETRIES):
        level = damping * 10.0**attempt
        reversed_damped = h.flip(0, 1)                                  # J H J, a copy
        reversed_damped.diagonal().add_(level * mean)
        lower, info = torch.linalg.cholesky_ex(reversed_damped)
        del reversed_damped
        if int(info) == 0 and all_finite(lower):
            upper = lower_triangular_inverse(lower).flip(0, 1)
            del lower
            if all_finite(upper):
                if attempt:
                    warnings.warn(f"{name}: Hessian not positive definite with damping "
                                  f"{damping:g}; used {level:g}", RuntimeWarning, stacklevel=3)
                return upper, level
    return None


# ------------------------------------------------------------------- per-column group scales


def _column_scales(scales: E2M1Scales, index: int | None = None) -> E2M1Scales:
    """Scales ``[out, G, 1]`` (or ``[out, 1, 1]`` without ``index``) as 1-D ``[out]`` fields of
    one group, contiguous (a strided operand made each column's products several times
    slower on a CPU)."""
    def pick(t: Tensor) -> Tensor:
        return (t[:, index] if index is not None else t).reshape(-1).contiguous()

    return E2M1Scales(pick(scales.code), pick(scales.reciprocal), pick(scales.dequant),
                      scales.gain, scales.pts)


def _stack_scales(parts: list[E2M1Scales]) -> E2M1Scales:
    """1-D per-group scales ``[out]`` of every group, stacked to ``[out, G]``."""
    return E2M1Scales(torch.stack([p.code for p in parts], -1),
                      torch.stack([p.reciprocal for p in parts], -1),
                      torch.stack([p.dequant for p in parts], -1), parts[0].gain, parts[0].pts)


def _check_inputs(weight: Tensor, h: Tensor, fmt: Format, name: str) -> None:
    if weight.dim() != 2:
        raise ValueError(f"{name}: GPTQ needs a 2-D weight [out, in], got shape "
                         f"{tuple(weight.shape)}")
    size = weight.shape[1]
    if size % fmt.block_size:
        raise ValueError(f"{name}: in_features {size} of weight shape {tuple(weight.shape)} is not "
                         f"a multiple of the {fmt.name} block {fmt.block_size}; pad it first")
    if h.shape != (size, size):
        raise ValueError(f"{name}: Hessian shape {tuple(h.shape)} does not match weight shape "
                         f"{tuple(weight.shape)} (expected [{size}, {size}])")
    if not all_finite(weight):
        raise ValueError(f"{name}: the weight of shape {tuple(weight.shape)} holds NaN or Inf")


def _check_block_size(block_size: int, fmt: Format, name: str) -> None:
    d = fmt.block_size
    if block_size < d or block_size % d:
        raise ValueError(f"{name}: block_size {block_size} must be a positive multiple of the "
                         f"{fmt.name} group {d}")


def _prepare(weight: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """float32 ``W`` and ``H`` with dead columns (``H_jj = 0``) masked: ``H_jj = 1``,
    ``W_:j = 0`` (copies where a column is dead; the callers only read them)."""
    w, h = weight.detach().to(_F32), h.detach().to(_F32)
    dead = (torch.diagonal(h) == 0).nonzero().squeeze(1)
    if dead.numel():
        w, h = w.clone(), h.clone()
        h[dead, dead] = 1.0
        w[:, dead] = 0.0
    return w, h


def _warn_fallback(name: str, size: int) -> None:
    warnings.warn(f"{name}: the Hessian of shape ({size}, {size}) is not positive "
                  f"definite even with {10 ** (DAMPING_RETRIES - 1)}x the damping; "
                  "falling back to round-to-nearest for this layer", RuntimeWarning, stacklevel=4)
    log.warning("%s: GPTQ fell back to RTN (Cholesky failed)", name)


def _round_column(column: Tensor, scales: E2M1Scales, divide: bool, out: Tensor,
                  code: Tensor | None = None) -> None:
    """One column rounded with its fixed scales into ``out`` (:func:`round_to_scales`'s
    arithmetic, bit for bit), and its magnitudes' E2M1 codes into ``code`` (uint8): the
    checkpoint's codes are then these, not a second rounding of the same values."""
    y = column / scales.dequant if divide else column * scales.reciprocal
    torch.mul(torch.copysign(round_e2m1_counted(y.abs(), code), y), scales.dequant, out=out)
    if scales.gain is not None:
        out.div_(scales.gain)


def gptq_layers(
    weights: Sequence[Tensor],
    h: Tensor,
    fmt: str | Format,
    *,
    damping: float = 0.01,
    act_order: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale_search: ScaleSearch = "minmax",
    group_scales_mode: GroupScales = "static",
    names: Sequence[str] | None = None,
    global_scales: Sequence[Tensor | None] | None = None,
) -> list[GPTQResult]:
    """GPTQ of layers that read the same inputs (one Hessian ``h [D, D]``, e.g. q/k/v), run
    once on their rows stacked: GPTQ treats rows independently given ``H``, so this equals one
    run per layer with fewer column steps.  Each layer keeps its own NVFP4 per-tensor scale,
    or takes the given one of ``global_scales`` (e.g. one shared by the layers vLLM fuses,
    :func:`~kbbq_pl.quant.scales.fused_weight_scales`)."""
    names = list(names) if names is not None else [f"weight{i}" for i in range(len(weights))]
    label = "+".join(names)
    fmt = check_fp4_format(fmt, label)
    if not weights or len(names) != len(weights):
        raise ValueError(f"{label}: need one name per weight, got {len(names)} for "
                         f"{len(weights)} weights")
    if global_scales is not None and len(global_scales) != len(weights):
        raise ValueError(f"{label}: need one global scale per weight, got "
                         f"{len(global_scales)} for {len(weights)} weights")
    for weight, name in zip(weights, names):
        _check_inputs(weight, h, fmt, name)
    _check_block_size(block_size, fmt, label)
    if group_scales_mode not in ("static", "dynamic"):
        raise ValueError(f"group_scales must be 'static' or 'dynamic', got {group_scales_mode!r}")
    w, h = _prepare(torch.cat([weight.detach().to(_F32) for weight in weights]), h)
    rows = [weight.shape[0] for weight in weights]
    layer_scales = (list(global_scales) if global_scales is not None
                    else [weight_global_scale(part, fmt) for part in w.split(rows)])
    row_scale = None
    if fmt.global_scale:
        row_scale = torch.cat([gs.expand(n) for gs, n in zip(layer_scales, rows)]).reshape(-1, 1, 1)
    dtypes = [weight.dtype for weight in weights]

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        h = h.index_select(0, perm).index_select(1, perm)
    factor = inverse_hessian_factor(h, damping, label)
    del h
    if factor is None:
        results = []
        for part, gs, dtype, name in zip(w.split(rows), layer_scales, dtypes, names):
            _warn_fallback(name, w.shape[1])
            tensor, values = rtn(part, fmt, search=scale_search, global_scale=gs)
            tensor.orig_dtype = dtype
            results.append(GPTQResult(tensor, values, None, float("nan"), True))
        return results
    upper, used = factor
    rounded_from, values, codes, scales = _gptq_columns(w, upper, perm, fmt, row_scale,
                                                        block_size, scale_search,
                                                        group_scales_mode)
    results = []
    offset = 0
    for n, gs, dtype in zip(rows, layer_scales, dtypes):
        part = E2M1Scales(scales.code[offset:offset + n], scales.reciprocal[offset:offset + n],
                          scales.dequant[offset:offset + n], scales.gain, None)
        tensor = assemble(rounded_from[offset:offset + n], part, fmt, dtype, gs,
                          magnitude_codes=codes[offset:offset + n])
        results.append(GPTQResult(tensor, values[offset:offset + n].contiguous(), perm, used,
                                  False))
        offset += n
    return results


def gptq(
    weight: Tensor,
    h: Tensor,
    fmt: str | Format,
    *,
    damping: float = 0.01,
    act_order: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale_search: ScaleSearch = "minmax",
    group_scales_mode: GroupScales = "static",
    name: str = "weight",
) -> GPTQResult:
    """GPTQ of ``weight [out, D]`` against the Hessian ``h [D, D]`` onto ``fmt`` (see the
    module docstring).  ``D`` must be a multiple of the format's block (pad first) and
    ``block_size`` a multiple of it."""
    return gptq_layers([weight], h, fmt, damping=damping, act_order=act_order,
                       block_size=block_size, scale_search=scale_search,
                       group_scales_mode=group_scales_mode, names=[name])[0]


def _gptq_columns(w: Tensor, upper: Tensor, perm: Tensor | None, fmt: Format,
                  row_scale: Tensor | None, block_size: int, scale_search: ScaleSearch,
                  group_scales_mode: GroupScales) -> tuple[Tensor, Tensor, Tensor, E2M1Scales]:
    """The column recursion on ``w [out, D]`` (dead columns masked) with the factor ``U`` of the
    (permuted) inverse Hessian: returns the values that were rounded, the rounded values and
    their magnitudes' E2M1 codes (all ``[out, D]``, original column order) and the scales
    ``[out, D / d]``."""
    out_features, size = w.shape
    d = fmt.block_size
    assert d is not None
    groups = size // d
    wt = w.T.contiguous()                                          # [D, out], row j = column
    if perm is not None:  # rows gathered after the transpose: 3 to 6x faster than w.T[perm]
        wt = wt.index_select(0, perm)
    order = perm.tolist() if perm is not None else list(range(size))
    group_of = [column // d for column in order]
    position = [0] * size
    for pos, column in enumerate(order):
        position[column] = pos
    parts: list[E2M1Scales | None] = [None] * groups
    if group_scales_mode == "static":
        static = group_scales(w.reshape(out_features, groups, d), fmt, row_scale, scale_search)
        parts = [_column_scales(static, g) for g in range(groups)]

    values_t = torch.empty_like(wt)                     # rows in the original column order
    codes_t = torch.empty_like(wt, dtype=torch.uint8)
    diag = torch.diagonal(upper).tolist()
    divide = fmt.scale_kind == "fp32"
    # the loop's row views made once (unbind), not indexed anew per column: with a few
    # thousand rows per column the indexing was a fifth of the loop's time on a CPU
    columns, values, codes, upper_rows = (wt.unbind(0), values_t.unbind(0), codes_t.unbind(0),
                                          upper.unbind(0))
    if perm is not None:  # position j writes the rounded column order[j] in place
        values, codes = tuple(values[c] for c in order), tuple(codes[c] for c in order)
    # one buffer for every block's errors: a fresh one per block is a fresh mapping to
    # page-fault on (a few MB each)
    all_errors = torch.empty(min(block_size, size), out_features, dtype=_F32, device=w.device)
    for i1 in range(0, size, block_size):
        i2 = min(i1 + block_size, size)
        errors = all_errors[:i2 - i1]
        block_errors = errors.unbind(0)
        # two-level lazy batching: inside a group of d columns the updates are rank-1, the rest
        # of the block is updated once per group and the rest of the matrix once per block
        for s1 in range(i1, i2, d):
            s2 = s1 + d
            for j in range(s1, s2):
                g = group_of[j]
                scales = parts[g]
                if scales is None:  # dynamic: the group's first column is reached
                    current = _current_group(wt, upper, errors, [position[c] for c in range(
                        g * d, (g + 1) * d)], i1, s1, s2, i2, j)
                    scales = _column_scales(group_scales(current.T.unsqueeze(1), fmt,
                                                         row_scale, scale_search))
                    parts[g] = scales
                column, q, err = columns[j], values[j], block_errors[j - i1]
                _round_column(column, scales, divide, q, codes[j])
                torch.sub(column, q, out=err)
                err.div_(diag[j])
                if j + 1 < s2:
                    wt[j + 1:s2].addr_(upper_rows[j][j + 1:s2], err, alpha=-1.0)
            if s2 < i2:
                wt[s2:i2].addmm_(upper[s1:s2, s2:i2].T, errors[s1 - i1:s2 - i1], alpha=-1.0)
        if i2 < size:
            wt[i2:].addmm_(upper[i1:i2, i2:].T, errors, alpha=-1.0)

    if perm is not None:
        wt = wt.index_select(0, torch.argsort(perm))
    return wt.T, values_t.T, codes_t.T, _stack_scales(parts)  # type: ignore[arg-type]


def _current_group(wt: Tensor, upper: Tensor, errors: Tensor, positions: list[int], i1: int,
                   s1: int, s2: int, i2: int, j: int) -> Tensor:
    """The current (error-updated) columns at ``positions`` ``[d, out]`` when position ``j`` is
    reached: columns past the group still owe the group's pending updates
    ``-U[s1:j, c]^T E[s1:j]``, columns past the lazy block the block's ``-U[i1:j, c]^T E[i1:j]``."""
    cols = torch.tensor(positions, device=wt.device)
    current = wt[cols].clone()
    for owed, start in (((cols >= s2) & (cols < i2), s1), (cols >= i2, i1)):
        if j > start and bool(owed.any()):
            current[owed] -= upper[start:j][:, cols[owed]].T @ errors[start - i1:j - i1]
    return current


def gptq_refit(
    weight: Tensor,
    h: Tensor,
    fmt: str | Format,
    *,
    lam: float = 1.0,
    transform_damping: float = DEFAULT_DAMPING,
    damping: float = 0.01,
    block_size: int = DEFAULT_BLOCK_SIZE,
    scale_search: ScaleSearch = "minmax",
    name: str = "weight",
) -> GPTQResult:
    """The WUSH paper's GPTQ: per scale group ``b`` in order, refit ``T_b`` (KBBQ(lam), WUSH at
    ``lam = 1``) from the error-updated weight block ``W_b`` and the calibration block
    ``Sigma_b = (H / 2)_bb``, fix the group's scales from the whole ``W_b T_b^-1``, then round
    its columns one at a time with GPTQ's updates, in the coordinates ``x_hat_b = T_b x_b``.

    Exact bookkeeping: in those coordinates the rows of the inverse-Hessian factor that belong
    to the group are ``[U_bb T_b^-1 | U_b,>b]``; with ``U_bb T_b^-1 = Q R`` (QR, ``R`` upper)
    they are ``Q [R | Q^T U_b,>b]``, so the group's recursion runs on ``R`` and its scaled
    errors ``E`` reach the later columns as ``E Q^T`` through the original ``U``.

    ``weight`` and ``h`` are in the original coordinates (``D`` a multiple of the block), and
    ``damping`` is added to ``h``'s diagonal there (GPTQ on a fixed ``T`` damps ``T H T^T``:
    a different regularizer for a ``T`` that is not orthogonal; the two agree as it goes to 0).
    Returns the quantized ``W T^-1`` and the fitted ``transform`` blocks.  NVFP4's per-tensor
    scale is fixed before the loop from ``W T_0^-1`` with ``T_0`` fitted on the original weight.
    """
    fmt = check_fp4_format(fmt, name)
    _check_inputs(weight, h, fmt, name)
    _check_block_size(block_size, fmt, name)
    d = fmt.block_size
    assert d is not None
    w, h = _prepare(weight, h)
    out_features, size = w.shape
    groups = size // d
    sigma = sigma_blocks_from_hessian(h, d)
    initial = kbbq_basis(w, sigma, transform_damping, name=name).transform(lam)
    global_scale = weight_global_scale(transform_weight(w, initial), fmt)
    factor = inverse_hessian_factor(h, damping, name)
    if factor is None:
        _warn_fallback(name, size)
        tensor, values = rtn(transform_weight(w, initial), fmt, search=scale_search,
                             global_scale=global_scale)
        tensor.orig_dtype = weight.dtype
        return GPTQResult(tensor, values, None, float("nan"), True, initial)
    upper, used = factor

    divide = fmt.scale_kind == "fp32"
    wt = w.T.contiguous()                                           # [D, out]
    rounded_t = torch.empty_like(wt)
    values_t = torch.empty_like(wt)
    codes_t = torch.empty_like(wt, dtype=torch.uint8)
    fitted = torch.empty(groups, d, d, dtype=_F64, device=w.device)
    parts: list[E2M1Scales] = []
    # as in _gptq_columns: row views made once, buffers reused across blocks and groups
    values, codes = values_t.unbind(0), codes_t.unbind(0)
    all_errors = torch.empty(min(block_size, size), out_features, dtype=_F32, device=w.device)
    scaled = torch.empty(d, out_features, dtype=_F32, device=w.device)
    scaled_rows = scaled.unbind(0)
    for i1 in range(0, size, block_size):
        i2 = min(i1 + block_size, size)
        errors = all_errors[:i2 - i1]
        for c0 in range(i1, i2, d):
            c1 = c0 + d
            g = c0 // d
            t = kbbq_basis(wt[c0:c1].T, sigma[g:g + 1], transform_damping, name=name).transform(lam)
            fitted[g] = t[0]
            hat_t = rounded_t[c0:c1]
            hat_t.copy_(transform_weight(wt[c0:c1].T, t).T)          # (W_b T_b^-1)^T
            scales = _column_scales(group_scales(hat_t.T, fmt, global_scale, scale_search))
            parts.append(scales)
            mixed = torch.linalg.solve(t[0].T, upper[c0:c1, c0:c1].to(_F64).T).T  # U_bb T^-1
            rotation, r = torch.linalg.qr(mixed)
            signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(_F64)
            r, rotation = (signs[:, None] * r).to(_F32), (rotation * signs).to(_F32)
            work = hat_t.clone()
            diag = torch.diagonal(r).tolist()
            work_rows, hat_rows, r_rows = work.unbind(0), hat_t.unbind(0), r.unbind(0)
            for j in range(d):
                column, q, err = work_rows[j], values[c0 + j], scaled_rows[j]
                hat_rows[j].copy_(column)                           # what is rounded
                _round_column(column, scales, divide, q, codes[c0 + j])
                torch.sub(column, q, out=err)
                err.div_(diag[j])
                if j + 1 < d:
                    work[j + 1:].addr_(r_rows[j][j + 1:], err, alpha=-1.0)
            rotated = rotation @ scaled                             # (E Q^T)^T
            errors[c0 - i1:c1 - i1] = rotated
            if c1 < i2:
                wt[c1:i2].addmm_(upper[c0:c1, c1:i2].T, rotated, alpha=-1.0)
        if i2 < size:
            wt[i2:].addmm_(upper[i1:i2, i2:].T, errors, alpha=-1.0)
    tensor = assemble(rounded_t.T, _stack_scales(parts), fmt, weight.dtype, global_scale,
                      magnitude_codes=codes_t.T)
    return GPTQResult(tensor, values_t.T.contiguous(), None, used, False, fitted)
