"""Run a transformer one block at a time over cached calibration inputs.

The calibration batches are first split into their parts (:func:`split_calibration`: every
batch, or the auto-brake's fitting and held-out sequences; each rank's share of them under
several processes).  Every block's arguments (positional and keyword: attention masks, rotary
position embeddings, ...) are captured once by running the model with each block passing its
hidden states through unchanged: they differ from block to block in many models (Gemma 2 to 4,
gpt-oss, Cohere 2, Qwen3 with sliding-window layers: a mask and rotary embeddings per layer
type; hybrids: a linear-attention layer's own mask; Gemma 4: per-layer inputs), and tensors that
several blocks share are held once.  Then each block in order runs over its arguments with the
previous block's outputs as hidden states.  Only one block's activations are held (on
``offload_device``), so memory does not grow with depth: the sequential pipeline of
llm-compressor and of the GPTQ reference loop.

    runner = SequentialRunner(model, batches)
    for step in runner:                    # step.index, step.name, step.module
        ...                                # register hooks on step.module's linears
        outputs = step.run()               # run the block over every cached input
        ...                                # quantize step.module, maybe run it again
        step.advance(outputs)              # the outputs feed the next block

Targeted layers (``targets``) outside the stack that the model runs before its first block
(Gemma 4's ``per_layer_model_projection`` of the embeddings) form a step of their own before the
blocks (:class:`PrologueStep`), after which the blocks' arguments are captured again through
them.  A model without a stack of blocks, or with another targeted layer outside it (an
``lm_head`` quantized too), runs as one step: the whole model over the batches.

Where a block's weights live between steps is the runner's :class:`BlockResidency`:
:class:`MoveToDevice` (the model in memory, each block moved to the device for its step and back)
or :class:`kbbq_pl.io.streaming.StreamedBlocks` (each block read from the checkpoint on disk for
its step, written to the output and released after it).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from .._compat import CACHE_ARGUMENTS
from ..formats import QuantizedTensor
from .modules import is_linear, modality_encoders
from .tokens import calibrating, count_tokens, token_positions, warn_unknown_padding

log = logging.getLogger(__name__)

Batches = Iterable[Mapping[str, Tensor]]
"""Calibration batches: the model's keyword inputs (``{"input_ids", "attention_mask"}``), a
list or a DataLoader."""


def _check_token_ids(model: nn.Module, ids: Any, index: int) -> None:
    """A ValueError where calibration batch ``index``'s ``input_ids`` name a token outside the
    rows of ``model``'s input embedding (torch's own error names neither)."""
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # not a transformers model, or not a text one
        return
    rows = getattr(embedding, "num_embeddings", None)
    if not isinstance(ids, Tensor) or not isinstance(rows, int) or ids.is_floating_point():
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= rows:
        raise ValueError(f"calibration batch {index}: 'input_ids' (shape {tuple(ids.shape)}, "
                         f"{ids.device}) holds token {low if low < 0 else high}, outside the "
                         f"model's {rows} embedding rows: tokenize with the model's tokenizer")


def _log_padding(batches: Sequence[Mapping[str, Any]]) -> None:
    """Say how many of the batches' positions are padding, left out of the calibration, and
    warn of masks whose padding cannot be told (not 2-D)."""
    warn_unknown_padding(batches)
    padded = sum(int((~p).sum()) for p in map(token_positions, batches) if p is not None)
    if padded:
        log.info("%d calibration positions are padding (attention_mask 0), left out of the "
                 "calibration's %d tokens", padded, count_tokens(batches))


@dataclass(frozen=True)
class CalibrationSplit:
    """How the cached calibration inputs divide: the first ``fit`` batches fit the transforms,
    the ``held_out`` batches after them are the auto-brake's held-out sequences (none without
    ``lam: auto``).

    ``part_tokens``: the tokens of each part (fitting, held-out) over the ranks that share it
    (this rank's alone when each rank brought its own batches); ``offsets``: the index of this
    rank's first token within each part.  The kept samples are spread over these indices
    (:func:`~kbbq_pl.quant.stats.spread_sample`), so a calibration sharded over ranks keeps one
    process's tokens."""

    fit: int
    held_out: int
    part_tokens: tuple[int, int]
    offsets: tuple[int, int] = (0, 0)

    def stride(self, keep: int, part: int | None = None) -> int:
        """One token in how many a sample of ``keep`` tokens spread over ``part`` (both parts
        when None) keeps."""
        tokens = sum(self.part_tokens) if part is None else self.part_tokens[part]
        return max(1, tokens // max(1, keep))

    def position(self, part: int) -> int:
        """The index of this rank's first token of ``part`` when the parts are run in order."""
        return sum(self.part_tokens[:part]) + self.offsets[part]

    @property
    def total(self) -> int:
        return self.fit + self.held_out

    @property
    def fit_part(self) -> slice:
        return slice(0, self.fit)

    @property
    def held_out_part(self) -> slice:
        return slice(self.fit, self.total)


def split_sequences(batches: Sequence[Mapping[str, Tensor]], holdout: float, seed: int = 0
                    ) -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """The fitting and the held-out sequences of the auto-brake.

    The rows (sequences) of all batches are pooled and a seeded permutation sends
    ``round(holdout * n)`` of them (at least one, at most ``n - 1``) to the held-out part; each
    part is re-batched in the original batch size, its rows in their original order, a new
    batch starting wherever the sequence length changes (whole sentences of different lengths
    are neither padded nor cut).  A sequence that is all padding is left out."""
    if not 0.0 < holdout < 1.0:
        raise ValueError(f"autobrake.holdout lies in (0, 1), got {holdout}")
    keys = list(batches[0].keys()) if batches else []
    if not keys:
        raise ValueError("the calibration set is empty: no batches")
    rows = [{k: b[k][i:i + 1] for k in keys} for b in batches for i in range(len(b[keys[0]]))]
    rows = [row for row in rows if (p := token_positions(row)) is None or bool(p.any())]
    if len(rows) < 2:
        raise ValueError(f"lam: auto needs at least 2 calibration sequences with tokens, got "
                         f"{len(rows)}")
    batch_size = len(batches[0][keys[0]])
    held = min(len(rows) - 1, max(1, round(holdout * len(rows))))
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))

    def rebatch(index: Tensor) -> list[dict[str, Tensor]]:
        groups: list[list[dict[str, Tensor]]] = []
        for i in index.sort().values.tolist():
            row, last = rows[i], groups[-1] if groups else None
            if (last is None or len(last) == batch_size
                    or any(last[0][k].shape != row[k].shape for k in keys)):
                groups.append([row])
            else:
                last.append(row)
        return [{k: torch.cat([row[k] for row in group]) for k in keys} for group in groups]

    return rebatch(order[held:]), rebatch(order[:held])


