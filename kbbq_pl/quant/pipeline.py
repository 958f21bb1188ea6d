"""Post-training W4A4 quantization of a model, one pipeline for every method.

:func:`quantize_model` walks the transformer blocks in order
(:class:`~kbbq_pl.quant.sequential.SequentialRunner`: the first block's inputs are captured
once, then each block runs over its cached inputs).  For each block, on ``device``:

1. the weight quantizer (:class:`~kbbq_pl.quant.weight_quantizer.WeightQuantizer`: RTN or the
   GPTQ family, the recipe's ``weights.quantizer``) runs the full-precision block with its hooks:
   input second moments or Hessians, held-out samples for ``lam="auto"``, summed over ranks;
2. it fits each linear's transform and quantizes ``W T^-1``;
3. for a static NVFP4 activation scale, ``amax(T x)`` of every layer's transformed inputs,
   from its inputs kept in step 1's pass (:func:`~kbbq_pl.quant.stats.kept_inputs`: the
   transform is known only after it, and running the block again would cost a pass);
4. every linear is swapped for a :class:`~kbbq_pl.quant.layers.QuantizedLinear` and gets its
   report row (kappas, utilization, output SNR on kept calibration tokens);
5. the next block's inputs are the outputs of the full-precision block (``propagate="fp"``, kept
   from step 1) or of the quantized block (``propagate="quantized"``, run after step 4).

Only the current block is on ``device``; the others stay where they are (e.g. on the CPU, so a
model larger than the accelerator's memory quantizes) and the cached activations live on
``offload_device``.  Peak memory goes into the report.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..transforms.autobrake import LambdaChoice, fold_sequences, model_finalists, split_sequences
from .config import (
    Batches,
    BroadcastFn,
    Collectives,
    QuantizationConfig,
    ReduceFn,
    _identity,
    count_tokens,
)
from .divergence import HeldOutStreams, held_out_divergence
from .gptq.quantizer import GPTQ
from .layers import QuantizedLinear, quantized_linears, swap_module
from .modules import check_finite, find_linears, in_out_features, linear_weight
from .report import QuantizationReport, chosen_lambda, layer_report, peak_memory_mb
from .rtn.quantizer import RTN
from .sequential import BlockResidency, SequentialRunner, trim_heap
from .stats import act_scales_from_amax, kept_inputs, transformed_amax
from .w4a4 import cache_decoded_weights
from .weight_quantizer import Block, CalibrationSplit, LayerPlan, WeightQuantizer

__all__ = ["WEIGHT_QUANTIZERS", "HeldOutComparison", "held_out_batches", "one_lambda_runs",
           "quantize_model", "select_layers"]

log = logging.getLogger(__name__)

WEIGHT_QUANTIZERS: dict[str, type[WeightQuantizer]] = {"rtn": RTN, "gptq": GPTQ}
"""The weight quantizer a recipe's ``weights.quantizer`` names."""


