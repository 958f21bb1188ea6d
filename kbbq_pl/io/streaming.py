"""Quantize a model larger than the machine's memory: its weights streamed from disk.

:func:`quantize_checkpoint` builds the model of a HuggingFace folder with its parameters on the
meta device (no memory), reads the layers outside the stack of blocks (embeddings, final norm,
head) and runs :func:`~kbbq_pl.quant.pipeline.quantize_model` with :class:`StreamedBlocks`: each
block's weights are read from the source safetensors files (memory-mapped, shard by shard, a
single file or a sharded checkpoint with its index) when the pipeline reaches the block, and once
it is quantized its tensors are written to the output as the next shard and the block is
released.  Peak memory: embeddings + head + one block + the calibration activations.  The
output folder is written atomically (:func:`kbbq_pl.io.fileio.write_folder`: it appears
complete or not at all) and reloads with :func:`kbbq_pl.from_pretrained`; its tensors are bit
for bit those of the in-memory pipeline with ``--offload`` (the layers before the first block
run on the CPU).  Every recipe streams in one pass.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from ..quant.collectives import Collectives
from ..quant.config import QuantizationConfig
from ..quant.pipeline import quantize_model
from ..quant.report import QuantizationReport
from ..quant.sequential import BlockStep, count_tokens, find_blocks
from .checkpoint import (
    CheckpointError,
    ShardWriter,
    check_materialized,
    checkpoint_contents,
    empty_model,
    is_causal_lm_config,
    missing_tensors,
    write_checkpoint_files,
)
from .fileio import check_output, write_folder

__all__ = ["SafetensorsSource", "StreamedBlocks", "available_memory", "model_skeleton",
           "quantize_checkpoint", "streams_by_default"]

log = logging.getLogger(__name__)

SOURCE_INDEX = "model.safetensors.index.json"
SOURCE_FILE = "model.safetensors"


def available_memory() -> int | None:
    """The bytes this process can still take: the smaller of the machine's available memory
    (``MemAvailable``) and what its cgroup's limit leaves (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``); None where neither can be read (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit.isdigit() and int(limit) < 1 << 60:
                found.append(int(limit) - int(Path(usage_file).read_text().strip()))
        except OSError:
            continue
    return min(found) if found else None


def streams_by_default(folder: str | Path, processes: int = 1) -> tuple[bool, str]:
    """Whether ``kbbq-pl quantize`` streams the model of ``folder`` when neither ``--stream``
    nor ``--no-stream`` is given: when its safetensors weights (held by each of ``processes``
    on this machine) exceed half of :func:`available_memory`.  Returns the answer and one line
    saying why."""
    try:
        weights = SafetensorsSource(folder).total_bytes
    except CheckpointError:
        return False, ""
    available = available_memory()
    if available is None or weights * processes <= available / 2:
        return False, ""
    gib = 2.0**30
    return True, (f"the model's weights ({weights * processes / gib:.1f} GiB"
                  + (f" for {processes} processes" if processes > 1 else "")
                  + f") exceed half of the memory available ({available / gib:.1f} GiB): "
                  "streaming them from disk block by block (--no-stream keeps the model in "
                  "memory)")


class SafetensorsSource:
    """The tensors of a HuggingFace model folder, read one at a time without loading the rest
    (``model.safetensors``, or the shards its ``model.safetensors.index.json`` maps).

    A name is looked up as the model spells it, then with its base-model prefix removed or
    added (a bare encoder read from a checkpoint saved with its head, and the reverse)."""

    def __init__(self, folder: str | Path, base_prefix: str = "") -> None:
        self.folder = Path(folder)
        self.base_prefix = base_prefix
        index = self.folder / SOURCE_INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index} is not a safetensors index ({error})") from None
            self.files = {name: self.folder / file for name, file in weight_map.items()}
        elif (self.folder / SOURCE_FILE).is_file():
            with self._open(self.folder / SOURCE_FILE) as handle:
                self.files = dict.fromkeys(handle.keys(), self.folder / SOURCE_FILE)
        else:
            raise CheckpointError(f"{self.folder}: no {SOURCE_FILE} or {SOURCE_INDEX} (streaming "
                                  "reads safetensors checkpoints)")

    @staticmethod
    def _open(file: Path):
        try:
            return safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file} cannot be read ({error})") from None

    @property
    def total_bytes(self) -> int:
        """The size of the checkpoint's files on disk."""
        return sum(file.stat().st_size for file in set(self.files.values()))

    def stored_name(self, name: str) -> str | None:
        """The checkpoint's name of the model's tensor ``name`` (None when it has none)."""
        candidates = [name]
        if self.base_prefix:
            lead = self.base_prefix + "."
            candidates.append(name[len(lead):] if name.startswith(lead) else lead + name)
        return next((c for c in candidates if c in self.files), None)

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The tensors ``names`` (the model's names), each file opened once; an error names the
        tensors the checkpoint lacks."""
        stored = {name: self.stored_name(name) for name in names}
        missing = [name for name, key in stored.items() if key is None]
        if missing:
            raise missing_tensors(self.folder, missing)
        by_file: dict[Path, list[str]] = {}
        for name, key in stored.items():
            by_file.setdefault(self.files[key], []).append(name)
        tensors: dict[str, Tensor] = {}
        for file, group in by_file.items():
            with self._open(file) as handle:
                for name in group:
                    tensors[name] = handle.get_tensor(stored[name])
        return tensors


def _materialize(module: nn.Module, tensors: dict[str, Tensor], device: torch.device,
                 prefix: str = "") -> None:
    """Give ``module``'s parameters and persistent buffers the values ``tensors`` holds (by
    their names under ``prefix``), converted to the dtype the module was built with, on
    ``device``."""
    lead = f"{prefix}." if prefix else ""
    state = {}
    for name, current in module.state_dict(keep_vars=True).items():
        value = tensors.get(lead + name)
        if value is None:
            continue
        if tuple(value.shape) != tuple(current.shape):
            raise CheckpointError(f"{lead + name}: stored {list(value.shape)}, the model's "
                                  f"config makes it {list(current.shape)}")
        state[name] = value.to(device=device, dtype=current.dtype)
    module.load_state_dict(state, strict=False, assign=True)


def model_skeleton(folder: str | Path, *, causal: bool | None = None,
                   dtype: torch.dtype = torch.float32) -> tuple[nn.Module, SafetensorsSource]:
    """The model of ``folder``'s ``config.json`` in eval mode, with the parameters of its blocks
    on the meta device (no memory) and everything else (embeddings, final norm, head, buffers)
    read from its checkpoint, in ``dtype`` as :func:`kbbq_pl.io.models.load_model` loads it;
    and the checkpoint, for :class:`StreamedBlocks`."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    model = empty_model(config, is_causal_lm_config(config) if causal is None else causal, dtype)
    source = SafetensorsSource(folder, getattr(model, "base_model_prefix", ""))
    blocks_name, _ = find_blocks(model)
    outside = [name for name in model.state_dict()
               if not name.startswith(blocks_name + ".") and source.stored_name(name)]
    _materialize(model, source.read(outside), torch.device("cpu"))
    model.tie_weights()
    check_materialized(model, folder, skip=blocks_name)
    model.eval()
    return model, source


