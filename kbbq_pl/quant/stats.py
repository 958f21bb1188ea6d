"""Calibration statistics of linear-layer inputs, accumulated with forward hooks.

Per targeted linear layer: the ``d x d`` diagonal blocks of the input second moment
``Sigma = E[x x^T]`` (memory ``O(in * d)``), the token count, the output energy
``sum ||W x||^2`` (the invariant numerator of kappa_bar, Lemma invariance, which would
otherwise need the full ``Sigma``), and an evenly spaced sample of input tokens for reports.

Sums are kept in float64: they add up to millions of rank-one terms whose small eigen-directions the
KBBQ fit inverts (``Lambda^(-lambda/4)``), and float32 running sums lose those directions to
rounding once the token count reaches ~10^4.  Each batch's own product is formed in float32
(relative error ~1e-7, far below the 1% damping the fit applies) and added to the float64 sums, so
the error does not grow with the number of tokens.  Across data-parallel ranks the sums and counts
are added with the caller's reduce function (:meth:`StatisticsCollector.reduce`), e.g. Lightning's
``trainer.strategy.reduce(t, reduce_op="sum")``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from ..formats import Format
from ..formats.padding import pad_features
from ..formats.rounding import all_finite
from .act_scale import static_act_scale
from .modules import check_finite, first_input, in_out_features, linear_weight
from .tokens import calibrating, token_positions, token_rows, warn_unknown_padding
from .w4a4 import transformed_input

_F64 = torch.float64
_ENERGY_CHUNK = 1 << 18


def accumulate(total: Tensor, product: Tensor) -> None:
    """``total += product`` (a float64 sum, a float32 product of the same shape), a few rows at a
    time: the same bits as one addition, without the whole float64 temporary that the dtype
    promotion makes, which the allocator maps anew and page-faults on every call (2752 x 2752:
    54 against 5 ms, one thread)."""
    total2, product2 = total.view(-1, total.shape[-1]), product.reshape(-1, total.shape[-1])
    rows = max(1, _ENERGY_CHUNK // total.shape[-1])
    for start in range(0, total2.shape[0], rows):
        total2[start:start + rows] += product2[start:start + rows]


@dataclass
class LayerStatistics:
    """Running sums for one linear layer (see the module docstring)."""

    in_features: int
    block: int
    sigma_sum: Tensor                     # [blocks, d, d] float64
    output_energy: Tensor                 # [] float64, sum over tokens of ||W x||^2
    tokens: Tensor                        # [] float64 count
    input_amax: Tensor                    # [] float32
    samples: list[Tensor] = field(default_factory=list)
    sample_outputs: list[Tensor] = field(default_factory=list)  # their float32 outputs, no bias
    seen: int = 0                         # index of the next token (for sampling)
    full_sum: Tensor | None = None        # [D, D] float64, when the full moment is asked for

    @property
    def padded_features(self) -> int:
        return self.sigma_sum.shape[0] * self.block

    @property
    def count(self) -> int:
        return int(self.tokens)

    def sigma_blocks(self) -> Tensor:
        """Diagonal blocks of ``E[x x^T]`` (float64), ``[blocks, d, d]``."""
        if self.count == 0:
            raise ValueError("no calibration tokens reached this layer")
        return self.sigma_sum / self.tokens

    def sigma_full(self) -> Tensor:
        """The full ``E[x x^T]`` (float64, padded dimension), when collected."""
        if self.full_sum is None:
            raise ValueError("the full second moment was not collected (full=False)")
        if self.count == 0:
            raise ValueError("no calibration tokens reached this layer")
        return self.full_sum / self.tokens

    def pooled(self, other: LayerStatistics) -> LayerStatistics:
        """The statistics of this layer's tokens and ``other``'s (another part of the
        calibration): the sums and counts of both, this part's kept samples."""
        full = None if self.full_sum is None or other.full_sum is None else (
            self.full_sum + other.full_sum)
        return LayerStatistics(
            self.in_features, self.block, self.sigma_sum + other.sigma_sum,
            self.output_energy + other.output_energy, self.tokens + other.tokens,
            torch.maximum(self.input_amax, other.input_amax), list(self.samples),
            list(self.sample_outputs), self.seen, full)

    def sample(self) -> Tensor:
        """The kept input tokens ``[n, in_features]`` (float32)."""
        if not self.samples:
            return torch.empty(0, self.in_features)
        return torch.cat(self.samples)

    def sample_output(self) -> Tensor | None:
        """The full-precision layer's outputs ``x W^T`` on the kept tokens, as its forward computed
        them in the calibration pass (float32, bias removed), or None where they were not kept
        (outputs of another dtype: the report then multiplies the kept inputs again)."""
        rows = sum(len(s) for s in self.samples)
        if not self.sample_outputs or sum(len(y) for y in self.sample_outputs) != rows:
            return None
        return torch.cat(self.sample_outputs)