def select_layers(model: nn.Module, config: QuantizationConfig) -> tuple[dict[str, nn.Module],
                                                                           dict[str, str]]:
    """Targeted layers, and those skipped with the reason; a weight holding NaN or Inf is an
    error naming the layer (before any calibration), and so is a model that already holds
    quantized layers (quantizing again would round rounded weights).  A weight still on the meta
    device (a block streamed from disk, not read yet) is checked when :func:`quantize_model`
    reaches its block."""
    existing = list(quantized_linears(model))
    if existing:
        raise ValueError(f"{type(model).__name__} is already quantized ({len(existing)} quantized "
                         f"layers, e.g. {existing[0]}): quantizing again would round rounded "
                         "weights; quantize the full-precision model")
    modules = find_linears(model, config.layers.targets, config.layers.ignore)
    for name, module in modules.items():
        if not linear_weight(module).is_meta:  # a streamed block's: checked when it is read
            check_finite(linear_weight(module), name, "weight")
    skipped: dict[str, str] = {}
    if config.format.unaligned == "skip":
        for name, module in list(modules.items()):
            in_features, _ = in_out_features(module)
            if in_features % config.block:
                skipped[name] = (f"in_features {in_features} is not a multiple of the "
                                 f"{config.format.name} block {config.block}")
                del modules[name]
                log.warning("%s: skipped (%s)", name, skipped[name])
    if not modules:
        raise ValueError("every targeted layer was skipped; nothing to quantize")
    return modules, skipped


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    batches: Batches,
    config: QuantizationConfig,
    *,
    reduce_sum: ReduceFn = _identity,
    reduce_max: ReduceFn = _identity,
    broadcast: BroadcastFn | None = None,
    rank: int = 0,
    world_size: int = 1,
    shard: bool = False,
    weight_quantizer: WeightQuantizer | None = None,
    trainable: bool = False,
    progress: bool = True,
    device: torch.device | str | None = None,
    offload_device: torch.device | str = "cpu",
    residency: BlockResidency | None = None,
    held_out: HeldOutStreams | None = None,
) -> QuantizationReport:
    """Quantize ``model`` in place with ``config`` (module docstring); returns the report.

    ``batches`` are the model's keyword inputs (a list or a DataLoader).  ``reduce_sum`` /
    ``reduce_max`` all-reduce a tensor across data-parallel ranks, ``broadcast(obj, src)``,
    ``rank`` and ``world_size`` split GPTQ's layers over them (identities on one process; see
    :func:`~kbbq_pl.quant.config.lightning_collectives`).  ``shard``: ``batches`` are every
    rank's calibration, the same on each (``kbbq-pl quantize`` under torchrun); the sequences are
    split for the auto-brake first and each rank calibrates on its contiguous share of every
    part, so that ``lam: auto`` scores one process's held-out tokens (without it each rank
    brought its own batches, as under a Lightning sampler).  ``trainable`` keeps high-precision
    master weights ``W T^-1`` for fine-tuning (RTN).  ``weight_quantizer`` replaces the one the
    recipe names (built with the same ``config`` and ``trainable``).  ``device`` runs each
    block (default: where the model is); ``offload_device`` holds the cached activations
    between blocks; ``residency`` brings each block's weights there (default: the model is in
    memory, :class:`~kbbq_pl.quant.sequential.MoveToDevice`; a model streamed from disk:
    :class:`kbbq_pl.io.streaming.StreamedBlocks`).  ``held_out`` carries the auto-brake's
    held-out sequences through the blocks beside the run (``autobrake.scope: best``).
    """
    if config.auto and config.autobrake.scope != "layer":
        return _quantize_model_scope(
            model, batches, config, weight_quantizer=weight_quantizer, residency=residency,
            reduce_sum=reduce_sum, reduce_max=reduce_max, broadcast=broadcast, rank=rank,
            world_size=world_size, shard=shard, trainable=trainable,
            progress=progress, device=device, offload_device=offload_device)
    start = time.perf_counter()
    collectives = Collectives(reduce_sum, reduce_max, broadcast, rank, world_size)
    quantizer = weight_quantizer or WEIGHT_QUANTIZERS[config.weights.quantizer](
        config, trainable=trainable)
    if quantizer.config != config or quantizer.trainable != trainable:
        raise ValueError(f"weight_quantizer {type(quantizer).__name__} was built for another "
                         f"recipe ({quantizer.config.label}, trainable={quantizer.trainable}) "
                         f"than this run's ({config.label}, trainable={trainable})")
    if world_size > 1 and broadcast is None and quantizer.splits_work:
        raise ValueError(f"world_size {world_size}: {config.method} splits layers across ranks "
                         "and needs broadcast(obj, src)")
    propagate = config.weights.propagate or quantizer.propagate
    batches = list(batches)
    if not batches:
        raise ValueError("the calibration set is empty: no batches")
    modules, skipped = select_layers(model, config)
    split, batches = _calibration_parts(batches, config, collectives, shard)
    streamed = {name for name, module in modules.items() if linear_weight(module).is_meta}
    targets = set(modules)  # names only: a replaced layer's weights are freed with its block
    del modules
    runner = SequentialRunner(model, batches, device=device,
                              offload_device=offload_device, targets=targets,
                              residency=residency)
    if streamed and runner.whole_model is not None:
        raise ValueError(f"{type(model).__name__} runs as one block ({runner.whole_model}): its "
                         "weights cannot be read block by block; load the model in memory")
    if held_out is not None:
        held_out.start(runner)
    if runner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(runner.device)
    report = QuantizationReport(config=config.to_dict(), skipped=skipped)
    timing = dict.fromkeys(("calibration", quantizer.work_stage, "activation_scales",
                            "quantize", "propagation"), 0.0)
    modes = weakref.WeakKeyDictionary((module, module.training) for module in model.modules())
    model.eval()
    try:
        steps = tqdm(runner, total=len(runner), desc=f"{config.method} {config.format.name}",
                     unit="block", disable=not progress or len(runner) == 1)
        for step in steps:
            last = step.index == len(runner) - 1
            linears = {n: m for n, m in step.linears().items() if n in targets}
            # propagating through the quantized block decodes its weights: the report's output
            # SNR decodes them first, and the block's forward reuses those copies
            with step.on_device(), (cache_decoded_weights() if propagate == "quantized"
                                    else contextlib.nullcontext()):
                for name in streamed.intersection(linears):
                    check_finite(linear_weight(linears[name]), name, "weight")
                outputs = None
                if held_out is not None:
                    held_out.before(step)
                if linears:
                    block = Block(step, linears, model, config, collectives, split, timing,
                                  progress)
                    outputs = _quantize_block(block, quantizer, propagate == "fp" and not last,
                                              report)
                if held_out is not None:
                    held_out.after(step)
                if not last:
                    tick = time.perf_counter()
                    if outputs is None:  # the quantized block's: each weight decoded once
                        outputs = step.run()
                    step.advance(outputs)
                    timing["propagation"] += time.perf_counter() - tick
            trim_heap()
    finally:  # every module back in its mode; the new layers in training mode, ready to be
        # fine-tuned (straight-through), until the model is put in eval mode
        for module in model.modules():
            module.training = modes.get(module, True)
    quantizer.finish(report)
    report.seconds.update(timing)
    report.seconds["total"] = time.perf_counter() - start
    report.model.update(peak_memory_mb(runner.device))
    report.model["blocks"] = len(runner)
    report.model["propagate"] = propagate
    if runner.whole_model is not None:
        report.model["whole_model"] = runner.whole_model
    return report


