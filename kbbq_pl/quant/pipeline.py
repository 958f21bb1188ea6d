"""Post-training W4A4 quantization of a model, one pipeline for every method.

:func:`quantize_model` walks the transformer blocks in order
(:class:`~kbbq_pl.quant.sequential.SequentialRunner`: the first block's inputs are captured
once, then each block runs over its cached inputs).  For each block, on ``device``:

1. the weight quantizer (:class:`~kbbq_pl.quant.weight_quantizer.WeightQuantizer`: RTN or the
   GPTQ family, the recipe's ``weights.quantizer``) runs the full-precision block with its hooks:
   input second moments or Hessians (with ``lam="auto"``, of the fitting and the held-out
   sequences apart), summed over ranks;
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
``offload_device``.  With ``compute_dtype`` (``kbbq-pl quantize``: float32) the model stays in
the dtype it is held in (e.g. bfloat16 as saved) and only the current block is converted for
its step (the layers before the first block, for the capture): one model's bytes in memory,
the float32 results.  Peak memory goes into the report.

A mixture-of-experts model's fused experts are made linear layers first, and every expert sees
every calibration token while the model is quantized (:mod:`kbbq_pl.quant.experts`); where the
experts share their transform (identity, Hadamard, Haar), static activation scales are shared
by every expert's up projection, and by every expert's down projection
(:func:`~kbbq_pl.quant.experts.expert_projections`), as vLLM's MoE layers use them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..transforms.fit import FITTED_TRANSFORMS
from .collectives import Collectives, ReduceFn
from .config import QuantizationConfig
from .experts import (
    ExpertLinears,
    calibrating_every_expert,
    expert_projections,
    moe_routers,
    unfuse_experts,
)
from .gptq.quantizer import GPTQ
from .layers import QuantizedLinear, quantized_linears, swap_module
from .modules import (
    adapter_linears,
    check_layer_finite,
    find_linears,
    has_own_forward,
    in_out_features,
    linear_weight,
    linear_weight_count,
    modality_encoders,
    task_head_linears,
    weights_outside_linears,
)
from .report import QuantizationReport, chosen_lambda, layer_report, peak_memory_mb
from .rtn.quantizer import RTN
from .sequential import Batches, BlockResidency, SequentialRunner, held_in, trim_heap
from .siblings import group_sibling_linears
from .stats import act_scales_from_amax, kept_inputs, transformed_amax
from .w4a4 import cache_decoded_weights
from .weight_quantizer import Block, LayerPlan, WeightQuantizer

__all__ = ["WEIGHT_QUANTIZERS", "quantize_model", "select_layers"]

log = logging.getLogger(__name__)

WEIGHT_QUANTIZERS: dict[str, type[WeightQuantizer]] = {"rtn": RTN, "gptq": GPTQ}
"""The weight quantizer a recipe's ``weights.quantizer`` names."""


