"""What to quantize and how: :class:`QuantizationConfig`, the recipe (the one place its fields
are declared and described, in groups: :class:`FormatConfig`, :class:`TransformConfig`,
:class:`WeightsConfig`, :class:`AutoBrakeConfig`, :class:`LayersConfig`), and the cross-rank
operations the pipeline runs with (:class:`Collectives`).

The recipe YAML (``recipe:``), ``kbbq-pl quantize --recipe.transform.lam 0.5``, the ``KBBQ``
Lightning callback and torchao's ``KBBQConfig`` all take a :class:`QuantizationConfig`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

import torch
from torch import Tensor

from ..formats import Format, get_format
from ..transforms.autobrake import DEFAULT_GRID
from ..transforms.fit import TRANSFORMS
from .act_scale import ActScale, check_act_scale, effective_act_scale

__all__ = [
    "FLAT_KEYS",
    "AutoBrakeConfig",
    "Batches",
    "BroadcastFn",
    "Collectives",
    "FormatConfig",
    "LayersConfig",
    "QuantizationConfig",
    "ReduceFn",
    "TransformConfig",
    "WeightsConfig",
    "count_tokens",
    "lightning_collectives",
    "torch_distributed_collectives",
]

Batches = Iterable[Mapping[str, Tensor]]
ReduceFn = Callable[[Tensor], Tensor]
BroadcastFn = Callable[[Any, int], Any]
"""``broadcast(obj, src)``: every rank returns rank ``src``'s ``obj`` (identity on one process)."""


