"""Post-training W4A4 quantization of a model: calibrate, fit transforms, quantize, swap.

:func:`quantize_model_rtn` is the round-to-nearest pipeline of
:func:`kbbq_pl.quant.pipeline.quantize_model` (behind the ``KBBQ`` Lightning callback and the
``kbbq-pl quantize`` command):

1. one no-grad pass over the calibration batches with hooks on the targeted linears collects the
   block second moments of their inputs (:mod:`kbbq_pl.quant.stats`), summed over ranks;
2. each layer's transform is fitted (:mod:`kbbq_pl.transforms`) and its weight ``W T^-1``
   rounded (RTN here; the GPTQ family plugs in through ``weight_quantizer``);
3. for a static NVFP4 activation scale, a second pass records the amax of the transformed
   inputs ``T x`` of every layer (on the full-precision inputs, each layer in isolation);
4. every layer is checked in isolation on kept calibration tokens (output SNR), then swapped for
   a :class:`~kbbq_pl.quant.layers.QuantizedLinear`.

The report holds, per layer, the aggregate participation factor before and after the transform
(Thm. GL ceiling with the real weights), the paired-ceiling utilization, the block ceiling and
the output SNR.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..formats import Format, QuantizedTensor, get_format, quantize
from ..formats.kernels import NVFP4_MIN_GLOBAL_SCALE
from ..law import noise_law as law
from ..transforms.autobrake import DEFAULT_GRID, LambdaChoice, select_lambda, split_sequences
from ..transforms.fit import (
    TRANSFORMS,
    fit_transform,
    kbbq_basis,
    transform_inputs,
    transform_weight,
    weight_block_grams,
)
from ..transforms.fold import expand_to_query_heads, fold_into_values, pooled_group_statistics
from .layers import QuantizedLinear, pad_features, quantized_linears, swap_module
from .modules import (
    cell_kind,
    check_finite,
    find_linears,
    first_input,
    in_out_features,
    linear_weight,
)
from .stats import LayerStatistics, StatisticsCollector, run_calibration
from .w4a4 import transformed_input

log = logging.getLogger(__name__)

Batches = Iterable[Mapping[str, Tensor]]
ReduceFn = Callable[[Tensor], Tensor]
BroadcastFn = Callable[[Any, int], Any]
"""``broadcast(obj, src)``: every rank returns rank ``src``'s ``obj`` (identity on one process)."""
WeightQuantizer = Callable[[str, nn.Module, Tensor, "Tensor | None", LayerStatistics],
                           QuantizedTensor]


