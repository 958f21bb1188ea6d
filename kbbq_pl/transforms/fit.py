"""Function-preserving transforms of a linear layer: identity, Haar, block Hadamard, WUSH, KBBQ.

A transform ``T`` re-embeds the inputs as ``x_hat = T x`` and the weights as ``W_hat = W T^-1``
so that ``W_hat x_hat = W x`` (paper Sec. "Transforms: invariance, blindness, and the ceiling").
It is stored as

* ``None``: the identity (I);
* a dense ``[D, D]`` matrix: the data-free Haar rotation (HAAR);
* a batch of diagonal blocks ``[D / d, d, d]``, the block matched to the quantization group
  (16 for NVFP4, 32 for MXFP4): block Hadamard (MR-GPTQ's micro-rotation), WUSH and KBBQ(lambda).

KBBQ (paper Eq. kbbq), per block ``b`` of the input dimension, fitted from the weight block
``W_b`` and the diagonal block ``Sigma_b`` of the calibration second moment:

    G_W = W_b^T W_b / d_out,  G_X = Sigma_b,  both damped by 0.01 * mean(diag) * I  (float64)
    W' = cholesky(G_W)  (W' W'^T = G_W)
    W'^T G_X W' = U Lambda U^T   (Lambda = S^2, S the paired spectrum of Eq. wushmain)
    T_b(lambda) = H Lambda^(-lambda / 4) U^T W'^T

lambda = 1 is WUSH (Eq. wushopt: full flattening, the paired ceiling); lambda = 0 whitens the
weight side and keeps the spectrum.  Every block is fitted at once (batched ``cholesky`` and
``eigh``; no loop over blocks); the eigendecomposition does not depend on lambda, so a grid of
lambdas shares it (:func:`kbbq_basis`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..law.noise_law import haar_rotation

TRANSFORMS = ("identity", "haar", "hadamard", "wush", "kbbq")
FITTED_TRANSFORMS = ("wush", "kbbq")
"""The transforms fitted from calibration statistics (the others are data-free)."""
HADAMARD_TRANSFORMS = ("hadamard", "wush", "kbbq")
"""The transforms whose blocks hold a Sylvester Hadamard factor (a power-of-two block)."""
DEFAULT_DAMPING = 0.01
_F64 = torch.float64


def hadamard(size: int, dtype: torch.dtype = _F64) -> Tensor:
    """The normalized Sylvester Hadamard matrix of a power-of-two ``size`` (``H H^T = I``)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {size}")
    h = torch.ones(1, 1, dtype=_F64)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(size)).to(dtype)


def damp(gram: Tensor, damping: float = DEFAULT_DAMPING) -> Tensor:
    """``G + damping * mean(diag G) * I`` on a batch of ``[..., d, d]`` matrices."""
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    level = torch.diagonal(gram, dim1=-2, dim2=-1).mean(-1)
    return gram + damping * level[..., None, None] * eye


def _work_dtype(tensor: Tensor) -> torch.dtype:
    """float64 stays float64; anything else is multiplied in float32 (the fit damps its
    matrices by 1%, far above float32 round-off, and the products are the costly part)."""
    return _F64 if tensor.dtype == _F64 else torch.float32


def weight_block_grams(weight: Tensor, block: int, name: str = "") -> Tensor:
    """``G_W = W_b^T W_b / d_out`` for every input block: ``[D / d, d, d]`` (float64).
    ``name`` (the layer) only labels errors."""
    out_features, in_features = weight.shape
    if in_features % block:
        raise ValueError(f"{name or 'layer'}: in_features {in_features} is not a multiple of "
                         f"the block size {block}")
    w = weight.to(_work_dtype(weight)).reshape(out_features, in_features // block, block)
    w = w.permute(1, 2, 0).contiguous()  # [blocks, d, out]
    return (torch.bmm(w, w.transpose(-1, -2)) / out_features).to(_F64)


@dataclass
class KBBQBasis:
    """The lambda-independent part of KBBQ for every block of a layer.

    ``transform(lam) = H diag(eigenvalues^(-lam / 4)) U^T W'^T`` per block; ``degenerate``
    marks blocks with no energy in the weights or the inputs, which keep the identity.
    """

    root_t: Tensor        # U^T W'^T, [blocks, d, d]
    eigenvalues: Tensor   # Lambda = S^2, [blocks, d]
    degenerate: Tensor    # [blocks] bool

    @property
    def paired_spectrum(self) -> Tensor:
        """The paired singular values ``S`` of Eq. wushsvd, per block."""
        return self.eigenvalues.clamp(min=0).sqrt()

    def transform(self, lam: float) -> Tensor:
        """KBBQ(lambda) blocks ``[blocks, d, d]`` (float64), Eq. kbbq."""
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"the brake lambda lies in [0, 1], got {lam}")
        d = self.root_t.shape[-1]
        power = self.eigenvalues.clamp(min=torch.finfo(_F64).tiny) ** (-lam / 4.0)
        blocks = hadamard(d).to(self.root_t.device) @ (power[..., None] * self.root_t)
        eye = torch.eye(d, dtype=_F64, device=blocks.device).expand_as(blocks)
        return torch.where(self.degenerate[:, None, None], eye, blocks)