def count_tokens(batches: Iterable[Mapping[str, Any]]) -> int:
    """The calibration tokens of ``batches``: the elements of their ``input_ids`` (a batch
    without an ``input_ids`` tensor counts none)."""
    return sum(int(b["input_ids"].numel()) for b in batches
               if isinstance(b.get("input_ids"), Tensor))


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

    def share(self, count: int, what: str = "the calibration set") -> slice:
        """This rank's contiguous share of ``count`` batches (all of them on one process); fewer
        batches than ranks is an error on every rank, before any work."""
        if count < self.world_size:
            raise ValueError(f"{self.world_size} processes need at least one calibration batch "
                             f"each; {what} has {count} (more calibration tokens, smaller "
                             "batches, or fewer processes)")
        return slice(self.rank * count // self.world_size,
                     (self.rank + 1) * count // self.world_size)

    def gather_rows(self, x: Tensor, limit: int | None = None) -> Tensor:
        """The rows of every rank's ``x [n_r, D]`` stacked in rank order, on every rank, at most
        ``limit`` of them, through the sum all-reduce (each rank fills its slot of a zero tensor;
        adding zeros is exact)."""
        if self.world_size > 1:
            counts = torch.zeros(self.world_size, dtype=torch.float64, device=x.device)
            counts[self.rank] = x.shape[0]
            counts = self.reduce_sum(counts).long()
            start = int(counts[:self.rank].sum())
            stacked = x.new_zeros(int(counts.sum()), x.shape[1])
            stacked[start:start + x.shape[0]] = x
            x = self.reduce_sum(stacked)
        return x if limit is None else x[:limit]


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


@dataclass(frozen=True)
class FormatConfig:
    """The FP4 format of weights and activations.

    Attributes:
        name: FP4 format of weights and activations (``nvfp4``, ``mxfp4``, ...).
        act_scale: NVFP4 activation per-tensor scale, ``static`` (calibrated) or ``dynamic``.
        unaligned: a layer whose ``in_features`` is not a multiple of the block: ``pad`` it with
            zero columns (and its inputs with zeros) or ``skip`` it (left in full precision).
    """

    name: str = "nvfp4"
    act_scale: Literal["static", "dynamic"] = "static"
    unaligned: Literal["pad", "skip"] = "pad"

    def __post_init__(self) -> None:
        fmt = get_format(self.name)
        if fmt.granularity != "block" or fmt.element != "e2m1":
            raise ValueError(f"W4A4 needs a block FP4 format, got {self.name!r}")
        check_act_scale(self.act_scale, "format.act_scale")
        if self.unaligned not in ("pad", "skip"):
            raise ValueError(f"format.unaligned must be 'pad' or 'skip', got {self.unaligned!r}")


@dataclass(frozen=True)
class TransformConfig:
    """The input transform of every quantized linear layer, and KBBQ's brake.

    Attributes:
        name: ``identity``, ``haar``, ``hadamard``, ``wush`` or ``kbbq``.
        lam: the KBBQ brake lambda in [0, 1] (Eq. kbbq), or ``auto``: chosen per layer on
            held-out calibration tokens (the auto-brake, set up by ``autobrake``).
        damping: relative damping of the transform fit's Gram matrices.
        seed: seed of the Haar rotation (and of the auto-brake's held-out split).
        fold_o_proj: fit each attention ``o_proj``'s block transform shared by the query heads
            that read one value head (pooled statistics) and fold it into ``v_proj``'s rows
            before ``v_proj`` is quantized (:mod:`kbbq_pl.transforms.fold`; exact in full
            precision), so ``o_proj`` needs no online transform (e.g. for a compressed-tensors
            export).  Llama-style ``v_proj`` / ``o_proj`` names; RTN, fixed lambda,
            post-training.
    """

    name: str = "kbbq"
    lam: float | Literal["auto"] = 0.75
    damping: float = 0.01
    seed: int = 0
    fold_o_proj: bool = False

    def __post_init__(self) -> None:
        if self.name not in TRANSFORMS:
            raise ValueError(f"transform.name must be one of {TRANSFORMS}, got {self.name!r}")
        if self.lam == "auto":
            if self.name != "kbbq":
                raise ValueError(f"lam='auto' chooses KBBQ's brake; transform is {self.name!r}")
        elif not (isinstance(self.lam, (int, float)) and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"the brake lam lies in [0, 1] or is 'auto', got {self.lam!r}")
        if self.fold_o_proj and (self.name == "haar" or self.lam == "auto"):
            raise ValueError("fold_o_proj folds block transforms fitted with a fixed lambda; "
                             f"got transform {self.name!r}, lam {self.lam!r}")


@dataclass(frozen=True)
class WeightsConfig:
    """How a block's linears become FP4 weights: the weight quantizer and its settings.

    Attributes:
        quantizer: ``rtn`` (round to nearest, :class:`~kbbq_pl.quant.rtn.RTN`) or ``gptq`` (the
            GPTQ family, :class:`~kbbq_pl.quant.gptq.GPTQ`).
        propagate: where the next block's calibration inputs come from: the full-precision
            block (``fp``: every layer is calibrated on the full-precision model's activations)
            or the quantized one (``quantized``: later blocks see the error of earlier ones, as
            in GPTQ's reference loop).  None: the weight quantizer's own default (RTN ``fp``,
            GPTQ ``quantized``).
        damping: GPTQ's relative Hessian damping (``H + damping * mean(diag H) I``).
        act_order: GPTQ rounds columns by decreasing ``diag(H)``; None (default): yes, except
            for the in-loop refit, which rounds whole blocks in their order.
        block_size: GPTQ's lazy-batch width (a multiple of the format's block).
        scale_search: ``minmax`` block scales from each group's amax, or ``mse`` (the best of
            100 shrunk amaxes by ``sum |e|^2.4``, FP-Quant's observer); RTN and GPTQ.
        group_scales: GPTQ block scales computed once from the (transformed) weight before the
            loop (``static``) or from the error-updated group when GPTQ reaches it (``dynamic``).
        transform_refit: for ``wush`` / ``kbbq`` with GPTQ (ignored otherwise): ``in_loop``
            (default) refits every block ``T_b`` on the error-updated weight inside the loop
            (the WUSH paper's variant); ``fixed`` fits ``T`` once from the calibration
            statistics and runs GPTQ on ``W T^-1`` with the Hessian ``T H T^T``.  Why
            ``in_loop`` is the default: :mod:`kbbq_pl.quant.gptq.quantizer`.
    """

    quantizer: Literal["rtn", "gptq"] = "rtn"
    propagate: Literal["fp", "quantized"] | None = None
    damping: float = 0.01
    act_order: bool | None = None
    block_size: int = 128
    scale_search: Literal["minmax", "mse"] = "minmax"
    group_scales: Literal["static", "dynamic"] = "static"
    transform_refit: Literal["fixed", "in_loop"] = "in_loop"

    def __post_init__(self) -> None:
        choices = {"quantizer": ("rtn", "gptq"), "scale_search": ("minmax", "mse"),
                   "group_scales": ("static", "dynamic"), "transform_refit": ("fixed", "in_loop"),
                   "propagate": (None, "fp", "quantized")}
        for field_name, allowed in choices.items():
            if getattr(self, field_name) not in allowed:
                raise ValueError(f"weights.{field_name} must be one of {allowed}, "
                                 f"got {getattr(self, field_name)!r}")
        if not (isinstance(self.damping, (int, float)) and self.damping > 0):
            raise ValueError(f"weights.damping (GPTQ's) must be a positive number, "
                             f"got {self.damping!r}")
        if not (isinstance(self.block_size, int) and self.block_size > 0):
            raise ValueError(f"weights.block_size must be a positive integer, "
                             f"got {self.block_size!r}")
        if self.act_order not in (None, True, False):
            raise ValueError(f"weights.act_order must be True, False or None (auto), "
                             f"got {self.act_order!r}")


@dataclass(frozen=True)
class AutoBrakeConfig:
    """The auto-brake (``transform.lam: auto``, :mod:`kbbq_pl.transforms.autobrake`).

    Attributes:
        grid: the auto-brake's candidate lambdas.
        holdout: the fraction of calibration sequences held out for selection (``folds: 1``).
        folds: 1 holds out ``holdout`` of the sequences once and scores the candidates fitted
            on the rest; K >= 2 cross-fits: the sequences are dealt into K folds, each fold is
            scored with candidates fitted on the other K - 1, and the errors are pooled (every
            sequence scored, each transform fitted on (K - 1) / K of the data; RTN only).
        tokens: the held-out tokens per layer the auto-brake scores on (over all folds).
        refit: whether the chosen lambda is refitted on all tokens (``True``) or the
            transform fitted on the fitting part is kept.
        select_on: where the auto-brake scores: ``holdout`` (the method) or ``fit`` (the
            fitting tokens, only to measure what the split buys).
        scope: ``layer``: each layer keeps the candidate of its smallest held-out error;
            ``model``: one lambda for every layer, the candidate of the smallest held-out error
            in dB averaged over the layers (:func:`~kbbq_pl.transforms.autobrake.model_lambda`).
            ``model`` quantizes twice: a first run with the per-layer choice scores the
            candidates (on a copy of the model, in memory), a second quantizes with the
            chosen lambda, bit for bit the fixed-lambda recipe.  ``best``: the per-layer
            model or one lambda, whichever generalizes better: the per-layer auto-brake and
            each finalist are quantized on the fitting sequences alone and compared on the
            held-out ones (KL of the next-token distributions, or the per-token cosine
            distance of the last hidden state for a model without logits); the closest is
            kept (the per-layer model of the scoring run, fitted on every sequence) or
            quantized on every sequence (a lambda).  One per-layer run more and one run per
            finalist, both on the fitting half; in memory the per-layer model and one trial's
            beside the model (streamed: none).
        finalists: with ``scope`` ``model`` or ``best``, how many candidates of the smallest
            mean error in dB are tried as whole models; where models are compared (more than
            one finalist, or ``best``), each is quantized on the fitting sequences alone and
            the model's lambda is the one whose outputs on the held-out sequences are closest
            to the full-precision model's, then quantized on every sequence: one run more per
            finalist, on half the tokens.  The mean over layers does not tell apart candidates
            a few hundredths of a dB apart that differ end to end
            (docs/results/2026-11-26-autobrake-finalists.md).
    """

    grid: tuple[float, ...] = DEFAULT_GRID
    holdout: float = 0.5
    folds: int = 1
    tokens: int = 512
    refit: bool = True
    select_on: Literal["holdout", "fit"] = "holdout"
    scope: Literal["layer", "model", "best"] = "layer"
    finalists: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(self.grid))
        if not self.grid or not all(0.0 <= float(v) <= 1.0 for v in self.grid):
            raise ValueError(f"autobrake.grid holds lambdas in [0, 1], got {self.grid}")
        if isinstance(self.folds, bool) or not isinstance(self.folds, int) or self.folds < 1:
            raise ValueError(f"autobrake.folds is a positive integer (1: one held-out split, "
                             f"K >= 2: K-fold cross-fitting), got {self.folds!r}")
        if self.folds > 1 and not self.refit:
            raise ValueError("autobrake.folds > 1 fits every fold's candidates on the other "
                             "folds; the chosen lambda is refitted on all tokens (refit: true)")
        if self.folds > 1 and self.select_on != "holdout":
            raise ValueError("autobrake.folds > 1 scores every fold held out: select_on must "
                             f"be 'holdout', got {self.select_on!r}")
        if self.select_on not in ("holdout", "fit"):
            raise ValueError(f"autobrake.select_on must be 'holdout' or 'fit', "
                             f"got {self.select_on!r}")
        if self.scope not in ("layer", "model", "best"):
            raise ValueError(f"autobrake.scope must be 'layer' (a lambda per layer), 'model' "
                             f"(one lambda for the model) or 'best' (the better of the two on "
                             f"the held-out sequences), got {self.scope!r}")
        if self.scope == "best" and self.folds > 1:
            raise ValueError("autobrake.scope 'best' compares the two models on the held-out "
                             "sequences: folds must be 1")
        if (isinstance(self.finalists, bool) or not isinstance(self.finalists, int)
                or not 1 <= self.finalists <= len(self.grid)):
            raise ValueError(f"autobrake.finalists is an integer from 1 to the grid's "
                             f"{len(self.grid)} candidates, got {self.finalists!r}")
        if self.finalists > 1 and self.scope == "layer":
            raise ValueError("autobrake.finalists makes whole models of one lambda each: it "
                             "needs autobrake.scope 'model' or 'best', not 'layer'")
        if self.finalists > 1 and self.folds > 1:
            raise ValueError("autobrake.finalists compares models on the held-out sequences: "
                             "folds must be 1")

    @property
    def compares_models(self) -> bool:
        """Whether whole models are quantized on the fitting sequences and compared on the
        held-out ones (``scope: best``, or more than one finalist)."""
        return self.scope == "best" or self.finalists > 1


