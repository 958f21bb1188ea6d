"""What to quantize and how: :class:`QuantizationConfig` (the fields of a recipe), and the
cross-rank operations the pipeline runs with (:class:`Collectives`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from torch import Tensor

from ..formats import Format, get_format
from ..transforms.autobrake import DEFAULT_GRID
from ..transforms.fit import TRANSFORMS

__all__ = ["Batches", "BroadcastFn", "Collectives", "QuantizationConfig", "ReduceFn",
           "lightning_collectives", "torch_distributed_collectives"]

Batches = Iterable[Mapping[str, Tensor]]
ReduceFn = Callable[[Tensor], Tensor]
BroadcastFn = Callable[[Any, int], Any]
"""``broadcast(obj, src)``: every rank returns rank ``src``'s ``obj`` (identity on one process)."""


def _identity(t: Tensor) -> Tensor:
    return t


def _same(obj: Any, src: int) -> Any:
    return obj


@dataclass(frozen=True)
class Collectives:
    """The data-parallel operations of the pipeline (identities on one process):
    ``reduce_sum`` / ``reduce_max`` all-reduce one tensor, ``broadcast(obj, src)`` gives every
    rank rank ``src``'s object; ``rank`` of ``world_size``.  Each rank calibrates on its own
    batches; the statistics are summed, and GPTQ splits its layers across the ranks."""

    reduce_sum: ReduceFn = _identity
    reduce_max: ReduceFn = _identity
    broadcast: BroadcastFn | None = None  # None: the identity (enough for RTN)
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.broadcast is None:
            object.__setattr__(self, "broadcast", _same)