def select_layers(model: nn.Module, config: QuantizationConfig) -> tuple[dict[str, nn.Module],
                                                                           dict[str, str]]:
    """Targeted layers, and those skipped with the reason; a weight holding NaN or Inf is an
    error naming the layer (before any calibration), and so is a model that already holds
    quantized layers (quantizing again would round rounded weights).  Fused mixture-of-experts
    experts are first made linear layers (:func:`~kbbq_pl.quant.experts.unfuse_experts`);
    a multimodal model's vision tower and projector are left out (text calibration does not run
    them: :func:`~kbbq_pl.quant.modules.modality_encoders`), each listed among the skipped, as
    are peft adapters' layers (:func:`~kbbq_pl.quant.modules.adapter_linears`), and
    so are the routers of mixture-of-experts layers (:func:`~kbbq_pl.quant.experts.moe_routers`)
    and linear layers whose class has its own forward (:func:`~kbbq_pl.quant.modules.
    has_own_forward`);
    weights outside linear layers (routers, experts of unknown layouts) are listed among the
    skipped, with a warning when they hold 1% or more of the weights.  A weight still on the meta
    device (a block streamed from disk, not read yet) is checked when :func:`quantize_model`
    reaches its block."""
    existing = list(quantized_linears(model))
    if existing:
        raise ValueError(f"{type(model).__name__} is already quantized ({len(existing)} quantized "
                         f"layers, e.g. {existing[0]}): quantizing again would round rounded "
                         "weights; quantize the full-precision model")
    unfuse_experts(model)
    modules = find_linears(model, config.layers.targets, config.layers.ignore)
    skipped: dict[str, str] = {}
    if config.layers.ignore is None:  # the default ignore: a task head, as the LM head
        for name in task_head_linears(model, list(modules)):
            del modules[name]
            skipped[name] = (f"the task head of {type(model).__name__} (outside its base "
                             "model): kept in full precision, as the LM head")
    encoders = {encoder: f"{encoder}." for encoder in modality_encoders(model)}
    for encoder, lead in encoders.items():
        inside = [name for name in modules if name == encoder or name.startswith(lead)]
        for name in inside:
            del modules[name]
        skipped[encoder] = (f"outside the language model of a multimodal model ({len(inside)} "
                            "targeted linear layers): text calibration does not run it; kept "
                            "in full precision")
    for name in adapter_linears(model):
        if modules.pop(name, None) is not None:
            skipped[name] = ("a peft adapter's linear layer: it trains in full precision beside "
                             "the quantized base layer")
    for name in moe_routers(model):
        if modules.pop(name, None) is not None:
            skipped[name] = ("the router of a mixture-of-experts layer: kept in full precision, "
                             "as vLLM and llm-compressor keep routers")
    for name, module in list(modules.items()):
        if has_own_forward(module):
            del modules[name]
            skipped[name] = (f"a {type(module).__name__}, a linear layer with its own forward: "
                             "a quantized linear in its place would compute something else; "
                             "kept in full precision")
    for name, module in modules.items():
        if not linear_weight(module).is_meta:  # a streamed block's: checked when it is read
            check_layer_finite(module, name)
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
    outside = {name: shape for name, shape in weights_outside_linears(model).items()
               if not name.startswith(tuple(encoders.values()))}
    for name, shape in outside.items():
        skipped[name] = (f"a {len(shape)}-D weight {list(shape)} outside a linear layer: "
                         "kept in full precision")
    held = sum(math.prod(shape) for shape in outside.values())
    share = held / (held + linear_weight_count(model))
    if share >= 0.01:
        name, shape = next(iter(outside.items()))
        log.warning("%d weights outside linear layers stay in full precision: %.0f%% of the "
                    "model's weights outside its embeddings and head (e.g. %s %s); kbbq-pl "
                    "quantizes linear layers", len(outside), 100 * share, name, list(shape))
    return modules, skipped


def untie_targeted_weights(model: nn.Module, modules: Mapping[str, nn.Module]) -> None:
    """Where a targeted layer's weight is tied to another parameter (an LM head tied to the
    input embedding, ``layers.ignore: []``), the head is quantized and the embedding is not:
    the model's config stops tying them (as llm-compressor unties them), so that a saved
    folder loads both instead of tying the embedding to the quantized head."""
    config = getattr(model, "config", None)
    holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    if config is None or not any(holders[id(m.weight)] > 1 for m in modules.values()):
        return
    for part in (config, config.get_text_config()):
        if getattr(part, "tie_word_embeddings", False):
            part.tie_word_embeddings = False