@dataclass(frozen=True)
class LayersConfig:
    """Which layers are quantized.

    Attributes:
        targets: module-name regular expressions of the layers to quantize (default: every
            linear layer but the LM head, embeddings and BERT's pooler; see
            :mod:`kbbq_pl.quant.modules`).
        ignore: module-name regular expressions of layers to leave in full precision.
    """

    targets: list[str] | None = None
    ignore: list[str] | None = None


GROUPS: dict[str, type] = {"format": FormatConfig, "transform": TransformConfig,
                           "weights": WeightsConfig, "autobrake": AutoBrakeConfig,
                           "layers": LayersConfig}
"""The groups of a recipe: field of :class:`QuantizationConfig` -> its dataclass."""

FLAT_KEYS: dict[str, str] = {
    "format": "format.name", "act_scale": "format.act_scale", "unaligned": "format.unaligned",
    "transform": "transform.name", "lam": "transform.lam", "damping": "transform.damping",
    "seed": "transform.seed", "fold_o_proj": "transform.fold_o_proj",
    "weight_quantizer": "weights.quantizer", "propagate": "weights.propagate",
    "gptq_damping": "weights.damping", "act_order": "weights.act_order",
    "gptq_block_size": "weights.block_size", "scale_search": "weights.scale_search",
    "group_scales": "weights.group_scales", "transform_refit": "weights.transform_refit",
    "auto_grid": "autobrake.grid", "auto_holdout": "autobrake.holdout",
    "auto_tokens": "autobrake.tokens", "auto_refit": "autobrake.refit",
    "auto_select_on": "autobrake.select_on", "targets": "layers.targets",
    "ignore": "layers.ignore", "keep_samples": "keep_samples"}
