"""The quantization report: one row per quantized layer (the participation factors before and
after its transform, Thm. GL ceiling with the real weights; the paired-ceiling utilization;
the block ceiling; the output SNR on kept calibration tokens), the skipped layers, the time per
stage and the peak memory."""

from __future__ import annotations

import math
import resource
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..formats.padding import pad_features
from ..law import noise_law as law
from ..transforms.fit import transform_inputs, transform_weight, weight_block_grams
from .autobrake import LambdaChoice
from .collectives import Collectives
from .config import QuantizationConfig
from .layers import QuantizedLinear
from .modules import cell_kind, linear_weight
from .stats import LayerStatistics

__all__ = ["LayerReport", "QuantizationReport", "chosen_lambda", "layer_kappas", "layer_report",
           "output_snr_db", "peak_memory_mb"]


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


def layer_kappas(stats: LayerStatistics, weight: Tensor, transform: Tensor | None,
                 block: int, sigma_full: Tensor | None = None) -> dict[str, float]:
    """kappa_bar before and after ``transform`` with the layer's real weights, utilization of
    the paired ceiling, and the mean block ceiling (Thm. GL ceiling, Eqs. blockceiling,
    wushratio).  The invariant numerator ``tr(G Sigma)`` comes from the output energy."""
    out_features = weight.shape[0]
    numerator = stats.output_energy / (stats.tokens * out_features)
    sigma_blocks = stats.sigma_blocks()
    if sigma_full is None and (transform is None or tuple(transform.shape[1:]) == (block, block)):
        # everything reads the diagonal blocks only: no D x D matrix (D = 28672 is 6.6 GB).
        # The weight's block grams from float32 products, without the [blocks, d, out] copy
        # of weight_block_grams (whose bits the fitted transforms keep): kappa moves by < 1e-8
        # relative against float64 (the bench's layers), at a fifth of the time
        grouped = weight.float().reshape(out_features, -1, block)
        gram_blocks = (torch.einsum("obi,obj->bij", grouped, grouped) / out_features).double()
        spectrum = law.paired_spectrum(sigma_blocks, gram_blocks)
        best = law.optimal_block_denominator(spectrum)
        after = law.block_denominator(sigma_blocks, gram_blocks, transform)
        ceilings = law.block_ceilings(sigma_blocks)
        return {
            "kappa_before": float(numerator / law.block_denominator(sigma_blocks, gram_blocks,
                                                                    None)),
            "kappa_after": float(numerator / after),
            "utilization": float(best / after),
            "block_ceiling": float(ceilings[torch.isfinite(ceilings)].mean()),
            "paired_ceiling": float(numerator / best),
        }
    dense = transform is not None and transform.dim() == 2
    w = weight.to(torch.float64)
    # only the gram's diagonal blocks enter unless the transform is dense: O(out D d), not D^2
    gram = law.weight_gram(w) if dense else torch.block_diag(*weight_block_grams(w, block))
    sigma = sigma_full if sigma_full is not None else torch.block_diag(*sigma_blocks)
    before = numerator / law._denominator(sigma, gram, None)
    after = numerator / law._denominator(sigma, gram, transform)
    spectrum = law.paired_spectrum(law.diagonal_blocks(sigma, block),
                                   law.diagonal_blocks(gram, block))
    best = law.optimal_block_denominator(spectrum)
    block_ceiling = law.block_kappa_star(sigma, block)
    return {
        "kappa_before": float(before),
        "kappa_after": float(after),
        "utilization": float(best / law._denominator(sigma, gram, transform)),
        "block_ceiling": float(block_ceiling[torch.isfinite(block_ceiling)].mean()),
        "paired_ceiling": float(numerator / best),
    }