class ReleasedBlock(nn.Module):
    """What a streamed block leaves in the model once it is written: nothing to run."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name} was quantized, written to the output and released "
                           "(streamed from disk); load the output with kbbq_pl.from_pretrained")


class StreamedBlocks:
    """A :class:`~kbbq_pl.quant.sequential.BlockResidency` for a model whose blocks are on
    disk: each block is read from ``source`` onto the runner's device for its step; after it,
    its tensors go to ``shards`` as the next shard (not on a rank that does not write:
    ``shards`` None) and the block is replaced by a :class:`ReleasedBlock` (its memory
    freed)."""

    def __init__(self, source: SafetensorsSource, shards: ShardWriter | None) -> None:
        self.source = source
        self.shards = shards

    def load(self, step: BlockStep) -> None:
        names = [f"{step.name}.{name}" for name in step.module.state_dict()]
        _materialize(step.module, self.source.read(names), step.runner.device, step.name)

    def unload(self, step: BlockStep, done: bool) -> None:
        if done and self.shards is not None:
            self.shards.add(checkpoint_contents(step.module, prefix=step.name))
        step.runner.blocks[step.index] = ReleasedBlock(step.name)  # the pipeline trims the heap


def quantize_checkpoint(
    source_dir: str | Path,
    out_dir: str | Path,
    config: QuantizationConfig,
    batches: Callable[[nn.Module], list[dict[str, Tensor]]] | list[dict[str, Tensor]],
    *,
    device: torch.device | str = "cpu",
    tokenizer: Any = None,
    recipe: dict[str, Any] | None = None,
    extra_files: Callable[[QuantizationReport], dict[str, str]] | None = None,
    overwrite: bool = False,
    causal: bool | None = None,
    progress: bool = True,
    collectives: Collectives | None = None,
    shard: bool = False,
) -> QuantizationReport:
    """Quantize the model of ``source_dir`` with ``config`` block by block from disk into the
    checkpoint folder ``out_dir`` (module docstring); returns the report.

    ``batches``: the calibration batches, or a function of the (empty) model that makes them
    (e.g. to read its vocabulary size).  ``device`` runs each block; ``recipe`` is stored in
    ``quantization_config.json``; ``extra_files(report)`` names files written beside (reports);
    ``collectives`` and ``shard``: several processes, as
    :func:`~kbbq_pl.quant.pipeline.quantize_model` takes them (every rank reads the blocks,
    rank 0 alone writes).  ``source_dir`` is only read."""
    collectives = collectives or Collectives()
    out = check_output(out_dir, overwrite=overwrite, sources=[source_dir])
    model, source = model_skeleton(source_dir, causal=causal)
    log.info("%s: streaming %d MiB of weights from %s", type(model).__name__,
             source.total_bytes >> 20, source_dir)
    calibration = batches(model) if callable(batches) else list(batches)

    def run(shards: ShardWriter | None) -> QuantizationReport:
        report = quantize_model(model, calibration, config, device=device,
                                residency=StreamedBlocks(source, shards), collectives=collectives,
                                shard=shard, progress=progress and collectives.rank == 0)
        report.model.update(streamed_from=str(source_dir),
                            calibration_tokens=count_tokens(calibration))
        return report

    if collectives.rank != 0:  # another rank of a process group: it quantizes, rank 0 writes
        return run(None)
    report: QuantizationReport | None = None

    def write(staging: Path) -> None:
        nonlocal report
        shards = ShardWriter(staging)
        report = run(shards)
        shards.add(checkpoint_contents(model))
        write_checkpoint_files(staging, model, shards, tokenizer=tokenizer, recipe=recipe,
                               extra_files=extra_files(report) if extra_files else None)

    write_folder(out, write, kind="checkpoint", overwrite=overwrite, sources=[source_dir])
    assert report is not None
    return report