def kbbq_basis(weight: Tensor, sigma_blocks: Tensor, damping: float = DEFAULT_DAMPING,
               name: str = "") -> KBBQBasis:
    """Fit the shared part of WUSH/KBBQ from ``weight [out, D]`` and the diagonal blocks
    ``sigma_blocks [D / d, d, d]`` of the input second moment (float64, damped, batched).
    ``name`` (the layer) only labels errors."""
    block = sigma_blocks.shape[-1]
    g_w = weight_block_grams(weight, block, name)
    g_x = sigma_blocks.to(_F64)
    if g_w.shape != g_x.shape:
        raise ValueError(f"{name or 'layer'}: weight blocks {tuple(g_w.shape)} do not match "
                         f"input statistics {tuple(g_x.shape)}")
    bad_w, bad_x = int((~torch.isfinite(g_w)).sum()), int((~torch.isfinite(g_x)).sum())
    if bad_w or bad_x:
        raise ValueError(
            f"{name or 'layer'}: cannot fit the transform: {bad_w} non-finite entries in the "
            f"weight block Grams and {bad_x} in the input second moments (shape "
            f"{tuple(g_x.shape)}, {g_x.device}); the weight or the inputs overflow or hold "
            "NaN/Inf")
    degenerate = (torch.diagonal(g_w, dim1=-2, dim2=-1).sum(-1) <= 0) | (
        torch.diagonal(g_x, dim1=-2, dim2=-1).sum(-1) <= 0)
    eye = torch.eye(block, dtype=_F64, device=g_w.device)
    g_w = torch.where(degenerate[:, None, None], eye, damp(g_w, damping))
    g_x = torch.where(degenerate[:, None, None], eye, damp(g_x, damping))
    root, info = torch.linalg.cholesky_ex(g_w)
    if bool((info > 0).any()):
        singular = (info > 0).nonzero().flatten().tolist()
        raise ValueError(
            f"{name or 'layer'}: cannot fit the transform: the weight Gram of {len(singular)} "
            f"of {len(info)} blocks (first: block {singular[0]}, input features "
            f"{singular[0] * block}..{singular[0] * block + block - 1}) is singular with damping "
            f"{damping} (rank-deficient: a zero or zero-padded weight column, or fewer than "
            f"{block} output rows); use a damping > 0 (default "
            f"{DEFAULT_DAMPING})")
    paired = root.transpose(-1, -2) @ g_x @ root
    eigenvalues, vectors = torch.linalg.eigh(paired)
    return KBBQBasis(vectors.transpose(-1, -2) @ root.transpose(-1, -2), eigenvalues, degenerate)


def fit_transform(
    kind: str,
    weight: Tensor,
    sigma_blocks: Tensor | None = None,
    *,
    block: int,
    lam: float = 1.0,
    seed: int = 0,
    damping: float = DEFAULT_DAMPING,
    name: str = "",
) -> Tensor | None:
    """The transform ``kind`` for one layer (``weight [out, D]``), in float64.

    ``identity`` -> None; ``haar`` -> a dense seeded Haar rotation ``[D, D]``; ``hadamard`` ->
    block Hadamard ``[D / d, d, d]``; ``wush`` and ``kbbq`` (with ``lam``) -> fitted blocks,
    which need ``sigma_blocks``.  ``name`` (the layer) labels errors.
    """
    in_features = weight.shape[1]
    if kind == "identity":
        return None
    if kind == "haar":
        generator = torch.Generator().manual_seed(seed)
        return haar_rotation(in_features, generator)
    if in_features % block:
        raise ValueError(f"{name or 'layer'}: in_features {in_features} is not a multiple of "
                         f"the block size {block}")
    if kind == "hadamard":
        return hadamard(block).expand(in_features // block, block, block).clone()
    if kind in FITTED_TRANSFORMS:
        if sigma_blocks is None:
            raise ValueError(f"the {kind} transform is fitted from calibration statistics")
        basis = kbbq_basis(weight, sigma_blocks, damping, name=name)
        return basis.transform(1.0 if kind == "wush" else lam)
    raise ValueError(f"unknown transform {kind!r}; choose from {TRANSFORMS}")


def transform_inputs(x: Tensor, transform: Tensor | None) -> Tensor:
    """``x_hat = T x`` for inputs ``x [..., D]`` (blockwise for block transforms)."""
    if transform is None:
        return x
    t = transform.to(x.dtype)
    if t.dim() == 2:
        return x @ t.T
    blocks, d, _ = t.shape
    grouped = x.reshape(-1, blocks, d).transpose(0, 1)  # [blocks, tokens, d]
    out = torch.bmm(grouped, t.transpose(-1, -2))
    return out.transpose(0, 1).reshape(x.shape)


def transform_weight(weight: Tensor, transform: Tensor | None) -> Tensor:
    """``W_hat = W T^-1`` for ``weight [out, D]`` (float64 for float64 weights, else float32).

    A dense ``T`` is applied by a solve.  For blocks, each ``d x d`` inverse comes from an LU
    solve against the identity and one batched product applies it to every row: the same
    arithmetic as a solve per row up to float64 round-off (~1e-12 relative), and an order of
    magnitude faster than torch's batched solve with thousands of right-hand sides on CPU.
    """
    if transform is None:
        return weight
    t = transform.to(_F64)
    if t.dim() == 2:
        return torch.linalg.solve(t, weight.to(_F64), left=False).to(weight.dtype)
    blocks, d, _ = t.shape
    eye = torch.eye(d, dtype=_F64, device=t.device).expand_as(t)
    work = _work_dtype(weight)
    inverse = torch.linalg.solve(t, eye).to(work)
    grouped = weight.to(work).reshape(weight.shape[0], blocks, d).transpose(0, 1).contiguous()
    out = torch.bmm(grouped, inverse)  # [blocks, out, d]
    return out.transpose(0, 1).reshape(weight.shape).to(weight.dtype)