def output_snr_db(layer: QuantizedLinear, weight: Tensor, bias: Tensor | None, x: Tensor,
                  exact: Tensor | None = None) -> float:
    """SNR of the quantized layer's output against the original on inputs ``x`` (isolation).

    ``exact``: the original outputs ``x W^T`` where the caller has them (the calibration pass
    kept them, :meth:`~kbbq_pl.quant.stats.LayerStatistics.sample_output`), else they are
    computed here.  The products and the difference are float32: FP4 noise is 20-30 dB below
    the signal, float32's rounding ~140 dB, so a float64 product (twice the time on a CPU)
    moves the figure by < 1e-7 dB (measured on 1024- and 2752-wide layers); the sums of squares
    are float64."""
    if x.numel() == 0:
        return float("nan")
    with torch.no_grad():
        x = x.to(torch.float32)
        if exact is None:
            exact = x @ weight.to(torch.float32).T
        approx = layer(x).to(torch.float32)
        if bias is not None:
            approx = approx - bias.to(torch.float32)
        noise = torch.linalg.vector_norm(approx.sub_(exact), dtype=torch.float64)
        signal = torch.linalg.vector_norm(exact, dtype=torch.float64)
        return float(20 * torch.log10(signal / noise))


def layer_report(name: str, module: nn.Module, layer: QuantizedLinear, stats: LayerStatistics,
                 transform: Tensor | None, config: QuantizationConfig,
                 act_global_scale: Tensor | None, lam: float | None = None,
                 folded: bool = False, collectives: Collectives | None = None) -> LayerReport:
    """The report row of ``module`` quantized as ``layer``: kappas with the real weights, and
    the output SNR on the kept calibration inputs (the layer in isolation; every rank's kept
    tokens with ``collectives``, so that several processes report what one does).
    ``folded``: the layer receives ``T x`` (its transform folded into the producer of its
    input)."""
    weight = linear_weight(module).detach()
    padded = pad_features(weight, config.fmt)
    dense = transform is not None and transform.dim() == 2
    kappas = layer_kappas(stats, padded, transform, config.block,
                          stats.sigma_full() if dense else None)
    sample = stats.sample().to(weight.device)
    kept = stats.sample_output()
    if collectives is not None and collectives.world_size > 1:
        sample = collectives.gather_rows(sample)
        # the float32 outputs, where every rank kept them (a rank may have kept no token)
        missing = torch.tensor([float(kept is None)], device=weight.device)
        if float(collectives.reduce_max(missing)) == 0.0:
            assert kept is not None
            kept = collectives.gather_rows(kept.to(weight.device))
        else:
            kept = None
    received = transform_inputs(pad_features(sample, config.fmt), transform)[
        :, :sample.shape[1]] if folded else sample
    exact_weight = transform_weight(padded, transform) if folded else weight
    snr = output_snr_db(layer, exact_weight, getattr(module, "bias", None), received,
                        exact=None if kept is None else kept.to(weight.device))
    return LayerReport(
        name=name, kind=cell_kind(name), in_features=layer.in_features,
        out_features=layer.out_features, padded_in=layer.padded_in,
        output_snr_db=snr, tokens=stats.count,
        act_global_scale=float(act_global_scale) if act_global_scale is not None else None,
        **kappas, lam=lam,
    )


def chosen_lambda(config: QuantizationConfig, choice: LambdaChoice | None) -> float | None:
    """The brake a layer was quantized with (None for a transform without one)."""
    if config.transform.name != "kbbq":
        return None
    return choice.lam if choice is not None else float(config.transform.lam)


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB: ``VmHWM`` of ``/proc/self/status`` on
    Linux (``ru_maxrss`` there starts at the RSS of the process that spawned this one, a
    large parent's), else ``ru_maxrss``."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def peak_memory_mb(device: torch.device | None = None) -> dict[str, float]:
    """Peak resident memory of this process (MiB, :func:`peak_rss_mb`) and, on a CUDA device,
    the peak memory allocated by torch since the last reset."""
    peak = {"peak_rss_mb": peak_rss_mb()}
    if device is not None and device.type == "cuda":
        peak["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return peak