@dataclass
class QuantizationConfig:
    """What to quantize and how (the fields of a recipe).

    Attributes:
        format: FP4 format of weights and activations (``nvfp4``, ``mxfp4``, ...).
        transform: ``identity``, ``haar``, ``hadamard``, ``wush`` or ``kbbq``.
        lam: the KBBQ brake lambda in [0, 1] (Eq. kbbq).
        targets, ignore: module-name regular expressions (see :mod:`kbbq_pl.quant.modules`).
        act_scale: NVFP4 activation per-tensor scale, ``static`` (calibrated) or ``dynamic``.
        damping: relative damping of the transform fit's Gram matrices.
        seed: seed of the Haar rotation.
        unaligned: a layer whose ``in_features`` is not a multiple of the block: ``pad`` it with
            zero columns (and its inputs with zeros) or ``skip`` it (left in full precision).
        keep_samples: calibration tokens kept per layer for the report's output SNR.
        auto_grid, auto_holdout, auto_tokens, auto_refit, auto_select_on: the auto-brake
            (``lam="auto"``, :mod:`kbbq_pl.transforms.autobrake`): the candidate lambdas; the
            fraction of calibration sequences held out for selection; the held-out tokens per layer
            it scores on; whether the chosen lambda is refitted on all tokens (``True``) or the
            transform fitted on the fitting part is kept; and ``holdout`` (the method) or
            ``fit`` (scoring on the fitting tokens, only to measure what the split buys).
        weight_quantizer: ``rtn`` (round to nearest after one calibration pass) or ``gptq``
            (the block-sequential GPTQ loop of :mod:`kbbq_pl.quant.sequential_gptq`).
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
            ``in_loop`` is the default: :mod:`kbbq_pl.quant.sequential_gptq`.
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

    def _check_weight_quantizer(self, fmt: Format) -> None:
        choices = {"weight_quantizer": ("rtn", "gptq"), "scale_search": ("minmax", "mse"),
                   "group_scales": ("static", "dynamic"), "transform_refit": ("fixed", "in_loop")}
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


@dataclass
class LayerReport:
    name: str
    kind: str
    in_features: int
    out_features: int
    padded_in: int
    kappa_before: float
    kappa_after: float
    utilization: float
    block_ceiling: float
    paired_ceiling: float
    output_snr_db: float
    act_global_scale: float | None
    tokens: int
    lam: float | None = None


@dataclass
class QuantizationReport:
    config: dict[str, Any]
    layers: list[LayerReport] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    autobrake: dict[str, LambdaChoice] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = {"config": self.config, "layers": [asdict(r) for r in self.layers],
                "skipped": self.skipped, "model": self.model, "seconds": self.seconds}
        if self.autobrake:
            data["autobrake"] = {name: {"lam": c.lam, "held_out_error_db": c.errors_db}
                                 for name, c in self.autobrake.items()}
        return data

    def summary(self) -> dict[str, float]:
        def median(values: list[float]) -> float:
            finite = [v for v in values if math.isfinite(v)]
            return float(torch.tensor(finite).median()) if finite else float("nan")

        return {
            "layers": len(self.layers),
            "median_kappa_before": median([r.kappa_before for r in self.layers]),
            "median_kappa_after": median([r.kappa_after for r in self.layers]),
            "median_utilization": median([r.utilization for r in self.layers]),
            "median_output_snr_db": median([r.output_snr_db for r in self.layers]),
        }


def _identity(t: Tensor) -> Tensor:
    return t


def layer_kappas(stats: LayerStatistics, weight: Tensor, transform: Tensor | None,
                 block: int, sigma_full: Tensor | None = None) -> dict[str, float]:
    """kappa_bar before and after ``transform`` with the layer's real weights, utilization of
    the paired ceiling, and the mean block ceiling (Thm. GL ceiling, Eqs. blockceiling,
    wushratio).  The invariant numerator ``tr(G Sigma)`` comes from the output energy."""
    w = weight.to(torch.float64)
    out_features = w.shape[0]
    numerator = stats.output_energy / (stats.tokens * out_features)
    sigma_blocks = stats.sigma_blocks()
    dense = transform is not None and transform.dim() == 2
    # only the gram's diagonal blocks enter unless the transform is dense: O(out D d), not D^2
    gram = law.weight_gram(w) if dense else torch.block_diag(*weight_block_grams(w, block))
    sigma = sigma_full if sigma_full is not None else torch.block_diag(*sigma_blocks)
    before = numerator / law._denominator(sigma, gram, None)
    after = numerator / law._denominator(sigma, gram, transform)
    spectrum = law.paired_spectrum(law.diagonal_blocks(sigma, block),
                                   law.diagonal_blocks(gram, block), damping=1e-12)
    best = law.optimal_block_denominator(spectrum)
    block_ceiling = law.block_kappa_star(sigma, block)
    return {
        "kappa_before": float(before),
        "kappa_after": float(after),
        "utilization": float(best / law._denominator(sigma, gram, transform)),
        "block_ceiling": float(block_ceiling[torch.isfinite(block_ceiling)].mean()),
        "paired_ceiling": float(numerator / best),
    }


def output_snr_db(layer: QuantizedLinear, weight: Tensor, bias: Tensor | None, x: Tensor) -> float:
    """SNR of the quantized layer's output against the original on inputs ``x`` (isolation)."""
    if x.numel() == 0:
        return float("nan")
    with torch.no_grad():
        exact = x.to(torch.float64) @ weight.to(torch.float64).T
        approx = layer(x.to(torch.float32)).to(torch.float64)
        if bias is not None:
            approx = approx - bias.to(torch.float64)
        noise = (approx - exact).square().mean()
        return float(10 * torch.log10(exact.square().mean() / noise))


def layer_report(name: str, module: nn.Module, layer: QuantizedLinear, stats: LayerStatistics,
                 transform: Tensor | None, config: QuantizationConfig,
                 act_global_scale: Tensor | None, lam: float | None = None,
                 folded: bool = False) -> LayerReport:
    """The report row of ``module`` quantized as ``layer``: kappas with the real weights, and
    the output SNR on the kept calibration inputs (the layer in isolation).  ``folded``: the
    layer receives ``T x`` (its transform folded into the producer of its input)."""
    weight = linear_weight(module).detach()
    padded = pad_features(weight, config.fmt)
    dense = transform is not None and transform.dim() == 2
    kappas = layer_kappas(stats, padded, transform, config.block,
                          stats.sigma_full() if dense else None)
    sample = stats.sample().to(weight.device)
    received = transform_inputs(pad_features(sample, config.fmt), transform)[
        :, :sample.shape[1]] if folded else sample
    exact_weight = transform_weight(padded, transform) if folded else weight
    snr = output_snr_db(layer, exact_weight, getattr(module, "bias", None), received)
    return LayerReport(
        name=name, kind=cell_kind(name), in_features=layer.in_features,
        out_features=layer.out_features, padded_in=layer.padded_in,
        output_snr_db=snr, tokens=stats.count,
        act_global_scale=float(act_global_scale) if act_global_scale is not None else None,
        **kappas, lam=lam,
    )