Candidate = str | float
"""A model :func:`one_lambda_runs` compares, quantized on the fitting sequences alone:
``"layer"`` (the per-layer auto-brake, ``autobrake.scope: best``) or a finalist lambda."""


def one_lambda_runs(config: QuantizationConfig,
                    score: Callable[[QuantizationConfig], QuantizationReport],
                    trial: Callable[[Candidate, QuantizationConfig], QuantizationReport],
                    quantize: Callable[[QuantizationConfig], QuantizationReport],
                    divergence: Callable[[Candidate], tuple[float, str]]
                    ) -> tuple[str, QuantizationReport]:
    """The runs of ``autobrake.scope`` ``model`` and ``best``.

    ``score`` runs the per-layer auto-brake on every sequence (on a copy of the model, or
    streamed) to score every candidate in every layer; its model is the ``scope: layer``
    recipe's.  The finalists are the ``autobrake.finalists`` candidates of the smallest mean
    error (:func:`model_finalists`).  Where models are compared (several finalists, or
    ``best``), ``trial(candidate, recipe)`` quantizes each candidate on the fitting sequences
    alone (with ``best``, the per-layer auto-brake too: ``"layer"``, which splits the fitting
    sequences again to choose) and the one whose outputs on the held-out sequences are closest
    to the full-precision model's (``divergence``) is kept.  Every comparison is out of
    sample: a model fitted on the held-out sequences too flatters the choices that fit them
    more closely (docs/results/2026-11-26-autobrake-finalists.md).  A kept lambda is then
    quantized on every sequence by ``quantize`` (bit for bit the fixed-lambda recipe); a kept
    ``"layer"`` is the scoring run's model.  Returns ``"layer"`` or ``"model"``, the model
    kept, and its report, which holds every layer's scores, the choices, the divergences and
    the runs' times."""
    autobrake = config.autobrake
    best = autobrake.scope == "best"
    layer_scope = replace(config, autobrake=replace(autobrake, scope="layer", finalists=1))
    scoring = score(layer_scope)
    finalists, means = model_finalists(scoring.autobrake, autobrake.finalists)
    log.info("autobrake.scope %s: finalists %s (mean held-out error %s dB)", autobrake.scope,
             ", ".join(f"{lam:g}" for lam in finalists),
             ", ".join(f"{k:g}: {v:.3f}" for k, v in means.items()))

    def fixed(lam: float) -> QuantizationConfig:
        return replace(config, transform=replace(config.transform, lam=lam))

    seconds = dict.fromkeys(("autobrake_scoring", "autobrake_trials", "autobrake_fixed",
                             "autobrake_compare"), 0.0)
    seconds["autobrake_scoring"] = scoring.seconds["total"]
    candidates: list[Candidate] = (["layer"] if best else []) + (
        list(finalists) if autobrake.compares_models else [])
    trials: dict[Candidate, tuple[float, str]] = {}
    for candidate in candidates:
        recipe = layer_scope if candidate == "layer" else fixed(float(candidate))
        seconds["autobrake_trials"] += trial(candidate, recipe).seconds["total"]
        tick = time.perf_counter()
        trials[candidate] = divergence(candidate)
        seconds["autobrake_compare"] += time.perf_counter() - tick
    if trials:
        log.info("autobrake.scope %s: held-out %s, fitted on the other sequences: %s",
                 autobrake.scope, trials[candidates[0]][1],
                 ", ".join(f"{'per layer' if c == 'layer' else f'{c:g}'}: {value:.5g}"
                           for c, (value, _) in trials.items()))
    lam = min(finalists, key=lambda c: trials[c][0]) if trials else finalists[0]
    kept = "layer" if best and trials["layer"][0] < trials[lam][0] else "model"
    summary = {"lam": lam, "mean_error_db": means,
               "layer_choices": {name: choice.lam for name, choice in scoring.autobrake.items()}}
    if trials:
        summary["finalists"] = {c: value for c, (value, _) in trials.items() if c != "layer"}
    if kept == "layer":
        report = scoring
    else:
        report = quantize(fixed(lam))
        seconds["autobrake_fixed"] = report.seconds["total"]
        report.autobrake = {name: LambdaChoice(lam, choice.errors)
                            for name, choice in scoring.autobrake.items()}
    report.config = config.to_dict()
    report.model["autobrake_model"] = summary
    if best:
        report.model["autobrake_best"] = {
            "kept": kept, "metric": trials["layer"][1],
            "divergence": {"layer": trials["layer"][0], "model": trials[lam][0]}}
        log.info("autobrake.scope best: keeps %s", "per layer" if kept == "layer"
                 else f"lambda {lam:g}")
    report.seconds.update({k: v for k, v in seconds.items() if v or k == "autobrake_fixed"})
    report.seconds["total"] = sum(seconds.values())
    return kept, report