"""Each field of the flat recipe of kbbq-pl before the groups (checkpoint metadata,
``quantizer: init_args:`` recipe files) -> its place in :class:`QuantizationConfig`."""


@dataclass(frozen=True)
class QuantizationConfig:
    """What to quantize and how: a recipe, in groups of fields (each group's own docstring
    describes its fields).  ``QuantizationConfig()`` is the default recipe, RTN-KBBQ NVFP4 with
    lambda 0.75; e.g. GPTQ-KBBQ MXFP4 with the auto-brake::

        QuantizationConfig(format=FormatConfig("mxfp4"), transform=TransformConfig(lam="auto"),
                           weights=WeightsConfig("gptq"))

    Attributes:
        format: the FP4 format of weights and activations.
        transform: the input transform and KBBQ's brake.
        weights: the weight quantizer (RTN or GPTQ) and its settings.
        autobrake: the auto-brake's settings (with ``transform.lam: auto``).
        layers: which layers are quantized.
        keep_samples: calibration tokens kept per layer for the report's output SNR.
    """

    format: FormatConfig = field(default_factory=FormatConfig)
    transform: TransformConfig = field(default_factory=TransformConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    autobrake: AutoBrakeConfig = field(default_factory=AutoBrakeConfig)
    layers: LayersConfig = field(default_factory=LayersConfig)
    keep_samples: int = 512

    def __post_init__(self) -> None:
        for name, group in GROUPS.items():
            value = getattr(self, name)
            if not isinstance(value, group):
                example = {"format": 'FormatConfig("mxfp4")',
                           "transform": 'TransformConfig("kbbq", lam=0.5)',
                           "weights": 'WeightsConfig("gptq")'}.get(name, f"{group.__name__}()")
                raise TypeError(f"QuantizationConfig {name} must be a {group.__name__} "
                                f"(e.g. {name}={example}), got {value!r}")
        block = self.block
        if self.weights.block_size % block:
            raise ValueError(f"weights.block_size must be a positive multiple of the "
                             f"{self.format.name} block {block}, got {self.weights.block_size}")
        if self.refits_in_loop and self.weights.act_order:
            raise ValueError("transform_refit='in_loop' refits and rounds the blocks in their "
                             "order: act-order needs transform_refit='fixed' (or act_order=None)")
        if self.auto and self.autobrake.folds > 1 and self.weights.quantizer != "rtn":
            raise ValueError(f"autobrake.folds {self.autobrake.folds}: cross-fitting is "
                             "implemented for RTN-KBBQ; GPTQ-KBBQ with lam: auto selects on one "
                             "held-out split (autobrake.folds: 1)")
        if self.transform.fold_o_proj and self.weights.quantizer != "rtn":
            raise ValueError("fold_o_proj folds block transforms fitted by RTN; got "
                             f"weights.quantizer {self.weights.quantizer!r}")

    @classmethod
    def field_descriptions(cls) -> dict[str, str]:
        """Each leaf field's description by its dotted name (``transform.lam``,
        ``keep_samples``), from the ``Attributes`` of its group's docstring (the one place a
        field is described; the CLI's and the ``KBBQ`` callback's help show these)."""
        from docstring_parser import parse

        def described(group: type) -> dict[str, str]:
            return {param.arg_name: " ".join((param.description or "").split())
                    for param in parse(group.__doc__ or "").params}

        out = {}
        for name, text in described(cls).items():
            if name in GROUPS:
                out.update({f"{name}.{leaf}": leaf_text
                            for leaf, leaf_text in described(GROUPS[name]).items()})
            else:
                out[name] = text
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationConfig:
        """The recipe of :meth:`to_dict`'s nested dictionary; the flat dictionary of earlier
        kbbq-pl versions (:data:`FLAT_KEYS`, e.g. in the metadata of older checkpoints) is read
        too."""
        data = dict(data)
        flat = any(key in data and not isinstance(data[key], Mapping) for key in GROUPS) or \
            any(key in FLAT_KEYS and key not in GROUPS and key != "keep_samples" for key in data)
        if flat:
            unknown = sorted(set(data) - set(FLAT_KEYS))
            if unknown:
                raise ValueError(f"unknown recipe fields {unknown}")
            nested: dict[str, Any] = {}
            for key, value in data.items():
                group, _, leaf = FLAT_KEYS[key].rpartition(".")
                if group:
                    nested.setdefault(group, {})[leaf] = value
                else:
                    nested[leaf] = value
            data = nested
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown recipe fields {unknown}")
        groups = {name: GROUPS[name](**data.pop(name)) for name in list(data) if name in GROUPS}
        return cls(**groups, **data)

    def to_dict(self) -> dict[str, Any]:
        """The recipe as nested JSON-ready dictionaries (tuples as lists)."""
        def plain(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value

        return plain(asdict(self))

    @property
    def fmt(self) -> Format:
        """The :class:`~kbbq_pl.formats.Format` that ``format.name`` names."""
        return get_format(self.format.name)

    @property
    def block(self) -> int:
        """The format's block size (16 for NVFP4, 32 for MXFP4)."""
        block = self.fmt.block_size
        assert block is not None
        return block

    @property
    def effective_act_scale(self) -> ActScale:
        """The activations' per-tensor scale the layers get: ``format.act_scale`` where the
        format has a per-tensor scale, else ``dynamic``
        (:func:`~kbbq_pl.quant.act_scale.effective_act_scale`)."""
        return effective_act_scale(self.fmt, self.format.act_scale)

    @property
    def weight_quantizer(self) -> str:
        """The weight quantizer's name, ``rtn`` or ``gptq`` (``weights.quantizer``)."""
        return self.weights.quantizer

    @property
    def auto(self) -> bool:
        """Whether the auto-brake chooses each layer's lambda (``transform.lam: auto``)."""
        return self.transform.name == "kbbq" and self.transform.lam == "auto"

    @property
    def refits_in_loop(self) -> bool:
        """Whether GPTQ refits the WUSH / KBBQ blocks inside its loop."""
        return (self.weights.quantizer == "gptq" and self.transform.name in ("wush", "kbbq")
                and self.weights.transform_refit == "in_loop")

    @property
    def gptq_act_order(self) -> bool:
        """The act-order GPTQ runs with (``weights.act_order``, or its automatic choice)."""
        order = self.weights.act_order
        return (not self.refits_in_loop) if order is None else order

    @property
    def method(self) -> str:
        """The paper's name of the method (I, HAAR, RTN-WUSH, RTN-KBBQ, ...)."""
        if self.weights.quantizer == "gptq":
            if self.transform.name == "hadamard" and self.weights.scale_search == "mse":
                return "MR-GPTQ"
            names = {"identity": "GPTQ", "haar": "GPTQ-HAAR", "hadamard": "GPTQ-HADAMARD",
                     "wush": "GPTQ-WUSH", "kbbq": "GPTQ-KBBQ"}
        else:
            names = {"identity": "I", "haar": "HAAR", "hadamard": "RTN-HADAMARD",
                     "wush": "RTN-WUSH", "kbbq": "RTN-KBBQ"}
        return names[self.transform.name]

    @property
    def label(self) -> str:
        """The whole recipe in a few words: method, format and the brake (``GPTQ-KBBQ nvfp4,
        lambda 0.75``; ``RTN-KBBQ mxfp4, lambda auto``; ``MR-GPTQ nvfp4``)."""
        label = f"{self.method} {self.format.name}"
        if self.transform.name == "kbbq":
            label += ", lambda auto" if self.auto else f", lambda {float(self.transform.lam):g}"
        return label