def _mse_rtn(config: QuantizationConfig) -> WeightQuantizer:
    """RTN of ``W T^-1`` with MSE-searched block scales (:func:`kbbq_pl.quant.gptq.rtn`)."""
    from .gptq import rtn

    def quantize_weight(name: str, module: nn.Module, padded: Tensor, transform: Tensor | None,
                        stats: LayerStatistics) -> QuantizedTensor:
        transformed = transform_weight(padded, transform)
        return rtn(transformed, config.fmt, search="mse")[0]

    return quantize_weight


def select_layers(model: nn.Module, config: QuantizationConfig) -> tuple[dict[str, nn.Module],
                                                                           dict[str, str]]:
    """Targeted layers, and those skipped with the reason; a weight holding NaN or Inf is an
    error naming the layer (before any calibration), and so is a model that already holds
    quantized layers (quantizing again would round rounded weights)."""
    existing = list(quantized_linears(model))
    if existing:
        raise ValueError(f"{type(model).__name__} is already quantized ({len(existing)} quantized "
                         f"layers, e.g. {existing[0]}): quantizing again would round rounded "
                         "weights; quantize the full-precision model")
    modules = find_linears(model, config.targets, config.ignore)
    for name, module in modules.items():
        check_finite(linear_weight(module), name, "weight")
    skipped: dict[str, str] = {}
    if config.unaligned == "skip":
        for name, module in list(modules.items()):
            in_features, _ = in_out_features(module)
            if in_features % config.block:
                skipped[name] = (f"in_features {in_features} is not a multiple of the "
                                 f"{config.format} block {config.block}")
                del modules[name]
                log.warning("%s: skipped (%s)", name, skipped[name])
    if not modules:
        raise ValueError("every targeted layer was skipped; nothing to quantize")
    return modules, skipped


@contextlib.contextmanager
def transformed_amax_hooks(modules: Mapping[str, nn.Module],
                           transforms: Mapping[str, Tensor | None],
                           fmt: Format) -> Iterator[dict[str, Tensor]]:
    """Pre-hooks recording, per layer, the amax of its padded, transformed inputs ``T x``
    during the block; yields the dict they fill."""
    amax: dict[str, Tensor] = {}
    handles = []
    for name, module in modules.items():
        in_features, _ = in_out_features(module)
        padded = pad_features(torch.empty(1, in_features), fmt).shape[1]

        @torch.no_grad()
        def hook(module, args, kwargs, name=name, in_features=in_features, padded=padded):
            x = first_input(args, kwargs)
            value = transformed_input(x, in_features, padded, transforms[name]).abs().max()
            amax[name] = value if name not in amax else torch.maximum(amax[name], value)

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield amax
    finally:
        for handle in handles:
            handle.remove()


def act_scales_from_amax(amax: Mapping[str, Tensor], reduce_max: ReduceFn) -> dict[str, Tensor]:
    """Static NVFP4 per-tensor activation scales ``amax / (448 * 6)``, amax maxed over ranks."""
    scales = {}
    for name, value in amax.items():
        value = reduce_max(value.float())
        scales[name] = (value / (448.0 * 6.0)).clamp(min=NVFP4_MIN_GLOBAL_SCALE).reshape(())
    return scales


@torch.no_grad()
def _static_act_scales(model: nn.Module, modules: Mapping[str, nn.Module],
                       transforms: Mapping[str, Tensor | None], config: QuantizationConfig,
                       batches: Batches, reduce_max: ReduceFn) -> dict[str, Tensor]:
    """Per-tensor NVFP4 scales ``amax(T x) / (448 * 6)`` of every layer's transformed inputs."""
    with transformed_amax_hooks(modules, transforms, config.fmt) as amax:
        run_calibration(model, batches)
    return act_scales_from_amax(amax, reduce_max)