ON_QUANTIZED: list[Callable[[nn.Module, QuantizationConfig], None]] = []
"""Called, in order, with each model :func:`quantize_model` quantized and its recipe: where the
edges plug in (``import kbbq_pl`` adds transformers' quantizer to a transformers model, so that
its ``save_pretrained`` and ``dequantize`` work as on a model transformers loaded:
:func:`kbbq_pl.io.hf_quantizer.attach_quantizer`)."""


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    batches: Batches,
    config: QuantizationConfig | str | Path,
    *,
    collectives: Collectives | None = None,
    shard: bool = False,
    weight_quantizer: WeightQuantizer | None = None,
    trainable: bool = False,
    progress: bool = True,
    device: torch.device | str | None = None,
    offload_device: torch.device | str = "cpu",
    residency: BlockResidency | None = None,
    compute_dtype: torch.dtype | None = None,
) -> QuantizationReport:
    """Quantize ``model`` in place with ``config`` (module docstring; a packaged recipe's name
    or a recipe file too); returns the report.  The quantized sibling linears (q/k/v,
    gate/up) are grouped (:func:`~kbbq_pl.quant.siblings.group_sibling_linears`).

    ``batches`` are the model's keyword inputs (a list or a DataLoader).  ``collectives``: the
    data-parallel operations of several processes (:class:`~kbbq_pl.quant.collectives.
    Collectives`; default one process).  ``shard``: ``batches`` are every rank's calibration,
    the same on each (``kbbq-pl quantize`` under torchrun), and each rank calibrates on its
    contiguous share of every part, so that ``lam: auto`` scores one process's held-out tokens
    (without it each rank brought its own batches, as under a Lightning sampler).
    ``trainable`` keeps high-precision master weights ``W T^-1`` for fine-tuning (RTN), of the
    layers whose weight requires grad (the others store codes, frozen as they were).
    ``weight_quantizer`` replaces the one the recipe names (built with the same ``config`` and
    ``trainable``).  ``device`` runs each block (default: where the model is);
    ``offload_device`` holds the cached activations between blocks; ``residency`` brings each
    block's weights there (default: the model is in memory,
    :class:`~kbbq_pl.quant.sequential.MoveToDevice`; a model streamed from disk:
    :class:`kbbq_pl.io.streaming.StreamedBlocks`).  ``compute_dtype``: each block (and the
    capture of the first block's inputs) computes in it, the model held as it is (module
    docstring); None computes in the model's own dtype.
    """
    start = time.perf_counter()
    config = QuantizationConfig.resolve(config, "quantize_model")
    collectives = collectives or Collectives()
    quantizer = weight_quantizer or WEIGHT_QUANTIZERS[config.weights.quantizer](
        config, trainable=trainable)
    if quantizer.config != config or quantizer.trainable != trainable:
        raise ValueError(f"weight_quantizer {type(quantizer).__name__} was built for another "
                         f"recipe ({quantizer.config.label}, trainable={quantizer.trainable}) "
                         f"than this run's ({config.label}, trainable={trainable})")
    if quantizer.splits_work and not collectives.can_broadcast:
        raise ValueError(f"world_size {collectives.world_size}: {config.method} splits layers "
                         "across ranks and needs Collectives.broadcast")
    propagate = config.weights.propagate or quantizer.propagate
    modules, skipped = select_layers(model, config)
    untie_targeted_weights(model, modules)
    streamed = {name for name, module in modules.items() if linear_weight(module).is_meta}
    targets = set(modules)  # names only: a replaced layer's weights are freed with its block
    del modules
    runner = SequentialRunner(
        model, batches, device=device, offload_device=offload_device, targets=targets,
        residency=residency, holdout=config.autobrake.holdout if config.auto else None,
        seed=config.transform.seed, compute_dtype=compute_dtype,
        shard=(collectives.rank, collectives.world_size) if shard else None)
    if streamed and runner.whole_model is not None:
        raise ValueError(f"{type(model).__name__} runs as one block ({runner.whole_model}): its "
                         "weights cannot be read block by block; load the model in memory")
    if runner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(runner.device)
    report = QuantizationReport(config=config.to_dict(), skipped=skipped)
    timing = dict.fromkeys(("calibration", quantizer.work_stage, "activation_scales",
                            "quantize", "propagation"), 0.0)
    modes = weakref.WeakKeyDictionary((module, module.training) for module in model.modules())
    model.eval()
    try:
        with calibrating_every_expert(model):
            steps = tqdm(runner, total=len(runner), desc=f"{config.method} {config.format.name}",
                         unit="block", disable=not progress or len(runner) == 1)
            for step in steps:
                last = step.index == len(runner.blocks) - 1
                linears = {n: m for n, m in step.linears().items() if n in targets}
                # propagating through the quantized block decodes its weights: the report's output
                # SNR decodes them first, and the block's forward reuses those copies
                with step.on_device(), held_in(step.module, compute_dtype), (
                        cache_decoded_weights() if propagate == "quantized"
                        else contextlib.nullcontext()):
                    for name in streamed.intersection(linears):
                        check_layer_finite(linears[name], name)
                    outputs = None
                    if linears:
                        block = Block(step, linears, model, config, collectives, runner.split,
                                      timing, progress)
                        outputs = _quantize_block(block, quantizer, propagate == "fp" and not last,
                                                  report)
                    if not last:
                        tick = time.perf_counter()
                        if outputs is None:  # the quantized block's: each weight decoded once
                            outputs = step.run()
                        step.advance(outputs)
                        timing["propagation"] += time.perf_counter() - tick
                # the replaced layers (held by the block's linears) and the outputs now held by
                # the next step go before the next block is loaded
                block = linears = outputs = None
                trim_heap()
    finally:  # every module back in its mode; the new layers in training mode, ready to be
        # fine-tuned (straight-through), until the model is put in eval mode
        for module in model.modules():
            module.training = modes.get(module, True)
    quantizer.finish(report)
    group_sibling_linears(model)  # q/k/v, gate/up: two launches a group on the kernels
    for hook in ON_QUANTIZED:
        hook(model, config)
    report.seconds.update(timing)
    report.seconds["total"] = time.perf_counter() - start
    report.model.update(peak_memory_mb(runner.device))
    report.model["blocks"] = len(runner.blocks)
    report.model["propagate"] = propagate
    if runner.whole_model is not None:
        report.model["whole_model"] = runner.whole_model
    if runner.prologue is not None:
        report.model["prologue"] = runner.prologue.names
    return report


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
    trim_heap()  # the calibration run's activations, whatever the quantizer
    timing["calibration"] += time.perf_counter() - tick

    tick = time.perf_counter()
    plans = quantizer.quantize(block, calibration)
    timing[quantizer.work_stage] += time.perf_counter() - tick

    scales: dict[str, Tensor] = {}
    if static:
        tick = time.perf_counter()
        shared = [] if config.transform.name in FITTED_TRANSFORMS else expert_projections(
            block.linears, lambda name: isinstance(block.model.get_submodule(name), ExpertLinears))
        scales = _static_act_scales(inputs, block.linears, plans, config, step.runner.device,
                                    block.collectives.reduce_max, shared)
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
            trainable=plan.weight is None and quantizer.keeps_master(module), name=name,
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
        trim_heap()
    timing["quantize"] += time.perf_counter() - tick
    return outputs


def _static_act_scales(inputs: Mapping[str, list[Tensor]], linears: Mapping[str, nn.Module],
                       plans: Mapping[str, LayerPlan], config: QuantizationConfig,
                       device: torch.device, reduce_max: ReduceFn,
                       shared: list[list[str]]) -> dict[str, Tensor]:
    """Static NVFP4 per-tensor scales of every layer's transformed inputs ``T x``,
    from the inputs kept in the calibration pass of the full-precision block (no second run
    of it; a folded layer's ``T`` applies to the unfolded weights' inputs, which these are).
    Each group of ``shared`` (one projection of a mixture-of-experts layer's experts, which
    vLLM quantizes under one scale) takes the largest amax of its layers."""
    transforms = {name: plan.transform for name, plan in plans.items()}
    amax = transformed_amax(inputs, linears, transforms, config.fmt, device)
    for group in shared:
        present = [name for name in group if name in amax]
        if present:
            amax.update(dict.fromkeys(present, torch.stack([amax[n] for n in present]).amax()))
    return act_scales_from_amax(amax, reduce_max)


def _set_full_precision(module: nn.Module, weight: Tensor, bias: Tensor | None) -> None:
    module.weight.copy_(weight)
    if bias is not None:
        module.bias.copy_(bias)