def _quantize_model_scope(model: nn.Module, batches: Batches, config: QuantizationConfig, *,
                          weight_quantizer: WeightQuantizer | None,
                          residency: BlockResidency | None, **run: Any) -> QuantizationReport:
    """``autobrake.scope`` ``model`` and ``best`` in memory (:func:`one_lambda_runs`): the
    per-layer run and each trial on copies of ``model``, the run at the chosen lambda on
    ``model``, the held-out sequences carried beside the runs (:class:`HeldOutComparison`)
    where models are compared; ``model`` becomes the kept one."""
    scope = config.autobrake.scope
    if weight_quantizer is not None:
        raise ValueError(f"autobrake.scope {scope!r} builds its own weight quantizers (one per "
                         "run); pass weight_quantizer=None")
    if residency is not None or any(linear_weight(m).is_meta
                                    for m in find_linears(model, config.layers.targets,
                                                          config.layers.ignore).values()):
        raise ValueError(f"autobrake.scope {scope!r} quantizes a copy of the model first: load "
                         "the model in memory, stream it from disk with kbbq_pl."
                         "quantize_checkpoint (kbbq-pl quantize --stream), or choose per layer "
                         "(autobrake.scope: layer)")
    comparison = HeldOutComparison(batches, config, run)
    per_layer: list[nn.Module] = []  # scope best: kept until the comparison

    def score(layer_scope: QuantizationConfig) -> QuantizationReport:
        scratch = copy.deepcopy(model)
        if scope == "best":
            per_layer.append(scratch)
        return quantize_model(scratch, batches, layer_scope, held_out=comparison.reference(),
                              **run)

    def trial(candidate: Candidate, recipe: QuantizationConfig) -> QuantizationReport:
        report = quantize_model(copy.deepcopy(model), comparison.fitting, recipe,
                                held_out=comparison.stream(candidate), **run)
        trim_heap()  # the trial's model is freed: its held-out outputs are in its stream
        return report

    try:
        kept, report = one_lambda_runs(
            config, score, trial,
            lambda fixed: quantize_model(model, batches, fixed, **run),
            lambda candidate: comparison.divergence(candidate, model))
        if kept == "layer":
            _adopt(model, per_layer[0])
    finally:
        per_layer.clear()
        trim_heap()
    return report


