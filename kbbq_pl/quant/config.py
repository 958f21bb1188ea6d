"""What to quantize and how: :class:`QuantizationConfig`, the recipe (the one place its fields
are declared and described, in groups: :class:`FormatConfig`, :class:`TransformConfig`,
:class:`WeightsConfig`, :class:`AutoBrakeConfig`, :class:`LayersConfig`).

The recipe YAML (``recipe:``), ``kbbq-pl quantize --recipe.transform.lam 0.5``, the ``KBBQ``
Lightning callback and torchao's ``KBBQConfig`` all take a :class:`QuantizationConfig`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from ..formats import Format, get_format
from ..transforms.fit import FITTED_TRANSFORMS, HADAMARD_TRANSFORMS, TRANSFORMS
from .act_scale import ActScale, check_act_scale, effective_act_scale
from .autobrake import DEFAULT_GRID

__all__ = ["AutoBrakeConfig", "FormatConfig", "LayersConfig", "QuantizationConfig",
           "TransformConfig", "WeightsConfig"]


def _is_number(value: Any) -> bool:
    """An int or float, not a bool (a YAML ``true`` is no damping)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
            before ``v_proj`` is quantized (:mod:`kbbq_pl.transforms.o_proj_fold`; exact in full
            precision), so ``o_proj`` needs no online transform (e.g. for a compressed-tensors
            export).  Llama-style ``v_proj`` / ``o_proj`` names; RTN, fixed lambda,
            post-training.  A block whose attention changes the values before ``o_proj`` (a
            gate, a norm) keeps its online transforms (checked on its outputs).
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
        if not (_is_number(self.damping) and math.isfinite(self.damping) and self.damping >= 0):
            raise ValueError(f"transform.damping (the transform fit's) must be a finite number "
                             f">= 0, got {self.damping!r}")
        if not (isinstance(self.seed, int) and not isinstance(self.seed, bool)):
            raise ValueError(f"transform.seed must be an integer, got {self.seed!r}")


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
        if not (_is_number(self.damping) and math.isfinite(self.damping) and self.damping > 0):
            raise ValueError(f"weights.damping (GPTQ's) must be a finite positive number, "
                             f"got {self.damping!r}")
        if not (isinstance(self.block_size, int) and self.block_size > 0):
            raise ValueError(f"weights.block_size must be a positive integer, "
                             f"got {self.block_size!r}")
        if self.act_order not in (None, True, False):
            raise ValueError(f"weights.act_order must be True, False or None (auto), "
                             f"got {self.act_order!r}")


@dataclass(frozen=True)
class AutoBrakeConfig:
    """The auto-brake (``transform.lam: auto``, :mod:`kbbq_pl.quant.autobrake`): each layer's
    lambda chosen on calibration sequences held out from its fit, then refitted on every token.

    Attributes:
        grid: the candidate lambdas.
        holdout: the fraction of the calibration sequences held out to score the candidates.
        tokens: the held-out tokens per layer the candidates are scored on.
    """

    grid: tuple[float, ...] = DEFAULT_GRID
    holdout: float = 0.5
    tokens: int = 512

    def __post_init__(self) -> None:
        object.__setattr__(self, "grid", tuple(self.grid))
        if not self.grid or not all(0.0 <= float(v) <= 1.0 for v in self.grid):
            raise ValueError(f"autobrake.grid holds lambdas in [0, 1], got {self.grid}")
        if not (isinstance(self.holdout, (int, float)) and 0.0 < self.holdout < 1.0):
            raise ValueError(f"autobrake.holdout is a fraction in (0, 1), got {self.holdout!r}")
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 1:
            raise ValueError(f"autobrake.tokens is a positive integer, got {self.tokens!r}")


REMOVED = {"autobrake.scope": "lam: auto chooses per layer; one lambda for the whole model is "
                              "a sweep: kbbq-pl compare --lams",
           "autobrake.finalists": "lam: auto chooses per layer; compare whole models with "
                                  "kbbq-pl compare --lams",
           "autobrake.folds": "lam: auto holds out one split (autobrake.holdout)",
           "autobrake.refit": "the chosen lambda is always refitted on every token",
           "autobrake.select_on": "candidates are always scored on the held-out tokens"}
"""Recipe fields that were removed, and what to do instead (one line in the error)."""