_FIBONACCI_HASH = 2654435769  # round(2^32 / golden ratio)
GRAM_TILE = 256


def gram(x: Tensor, tile: int = GRAM_TILE) -> Tensor:
    """``x^T x`` of ``x [n, D]`` (float32) from the tiles on and above the diagonal, the ones
    below being their transposes: ``(t + 1) / 2t`` of the product's work for ``t`` tiles
    (torch exposes no SYRK).  On the AVX2 CPU it was measured on, the same bits as ``x.T @ x``
    for D = 1024 and 2752, and 1.4x / 1.7x faster (one thread, 1,024 tokens; tiles of 256: 16.0
    and 94.6 ms, against 18.6 and 99.3 with tiles of 512)."""
    size = x.shape[1]
    if size <= tile:
        return x.T @ x
    out = torch.empty(size, size, dtype=x.dtype, device=x.device)
    for start in range(0, size, tile):
        stop = min(start + tile, size)
        rows = torch.mm(x[:, start:stop].T, x[:, start:])
        out[start:stop, start:] = rows
        if stop < size:
            out[stop:, start:stop] = rows[:, stop - start:].T
    return out


def spread_sample(start: int, count: int, stride: int) -> Tensor:
    """Which of the tokens ``start .. start + count - 1`` (global indices) a sample keeps: one in
    ``stride`` on average, the token ``i`` when the fractional part of ``i / golden ratio`` (a
    Weyl sequence, Fibonacci hashing) falls below ``1 / stride``.  Evenly spread like every
    ``stride``-th token, but never in step with the sequence length: every ``stride``-th token of
    256-token blocks with ``stride = 4`` skips position 255 ([SEP]) in every block, this keeps
    it as often as any other position.  Deterministic: a function of the index alone."""
    index = torch.arange(start, start + count, dtype=torch.int64)
    if stride <= 1:
        return torch.ones(count, dtype=torch.bool)
    return (index * _FIBONACCI_HASH) % 2**32 < 2**32 // stride


class InputProducts(NamedTuple):
    """The products of one input tensor of a forward call, shared by the layers reading it."""

    source: weakref.ref[Tensor]    # the tensor the layers were called with (not kept alive)
    version: int                   # its version counter when the products were formed
    padded_features: int
    reader: str                    # the first layer that read it
    blocks: Tensor | None          # [blocks, d, d] float32 diagonal blocks of x^T x
    full: Tensor | None            # [D, D] float32 x^T x (padded), when collected