def _stride(expected_tokens: int | None, keep: int, part: Sequence, whole: Sequence) -> int:
    """Keep every n-th token so that ``keep`` tokens spread over this part of the data."""
    tokens = (expected_tokens or 0) * len(part) // max(1, len(whole))
    return max(1, tokens // max(1, keep))


def chosen_lambda(config: QuantizationConfig, choice: LambdaChoice | None) -> float | None:
    if config.transform != "kbbq":
        return None
    return choice.lam if choice is not None else float(config.lam)


def auto_transform(weight: Tensor, fit: LayerStatistics, held_out: LayerStatistics,
                   config: QuantizationConfig, reduce_sum: ReduceFn = _identity,
                   reduce_max: ReduceFn = _identity, name: str = "") -> tuple[Tensor, LambdaChoice]:
    """KBBQ with the lambda the held-out tokens prefer (:mod:`kbbq_pl.transforms.autobrake`).

    The basis (Cholesky and eigendecomposition of every block) is fitted once on the fitting
    part and shared by every candidate; the chosen lambda is then refitted on all tokens when
    ``config.auto_refit``."""
    basis = kbbq_basis(weight, fit.sigma_blocks(), config.damping, name=name)
    samples = (held_out if config.auto_select_on == "holdout" else fit).sample()
    samples = pad_features(samples, config.fmt).to(weight.device)
    act_scale = "static" if config.act_scale == "static" and config.fmt.global_scale else "dynamic"
    choice = select_lambda(weight, basis, samples, config.fmt, config.auto_grid, act_scale,
                           reduce_sum, reduce_max)
    if config.auto_refit:
        pooled = (fit.sigma_sum + held_out.sigma_sum) / (fit.tokens + held_out.tokens)
        basis = kbbq_basis(weight, pooled, config.damping, name=name)
    return basis.transform(choice.lam), choice


def attention_heads(config: Any) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)`` of a HuggingFace config."""
    n_heads = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return n_heads, n_kv, head_dim


def fold_o_proj_transforms(model: nn.Module, modules: Mapping[str, nn.Module],
                           stats: Mapping[str, LayerStatistics],
                           transforms: dict[str, Tensor | None],
                           config: QuantizationConfig) -> list[str]:
    """``config.fold_o_proj``: refit every ``o_proj``'s transform shared per value head, fold
    it into its ``v_proj``'s rows (the model's full-precision weights, in place), refit that
    ``v_proj``'s transform on its new weight; returns the folded ``o_proj`` names."""
    n_heads, n_kv, head_dim = attention_heads(model.config)
    pairs = [(name, name.removesuffix("o_proj") + "v_proj") for name in modules
             if name.endswith("o_proj")]
    pairs = [(o, v) for o, v in pairs if v in modules]
    if not pairs:
        raise ValueError("fold_o_proj: no targeted o_proj with a targeted v_proj beside it "
                         f"in {type(model).__name__}")

    def fit(weight: Tensor, sigma: Tensor) -> Tensor | None:
        return fit_transform(config.transform, weight, sigma, block=config.block,
                             lam=float(config.lam), seed=config.seed, damping=config.damping)

    folded = []
    for o_name, v_name in pairs:
        o_weight = linear_weight(modules[o_name]).detach()
        stacked, sigma = pooled_group_statistics(o_weight, stats[o_name].sigma_blocks(),
                                                 head_dim, n_heads, n_kv)
        shared = fit(stacked, sigma)
        if shared is None:
            continue
        transforms[o_name] = expand_to_query_heads(shared, n_heads, n_kv)
        v_module = modules[v_name]
        weight, bias = fold_into_values(linear_weight(v_module).detach(), v_module.bias,
                                        transforms[o_name], head_dim, n_heads, n_kv)
        with torch.no_grad():
            v_module.weight.copy_(weight)
            if bias is not None:
                v_module.bias.copy_(bias)
        transforms[v_name] = fit(pad_features(weight, config.fmt),
                                 stats[v_name].sigma_blocks())
        folded.append(o_name)
    return folded