@dataclass(frozen=True)
class LayersConfig:
    """Which layers are quantized.

    Attributes:
        targets: module-name regular expressions of the layers to quantize (default: every
            linear layer but the LM head and any other task head, embeddings, BERT's pooler,
            Mamba's ``dt_proj`` and sparse attention's scoring layers; see
            :mod:`kbbq_pl.quant.modules`).  Routers of
            mixture-of-experts layers and linear layers with their own forward are never
            quantized.
        ignore: module-name regular expressions of layers to leave in full precision (a
            pattern that matches no linear layer is named in a warning; given, it replaces
            the default list and the task-head rule).  Both also read
            compressed-tensors' ``re:<pattern>`` spelling.
    """

    targets: list[str] | None = None
    ignore: list[str] | None = None

    def __post_init__(self) -> None:
        # one pattern or any sequence of them, held as the list a recipe file gives, so that a
        # recipe equals itself read back (from_dict(to_dict()))
        for name in ("targets", "ignore"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, [value])
            elif value is not None:
                if not all(isinstance(pattern, str) for pattern in value):
                    raise ValueError(f"layers.{name} holds module-name patterns (strings), "
                                     f"got {value!r}")
                object.__setattr__(self, name, list(value))


GROUPS: dict[str, type] = {"format": FormatConfig, "transform": TransformConfig,
                           "weights": WeightsConfig, "autobrake": AutoBrakeConfig,
                           "layers": LayersConfig}
"""The groups of a recipe: field of :class:`QuantizationConfig` -> its dataclass."""

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
        if not (isinstance(self.keep_samples, int) and not isinstance(self.keep_samples, bool)
                and self.keep_samples > 0):
            raise ValueError(f"keep_samples (tokens kept per layer for the report's output "
                             f"SNR) must be a positive integer, got {self.keep_samples!r}")
        block = self.block
        if self.transform.name in HADAMARD_TRANSFORMS and block & (block - 1):
            raise ValueError(f"transform {self.transform.name!r} multiplies each block by a "
                             f"Sylvester Hadamard matrix, which needs a power-of-two block; "
                             f"format {self.format.name} has blocks of {block} (use transform "
                             "haar or identity, or a format with power-of-two blocks)")
        if self.weights.block_size % block:
            raise ValueError(f"weights.block_size must be a positive multiple of the "
                             f"{self.format.name} block {block}, got {self.weights.block_size}")
        if self.refits_in_loop and self.weights.act_order:
            raise ValueError("transform_refit='in_loop' refits and rounds the blocks in their "
                             "order: act-order needs transform_refit='fixed' (or act_order=None)")
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
    def from_recipe(cls, name: str | Path) -> QuantizationConfig:
        """The recipe of a packaged recipe (``"rtn_kbbq_nvfp4_lam0.75"``; ``kbbq-pl recipes``
        lists them) or of a recipe file as ``kbbq-pl quantize --config`` reads it: its
        ``recipe`` block (:meth:`from_dict`).  A name that is neither is an error suggesting
        the closest packaged names."""
        import yaml

        from kbbq_pl.recipes import recipe_path

        path = Path(name) if Path(name).is_file() else recipe_path(str(name))
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        block = document.get("recipe") if isinstance(document, Mapping) else None
        if not isinstance(block, Mapping):
            raise ValueError(f"{path}: a recipe file holds its recipe under 'recipe:' "
                             "(as the packaged recipes do), found none")
        return cls.from_dict(block)

    @classmethod
    def resolve(cls, recipe: QuantizationConfig | str | Path, taker: str) -> QuantizationConfig:
        """The recipe a ``config=`` argument names: a :class:`QuantizationConfig` as it is, a
        packaged recipe's name or a recipe file read by :meth:`from_recipe`; anything else is
        a TypeError naming ``taker``."""
        if isinstance(recipe, (str, Path)):
            return cls.from_recipe(recipe)
        if not isinstance(recipe, cls):
            raise TypeError(f"{taker} takes a recipe: a QuantizationConfig, or a packaged "
                            f"recipe's name or a recipe file, got {recipe!r}")
        return recipe

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationConfig:
        """The recipe of :meth:`to_dict`'s nested dictionary; an unknown field is an error
        naming it (a removed one, with what to do instead)."""
        data = dict(data)
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        groups = {}
        for name in [name for name in data if name in GROUPS]:
            value = data.pop(name)
            if not isinstance(value, Mapping):
                unknown.append(name)
                continue
            known = {f.name for f in fields(GROUPS[name])}
            unknown += [f"{name}.{leaf}" for leaf in value if leaf not in known]
            groups[name] = {leaf: v for leaf, v in value.items() if leaf in known}
        if unknown:
            hints = "; ".join(f"{key}: {REMOVED[key]}" for key in unknown if key in REMOVED)
            raise ValueError(f"unknown recipe fields {unknown}" + (f" ({hints})" if hints else "")
                             + "; kbbq-pl quantize -h lists the fields")
        return cls(**{name: GROUPS[name](**value) for name, value in groups.items()}, **data)

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
        return (self.weights.quantizer == "gptq" and self.transform.name in FITTED_TRANSFORMS
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