class StatisticsCollector:
    """Accumulates :class:`LayerStatistics` for ``modules`` (name -> linear) during forwards.

    ``block`` is the transform / quantization block; a layer whose ``in_features`` is not a
    multiple of it is zero-padded (the quantized layer pads its inputs the same way).
    ``keep_samples`` tokens per layer are kept for reports and the auto-brake, one in
    ``sample_stride`` (:func:`spread_sample`).
    ``full`` also accumulates the full ``D x D`` second moment (memory ``O(in^2)``: for dense
    transforms and GPTQ Hessians).
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module],
        block: int,
        keep_samples: int = 256,
        sample_stride: int = 1,
        full: bool = False,
    ) -> None:
        self.modules = dict(modules)
        self.block = block
        self.keep_samples = keep_samples
        self.sample_stride = max(1, sample_stride)
        self.stats: dict[str, LayerStatistics] = {}
        self.full = full
        self.block_products = True  # the diagonal blocks of each call's x^T x
        self._last: InputProducts | None = None  # see _products
        for name, module in self.modules.items():
            in_features, _ = in_out_features(module)
            blocks = -(-in_features // block)
            device = linear_weight(module).device
            self.stats[name] = LayerStatistics(
                in_features, block,
                torch.zeros(blocks, block, block, dtype=_F64, device=device),
                torch.zeros((), dtype=_F64, device=device),
                torch.zeros((), dtype=_F64, device=device),
                torch.zeros((), dtype=torch.float32, device=device),
            )
            if full:
                size = blocks * block
                self.stats[name].full_sum = torch.zeros(size, size, dtype=_F64, device=device)

    @torch.no_grad()
    def _update(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Tensor):
        stats = self.stats[name]
        source = first_input(args, kwargs)
        x = token_rows(source.detach(), name)
        if not len(x):  # a batch of padding only
            return
        products = self._products(name, stats, source, x)
        accumulate(stats.sigma_sum, products.blocks)
        if products.full is not None:
            accumulate(stats.full_sum, products.full)
        self._update_common(name, stats, module, x, output)

    def _products(self, name: str, stats: LayerStatistics, source: Tensor, x: Tensor
                  ) -> InputProducts:
        """The products of this call's input ``source`` (flattened: ``x``), computed once for
        the layers that read one tensor in a row (``q``/``k``/``v``, ``gate``/``up``), the same
        bits as each computing its own.  A NaN or Inf input raises, naming the first layer
        that reads it."""
        last = self._last
        if (last is not None and last.source() is source and last.version == source._version
                and last.padded_features == stats.padded_features
                and (not self.full or last.full is not None)):
            return last
        self._flush()
        xf = x.float()
        extra = stats.padded_features - stats.in_features
        if extra:
            xf = F.pad(xf, (0, extra))
        blocks = None
        if self.block_products:
            grouped = xf.reshape(-1, stats.sigma_sum.shape[0], self.block).transpose(0, 1)
            blocks = torch.bmm(grouped.transpose(-1, -2), grouped)
        full = gram(xf) if self.full else None
        if not all_finite(blocks if blocks is not None else full):  # NaN/Inf reach the products
            check_finite(x, name)
        # a weak reference: a freed input is never matched (nor kept alive by a collector that
        # stays attached); the version counter tells a buffer refilled in place
        self._last = InputProducts(weakref.ref(source), source._version, stats.padded_features,
                                   name, blocks, full)
        return self._last

    def _flush(self) -> None:
        """Called before the last input's products are replaced (and when the hooks come off):
        a collector that adds them later (:class:`~kbbq_pl.quant.gptq.HessianCollector`) adds
        them here."""

    def _update_common(self, name: str, stats: LayerStatistics, module: nn.Module, x: Tensor,
                       output: Tensor) -> None:
        """Output energy, token count, input amax and kept samples of one call."""
        bias = getattr(module, "bias", None)
        y = token_rows(output.detach(), name).float()
        if bias is not None:
            y = y - bias.detach().float()
        # exact squares, float64 sums; in chunks that stay in the cache (a whole call's float64
        # copy took 12x longer on a CPU: 2048 x 1536 outputs, one thread)
        for chunk in y.reshape(-1).split(_ENERGY_CHUNK):
            chunk = chunk.to(_F64)
            stats.output_energy += torch.dot(chunk, chunk)
        stats.tokens += x.shape[0]
        stats.input_amax = torch.maximum(stats.input_amax, x.abs().max().float())
        self._keep(stats, x, y if output.dtype == torch.float32 else None)

    def _keep(self, stats: LayerStatistics, x: Tensor, y: Tensor | None = None) -> None:
        """Keep the spread sample of this call's tokens and, when given (float32 forwards, where
        they are exact), their outputs: the report's reference needs no second product."""
        kept = sum(len(s) for s in stats.samples)
        if kept < self.keep_samples:
            chosen = spread_sample(stats.seen, x.shape[0], self.sample_stride)
            rows = chosen.nonzero().squeeze(1)[: self.keep_samples - kept].to(x.device)
            stats.samples.append(x.index_select(0, rows).float().cpu())
            if y is not None:
                stats.sample_outputs.append(y.index_select(0, rows).cpu())
        stats.seen += x.shape[0]

    def seek(self, token: int) -> None:
        """Index the next token as ``token`` (the sample is a function of the index: a rank
        that runs the calibration's tokens from ``token`` on keeps those one process keeps)."""
        for stats in self.stats.values():
            stats.seen = token

    def attach(self) -> list[RemovableHandle]:
        """Register the accumulating forward hook on every module; the caller removes them
        (:meth:`hooks` for the duration of a block)."""
        handles = []
        for name, module in self.modules.items():
            def hook(module, args, kwargs, output, name=name):
                self._update(name, module, args, kwargs, output)
            handles.append(module.register_forward_hook(hook, with_kwargs=True))
        return handles

    @contextlib.contextmanager
    def hooks(self) -> Iterator[StatisticsCollector]:
        """Hooks on every module for the duration of the block."""
        handles = self.attach()
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._flush()
            self._last = None

    def reduce(self, reduce_sum: Callable[[Tensor], Tensor]) -> None:
        """Add the sums of all ranks (``reduce_sum`` all-reduces one tensor with SUM)."""
        for stats in self.stats.values():
            stats.sigma_sum = reduce_sum(stats.sigma_sum)
            stats.output_energy = reduce_sum(stats.output_energy)
            stats.tokens = reduce_sum(stats.tokens)
            if stats.full_sum is not None:
                stats.full_sum = reduce_sum(stats.full_sum)

    def release(self, name: str) -> None:
        """Drop the large sums of a layer that is done with (keeps the counts)."""
        stats = self.stats[name]
        stats.sigma_sum = stats.sigma_sum[:0]
        stats.full_sum = None
        stats.samples = []
        stats.sample_outputs = []

    def check_nonempty(self) -> None:
        missing = [name for name, s in self.stats.items() if s.count == 0]
        if missing:
            raise ValueError(
                f"{len(missing)} targeted layers saw no calibration tokens (e.g. {missing[0]}); "
                "the calibration set is empty or those layers are not reached by forward() "
                "(a module that reads their weight instead of calling them, or an encoder "
                "that a decoder-only calibration never runs): leave them out with "
                "--recipe.layers.ignore PATTERN"
            )


