"""Round to nearest, the weight quantizer of I, HAAR, RTN-WUSH and RTN-KBBQ.

Per block (:class:`RTN`): hooks on the targeted linears collect the ``d x d`` block second
moments of their inputs (:mod:`kbbq_pl.quant.stats`), summed over ranks; each layer's transform
is fitted (:mod:`kbbq_pl.transforms`; with ``lam="auto"`` the brake is chosen on held-out
sequences, :func:`auto_transform`) and ``W T^-1`` is rounded to nearest with min-max block scales
(or MSE-searched ones, ``scale_search="mse"``, :func:`~kbbq_pl.quant.rtn.algorithm.rtn`); the
layers vLLM fuses (q/k/v, gate/up) share one NVFP4 per-tensor scale when they share their
transform (identity, Hadamard, Haar; :func:`~kbbq_pl.quant.scales.fused_weight_scales`); with
``transform.fold_o_proj`` the ``o_proj`` transforms are folded into the ``v_proj`` rows
(:func:`fold_o_proj_transforms`, over :func:`kbbq_pl.transforms.o_proj_fold.fold_o_proj`).  By
default the next block is calibrated on the full-precision block's outputs, so every layer's
statistics are those of the full-precision model (``propagate="fp"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from ...formats import fake_quantize, quantize
from ...formats.padding import pad_features
from ...transforms.fit import FITTED_TRANSFORMS, fit_transform, kbbq_basis, transform_weight
from ...transforms.o_proj_fold import attention_heads, fold_o_proj
from ..autobrake import LambdaChoice, choose_lambda
from ..config import QuantizationConfig
from ..modules import fused_groups, is_transposed, linear_weight
from ..report import QuantizationReport
from ..scales import fused_weight_scales
from ..stats import LayerStatistics, StatisticsCollector
from ..tokens import calibrating, token_rows
from ..weight_quantizer import Block, LayerPlan, WeightQuantizer
from .algorithm import rtn

__all__ = ["RTN", "auto_transform", "fold_o_proj_transforms"]

log = logging.getLogger(__name__)


def auto_transform(weight: Tensor, fit: LayerStatistics, held_out: LayerStatistics,
                   samples: Tensor, config: QuantizationConfig, name: str = ""
                   ) -> tuple[Tensor, LambdaChoice]:
    """KBBQ with the lambda the held-out ``samples`` prefer (:func:`~kbbq_pl.quant.autobrake.
    choose_lambda`; every rank's, gathered), refitted on every token.  The candidates share
    one basis fitted on the fitting part (Cholesky and eigendecomposition of every block,
    :func:`~kbbq_pl.transforms.fit.kbbq_basis`), each rounded to nearest with the block scales
    it is stored with (``weights.scale_search``)."""
    basis = kbbq_basis(weight, fit.sigma_blocks(), config.transform.damping, name=name)

    def candidate(lam: float) -> tuple[Tensor, Tensor]:
        transform = basis.transform(lam)
        transformed = transform_weight(weight.float(), transform)
        if config.weights.scale_search == "mse":
            return rtn(transformed, config.fmt, search="mse")[1], transform
        return fake_quantize(transformed, config.fmt), transform  # min-max: rtn's, faster

    samples = pad_features(samples, config.fmt).to(weight.device)
    choice = choose_lambda(weight, samples, candidate, config.fmt, config.autobrake.grid,
                           config.effective_act_scale)
    basis = kbbq_basis(weight, fit.pooled(held_out).sigma_blocks(), config.transform.damping,
                       name=name)
    return basis.transform(choice.lam), choice


FOLD_TOLERANCE = 1e-3
"""The largest relative change of a block's full-precision outputs that a fold may make (the
fold is exact in real arithmetic; float32 rounding moves them by ~1e-6)."""


def fold_o_proj_transforms(block: Block, stats: dict[str, LayerStatistics],
                           transforms: dict[str, Tensor | None]
                           ) -> dict[str, tuple[str, Tensor, Tensor | None]]:
    """``transform.fold_o_proj``: refit every ``o_proj``'s transform shared per value head and
    fold it into its ``v_proj``'s rows; refit that ``v_proj``'s transform on its new weight.
    Updates ``transforms``; returns, per folded ``o_proj``, its ``v_proj`` and the new
    full-precision ``(weight, bias)`` of the ``v_proj`` (the model is not changed).

    The fold assumes that ``o_proj`` reads the attention probabilities times the values.  An
    attention that changes the values on the way (Qwen3-Next's output gate, Gemma 3n's
    ``v_norm``) breaks it: the block is run in full precision on its first cached batch with
    the folds in place, and where its outputs move by more than :data:`FOLD_TOLERANCE` the
    block keeps its online transforms, with a warning."""
    config, modules = block.config, block.linears
    heads = attention_heads(block.model.config)
    pairs = [(name, name.removesuffix("o_proj") + "v_proj") for name in modules
             if name.endswith("o_proj")]
    pairs = [(o, v) for o, v in pairs if v in modules]
    if not pairs:
        raise ValueError("fold_o_proj: no targeted o_proj with a targeted v_proj beside it "
                         f"in {type(block.model).__name__} ({', '.join(modules)})")

    def fit(weight: Tensor, sigma: Tensor) -> Tensor | None:
        return fit_transform(config.transform.name, weight, sigma, block=config.block,
                             lam=float(config.transform.lam), seed=config.transform.seed,
                             damping=config.transform.damping)

    folded, unfolded = {}, dict(transforms)
    for o_name, v_name in pairs:
        v_module = modules[v_name]
        try:
            pair = fold_o_proj(linear_weight(modules[o_name]).detach(),
                               stats[o_name].sigma_blocks(), linear_weight(v_module).detach(),
                               v_module.bias, stats[v_name].sigma_blocks(), heads, fit,
                               config.fmt)
        except ValueError as error:
            raise ValueError(f"fold_o_proj: {o_name} into {v_name}: {error}") from error
        if pair is None:
            continue
        transforms[o_name] = pair.o_transform
        transforms[v_name] = pair.v_transform
        folded[o_name] = (v_name, pair.v_weight, pair.v_bias)
    change = _fold_change(block, folded, transforms) if folded else 0.0
    if change > FOLD_TOLERANCE:
        log.warning("fold_o_proj: %s: folding moves the block's full-precision outputs by %.2g "
                    "(relative): its attention changes the values before o_proj (a gate or a "
                    "norm), so its o_proj keeps an online transform", ", ".join(folded), change)
        transforms.update(unfolded)
        return {}
    return folded


@torch.no_grad()
def _fold_change(block: Block, folded: dict[str, tuple[str, Tensor, Tensor | None]],
                 transforms: dict[str, Tensor | None]) -> float:
    """The relative change of the block's outputs, at the token positions of its first cached
    batch that has tokens, when each folded ``o_proj`` computes with ``W T^-1`` and its
    ``v_proj`` with the folded rows (full precision)."""
    positions = block.step.runner.positions
    first = next((i for i, p in enumerate(positions) if p is None or bool(p.any())), 0)
    batch = slice(first, first + 1)
    reference = block.step.run(subset=batch)[0]
    saved = []
    try:
        for o_name, (v_name, weight, bias) in folded.items():
            o_module, v_module = block.linears[o_name], block.linears[v_name]
            for module, new in ((o_module, transform_weight(
                    linear_weight(o_module).detach(), transforms[o_name])),
                                (v_module, weight)):
                saved.append((module.weight, module.weight.data))
                module.weight.data = (new.T if is_transposed(module) else new).to(
                    module.weight.dtype)
            if bias is not None:
                saved.append((v_module.bias, v_module.bias.data))
                v_module.bias.data = bias.to(v_module.bias.dtype)
        outputs = block.step.run(subset=batch)[0]
    finally:
        for tensor, data in reversed(saved):
            tensor.data = data
    if positions[first] is not None:  # padding's outputs are not the model's
        with calibrating(positions[first]):
            reference, outputs = token_rows(reference), token_rows(outputs)
    reference, outputs = reference.double(), outputs.double()
    change = (outputs - reference).norm() / reference.norm().clamp(min=1e-30)
    return float(block.collectives.reduce_max(change.float()))  # every rank decides alike


@dataclass
class RTNCalibration:
    """A block's statistics: of the fitting batches (every batch without ``lam="auto"``), and
    of the held-out ones."""

    fit: StatisticsCollector
    held_out: StatisticsCollector | None


class RTN(WeightQuantizer):
    """Round to nearest of ``W T^-1`` (module docstring); ``trainable`` keeps the master
    weights ``W T^-1`` in high precision for fine-tuning
    (:class:`~kbbq_pl.quant.layers.QuantizedLinear`)."""

    propagate: ClassVar = "fp"
    work_stage: ClassVar = "fit_transforms"

    def __init__(self, config: QuantizationConfig, *, trainable: bool = False) -> None:
        super().__init__(config, trainable=trainable)
        if trainable and config.transform.fold_o_proj:
            raise ValueError("fold_o_proj changes v_proj's full-precision weights before "
                             "quantizing: it is for post-training quantization (trainable=False)")
        self.folded: list[str] = []

    def calibrate(self, block: Block, keep_outputs: bool
                  ) -> tuple[RTNCalibration, list[Tensor] | None]:
        config, split, step = self.config, block.split, block.step
        keep = config.keep_samples
        fit = StatisticsCollector(block.linears, config.block, keep, split.stride(keep, 0),
                                  full=config.transform.name == "haar")
        fit.seek(split.offsets[0])
        with fit.hooks():
            outputs = step.run(keep_outputs, subset=split.fit_part)
        fit.reduce(block.collectives.reduce_sum)
        fit.check_nonempty()
        held_out = None
        if split.held_out:
            held_out = StatisticsCollector(block.linears, config.block, config.autobrake.tokens,
                                           split.stride(config.autobrake.tokens, 1))
            held_out.seek(split.offsets[1])
            with held_out.hooks():
                rest = step.run(keep_outputs, subset=split.held_out_part)
            held_out.reduce(block.collectives.reduce_sum)
            if outputs is not None and rest is not None:
                outputs += rest
        return RTNCalibration(fit, held_out), outputs

    def quantize(self, block: Block, calibration: RTNCalibration) -> dict[str, LayerPlan]:
        config = self.config
        stats = calibration.fit.stats
        transforms: dict[str, Tensor | None] = {}
        choices: dict[str, LambdaChoice] = {}
        padded = {name: pad_features(linear_weight(module).detach(), config.fmt)
                  for name, module in block.linears.items()}
        held_out = calibration.held_out
        for name, weight in padded.items():
            if held_out is not None:
                samples = block.collectives.gather_rows(  # on the device, as NCCL needs
                    held_out.stats[name].sample().to(weight.device), held_out.keep_samples)
                transforms[name], choices[name] = auto_transform(
                    weight, stats[name], held_out.stats[name], samples, config, name)
            else:
                transforms[name] = fit_transform(
                    config.transform.name, weight, stats[name].sigma_blocks(), block=config.block,
                    lam=config.transform.lam, seed=config.transform.seed,
                    damping=config.transform.damping, name=name)
        folded = {}
        if config.transform.fold_o_proj:
            folded = fold_o_proj_transforms(block, stats, transforms)
            self.folded += list(folded)
        new_values = {v_name: (weight, bias) for v_name, weight, bias in folded.values()}
        shared: dict[str, Tensor | None] = {}
        # stored codes (no master weight: not trainable, or a weight that does not require
        # grad) of the layers vLLM fuses share one per-tensor scale
        frozen = {name for name, module in block.linears.items() if not self.keeps_master(module)}
        if config.fmt.global_scale and config.transform.name not in FITTED_TRANSFORMS:
            groups = [group for group in fused_groups(block.linears) if frozen.issuperset(group)]
            shared = fused_weight_scales(
                {name: transform_weight(padded[name], transforms[name])
                 for group in groups for name in group}, config.fmt, groups)

        plans = {}
        for name in block.linears:
            weight = padded[name]
            full_precision = new_values.get(name)
            if full_precision is not None:  # the weight the module takes (in its dtype)
                weight = pad_features(full_precision[0].to(weight.dtype), config.fmt)
            quantized = None
            if config.weights.scale_search == "mse" or name in shared:
                quantized = rtn(transform_weight(weight, transforms[name]), config.fmt,
                                search=config.weights.scale_search,
                                global_scale=shared.get(name))[0]
            elif name in folded:
                quantized = quantize(transform_weight(weight, transforms[name]), config.fmt,
                                     name=f"{name}.weight")
            plans[name] = LayerPlan(  # the report reads every token's statistics
                transform=transforms[name], online=None if name in folded else transforms[name],
                stats=stats[name] if held_out is None else stats[name].pooled(
                    held_out.stats[name]),
                weight=quantized, full_precision=full_precision,
                choice=choices.get(name), folded=name in folded)
        return plans

    def finish(self, report: QuantizationReport) -> None:
        if self.config.transform.fold_o_proj:
            report.model["o_proj_folded_into_v_proj"] = self.folded
