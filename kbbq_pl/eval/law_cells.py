"""Per-cell measurement of the noise law on a real model (paper Sec. 2, "Measurement").

A *cell* is one GEMM with its own weight and its own input second moment: the targeted linear
layers of one transformer block that have the same :func:`~kbbq_pl.quant.modules.cell_kind` and read
the same input, their weights concatenated along out-features (fused QKV, output, fused
gate/up, down).  A targeted linear of kind ``other`` is a cell of its own.

The model runs one block at a time over the calibration batches at full precision
(:class:`~kbbq_pl.quant.sequential.SequentialRunner`); forward pre-hooks see every targeted linear's
input, and for each cell and each batch (one forward call):

* the input's second moment ``Sigma = E[x x^T]`` accumulates in float64, with the per-coordinate
  minimum and maximum (to find coordinates with zero variance);
* for ``rows`` rows of the fused weight, sampled with the seed, the exact dot products ``S`` and,
  per format, the error ``dS = w_hat . x_hat - w . x`` with *both* operands quantized: the weight
  on the whole fused matrix (blocks along in-features), the batch's ``[tokens, D]`` input as one
  tensor (one dynamic per-tensor scale per forward call, as deployed);
* the sums of ``S^2`` and ``dS^2`` per row.

Each cell is measured in isolation: its inputs come from the full-precision forward, so the
error is the cell's own.  Only one block's statistics are held at a time, so memory does not
grow with depth.  A record is one sampled row: kappa (Def. kappa, from ``Sigma``), the SNR per
format (``10 log10 sum S^2 / sum dS^2``) and the residual ``r`` (Eq. residual).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..formats import fake_quantize, get_format
from ..law import noise_law as law
from ..quant.modules import (
    cell_kind,
    check_finite,
    find_linears,
    first_input,
    flatten_tokens,
    linear_weight,
)
from ..quant.sequential import BlockStep, SequentialRunner

_F64 = torch.float64
CELL_ORDER = ("qkv", "out", "up", "down", "other")


@dataclass
class LawRecord:
    """One sampled row of one cell: kappa and, per format, the SNR and the residual r."""

    block: int
    layer: str
    cell: str
    kind: str
    row: int
    kappa: float
    snr_db: dict[str, float]
    r_db: dict[str, float]


@dataclass
class CellReport:
    """Aggregate statistics of one cell (paper Table kappamargins) and what was excluded.

    ``kappa_identity`` is kappa_I, the aggregate participation factor of the untransformed cell
    over its real rows (Thm. GL ceiling's kappa_bar at T = I with G = W^T W / out);
    ``kappa_rotation`` the Haar attractor with the same Gram; ``kappa_star`` the layer ceiling
    (Eq. glceiling); ``block_kappa_star`` the median over the cell's input blocks of the block
    ceiling (Eq. blockceiling) at ``block_size``, with its minimum and maximum.  Values that are
    undefined (no energy) are None.
    """

    block: int
    layer: str
    cell: str
    kind: str
    members: list[str]
    in_features: int
    out_features: int
    tokens: int
    calls: int
    kappa_identity: float | None
    kappa_rotation: float | None
    kappa_star: float | None
    block_size: int
    block_kappa_star: float | None
    block_kappa_star_min: float | None
    block_kappa_star_max: float | None
    dead_coordinates: list[int] = field(default_factory=list)
    constant_coordinates: list[int] = field(default_factory=list)
    excluded_blocks: list[int] = field(default_factory=list)
    excluded_rows: list[dict[str, Any]] = field(default_factory=list)
    uncovered_features: int = 0  # the last input features, in no whole block of block_size


@dataclass
class LawMeasurement:
    """Everything :func:`measure_law` measured."""

    formats: list[str]
    records: list[LawRecord]
    cells: list[CellReport]
    skipped_linears: list[dict[str, str]]


def _finite_or_none(value: Tensor | float) -> float | None:
    number = float(value)
    return number if math.isfinite(number) else None


def _row_seed(seed: int, cell: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(cell.encode())) % (2**63)


def quantized_rows(weight: Tensor, rows: Tensor, fmt: str, name: str = "weight") -> Tensor:
    """``fake_quantize(weight, fmt, pad=True)[rows]`` without rounding the whole matrix.

    Every format's scales are either per tensor, set by the tensor's amax (FP8 and INT per
    tensor, NVFP4's FP32 scale), or per row or per block within a row; so rounding the sampled
    rows together with the row that holds the tensor's amax gives the same values (tested
    against the whole matrix).
    """
    anchor = weight.abs().amax(dim=1).argmax().reshape(1)
    stacked = weight[torch.cat([rows, anchor])]
    return fake_quantize(stacked, fmt, pad=True, name=name)[: len(rows)]


class _CellAccumulator:
    """Streaming sums of one cell over the forward calls of its block."""

    def __init__(self, block: int, layer: str, cell: str, kind: str, members: list[str],
                 weight: Tensor, formats: Sequence[str], rows: int, seed: int) -> None:
        self.block, self.layer, self.cell, self.kind = block, layer, cell, kind
        self.members = members
        self.formats = list(formats)
        # the sums are float64 on the CPU, where :meth:`add` brings the inputs too
        self.weight = weight.detach().to("cpu")
        if not torch.isfinite(self.weight).all():
            raise ValueError(f"{cell}: the weight of {', '.join(members)} holds NaN or Inf values")
        out_features, in_features = self.weight.shape
        generator = torch.Generator().manual_seed(_row_seed(seed, cell))
        count = min(rows, out_features)
        self.rows = torch.randperm(out_features, generator=generator)[:count].sort().values
        self.weight_rows = self.weight[self.rows].to(_F64)
        self.quantized_rows = {
            fmt: quantized_rows(self.weight, self.rows, fmt, name=f"{cell} weight").to(_F64)
            for fmt in self.formats
        }
        self.second_moment = torch.zeros(in_features, in_features, dtype=_F64)
        self.minimum = torch.full((in_features,), math.inf, dtype=_F64)
        self.maximum = torch.full((in_features,), -math.inf, dtype=_F64)
        self.signal = torch.zeros(count, dtype=_F64)
        self.noise = {fmt: torch.zeros(count, dtype=_F64) for fmt in self.formats}
        self.tokens = 0
        self.calls = 0

    @torch.no_grad()
    def add(self, x: Tensor) -> None:
        x = flatten_tokens(x.detach()).to("cpu")
        exact_input = x.to(_F64)
        batch_min, batch_max = exact_input.amin(0), exact_input.amax(0)  # NaN propagates
        if not bool(torch.isfinite(batch_min).all() & torch.isfinite(batch_max).all()):
            check_finite(x, self.members[0])  # raises, naming the layer
        self.minimum = torch.minimum(self.minimum, batch_min)
        self.maximum = torch.maximum(self.maximum, batch_max)
        self.second_moment.addmm_(exact_input.T, exact_input)
        exact = exact_input @ self.weight_rows.T
        self.signal += exact.square().sum(0)
        for fmt in self.formats:
            quantized = fake_quantize(x, fmt, pad=True, name=self.members[0]).to(_F64)
            error = quantized @ self.quantized_rows[fmt].T - exact
            self.noise[fmt] += error.square().sum(0)
        self.tokens += x.shape[0]
        self.calls += 1

    def finish(self, block_size: int) -> tuple[list[LawRecord], CellReport]:
        sigma = self.second_moment / max(self.tokens, 1)
        dead = (self.maximum == 0) & (self.minimum == 0)
        constant = (self.maximum == self.minimum) & ~dead
        kappas = law.kappa(self.weight_rows, sigma)
        records: list[LawRecord] = []
        excluded_rows: list[dict[str, Any]] = []
        for index, row in enumerate(self.rows.tolist()):
            kappa_value = float(kappas[index])
            if not (self.signal[index] > 0 and math.isfinite(kappa_value) and kappa_value > 0):
                excluded_rows.append({"row": row, "reason": "no signal: the row's products "
                                      "have no energy, kappa is undefined"})
                continue
            snr = {fmt: 10.0 * math.log10(float(self.signal[index] / self.noise[fmt][index]))
                   if self.noise[fmt][index] > 0 else math.inf for fmt in self.formats}
            exact_formats = [fmt for fmt, value in snr.items() if not math.isfinite(value)]
            if exact_formats:
                excluded_rows.append({"row": row, "reason": "no rounding error in "
                                      f"{', '.join(exact_formats)}: the SNR is infinite"})
                continue
            residual = {fmt: value - 10.0 * math.log10(kappa_value) for fmt, value in snr.items()}
            records.append(LawRecord(self.block, self.layer, self.cell, self.kind, row,
                                     kappa_value, snr, residual))
        return records, self._report(sigma, dead, constant, block_size, excluded_rows)

    def _report(self, sigma: Tensor, dead: Tensor, constant: Tensor, block_size: int,
                excluded_rows: list[dict[str, Any]]) -> CellReport:
        out_features, in_features = self.weight.shape
        gram = law.weight_gram(self.weight)
        energy = torch.trace(sigma) > 0
        kappa_identity = _finite_or_none(law.kappa_bar(sigma, None, gram)) if energy else None
        kappa_rotation = _finite_or_none(law.haar_attractor(sigma, gram)) if energy else None
        kappa_star = _finite_or_none(law.kappa_star(sigma)) if energy else None
        covered = in_features - in_features % block_size
        excluded_blocks: list[int] = []
        block_values = torch.empty(0, dtype=_F64)
        if covered:
            ceilings = law.block_kappa_star(sigma[:covered, :covered], block_size)
            finite = torch.isfinite(ceilings)
            excluded_blocks = torch.nonzero(~finite).flatten().tolist()
            block_values = ceilings[finite]
        summary: tuple[float | None, float | None, float | None] = (None, None, None)
        if block_values.numel():
            summary = (float(block_values.quantile(0.5)), float(block_values.min()),
                       float(block_values.max()))
        return CellReport(
            block=self.block, layer=self.layer, cell=self.cell, kind=self.kind,
            members=list(self.members), in_features=in_features, out_features=out_features,
            tokens=self.tokens, calls=self.calls, kappa_identity=kappa_identity,
            kappa_rotation=kappa_rotation, kappa_star=kappa_star, block_size=block_size,
            block_kappa_star=summary[0], block_kappa_star_min=summary[1],
            block_kappa_star_max=summary[2],
            dead_coordinates=torch.nonzero(dead).flatten().tolist(),
            constant_coordinates=torch.nonzero(constant).flatten().tolist(),
            excluded_blocks=excluded_blocks, excluded_rows=excluded_rows,
            uncovered_features=in_features - covered,
        )


def _same_input(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))


class _BlockMeasurement:
    """Hooks on one block: capture the targeted linears' inputs per forward call, group them
    into cells at the first call, and feed each call's inputs to the cells' accumulators."""

    def __init__(self, step: BlockStep, linears: Mapping[str, nn.Module],
                 formats: Sequence[str], rows: int, seed: int) -> None:
        self.step = step
        self.linears = dict(linears)
        self.formats, self.rows, self.seed = formats, rows, seed
        self.captured: dict[str, list[Tensor]] = {}
        self.cells: list[tuple[str, _CellAccumulator]] | None = None
        self.never_called: list[str] = []

    def _pre_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.captured.setdefault(name, []).append(first_input(args, kwargs).detach())
        return hook

    def _after_block(self, module: nn.Module, args: tuple, output: Any) -> None:
        captured, self.captured = self.captured, {}
        if self.cells is None:
            self.cells = self._group(captured)
        for primary, accumulator in self.cells:
            for x in captured.get(primary, []):
                accumulator.add(x)

    def _group(self, captured: Mapping[str, list[Tensor]]) -> list[tuple[str, _CellAccumulator]]:
        """Cells of this block: same kind and same input (checked on this first call)."""
        self.never_called = [name for name in self.linears if name not in captured]
        groups: list[tuple[str, list[str]]] = []
        for name in self.linears:
            if name not in captured:
                continue
            kind = cell_kind(name)
            for group_kind, members in groups:
                if (kind != "other" and group_kind == kind
                        and _same_input(captured[members[0]][0], captured[name][0])):
                    members.append(name)
                    break
            else:
                groups.append((kind, [name]))
        groups.sort(key=lambda group: CELL_ORDER.index(group[0]))
        per_kind: dict[str, int] = {}
        for kind, _ in groups:
            per_kind[kind] = per_kind.get(kind, 0) + 1
        cells = []
        for kind, members in groups:
            if kind == "other" or per_kind[kind] > 1:
                cell = members[0] if len(members) == 1 else f"{self.step.name}.{kind}[{members[0]}]"
            else:
                cell = f"{self.step.name}.{kind}"
            weight = torch.cat([linear_weight(self.linears[m]).detach() for m in members], dim=0)
            accumulator = _CellAccumulator(self.step.index, self.step.name, cell, kind, members,
                                           weight, self.formats, self.rows, self.seed)
            cells.append((members[0], accumulator))
        return cells

    def run(self) -> list[Tensor]:
        handles = [m.register_forward_pre_hook(self._pre_hook(n), with_kwargs=True)
                   for n, m in self.linears.items()]
        handles.append(self.step.module.register_forward_hook(self._after_block))
        try:
            outputs = self.step.run()
        finally:
            for handle in handles:
                handle.remove()
        assert outputs is not None
        return outputs


def _measure_block(step: BlockStep, linears: Mapping[str, nn.Module], formats: Sequence[str],
                   rows: int, seed: int, block_size: int, records: list[LawRecord],
                   cells: list[CellReport], not_called: list[str]) -> list[Tensor]:
    """Run one block with its hooks; append its records and cell reports.  The block's
    accumulators (its second moments) go out of scope on return."""
    block = _BlockMeasurement(step, linears, formats, rows, seed)
    outputs = block.run()
    not_called.extend(block.never_called)
    for _, accumulator in block.cells or []:
        cell_records, report = accumulator.finish(block_size)
        records.extend(cell_records)
        cells.append(report)
    return outputs


def measure_law(
    model: nn.Module,
    batches: Sequence[Mapping[str, Tensor]],
    formats: Sequence[str],
    *,
    targets: Sequence[str] | str | None = None,
    ignore: Sequence[str] | str | None = None,
    rows: int = 8,
    seed: int = 0,
    block_size: int = 16,
    progress: bool = False,
) -> LawMeasurement:
    """Measure kappa and the SNR of every format per sampled row of every cell of ``model``.

    ``batches`` are the model's keyword inputs (``{"input_ids", "attention_mask"}``), one
    forward call each; ``formats`` are format names (:func:`~kbbq_pl.formats.get_format`);
    ``targets`` / ``ignore`` select the linear layers (:func:`~kbbq_pl.quant.modules.find_linears`,
    which raises a ValueError when nothing matches).  Raises a ValueError naming the layer when
    an input holds NaN or Inf.  See the module docstring for what is measured.
    """
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
    formats = [get_format(f).name for f in formats]
    if not formats:
        raise ValueError("no formats to measure")
    targeted = find_linears(model, targets, ignore)
    runner = SequentialRunner(model, batches)
    in_blocks: set[str] = set()
    not_called: list[str] = []
    records: list[LawRecord] = []
    cells: list[CellReport] = []
    from tqdm.auto import tqdm

    for step in tqdm(runner, total=len(runner), desc="noise law", unit="block",
                     disable=not progress):
        linears = {n: m for n, m in step.linears().items() if n in targeted}
        in_blocks.update(linears)
        if not linears:
            step.advance(step.run())
            continue
        outputs = _measure_block(step, linears, formats, rows, seed, block_size, records, cells,
                                 not_called)
        step.advance(outputs)
    if not in_blocks:
        raise ValueError(
            f"none of the {len(targeted)} targeted linear layers lies in the transformer blocks "
            f"of {type(model).__name__} ({runner.blocks_name}); targeted: "
            + ", ".join(list(targeted)[:6])
        )
    skipped = [{"linear": name, "reason": "not inside a transformer block"}
               for name in targeted if name not in in_blocks]
    skipped += [{"linear": name, "reason": "never called by its block's forward"}
                for name in not_called]
    return LawMeasurement(formats, records, cells, skipped)