def model_device(model: nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


@torch.no_grad()
def run_calibration(model: nn.Module, batches: Iterable[Mapping[str, Tensor]]) -> int:
    """Run ``model(**batch)`` over every batch (eval mode, no grad), the hooks told each
    batch's padding (:func:`~kbbq_pl.quant.tokens.calibrating`); returns the batch count."""
    device = model_device(model)
    was_training = model.training
    model.eval()
    count = 0
    try:
        for batch in batches:
            if count == 0:  # a stream: the first batch says what the mask is
                warn_unknown_padding([batch])
            inputs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}
            with calibrating(token_positions(batch)):
                model(**inputs)
            count += 1
    finally:
        model.train(was_training)
    return count


@contextlib.contextmanager
def kept_inputs(modules: Mapping[str, nn.Module], block: nn.Module,
                store: torch.device) -> Iterator[dict[str, list[Tensor]]]:
    """Pre-hooks keeping a copy (on ``store``) of every layer's input tokens (padding left out:
    :func:`~kbbq_pl.quant.tokens.token_rows`) in each call of ``block`` while attached; layers
    that read one tensor (``q``/``k``/``v``, ``gate``/``up``) share one copy.  Yields
    ``{name: [inputs of each call]}``: what a measurement that needs the fitted transforms
    reads instead of running the block again."""
    kept: dict[str, list[Tensor]] = {name: [] for name in modules}
    # this call's inputs by identity, each held (so its id is not reused) with its copy
    copies: dict[int, tuple[Tensor, Tensor]] = {}

    def new_call(module, args):
        copies.clear()

    def hook(module, args, kwargs, name):
        x = first_input(args, kwargs)
        entry = copies.get(id(x))
        if entry is None or entry[0] is not x:
            entry = copies[id(x)] = (x, token_rows(x.detach(), name).to(store, copy=True))
        kept[name].append(entry[1])

    handles = [block.register_forward_pre_hook(new_call)]
    handles += [module.register_forward_pre_hook(functools.partial(hook, name=name),
                                                 with_kwargs=True)
                for name, module in modules.items()]
    try:
        yield kept
    finally:
        for handle in handles:
            handle.remove()
        copies.clear()


@torch.no_grad()
def transformed_amax(kept: Mapping[str, Iterable[Tensor]], modules: Mapping[str, nn.Module],
                     transforms: Mapping[str, Tensor | None], fmt: Format,
                     device: torch.device) -> dict[str, Tensor]:
    """Per layer, the amax of its padded, transformed inputs ``T x`` over its kept inputs
    (:func:`kept_inputs`), computed on ``device`` (where the block runs: the same bits as a
    run of the block there); layers never called are absent."""
    readers: dict[tuple[int, ...], list[str]] = {}  # layers that read the same tensors
    for name, inputs in kept.items():
        readers.setdefault(tuple(map(id, inputs)), []).append(name)
    amax: dict[str, Tensor] = {}
    for names in readers.values():
        in_features, _ = in_out_features(modules[names[0]])
        padded = pad_features(torch.empty(1, in_features), fmt).shape[1]
        for x in kept[names[0]]:
            x = x.to(device)  # once for every layer that reads it
            for name in names:
                value = tensor_amax(transformed_input(x, in_features, padded, transforms[name]))
                amax[name] = value if name not in amax else torch.maximum(amax[name], value)
    return amax


def tensor_amax(x: Tensor) -> Tensor:
    """``max |x|`` (float32), 0 for an empty ``x`` (a batch of padding only: every rank still
    gives each layer it called an amax to reduce)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().max().float()


def act_scales_from_amax(amax: Mapping[str, Tensor],
                         reduce_max: Callable[[Tensor], Tensor]) -> dict[str, Tensor]:
    """Static NVFP4 per-tensor activation scales (:func:`~kbbq_pl.quant.act_scale.
    static_act_scale`) of each layer's amax, maxed over ranks."""
    return {name: static_act_scale(reduce_max(value.float())) for name, value in amax.items()}