def quantize_model_rtn(
    model: nn.Module,
    batches: Batches,
    config: QuantizationConfig,
    *,
    reduce_sum: ReduceFn = _identity,
    reduce_max: ReduceFn = _identity,
    weight_quantizer: WeightQuantizer | None = None,
    expected_tokens: int | None = None,
    trainable: bool = False,
    progress: bool = True,
) -> QuantizationReport:
    """Quantize ``model`` in place with RTN weights (see the module docstring); returns the
    report.  Called through :func:`kbbq_pl.quant.pipeline.quantize_model`.

    ``batches`` is re-iterated when a second pass is needed (static activation scales), so pass
    a list or a DataLoader, not a generator.  ``reduce_sum`` / ``reduce_max`` all-reduce a tensor
    across data-parallel ranks (identity on one process).  ``trainable`` keeps high-precision
    master weights ``W T^-1`` for fine-tuning (see :class:`~kbbq_pl.quant.layers.QuantizedLinear`).
    """
    start = time.perf_counter()
    modules, skipped = select_layers(model, config)
    report = QuantizationReport(config=config.to_dict(), skipped=skipped)
    dense = config.transform == "haar"
    batches = list(batches)
    if not batches:
        raise ValueError("the calibration set is empty: no batches")
    fit_batches, holdout_batches = (
        split_sequences(batches, config.auto_holdout, config.seed) if config.auto
        else (batches, []))
    keep = config.keep_samples
    if config.auto and config.auto_select_on == "fit":
        keep = max(keep, config.auto_tokens)
    stride = _stride(expected_tokens, keep, fit_batches, batches)
    collector = StatisticsCollector(modules, config.block, keep, stride, full=dense)
    with collector.hooks():
        run_calibration(model, fit_batches)
    collector.reduce(reduce_sum)
    collector.check_nonempty()
    holdout = None
    if holdout_batches:
        holdout = StatisticsCollector(
            modules, config.block, config.auto_tokens,
            _stride(expected_tokens, config.auto_tokens, holdout_batches, batches))
        with holdout.hooks():
            run_calibration(model, holdout_batches)
        holdout.reduce(reduce_sum)
    report.seconds["calibration"] = time.perf_counter() - start

    fit_start = time.perf_counter()
    transforms: dict[str, Tensor | None] = {}
    for name, module in modules.items():
        stats = collector.stats[name]
        weight = pad_features(linear_weight(module).detach(), config.fmt)
        if config.auto:
            assert holdout is not None
            transforms[name], report.autobrake[name] = auto_transform(
                weight, stats, holdout.stats[name], config, reduce_sum, reduce_max, name)
        else:
            transforms[name] = fit_transform(
                config.transform, weight, stats.sigma_blocks(), block=config.block,
                lam=config.lam, seed=config.seed, damping=config.damping, name=name)
    folded: list[str] = []
    if config.fold_o_proj:
        if trainable:
            raise ValueError("fold_o_proj changes v_proj's full-precision weights before "
                             "quantizing: it is for post-training quantization (trainable=False)")
        folded = fold_o_proj_transforms(model, modules, collector.stats, transforms, config)
        report.model["o_proj_folded_into_v_proj"] = folded
    online = {name: None if name in folded else t for name, t in transforms.items()}
    report.seconds["fit_transforms"] = time.perf_counter() - fit_start

    scales: dict[str, Tensor] = {}
    static = config.act_scale == "static" and config.fmt.global_scale
    if static:
        scale_start = time.perf_counter()
        scales = _static_act_scales(model, modules, online, config, batches, reduce_max)
        report.seconds["activation_scales"] = time.perf_counter() - scale_start

    quant_start = time.perf_counter()
    if weight_quantizer is None and config.scale_search == "mse":
        weight_quantizer = _mse_rtn(config)
    items = tqdm(modules.items(), desc=f"{config.method} {config.format}", unit="layer",
                 disable=not progress)
    for name, module in items:
        stats = collector.stats[name]
        transform = transforms[name]
        weight = linear_weight(module).detach()
        padded = pad_features(weight, config.fmt)
        quantized = None
        if weight_quantizer is not None:
            quantized = weight_quantizer(name, module, padded, transform, stats)
        elif name in folded:
            quantized = quantize(transform_weight(padded, transform), config.fmt,
                                 name=f"{name}.weight")
        layer = QuantizedLinear.from_linear(
            module, config.fmt, online[name], act_scale="static" if static else "dynamic",
            act_global_scale=scales[name].to(weight.device) if static else None,
            trainable=trainable and quantized is None, name=name, quantized_weight=quantized)
        layer.to(weight.device)
        report.layers.append(layer_report(
            name, module, layer, stats, transform, config, scales.get(name),
            lam=chosen_lambda(config, report.autobrake.get(name)), folded=name in folded))
        swap_module(model, name, layer)
        collector.release(name)
    report.seconds["quantize"] = time.perf_counter() - quant_start
    report.seconds["total"] = time.perf_counter() - start
    return report