class HeldOutComparison:
    """The held-out sequences of :func:`one_lambda_runs` and the streams its runs carry: the
    full-precision model's rides with the scoring run (:meth:`reference`), each trial carries
    its own (:meth:`stream`); nothing where nothing is compared (``scope: model`` with one
    finalist).  ``fitting``: the fitting sequences the trials calibrate on (every rank's, as
    ``batches`` are: the pipeline shards them)."""

    def __init__(self, batches: Batches, config: QuantizationConfig,
                 run: Mapping[str, Any]) -> None:
        autobrake = config.autobrake
        self.compare = autobrake.compares_models
        self.reduce_sum = run.get("reduce_sum", _identity)
        self.batches = held_out_batches(batches, config, run) if self.compare else []
        self.fitting = (split_sequences(list(batches), autobrake.holdout,
                                        config.transform.seed)[0] if self.compare else [])
        self.full_precision: HeldOutStreams | None = None
        self.streams: dict[Candidate, HeldOutStreams] = {}

    def reference(self) -> HeldOutStreams | None:
        """The stream the scoring run carries: each block in full precision (None: nothing
        is compared)."""
        if self.compare:
            self.full_precision = HeldOutStreams(self.batches, before="reference")
        return self.full_precision

    def stream(self, candidate: Candidate) -> HeldOutStreams:
        """The stream the trial of ``candidate`` carries: each block once quantized."""
        self.streams[candidate] = HeldOutStreams(self.batches, after="candidate")
        return self.streams[candidate]

    def divergence(self, candidate: Candidate, tail: nn.Module) -> tuple[float, str]:
        """How far ``candidate``'s outputs are from the full-precision model's
        (:func:`held_out_divergence`; ``tail`` runs the layers after the blocks)."""
        reference = self.full_precision
        assert reference is not None, "the scoring run carries the full-precision stream"
        (result,) = held_out_divergence(
            reference.model("reference", tail),
            {candidate: self.streams.pop(candidate).model("candidate", tail)},
            reference.batches, self.reduce_sum).values()
        return result


def held_out_batches(batches: Batches, config: QuantizationConfig, run: Mapping[str, Any]
                     ) -> list[Any]:
    """This rank's held-out sequences of the auto-brake's split (as the pipeline makes it)."""
    collectives = Collectives(run.get("reduce_sum", _identity), run.get("reduce_max", _identity),
                              run.get("broadcast"), run.get("rank", 0), run.get("world_size", 1))
    split, mine = _calibration_parts(list(batches), config, collectives, run.get("shard", False))
    return mine[split.held_out_part]


def _adopt(model: nn.Module, other: nn.Module) -> None:
    """Make ``model`` hold ``other``'s submodules, parameters and buffers (``other`` is a deep
    copy of ``model`` quantized another way)."""
    for key in ("_modules", "_parameters", "_buffers"):
        model.__dict__[key] = other.__dict__[key]


