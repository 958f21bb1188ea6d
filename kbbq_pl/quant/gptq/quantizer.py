"""The GPTQ family as a weight quantizer: GPTQ, MR-GPTQ, GPTQ-WUSH, GPTQ-KBBQ (the algorithm on
tensors is :mod:`kbbq_pl.quant.gptq.algorithm`).

:class:`GPTQ` is the weight quantizer (:mod:`kbbq_pl.quant.weight_quantizer`) of the GPTQ family in
the block-sequential pipeline (:func:`kbbq_pl.quant.pipeline.quantize_model`).  For each block:

1. calibrate: run the full-precision block over its cached inputs, by default the outputs of
   the previous, already quantized block (``propagate="quantized"``: quantization error
   propagates as in GPTQ's reference loop); hooks accumulate every targeted linear's Hessian
   ``H = (2 / n) sum x x^T`` (:class:`HessianCollector`; q/k/v and gate/up share one product per
   call), summed over data-parallel ranks;
2. quantize each linear (:func:`quantize_layers`): fit its transform from the diagonal blocks of
   ``H / 2`` (WUSH / KBBQ) or take the data-free one (identity, block Hadamard, Haar), then GPTQ
   on ``W T^-1`` with ``T H T^T`` (or the in-loop refit variant); layers are split across ranks
   and broadcast from their owner;
3. the pipeline then calibrates the static activation scales, swaps in the
   :class:`~kbbq_pl.quant.layers.QuantizedLinear` layers (the same modules, report rows and
   checkpoints as RTN) and runs the quantized block, W4A4 as deployed, to produce the next
   block's inputs.

Memory: one block's weights, Hessians (float64 sums) and one block's calibration activations.

Distributed: :class:`~kbbq_pl.quant.collectives.Collectives` (all-reduces, ``broadcast(obj, src)``,
``rank`` and ``world_size``).  Each rank calibrates on its own batches; Hessians are summed
in float64 and rounded to float32 once, so every rank (and a single process with all the
batches) starts GPTQ from the same float32 ``H`` (:meth:`HessianCollector.reduce`); each layer
(or stack of layers sharing a Hessian) is quantized by one rank and broadcast.

GPTQ-WUSH / GPTQ-KBBQ: ``transform_refit="in_loop"`` (the default; the WUSH paper's variant,
:func:`~kbbq_pl.quant.gptq.algorithm.gptq_refit`) refits each ``T_b`` on the error-updated weight
block when GPTQ reaches it and rounds the block's columns with GPTQ's updates in its coordinates;
``"fixed"`` fits ``T`` once from the calibration statistics and runs GPTQ on ``W T^-1`` with
``T H T^T`` (with act-order).  The in-loop refit is the default (the WUSH paper's choice; the
braked KBBQ refit stays stable in MXFP4 where GPTQ-WUSH at lambda 1 can collapse).
``lam="auto"`` (:func:`auto_gptq`) runs GPTQ-KBBQ for every lambda on the fitting part's
Hessian and keeps the lambda whose quantized layer has the smallest realized W4A4 output error
on the held-out tokens (:mod:`kbbq_pl.quant.autobrake`), then quantizes it with the Hessian of
every token.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...formats import QuantizedTensor
from ...formats.padding import pad_features
from ...transforms.fit import FITTED_TRANSFORMS, fit_transform, transform_weight
from ..autobrake import LambdaChoice, choose_lambda
from ..collectives import ReduceFn
from ..config import QuantizationConfig
from ..modules import first_input, fused_groups, linear_weight
from ..report import QuantizationReport
from ..scales import fused_weight_scales
from ..sequential import trim_heap
from ..stats import StatisticsCollector, accumulate
from ..tokens import token_rows
from ..weight_quantizer import Block, LayerPlan, WeightQuantizer
from .algorithm import (
    GPTQResult,
    gptq_layers,
    gptq_refit,
    hessian,
    sigma_blocks_from_hessian,
    transform_hessian,
)

__all__ = ["GPTQ", "HessianCollector", "assign_owners", "auto_gptq",
           "quantize_layers"]


class HessianCollector(StatisticsCollector):
    """GPTQ Hessians of a block's linears, with the report statistics of
    :class:`~kbbq_pl.quant.stats.StatisticsCollector` (output energy, token count, samples).

    Per forward call, each distinct input tensor gets one float32 product ``x^T x``, added to
    the float64 sum ``full_sum`` of the layers reading it (q/k/v, gate/up) once they all have:
    layers that have read the same tensors so far hold one sum, added to once (a layer whose
    input parts ways takes a copy), so q/k/v cost one sum's memory and additions, with the
    same bits as three.  :meth:`reduce` groups the layers by their sums (:meth:`groups`); the
    block second moments ``sigma_sum`` are the sums' diagonal blocks.
    """

    def __init__(self, modules: Mapping[str, nn.Module], block: int, keep_samples: int = 256,
                 sample_stride: int = 1) -> None:
        super().__init__(modules, block, keep_samples, sample_stride)
        self.full = True  # the sums are allocated as they are first added to (_flush)
        self.block_products = False  # the blocks are the diagonal of the full sum (reduce)
        self._sources: dict[str, list[str]] = {name: [] for name in self.modules}
        self._readers: list[str] = []  # the layers that read the last product, in call order

    @torch.no_grad()
    def _update(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Tensor):
        stats = self.stats[name]
        source = first_input(args, kwargs)
        x = token_rows(source.detach(), name)
        if not len(x):  # a batch of padding only
            return
        products = self._products(name, stats, source, x)
        self._sources[name].append(products.reader)
        self._readers.append(name)
        self._update_common(name, stats, module, x, output)

    def _flush(self) -> None:
        """Add the last product to its readers' sums: once to a sum that exactly its readers
        hold, each reading it as many times; to a copy where other layers hold the sum too
        (or read it a different number of times); to a new sum for a first read."""
        readers, self._readers = self._readers, []
        if not readers:
            return
        assert self._last is not None and self._last.full is not None
        product = self._last.full
        holders = Counter(id(s.full_sum) for s in self.stats.values() if s.full_sum is not None)
        readings: dict[tuple[int | None, int], list[str]] = {}
        for name, count in Counter(readers).items():
            held = self.stats[name].full_sum
            readings.setdefault((None if held is None else id(held), count), []).append(name)
        for (held, count), names in readings.items():
            total = self.stats[names[0]].full_sum
            if total is None:
                size = self.stats[names[0]].padded_features
                total = torch.zeros(size, size, dtype=torch.float64, device=product.device)
            elif len(names) < holders[held]:
                total = total.clone()
            for _ in range(count):
                accumulate(total, product)
            for name in names:
                self.stats[name].full_sum = total

    def groups(self) -> list[list[str]]:
        """Layers whose Hessians are the same sums (they read the same tensor in every call),
        in module order."""
        grouped: dict[tuple, list[str]] = {}
        for name, sources in self._sources.items():
            key = (tuple(sources), self.stats[name].padded_features)
            grouped.setdefault(key, []).append(name)
        return list(grouped.values())

    def reduce(self, reduce_sum: ReduceFn, reduce_max: ReduceFn | None = None) -> None:
        """Sum the float64 Hessian sums, output energies and token counts over ranks (with
        ``reduce_max``, the max of the input amax), once per group of layers sharing a sum,
        then fill in the block second moments.

        Summation order: every call adds a float32 product to a float64 sum, and the ranks'
        sums are added in float64.  float64 carries 29 more mantissa bits than float32, so these
        additions are exact, hence independent of their order and of how the batches are split
        over ranks, as long as an entry's per-call values span less than ``2^29 / calls`` in
        magnitude; beyond that, the differences are float64 roundings (~1e-16 relative), and
        :meth:`hessian` rounds to float32 (6e-8) once at the end.  One process and several give
        the same float32 ``H``, and the same codes (tests/quant/test_gptq_pipeline.py), when
        they run the same batches: each call's product is formed in float32, so regrouping the
        tokens into other batches changes its roundings (and GPTQ's codes near their ties).
        """
        self._flush()
        self._last = None
        for group in self.groups():
            leader = self.stats[group[0]]
            if leader.full_sum is None:  # no call reached it on this rank: it adds zeros
                size = leader.padded_features
                leader.full_sum = torch.zeros(size, size, dtype=torch.float64,
                                              device=leader.sigma_sum.device)
            for name in group[1:]:  # identical by construction; share one tensor
                self.stats[name].full_sum = leader.full_sum
            total = reduce_sum(leader.full_sum)
            blocks = leader.sigma_sum.shape[0]
            grid = total.reshape(blocks, self.block, blocks, self.block)
            index = torch.arange(blocks, device=grid.device)
            sigma = grid[index, :, index, :].clone()
            for name in group:
                self.stats[name].full_sum = total
                self.stats[name].sigma_sum = sigma
        for stats in self.stats.values():
            stats.output_energy = reduce_sum(stats.output_energy)
            stats.tokens = reduce_sum(stats.tokens)
            if reduce_max is not None:
                stats.input_amax = reduce_max(stats.input_amax)

    def hessian(self, name: str, keep_sum: bool = False) -> Tensor:
        """``H = (2 / n) sum x x^T`` (float32) of layer ``name`` (padded dimension), shared by
        its group; the float64 sum is dropped unless ``keep_sum`` (a dense transform's report
        needs the full second moment)."""
        stats = self.stats[name]
        assert stats.full_sum is not None
        h = hessian(stats.full_sum, stats.tokens)
        if not keep_sum:
            total = stats.full_sum
            for other in self.stats.values():
                if other.full_sum is total:
                    other.full_sum = None
        return h


def quantize_layers(weights: Mapping[str, Tensor], h: Tensor, config: QuantizationConfig
                    ) -> dict[str, tuple[GPTQResult, Tensor | None]]:
    """GPTQ of the layers ``weights`` (name -> ``[out, D]``, padded to whole blocks) that share
    the float32 Hessian ``h [D, D]``, with the transform of ``config``; returns per layer the
    result (the quantized ``W T^-1``) and the transform ``T`` (float64, None for the identity).

    Several layers need a data-free transform (identity, Hadamard, Haar: one ``T`` for all);
    they run as one stacked GPTQ (:func:`kbbq_pl.quant.gptq.algorithm.gptq_layers`), the ones
    vLLM fuses (q/k/v, gate/up) with one NVFP4 per-tensor scale
    (:func:`~kbbq_pl.quant.scales.fused_weight_scales`).
    """
    fmt = config.fmt
    kind = config.transform.name
    names = list(weights)
    common = {"damping": config.weights.damping, "block_size": config.weights.block_size,
              "scale_search": config.weights.scale_search}
    if kind in FITTED_TRANSFORMS:
        if len(names) != 1:
            raise ValueError(f"{kind} transforms are fitted per layer: quantize {names} one by one")
        name, weight = names[0], weights[names[0]]
        if config.refits_in_loop:
            lam = 1.0 if kind == "wush" else config.transform.lam
            result = gptq_refit(weight, h, fmt, lam=lam, transform_damping=config.transform.damping,
                                name=name, **common)
            return {name: (result, result.transform)}
        sigma = sigma_blocks_from_hessian(h, config.block)
        transform = fit_transform(kind, weight, sigma, block=config.block,
                                  lam=config.transform.lam, seed=config.transform.seed,
                                  damping=config.transform.damping, name=name)
    else:
        transform = fit_transform(kind, weights[names[0]], None, block=config.block,
                                  seed=config.transform.seed, name=names[0])
    transformed = {n: transform_weight(weights[n].to(torch.float32), transform) for n in names}
    scales = fused_weight_scales(transformed, fmt, fused_groups(transformed))
    results = gptq_layers(list(transformed.values()), transform_hessian(h, transform), fmt,
                          act_order=config.gptq_act_order,
                          group_scales_mode=config.weights.group_scales,
                          names=names, global_scales=[scales[n] for n in names], **common)
    return {name: (result, transform) for name, result in zip(names, results)}


def _with_lam(config: QuantizationConfig, lam: float) -> QuantizationConfig:
    return replace(config, transform=replace(config.transform, lam=lam))


def auto_gptq(name: str, weight: Tensor, h_fit: Tensor, h_all: Tensor, x_held_out: Tensor,
              config: QuantizationConfig) -> tuple[tuple[GPTQResult, Tensor | None], LambdaChoice]:
    """GPTQ-KBBQ with ``lam="auto"``: every lambda of ``config.autobrake.grid`` is a candidate
    quantized by GPTQ with the fitting part's Hessian ``h_fit``, scored on the held-out inputs
    (:func:`~kbbq_pl.quant.autobrake.choose_lambda`); the chosen lambda is quantized again with
    the Hessian of every token ``h_all``.  Returns ``(result, transform)`` as
    :func:`quantize_layers` does, and the choice."""
    def candidate(lam: float) -> tuple[Tensor, Tensor | None]:
        result, transform = quantize_layers({name: weight}, h_fit, _with_lam(config, lam))[name]
        return result.values, transform

    choice = choose_lambda(weight, x_held_out, candidate, config.fmt, config.autobrake.grid,
                           config.effective_act_scale)
    return quantize_layers({name: weight}, h_all, _with_lam(config, choice.lam))[name], choice


def assign_owners(costs: Mapping[str, float], world_size: int) -> dict[str, int]:
    """Rank that quantizes each layer: largest cost first to the least loaded rank (ties to the
    lower rank, then by name), deterministic."""
    loads = [0.0] * world_size
    owners: dict[str, int] = {}
    for name in sorted(costs, key=lambda n: (-costs[n], n)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        owners[name] = rank
        loads[rank] += costs[name]
    return owners


_SCALE_DTYPES = {"e4m3": torch.float8_e4m3fn, "e8m0": torch.float8_e8m0fnu, "fp32": torch.float32}


def _payload(result: GPTQResult, transform: Tensor | None,
             choice: LambdaChoice | None = None) -> dict[str, Any]:
    """The result as plain tensors for ``broadcast`` (pickle does not carry float8 storages:
    block scales travel as their bytes)."""
    weight = result.weight
    scale = weight.scale if weight.scale.dtype == torch.float32 else weight.scale.view(torch.uint8)
    return {"qdata": weight.qdata, "scale": scale, "global_scale": weight.global_scale,
            "transform": transform, "damping": result.damping, "fallback": result.fallback,
            "choice": choice}


def _quantized_weight(payload: Mapping[str, Any], config: QuantizationConfig,
                      orig_dtype: torch.dtype, device: torch.device) -> QuantizedTensor:
    qdata = payload["qdata"].to(device)
    gs = payload["global_scale"]
    scale = payload["scale"].view(_SCALE_DTYPES[config.fmt.scale_kind]).to(device)
    return QuantizedTensor(qdata, scale, config.fmt, orig_dtype,
                           qdata.shape[-1] * 2, None if gs is None else gs.to(device))


def _fitting_hessian(collector: HessianCollector, held_out: HessianCollector, name: str
                     ) -> Tensor:
    """The Hessian GPTQ-KBBQ's auto-brake candidates are fitted with: of the tokens not held
    out (all tokens minus the held-out part)."""
    total, held = collector.stats[name], held_out.stats[name]
    assert total.full_sum is not None and held.full_sum is not None
    return hessian(total.full_sum - held.full_sum, total.tokens - held.tokens)


@dataclass
class GPTQCalibration:
    """A block's Hessians (all cached batches) and, with ``lam="auto"``, those of the held-out
    batches."""

    all: HessianCollector
    held_out: HessianCollector | None


class GPTQ(WeightQuantizer):
    """The GPTQ family (module docstring): GPTQ, MR-GPTQ, GPTQ-WUSH, GPTQ-KBBQ."""

    propagate: ClassVar = "quantized"
    work_stage: ClassVar = "gptq"
    splits_work: ClassVar = True

    def __init__(self, config: QuantizationConfig, *, trainable: bool = False) -> None:
        if trainable:
            raise ValueError("GPTQ stores rounded codes, not master weights: fine-tune from "
                             "weights.quantizer='rtn' (trainable=True), or run GPTQ after")
        super().__init__(config)
        self.info: dict[str, dict[str, Any]] = {}

    def calibrate(self, block: Block, keep_outputs: bool
                  ) -> tuple[GPTQCalibration, list[Tensor] | None]:
        config, split, step = self.config, block.split, block.step
        reduce_sum, reduce_max = block.collectives.reduce_sum, block.collectives.reduce_max
        collector = HessianCollector(block.linears, config.block, config.keep_samples,
                                     split.stride(config.keep_samples))
        held_out = None
        if split.held_out:
            held_out = HessianCollector(block.linears, config.block, config.autobrake.tokens,
                                        split.stride(config.autobrake.tokens, 1))
            held_out.seek(split.offsets[1])
        # one pass over the batches in order; the held-out batches feed both collectors
        outputs: list[Tensor] | None = [] if keep_outputs else None
        with collector.hooks():
            for k, part in enumerate((split.fit_part, split.held_out_part)):
                collector.seek(split.position(k))
                with (held_out.hooks() if held_out is not None and k == 1
                      else contextlib.nullcontext()):
                    part_outputs = step.run(keep_outputs, subset=part)
                if outputs is not None and part_outputs is not None:
                    outputs += part_outputs
        collector.reduce(reduce_sum, reduce_max)
        collector.check_nonempty()
        if held_out is not None:
            held_out.reduce(reduce_sum, reduce_max)
            held_out.check_nonempty()
        return GPTQCalibration(collector, held_out), outputs

    def quantize(self, block: Block, calibration: GPTQCalibration) -> dict[str, LayerPlan]:
        """GPTQ of the block's linears, split across ranks (largest first) and broadcast from
        their owner; with ``lam="auto"`` the brake is chosen per layer (:func:`auto_gptq`)."""
        config, linears = self.config, block.linears
        collectives = block.collectives
        rank, world_size = collectives.rank, collectives.world_size
        collector, held_out = calibration.all, calibration.held_out
        weights = {name: pad_features(linear_weight(m).detach(), config.fmt)
                   for name, m in linears.items()}
        stacked = config.transform.name not in FITTED_TRANSFORMS
        groups = collector.groups()
        jobs = groups if stacked else [[name] for group in groups for name in group]
        costs = {job[0]: float(weights[job[0]].shape[1]) ** 2 * (
            sum(weights[n].shape[0] for n in job) + weights[job[0]].shape[1]) for job in jobs}
        owners = assign_owners(costs, world_size)
        payloads: dict[str, Any] = {}
        bar = tqdm(total=len(linears), desc=block.step.name, unit="layer", leave=False,
                   disable=not block.progress)
        dense = config.transform.name == "haar"
        for group in groups:
            mine = [job for job in jobs if job[0] in group and owners[job[0]] == rank]
            h_fit = None
            if held_out is not None:
                # the kept samples live on the CPU: on the layer's device (the scoring's
                # products, an NCCL gather) they meet its weight
                x_held_out = {n: collectives.gather_rows(
                    pad_features(held_out.stats[n].sample(), config.fmt).to(weights[n].device),
                    held_out.keep_samples) for n in group}
                if mine:
                    h_fit = _fitting_hessian(collector, held_out, group[0])
            h = collector.hessian(group[0], keep_sum=dense) if mine else None
            for job in mine:
                if h_fit is not None:
                    (name,) = job
                    done, choice = auto_gptq(name, weights[name], h_fit, h, x_held_out[name],
                                             config)
                    payloads[name] = _payload(*done, choice)
                else:
                    done = quantize_layers({n: weights[n] for n in job}, h, config)
                    payloads.update({n: _payload(*done[n]) for n in job})
                trim_heap()
            del h, h_fit
            bar.update(len(group))
        bar.close()
        for job in jobs:  # every rank walks the jobs in the same order
            for name in job:
                payloads[name] = collectives.broadcast(payloads.get(name), owners[job[0]])

        plans = {}
        for name, module in linears.items():
            payload = payloads[name]
            weight = linear_weight(module)
            self.info[name] = {"damping": payload["damping"], "fallback": payload["fallback"]}
            plans[name] = LayerPlan(
                transform=payload["transform"], online=payload["transform"],
                stats=collector.stats[name],
                weight=_quantized_weight(payload, config, weight.dtype, weight.device),
                choice=payload["choice"])
        return plans

    def finish(self, report: QuantizationReport) -> None:
        report.model["gptq"] = self.info