def split_calibration(batches: Sequence[Mapping[str, Tensor]], holdout: float | None = None,
                      seed: int = 0, shard: tuple[int, int] | None = None
                      ) -> tuple[CalibrationSplit, list[Mapping[str, Tensor]]]:
    """The parts of the calibration, every batch or with ``holdout`` the auto-brake's fitting
    and held-out sequences (:func:`split_sequences`), and this process's batches, part after
    part.  ``shard = (rank, world_size)``: the batches are every rank's, the same on each, and
    this rank keeps its contiguous share of every part (an error on every rank, before any
    work, where a part has fewer batches than ranks)."""
    parts = (list(split_sequences(batches, holdout, seed)) if holdout is not None
             else [list(batches), []])
    part_tokens = (count_tokens(parts[0]), count_tokens(parts[1]))
    offsets = [0, 0]
    if shard is not None:
        rank, world_size = shard
        for k, (part, name) in enumerate(zip(parts, ("the fitting part" if holdout is not None
                                                      else "the calibration set",
                                                      "the held-out part"))):
            if not part and k == 1:
                continue
            if len(part) < world_size:
                raise ValueError(f"{world_size} processes need at least one calibration batch "
                                 f"each; {name} has {len(part)} (more calibration tokens, "
                                 "smaller batches, or fewer processes)")
            start, stop = rank * len(part) // world_size, (rank + 1) * len(part) // world_size
            offsets[k] = count_tokens(part[:start])
            parts[k] = part[start:stop]
    split = CalibrationSplit(len(parts[0]), len(parts[1]), part_tokens, (offsets[0], offsets[1]))
    return split, parts[0] + parts[1]


