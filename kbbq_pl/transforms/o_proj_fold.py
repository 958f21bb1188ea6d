"""Folding ``o_proj``'s input transform into ``v_proj``'s output rows.

The input of an attention block's output projection is, for query head ``h``, ``A_h V_g``: the
attention probabilities ``A_h`` (they mix tokens) times the value head ``g = g(h)`` that ``h``
reads, ``V_g = x Wv_g^T + bv_g`` (grouped-query attention: ``n_heads / n_kv_heads`` query heads
per value head, consecutive).  A block transform acting on the features of head ``h``
commutes with ``A_h`` (whose rows sum to one, so the bias passes too)::

    (A_h V_g) T^T = A_h (V_g T^T) = A_h (x (T Wv_g)^T + T bv_g)

so ``o_proj``'s online transform can be folded offline into ``v_proj``'s rows, exactly in full
precision, when (1) the transform's blocks lie inside heads (``d`` divides ``head_dim``) and
(2) every query head reading value head ``g`` uses the same blocks.  (2) holds for MHA and
for data-free transforms; for fitted ones (WUSH, KBBQ) :func:`pooled_group_statistics` fits
one transform per value head from the statistics of the query heads that share it.  No other
per-block transform folds: the inputs of ``q/k/v_proj`` and ``gate/up_proj`` come from a norm
(a diagonal scale) and ``down_proj``'s from an elementwise product.

:func:`fold_o_proj` is one fold: ``o_proj``'s transform fitted shared per value head, folded
into ``v_proj``'s rows, and ``v_proj``'s own transform refitted on its new weight.  Walking a
model for its ``o_proj`` / ``v_proj`` pairs and their statistics is the quantizer's part
(:func:`kbbq_pl.quant.rtn.quantizer.fold_o_proj_transforms`): transforms sit below
:mod:`kbbq_pl.quant` and read no modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..formats import Format
from ..formats.padding import pad_features

FitFn = Callable[[Tensor, Tensor], "Tensor | None"]
"""``fit(weight, sigma_blocks)``: the transform of a weight from its input statistics (None for
the identity)."""


def check_heads(blocks: int, d: int, head_dim: int, n_heads: int) -> None:
    """Raise a ValueError unless ``blocks`` blocks of ``d`` lie inside ``n_heads`` heads of
    ``head_dim`` and cover them."""
    if head_dim % d:
        raise ValueError(f"the transform's blocks of {d} span heads of head_dim {head_dim}: "
                         "attention mixes tokens per head, so they do not fold into v_proj")
    if blocks * d != n_heads * head_dim:
        raise ValueError(f"{blocks} blocks of {d} do not cover {n_heads} heads of {head_dim}")


def _heads(transform: Tensor, head_dim: int, n_heads: int) -> Tensor:
    """Blocks ``[n_heads * head_dim / d, d, d]`` as ``[n_heads, head_dim / d, d, d]``."""
    if transform.dim() != 3:
        raise ValueError(f"only block transforms fold into v_proj, got a {transform.dim()}-d "
                         f"transform of shape {tuple(transform.shape)}")
    d = transform.shape[-1]
    check_heads(transform.shape[0], d, head_dim, n_heads)
    return transform.reshape(n_heads, head_dim // d, d, d)


def value_head_blocks(transform: Tensor, head_dim: int, n_heads: int, n_kv_heads: int) -> Tensor:
    """The blocks of each value head ``[n_kv_heads, head_dim / d, d, d]``; raises a ValueError
    naming two query heads of one group whose blocks differ (the fold would not be exact)."""
    per_head = _heads(transform, head_dim, n_heads)
    group = n_heads // n_kv_heads
    grouped = per_head.reshape(n_kv_heads, group, *per_head.shape[1:])
    for g in range(n_kv_heads):
        for member in range(1, group):
            if not torch.equal(grouped[g, member], grouped[g, 0]):
                raise ValueError(
                    f"query heads {g * group} and {g * group + member} read value head {g} "
                    "but have different transforms: fit them shared (fold_o_proj) to fold")
    return grouped[:, 0]


def fold_into_values(v_weight: Tensor, v_bias: Tensor | None, transform: Tensor, head_dim: int,
                     n_heads: int, n_kv_heads: int) -> tuple[Tensor, Tensor | None]:
    """``v_proj``'s weight ``[n_kv_heads * head_dim, in]`` and bias with ``o_proj``'s input
    transform folded into their rows (float64 arithmetic, returned in their dtype)."""
    blocks = value_head_blocks(transform, head_dim, n_heads, n_kv_heads).to(torch.float64)
    d = blocks.shape[-1]
    rows = v_weight.to(torch.float64).reshape(n_kv_heads, head_dim // d, d, -1)
    weight = (blocks @ rows).reshape(v_weight.shape).to(v_weight.dtype)
    bias = None
    if v_bias is not None:
        b = v_bias.to(torch.float64).reshape(n_kv_heads, head_dim // d, d, 1)
        bias = (blocks @ b).reshape(v_bias.shape).to(v_bias.dtype)
    return weight, bias


def pooled_group_statistics(o_weight: Tensor, sigma_blocks: Tensor, head_dim: int,
                            n_heads: int, n_kv_heads: int) -> tuple[Tensor, Tensor]:
    """``o_proj``'s weight and input statistics pooled over the query heads of each group, so
    that one transform per value head is fitted from them: the weight columns of the heads of
    a group stacked as rows (``G_W`` becomes their mean), ``Sigma``'s blocks averaged.
    Returns ``(weight [out * group, n_kv_heads * head_dim], sigma [.., d, d])``."""
    group = n_heads // n_kv_heads
    out_features = o_weight.shape[0]
    w = o_weight.reshape(out_features, n_kv_heads, group, head_dim)
    stacked = w.permute(2, 0, 1, 3).reshape(group * out_features, n_kv_heads * head_dim)
    d = sigma_blocks.shape[-1]
    per_head = sigma_blocks.reshape(n_kv_heads, group, head_dim // d, d, d)
    return stacked, per_head.mean(1).reshape(-1, d, d)


def expand_to_query_heads(blocks: Tensor, n_heads: int, n_kv_heads: int) -> Tensor:
    """One transform per value head ``[n_kv_heads * head_dim / d, d, d]`` repeated for the
    query heads that read it: ``[n_heads * head_dim / d, d, d]``."""
    per_group = blocks.reshape(n_kv_heads, -1, *blocks.shape[-2:])
    return per_group.repeat_interleave(n_heads // n_kv_heads, 0).reshape(-1, *blocks.shape[-2:])


def attention_heads(config: Any) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)`` of a HuggingFace config (its text model's, in a
    multimodal config)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return n_heads, n_kv, head_dim


@dataclass
class FoldedPair:
    """One ``o_proj`` transform folded into its ``v_proj``: the transforms both layers get and
    the ``v_proj``'s new full-precision weight and bias."""

    o_transform: Tensor
    v_transform: Tensor | None
    v_weight: Tensor
    v_bias: Tensor | None