def _calibration_parts(batches: list[Any], config: QuantizationConfig, collectives: Collectives,
                       shard: bool) -> tuple[CalibrationSplit, list[Any]]:
    """The parts of the calibration (the fitting and held-out sequences of ``lam: auto``, its
    folds, or every batch) and this rank's batches, part after part; with ``shard`` each rank
    keeps its contiguous share of every part."""
    folded = config.auto and config.autobrake.folds > 1
    if folded:
        parts = fold_sequences(batches, config.autobrake.folds, config.transform.seed)
    elif config.auto:
        parts = list(split_sequences(batches, config.autobrake.holdout, config.transform.seed))
    else:
        parts = [batches, []]
    part_tokens = tuple(count_tokens(part) for part in parts)
    offsets = [0] * len(parts)
    if shard:
        names = ([f"fold {k}" for k in range(len(parts))] if folded else
                 ["the calibration set" if not config.auto else "the fitting part",
                  "the held-out part"])
        for k, part in enumerate(parts):
            if part or k == 0:
                share = collectives.share(len(part), names[k])
                offsets[k] = count_tokens(part[:share.start])
                parts[k] = part[share]
    sizes = [len(part) for part in parts]
    split = (CalibrationSplit(sum(sizes), 0, part_tokens, tuple(offsets), tuple(sizes))
             if folded else CalibrationSplit(sizes[0], sizes[1], part_tokens, tuple(offsets)))
    return split, [batch for part in parts for batch in part]


def _quantize_block(block: Block, quantizer: WeightQuantizer, keep_outputs: bool,
                    report: QuantizationReport) -> list[Tensor] | None:
    """Steps 1-4 of the module docstring for one block; returns the full-precision block's
    outputs when ``keep_outputs``."""
    config, timing, step = block.config, block.timing, block.step
    static = config.effective_act_scale == "static"
    tick = time.perf_counter()
    with (kept_inputs(block.linears, step.module, step.runner.offload_device) if static
          else contextlib.nullcontext({})) as inputs:
        calibration, outputs = quantizer.calibrate(block, keep_outputs)
    timing["calibration"] += time.perf_counter() - tick

    tick = time.perf_counter()
    plans = quantizer.quantize(block, calibration)
    timing[quantizer.work_stage] += time.perf_counter() - tick

    scales: dict[str, Tensor] = {}
    if static:
        tick = time.perf_counter()
        scales = _static_act_scales(inputs, block.linears, plans, config, step.runner.device,
                                    block.collectives.reduce_max)
        inputs.clear()
        timing["activation_scales"] += time.perf_counter() - tick

    tick = time.perf_counter()
    for name, module in block.linears.items():
        plan = plans[name]
        if plan.full_precision is not None:
            _set_full_precision(module, *plan.full_precision)
        weight = linear_weight(module)
        layer = QuantizedLinear.from_linear(
            module, config.fmt, plan.online, act_scale=config.effective_act_scale,
            act_global_scale=scales[name].to(weight.device) if static else None,
            trainable=quantizer.trainable and plan.weight is None, name=name,
            quantized_weight=plan.weight)
        layer.to(weight.device)
        report.layers.append(layer_report(name, module, layer, plan.stats, plan.transform,
                                          config, scales.get(name),
                                          lam=chosen_lambda(config, plan.choice),
                                          folded=plan.folded,
                                          collectives=block.collectives))
        if plan.choice is not None:
            report.autobrake[name] = plan.choice
        swap_module(block.model, name, layer)
    timing["quantize"] += time.perf_counter() - tick
    return outputs


def _static_act_scales(inputs: Mapping[str, list[Tensor]], linears: Mapping[str, nn.Module],
                       plans: Mapping[str, LayerPlan], config: QuantizationConfig,
                       device: torch.device, reduce_max: ReduceFn) -> dict[str, Tensor]:
    """Per-tensor NVFP4 scales ``amax(T x) / (448 * 6)`` of every layer's transformed inputs,
    from the inputs kept in the calibration pass of the full-precision block (no second run
    of it; a folded layer's ``T`` applies to the unfolded weights' inputs, which these are)."""
    transforms = {name: plan.transform for name, plan in plans.items()}
    amax = transformed_amax(inputs, linears, transforms, config.fmt, device)
    return act_scales_from_amax(amax, reduce_max)


def _set_full_precision(module: nn.Module, weight: Tensor, bias: Tensor | None) -> None:
    module.weight.copy_(weight)
    if bias is not None:
        module.bias.copy_(bias)