def _block_stack(model: nn.Module) -> tuple[str, nn.ModuleList, str | None]:
    """The stack of blocks to walk (:func:`find_blocks`), or the whole model as one block with
    the reason: it has no stack."""
    try:
        name, blocks = find_blocks(model)
    except ValueError as error:
        return "", nn.ModuleList([model]), str(error)
    return name, blocks, None


class _Prologue(nn.Module):
    """The targeted layers a model runs before its first block (Gemma 4's
    ``per_layer_model_projection`` of the embeddings), as one step of a
    :class:`SequentialRunner`: ``forward(**batch)`` runs the model up to its blocks for one
    batch (their layers as they are then, quantized or not) and returns every block's
    arguments for it (:meth:`SequentialRunner.capture`)."""

    def __init__(self, runner: SequentialRunner, linears: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self.__dict__["_runner"] = runner  # not a submodule
        self.names = list(linears)
        self.layers = nn.ModuleList(linears.values())  # the model's own modules

    def forward(self, **batch: Tensor) -> list[BlockInput]:
        runner = self.__dict__["_runner"]
        with computed_in(runner.model, runner.compute_dtype):
            calls = runner.capture([batch])
        return [block_calls[0] for block_calls in calls]


class PrologueStep:
    """The step of a :class:`SequentialRunner` before its blocks (:class:`_Prologue`): its
    inputs are the calibration batches, its outputs every block's arguments per batch, which
    :meth:`advance` makes the blocks' (the blocks then see the prologue's layers as the step
    left them).  It runs where the model's first layers are, as the capture does."""

    index = -1
    name = "prologue"

    def __init__(self, runner: SequentialRunner, module: _Prologue) -> None:
        self.runner = runner
        self.module = module

    @property
    def inputs(self) -> list[BlockInput]:
        return self.runner.batches

    def linears(self) -> dict[str, nn.Module]:
        return dict(zip(self.module.names, self.module.layers))

    @contextlib.contextmanager
    def on_device(self) -> Iterator[PrologueStep]:
        yield self

    @torch.no_grad()
    def run(self, keep_outputs: bool = True, subset: slice = slice(None)
            ) -> list[list[BlockInput]] | None:
        outputs = [] if keep_outputs else None
        for index in range(len(self.inputs))[subset]:
            with calibrating(self.runner.positions[index]):
                calls = self.module(**self.inputs[index].kwargs)
            if outputs is not None:
                outputs.append(calls)
        return outputs

    def advance(self, outputs: Sequence[list[BlockInput]]) -> None:
        """Every block's arguments from ``outputs`` (per batch, from :meth:`run`)."""
        if len(outputs) != len(self.inputs):
            raise ValueError(f"{len(outputs)} outputs for {len(self.inputs)} batches")
        self.runner.calls = [list(per_block) for per_block in zip(*outputs)]
        self.runner.inputs = self.runner.calls[0]


class _Recorder(nn.Module):
    """Stands in for a block in its stack while the blocks' arguments are captured: its
    forward is ``record``; any other attribute is the block's (a model's loop may read the
    block's layer type)."""

    def __init__(self, block: nn.Module, record: Any) -> None:
        super().__init__()
        self.__dict__["_block"] = block  # not a submodule
        self.record = record

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_block"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.record(*args, **kwargs)


class _Stop(Exception):
    """Raised by the capture of the last block's arguments to end the model's forward."""


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of transformer blocks: the longest ``nn.ModuleList`` whose items
    hold linear layers (``model.layers``, ``encoder.layer``, ``transformer.h``, ...), outside
    a multimodal model's vision tower (:func:`~kbbq_pl.quant.modules.modality_encoders`).
    A list of linear layers (Gemma 3n's ``altup_projections``) is not a stack of blocks."""
    best: tuple[str, nn.ModuleList] | None = None
    encoders = tuple(f"{name}." for name in modality_encoders(model))
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if encoders and name.startswith(encoders):
            continue
        if not all(any(is_linear(m) for m in item.modules()) for item in module):
            continue
        if any(is_linear(item) for item in module):
            continue
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        raise ValueError(f"{type(model).__name__} has no stack of transformer blocks "
                         "(an nn.ModuleList of modules with linear layers)")
    return best


def _to(value: Any, device: torch.device, moved: dict[int, tuple[Tensor, Tensor]] | None = None
        ) -> Any:
    """``value`` with every tensor it holds (in a :class:`BlockInput`, tuples, lists and dicts:
    hidden states, position embeddings, attention masks, cache positions) on ``device``.
    ``moved``: a tensor met again (the same object) is moved once (``id`` -> (the tensor, its
    copy); the tensor is kept so that its ``id`` is not reused)."""
    if isinstance(value, Tensor):
        if moved is None:
            return value.detach().to(device)
        if id(value) not in moved:
            moved[id(value)] = (value, value.detach().to(device))
        return moved[id(value)][1]
    if isinstance(value, BlockInput):
        return BlockInput(_to(value.args, device, moved), _to(value.kwargs, device, moved))
    if isinstance(value, tuple):
        return tuple(_to(v, device, moved) for v in value)
    if isinstance(value, list):
        return [_to(v, device, moved) for v in value]
    if isinstance(value, dict):
        return {k: _to(v, device, moved) for k, v in value.items()}
    return value


def _hidden(output: Any) -> Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass
class BlockInput:
    """One cached call of a block: its positional and keyword arguments."""

    args: tuple
    kwargs: dict

    def with_hidden(self, hidden: Tensor) -> BlockInput:
        if self.args:
            return BlockInput((hidden, *self.args[1:]), self.kwargs)
        return BlockInput(self.args, {**self.kwargs, "hidden_states": hidden})

    @property
    def hidden(self) -> Tensor:
        """The hidden states of the call (its first positional argument, or ``hidden_states``)."""
        return self.args[0] if self.args else self.kwargs["hidden_states"]



class BlockStep:
    """One block of a :class:`SequentialRunner`: run it over the cached inputs, then advance."""

    def __init__(self, runner: SequentialRunner, index: int, name: str, module: nn.Module):
        self.runner = runner
        self.index = index
        self.name = name
        self.module = module

    @property
    def inputs(self) -> list[BlockInput]:
        return self.runner.inputs

    def linears(self) -> dict[str, nn.Module]:
        """The block's linear layers by their qualified name in the whole model."""
        prefix = f"{self.name}." if self.name else ""
        return {prefix + n: m for n, m in self.module.named_modules() if is_linear(m)}

    @contextlib.contextmanager
    def on_device(self) -> Iterator[BlockStep]:
        """The block's weights on the runner's device for the duration (the runner's
        :class:`BlockResidency` brings them and takes them away: every other block stays where
        it is, and the model need not fit on the device)."""
        residency = self.runner.residency
        residency.load(self)
        done = False
        try:
            yield self
            done = True
        finally:
            residency.unload(self, done)

    @torch.no_grad()
    def run(self, keep_outputs: bool = True, subset: slice = slice(None)) -> list[Tensor] | None:
        """Run the block over the cached inputs (all, or the batches ``subset``) on the
        runner's device, each call's hooks told its batch's padding (:func:`~kbbq_pl.quant.
        tokens.calibrating`)."""
        device = self.runner.device
        outputs = [] if keep_outputs else None
        for index in range(len(self.inputs))[subset]:
            cached = self.inputs[index]
            call = _to(cached, device) if device != self.runner.offload_device else cached
            with calibrating(self.runner.positions[index]):
                output = self.module(*call.args, **call.kwargs)
            if outputs is not None:
                outputs.append(_hidden(output).detach().to(self.runner.offload_device))
        return outputs

    def advance(self, outputs: Sequence[Tensor]) -> None:
        """Feed ``outputs`` (from :meth:`run`) to the next block, with its own arguments."""
        if len(outputs) != len(self.inputs):
            raise ValueError(f"{len(outputs)} outputs for {len(self.inputs)} cached inputs")
        runner = self.runner
        following = runner.calls[self.index + 1] if self.index + 1 < len(runner.calls) else None
        runner.inputs = [(c if following is None else following[b]).with_hidden(o)
                         for b, (c, o) in enumerate(zip(self.inputs, outputs))]


class BlockResidency(Protocol):
    """Where a block's weights come from for its step and go after it."""

    def load(self, step: BlockStep) -> None:
        """Put ``step.module``'s weights on ``step.runner.device``."""

    def unload(self, step: BlockStep, done: bool) -> None:
        """Take them away after the step (``done``: the step finished; False on an error)."""


class MoveToDevice:
    """The model in memory: each block moves to the runner's device for its step and back to
    where it was after it."""

    def __init__(self) -> None:
        self._home: dict[int, torch.device] = {}

    def load(self, step: BlockStep) -> None:
        self._home[step.index] = next(step.module.parameters()).device
        step.module.to(step.runner.device)

    def unload(self, step: BlockStep, done: bool) -> None:
        step.module.to(self._home.pop(step.index))


class SequentialRunner:
    """Iterate over a model's blocks with their calibration inputs (see the module docstring).

    ``batches`` are the model's keyword inputs (dicts such as ``{"input_ids",
    "attention_mask"}``), split into their parts by :func:`split_calibration` (``holdout``,
    ``seed``, ``shard``; :attr:`split` says which cached inputs are which); ``device`` runs the
    blocks, ``offload_device`` holds the cached activations between blocks, ``residency``
    brings each block's weights (default :class:`MoveToDevice`); ``compute_dtype``: the layers
    before the first block compute in it (:func:`computed_in`), as the pipeline computes each
    block (None: the model's own).  ``whole_model``: why the model runs as one block (targeted
    layers outside the stack, ``targets``, or no stack), None when it runs block by block.
    """

    def __init__(
        self,
        model: nn.Module,
        batches: Batches,
        device: torch.device | str | None = None,
        offload_device: torch.device | str = "cpu",
        targets: Collection[str] | None = None,
        residency: BlockResidency | None = None,
        *,
        holdout: float | None = None,
        seed: int = 0,
        shard: tuple[int, int] | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        batches = list(batches)
        if not batches:
            raise ValueError("the calibration set is empty: no batches")
        for index, batch in enumerate(batches):
            if not isinstance(batch, Mapping):
                raise TypeError(
                    f"calibration batch {index} is a {type(batch).__name__}"
                    f"{f' of shape {tuple(batch.shape)}' if isinstance(batch, Tensor) else ''}: "
                    "batches are dicts of the model's keyword inputs, such as "
                    "{'input_ids': ids, 'attention_mask': mask}")
            for key in ("input_ids", "attention_mask"):
                value = batch.get(key)
                if isinstance(value, (list, tuple)):
                    raise TypeError(f"calibration batch {index}: {key!r} is a "
                                    f"{type(value).__name__}; batches hold tensors (a tokenizer's "
                                    "return_tensors='pt')")
                if isinstance(value, Tensor) and not value.numel():
                    raise ValueError(f"calibration batch {index}: {key!r} is empty (shape "
                                     f"{tuple(value.shape)})")
            _check_token_ids(model, batch.get("input_ids"), index)
        _log_padding(batches)
        self.split, batches = split_calibration(batches, holdout, seed, shard)
        self.model = model
        self.residency = residency or MoveToDevice()
        self.device = torch.device(device) if device else next(model.parameters()).device
        self.offload_device = torch.device(offload_device)
        self.compute_dtype = compute_dtype
        self.blocks_name, self.blocks, self.whole_model = _block_stack(model)
        self.calls: list[list[BlockInput]] = []
        """Each block's arguments per batch (their hidden states those of the first block)."""
        self.batches = [_to(BlockInput((), dict(batch)), self.offload_device)
                        for batch in batches]
        self.positions = [token_positions(batch) for batch in batches]
        """Each batch's token positions (None: no padding), which its calls' hooks keep."""
        self.prologue: _Prologue | None = None
        """The targeted layers run before the first block, quantized in a step of their own."""
        self._batch_index, self._batch_in_blocks = 0, False  # where the capture is (_watching)
        outside = [] if self.whole_model else [
            t for t in targets or () if not t.startswith(self.blocks_name + ".")]
        if self.whole_model is None:
            with computed_in(model, compute_dtype), self._watching(outside) as before:
                self.calls = self.capture(batches)
            after = [name for name in outside if name not in before]
            if after:
                self.whole_model = (f"targeted layers outside its blocks {self.blocks_name} "
                                    f"not run before them: {', '.join(after[:3])}")
            elif outside:
                self.prologue = _Prologue(self, {n: model.get_submodule(n) for n in outside})
        if self.whole_model is None:
            self.inputs = self.calls[0]
        else:
            log.info("%s: the model runs as one block (%s)", type(model).__name__,
                     self.whole_model)
            self.blocks_name, self.blocks, self.calls = "", nn.ModuleList([model]), []
            self.inputs = self.batches

    @contextlib.contextmanager
    def _watching(self, names: Sequence[str]) -> Iterator[set[str]]:
        """Within it, the capture notes which of the layers ``names`` every batch runs before
        its first block: yields that set, complete at the end."""
        seen: dict[str, set[int]] = {name: set() for name in names}
        late: set[str] = set()

        def hook(name: str):
            def note(module: nn.Module, args: Any) -> None:
                if self._batch_in_blocks:
                    late.add(name)
                else:
                    seen[name].add(self._batch_index)
            return note

        handles = [self.model.get_submodule(name).register_forward_pre_hook(hook(name))
                   for name in names]
        before: set[str] = set()
        try:
            yield before
        finally:
            for handle in handles:
                handle.remove()
        batches = set(range(len(self.batches)))
        before.update(name for name, hit in seen.items() if hit == batches and name not in late)

    @torch.no_grad()
    def capture(self, batches: Sequence[Mapping[str, Tensor]]) -> list[list[BlockInput]]:
        """Every block's arguments for each of ``batches`` (the first block's with its hidden
        states, the others' without): the model runs with each block replaced in its stack by
        a :class:`_Recorder` that records its arguments and returns its hidden states, up to
        the last block.
        A model that cannot run so (its code reads more of a block's output than the hidden
        states) gives every block the first block's arguments, with a log message."""
        try:
            return self._run_recording(batches, len(self.blocks))
        except Exception as error:  # noqa: BLE001 - the first block's alone, or the real error
            first = self._run_recording(batches, 1)[0]
            log.info("%s: each block is given the first block's arguments (the model does not "
                     "run with its blocks passed through: %s)", type(self.model).__name__, error)
            return [first] * len(self.blocks)

    def _run_recording(self, batches: Sequence[Mapping[str, Tensor]], count: int
                       ) -> list[list[BlockInput]]:
        """The arguments of the first ``count`` blocks per batch (:meth:`capture`)."""
        calls: list[list[BlockInput]] = [[] for _ in range(count)]
        moved: dict[int, tuple[Tensor, Tensor]] = {}  # per batch: what its blocks share

        def recorder(index: int):
            def forward(*args: Any, **kwargs: Any) -> Tensor:
                self._batch_in_blocks = True
                kwargs = {k: v for k, v in kwargs.items()
                          if k not in (*CACHE_ARGUMENTS, "use_cache")}
                call = BlockInput(tuple(args), kwargs)
                hidden = call.hidden
                calls[index].append(_to(call if index == 0 else call.with_hidden(None),
                                        self.offload_device, moved))
                if index == count - 1:
                    raise _Stop
                return hidden
            return forward

        device = next(self.model.parameters()).device  # the layers before the first block
        blocks = list(self.blocks)[:count]
        for index, block in enumerate(blocks):  # the blocks themselves (and hooks) never run
            self.blocks[index] = _Recorder(block, recorder(index))
        try:
            for self._batch_index, batch in enumerate(batches):
                batch = {k: v.to(device) for k, v in batch.items()}
                moved.clear()
                self._batch_in_blocks = False
                try:
                    self.model(**batch, use_cache=False)
                except _Stop:
                    pass
        finally:
            for index, block in enumerate(blocks):
                self.blocks[index] = block
        if not calls[0]:
            raise ValueError("no calibration batches: the calibration set is empty")
        counts = {len(recorded) for recorded in calls}
        if counts != {len(batches)}:
            raise ValueError(f"the blocks were called {sorted(counts)} times for "
                             f"{len(batches)} batches")
        return calls

    def __len__(self) -> int:
        return len(self.blocks) + (self.prologue is not None)

    def __iter__(self) -> Iterator[BlockStep | PrologueStep]:
        if self.prologue is not None:
            yield PrologueStep(self, self.prologue)
        for index in range(len(self.blocks)):  # by index: a released block is not held here
            name = f"{self.blocks_name}.{index}" if self.whole_model is None else ""
            yield BlockStep(self, index, name, self.blocks[index])


def _floating_tensors(module: nn.Module, dtype: torch.dtype, recurse: bool = True
                      ) -> list[Tensor]:
    """The parameters and buffers of ``module`` (and of its submodules with ``recurse``) of a
    floating dtype other than ``dtype``, outside quantized layers (whose weight is a
    :class:`~kbbq_pl.formats.QuantizedTensor`: they compute as they were built)."""
    found: dict[int, Tensor] = {}
    for sub in (module.modules() if recurse else [module]):
        if isinstance(getattr(sub, "weight", None), QuantizedTensor):
            continue
        for tensor in [*sub._parameters.values(), *sub._buffers.values()]:
            if tensor is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                found[id(tensor)] = tensor
    return list(found.values())


def _convert(tensors: list[Tensor], dtype: torch.dtype, keep: bool = True
             ) -> list[tuple[Tensor, Tensor | torch.dtype]]:
    """Convert ``tensors`` in place (their ``.data``) to ``dtype``; returns each with the data
    it held (``keep``), else with its dtype (the data is freed as it is converted)."""
    stored = [(tensor, tensor.data if keep else tensor.dtype) for tensor in tensors]
    for tensor in tensors:
        tensor.data = tensor.data.to(dtype)
    return stored


def _restore(stored: list[tuple[Tensor, Tensor | torch.dtype]],
             module: nn.Module | None = None) -> None:
    """Give the tensors of :func:`_convert` their dtypes back (exact, from bfloat16 or float16
    through float32): the very storage kept when the values did not change (no copy: a model
    memory-mapped from safetensors is not held twice).  With ``module``, only the tensors it
    still holds."""
    held = None if module is None else {
        id(t) for t in [*module.parameters(), *module.buffers()]}
    for tensor, data in stored:
        if held is not None and id(tensor) not in held:
            continue
        restored = tensor.data.to(data if isinstance(data, torch.dtype) else data.dtype)
        unchanged = isinstance(data, Tensor) and torch.equal(restored, data)
        tensor.data = data if unchanged else restored


@contextlib.contextmanager
def held_in(module: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """``module``'s floating parameters and buffers (quantized layers aside) in ``dtype`` for
    the duration (the others freed meanwhile: a block is not held twice), then in the dtype
    each had again (those the module still holds: a layer
    replaced meanwhile is gone).  None: as they are."""
    stored = [] if dtype is None else _convert(_floating_tensors(module, dtype), dtype,
                                               keep=False)
    try:
        yield
    finally:
        _restore(stored, module)


@contextlib.contextmanager
def computed_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Run ``model``'s forward in ``dtype`` without holding the model in ``dtype``: each module
    holding floating tensors of its own (a linear, a norm) has them converted to ``dtype`` when
    its forward starts and back when it ends, one module at a time (a module that computes
    with another's tensors without calling it would see them unconverted);
    an embedding table is not converted, its rows are (a lookup copies them: the same values,
    without the whole table in ``dtype``); quantized layers compute as they were built; the
    memory a module's forward freed goes back to the system as it ends (:func:`trim_heap`: the
    transient peak is one module's, not the heap's).  The
    outputs are those of the model converted to ``dtype`` as a whole.  None: as it is."""
    if dtype is None:
        yield
        return
    units = [m for m in model.modules() if _floating_tensors(m, dtype, recurse=False)]
    converted: dict[int, list[tuple[Tensor, Tensor]]] = {}

    def enter(unit: nn.Module) -> None:
        converted[id(unit)] = _convert(_floating_tensors(unit, dtype, recurse=False), dtype)

    def leave(unit: nn.Module) -> None:
        _restore(converted.pop(id(unit), []))
        trim_heap()

    def rows_in_dtype(unit: nn.Module, args: Any, out: Any) -> Any:
        return out.to(dtype) if isinstance(out, Tensor) and out.is_floating_point() else out

    handles = []
    for unit in units:
        if isinstance(unit, nn.Embedding) and unit.max_norm is None:
            handles.append(unit.register_forward_hook(rows_in_dtype))
            continue
        handles.append(unit.register_forward_pre_hook(lambda m, args: enter(m)))
        handles.append(unit.register_forward_hook(lambda m, args, out: leave(m),
                                                  always_call=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        if converted:  # a forward that raised half way: its units back, their copies freed
            for stored in converted.values():
                _restore(stored)
            converted.clear()
            trim_heap()


def trim_heap() -> None:
    """Return freed CPU memory to the operating system (glibc ``malloc_trim``; a no-op
    elsewhere).  Freed tensors otherwise stay in the allocator's heap, and the RSS of a long
    loop grows block after block with memory that is no longer in use."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None