def fold_o_proj(o_weight: Tensor, o_sigma: Tensor, v_weight: Tensor, v_bias: Tensor | None,
                v_sigma: Tensor, heads: tuple[int, int, int], fit: FitFn, fmt: Format
                ) -> FoldedPair | None:
    """Fit ``o_proj``'s transform shared per value head (``fit`` on the statistics pooled by
    :func:`pooled_group_statistics`), fold it into ``v_proj``'s rows and refit ``v_proj``'s
    transform on its new weight (zero-padded to whole ``fmt`` blocks) and input statistics
    ``v_sigma``; None when ``fit`` gives the identity (nothing to fold).  ``heads`` is
    ``(n_heads, n_kv_heads, head_dim)`` (:func:`attention_heads`)."""
    n_heads, n_kv, head_dim = heads
    check_heads(o_sigma.shape[0], o_sigma.shape[-1], head_dim, n_heads)
    stacked, sigma = pooled_group_statistics(o_weight, o_sigma, head_dim, n_heads, n_kv)
    shared = fit(stacked, sigma)
    if shared is None:
        return None
    o_transform = expand_to_query_heads(shared, n_heads, n_kv)
    weight, bias = fold_into_values(v_weight, v_bias, o_transform, head_dim, n_heads, n_kv)
    v_transform = fit(pad_features(weight, fmt), v_sigma)
    return FoldedPair(o_transform, v_transform, weight, bias)