def torch_distributed_collectives(group: Any = None) -> dict[str, Any]:
    """``reduce_sum``, ``reduce_max``, ``broadcast``, ``rank`` and ``world_size`` over an
    initialized ``torch.distributed`` process group, as keyword arguments of
    :func:`kbbq_pl.quant.pipeline.quantize_model`."""
    import torch.distributed as dist

    def reduce(op: Any):
        def run(t: Tensor) -> Tensor:
            out = t.detach().clone().contiguous()
            dist.all_reduce(out, op=op, group=group)
            return out
        return run

    def broadcast(obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    return {"reduce_sum": reduce(dist.ReduceOp.SUM), "reduce_max": reduce(dist.ReduceOp.MAX),
            "broadcast": broadcast, "rank": dist.get_rank(group),
            "world_size": dist.get_world_size(group)}


def lightning_collectives(strategy: Any) -> dict[str, Any]:
    """The same keyword arguments from a Lightning strategy (``trainer.strategy``)."""
    return {"reduce_sum": lambda t: strategy.reduce(t, reduce_op="sum"),
            "reduce_max": lambda t: strategy.reduce(t, reduce_op="max"),
            "broadcast": lambda obj, src: strategy.broadcast(obj, src=src),
            "rank": strategy.global_rank, "world_size": strategy.world_size}


@dataclass
class QuantizationConfig:
    """What to quantize and how (the fields of a recipe).

    Attributes:
        format: FP4 format of weights and activations (``nvfp4``, ``mxfp4``, ...).
        transform: ``identity``, ``haar``, ``hadamard``, ``wush`` or ``kbbq``.
        lam: the KBBQ brake lambda in [0, 1] (Eq. kbbq), or ``auto``: chosen per layer on
            held-out calibration tokens (the auto-brake).
        targets: module-name regular expressions of the layers to quantize (default: every
            linear layer but the LM head, embeddings and BERT's pooler; see
            :mod:`kbbq_pl.quant.modules`).
        ignore: module-name regular expressions of layers to leave in full precision.
        act_scale: NVFP4 activation per-tensor scale, ``static`` (calibrated) or ``dynamic``.
        damping: relative damping of the transform fit's Gram matrices.
        seed: seed of the Haar rotation.
        unaligned: a layer whose ``in_features`` is not a multiple of the block: ``pad`` it with
            zero columns (and its inputs with zeros) or ``skip`` it (left in full precision).
        keep_samples: calibration tokens kept per layer for the report's output SNR.
        auto_grid: the auto-brake's candidate lambdas (``lam="auto"``,
            :mod:`kbbq_pl.transforms.autobrake`).
        auto_holdout: the auto-brake's fraction of calibration sequences held out for selection.
        auto_tokens: the held-out tokens per layer the auto-brake scores on.
        auto_refit: whether the auto-brake's chosen lambda is refitted on all tokens (``True``)
            or the transform fitted on the fitting part is kept.
        auto_select_on: where the auto-brake scores: ``holdout`` (the method) or ``fit`` (the
            fitting tokens, only to measure what the split buys).
        weight_quantizer: the strategy that turns a block's linears into FP4 weights: ``rtn``
            (round to nearest, :class:`~kbbq_pl.quant.rtn.RTN`) or ``gptq`` (the GPTQ family,
            :class:`~kbbq_pl.quant.gptq_quantizer.GPTQ`).
        propagate: where the next block's calibration inputs come from: the full-precision
            block (``fp``: every layer is calibrated on the full-precision model's activations)
            or the quantized one (``quantized``: later blocks see the error of earlier ones, as
            in GPTQ's reference loop).  None: the weight quantizer's own default (RTN ``fp``,
            GPTQ ``quantized``).
        gptq_damping: GPTQ's relative Hessian damping (``H + gptq_damping * mean(diag H) I``).
        act_order: GPTQ rounds columns by decreasing ``diag(H)``; None (default): yes, except
            for the in-loop refit, which rounds whole blocks in their order.
        gptq_block_size: GPTQ's lazy-batch width (a multiple of the format's block).
        scale_search: ``minmax`` block scales from each group's amax, or ``mse`` (the best of
            100 shrunk amaxes by ``sum |e|^2.4``, FP-Quant's observer); RTN and GPTQ.
        group_scales: GPTQ block scales computed once from the (transformed) weight before the
            loop (``static``) or from the error-updated group when GPTQ reaches it (``dynamic``).
        transform_refit: for ``wush`` / ``kbbq`` with GPTQ (ignored otherwise): ``in_loop``
            (default) refits every block ``T_b`` on the error-updated weight inside the loop
            (the WUSH paper's variant); ``fixed`` fits ``T`` once from the calibration
            statistics and runs GPTQ on ``W T^-1`` with the Hessian ``T H T^T``.  Why
            ``in_loop`` is the default: :mod:`kbbq_pl.quant.gptq_quantizer`.
        fold_o_proj: fit each attention ``o_proj``'s block transform shared by the query heads
            that read one value head (pooled statistics) and fold it into ``v_proj``'s rows
            before ``v_proj`` is quantized (:mod:`kbbq_pl.transforms.fold`; exact in full
            precision), so ``o_proj`` needs no online transform (e.g. for a compressed-tensors
            export).
            Llama-style ``v_proj`` / ``o_proj`` names; RTN, fixed lambda, post-training.
    """

    format: str = "nvfp4"
    transform: str = "kbbq"
    lam: float | Literal["auto"] = 0.75
    targets: list[str] | None = None
    ignore: list[str] | None = None
    act_scale: Literal["static", "dynamic"] = "static"
    damping: float = 0.01
    seed: int = 0
    unaligned: Literal["pad", "skip"] = "pad"
    keep_samples: int = 512
    auto_grid: tuple[float, ...] = DEFAULT_GRID
    auto_holdout: float = 0.5
    auto_tokens: int = 512
    auto_refit: bool = True
    auto_select_on: Literal["holdout", "fit"] = "holdout"
    weight_quantizer: Literal["rtn", "gptq"] = "rtn"
    propagate: Literal["fp", "quantized"] | None = None
    gptq_damping: float = 0.01
    act_order: bool | None = None
    gptq_block_size: int = 128
    scale_search: Literal["minmax", "mse"] = "minmax"
    group_scales: Literal["static", "dynamic"] = "static"
    transform_refit: Literal["fixed", "in_loop"] = "in_loop"
    fold_o_proj: bool = False

    def __post_init__(self) -> None:
        fmt = get_format(self.format)
        if fmt.granularity != "block" or fmt.element != "e2m1":
            raise ValueError(f"W4A4 needs a block FP4 format, got {self.format!r}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {self.transform!r}")
        if self.lam == "auto":
            if self.transform != "kbbq":
                raise ValueError(
                    f"lam='auto' chooses KBBQ's brake; transform is {self.transform!r}")
            if not self.auto_grid or not all(0.0 <= float(v) <= 1.0 for v in self.auto_grid):
                raise ValueError(f"auto_grid holds lambdas in [0, 1], got {self.auto_grid}")
            if self.auto_select_on not in ("holdout", "fit"):
                raise ValueError(f"auto_select_on must be 'holdout' or 'fit', "
                                 f"got {self.auto_select_on!r}")
        elif not (isinstance(self.lam, (int, float)) and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"the brake lam lies in [0, 1] or is 'auto', got {self.lam!r}")
        if self.act_scale not in ("static", "dynamic"):
            raise ValueError(f"act_scale must be 'static' or 'dynamic', got {self.act_scale!r}")
        if self.unaligned not in ("pad", "skip"):
            raise ValueError(f"unaligned must be 'pad' or 'skip', got {self.unaligned!r}")
        self._check_weight_quantizer(fmt)
        if self.fold_o_proj and (self.transform == "haar" or self.auto
                                 or self.weight_quantizer != "rtn"):
            raise ValueError("fold_o_proj folds block transforms fitted by RTN with a fixed "
                             f"lambda; got transform {self.transform!r}, lam {self.lam!r}, "
                             f"weight_quantizer {self.weight_quantizer!r}")

    @classmethod
    def field_descriptions(cls) -> dict[str, str]:
        """Each field's description, from the ``Attributes`` above (the one place a field is
        described; the ``KBBQ`` callback's and the CLI's help show these)."""
        from docstring_parser import parse

        return {param.arg_name: " ".join((param.description or "").split())
                for param in parse(cls.__doc__ or "").params}

    def _check_weight_quantizer(self, fmt: Format) -> None:
        choices = {"weight_quantizer": ("rtn", "gptq"), "scale_search": ("minmax", "mse"),
                   "group_scales": ("static", "dynamic"), "transform_refit": ("fixed", "in_loop"),
                   "propagate": (None, "fp", "quantized")}
        for field_name, allowed in choices.items():
            if getattr(self, field_name) not in allowed:
                raise ValueError(f"{field_name} must be one of {allowed}, "
                                 f"got {getattr(self, field_name)!r}")
        if not (isinstance(self.gptq_damping, (int, float)) and self.gptq_damping > 0):
            raise ValueError(f"gptq_damping must be a positive number, got {self.gptq_damping!r}")
        block = fmt.block_size or 1
        if self.gptq_block_size < block or self.gptq_block_size % block:
            raise ValueError(f"gptq_block_size must be a positive multiple of the {fmt.name} "
                             f"block {block}, got {self.gptq_block_size}")
        if self.act_order not in (None, True, False):
            raise ValueError(f"act_order must be True, False or None (auto), "
                             f"got {self.act_order!r}")
        if self.refits_in_loop and self.act_order:
            raise ValueError("transform_refit='in_loop' refits and rounds the blocks in their "
                             "order: act-order needs transform_refit='fixed' (or act_order=None)")

    @property
    def refits_in_loop(self) -> bool:
        """Whether GPTQ refits the WUSH / KBBQ blocks inside its loop."""
        return (self.weight_quantizer == "gptq" and self.transform in ("wush", "kbbq")
                and self.transform_refit == "in_loop")

    @property
    def gptq_act_order(self) -> bool:
        """The act-order GPTQ runs with (``act_order``, or its automatic choice)."""
        return (not self.refits_in_loop) if self.act_order is None else self.act_order

    @property
    def fmt(self) -> Format:
        return get_format(self.format)

    @property
    def block(self) -> int:
        assert self.fmt.block_size is not None
        return self.fmt.block_size

    @property
    def method(self) -> str:
        """The paper's name of the method (I, HAAR, RTN-WUSH, RTN-KBBQ, ...)."""
        if self.weight_quantizer == "gptq":
            if self.transform == "hadamard" and self.scale_search == "mse":
                return "MR-GPTQ"
            names = {"identity": "GPTQ", "haar": "GPTQ-HAAR", "hadamard": "GPTQ-HADAMARD",
                     "wush": "GPTQ-WUSH", "kbbq": "GPTQ-KBBQ"}
        else:
            names = {"identity": "I", "haar": "HAAR", "hadamard": "RTN-HADAMARD",
                     "wush": "RTN-WUSH", "kbbq": "RTN-KBBQ"}
        return names[self.transform]

    @property
    def label(self) -> str:
        """The whole recipe in a few words: method, format and the brake (``GPTQ-KBBQ nvfp4,
        lambda 0.75``; ``RTN-KBBQ mxfp4, lambda auto``; ``MR-GPTQ nvfp4``)."""
        label = f"{self.method} {self.format}"
        if self.transform == "kbbq":
            label += ", lambda auto" if self.auto else f", lambda {float(self.lam):g}"
        return label

    @property
    def auto(self) -> bool:
        return self.transform == "kbbq" and self.lam == "auto"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["auto_grid"] = list(self.auto_grid)
        return data
