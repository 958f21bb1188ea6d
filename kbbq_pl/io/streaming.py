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
run on the CPU).  Every recipe streams in one pass.  Tensors are found by the model's names
through the architecture's conversion mapping, as ``from_pretrained`` finds them
(:class:`SafetensorsSource`), so a mixture-of-experts block's experts, stored expert by expert
or fused, are read as its fused parameters and handed to its
:class:`~kbbq_pl.quant.experts.ExpertLinears` (the pipeline made them linear layers on the meta
device).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from copy import deepcopy
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from ..quant.collectives import Collectives
from ..quant.config import QuantizationConfig
from ..quant.experts import ExpertLinears
from ..quant.pipeline import quantize_model
from ..quant.report import QuantizationReport
from ..quant.sequential import BlockStep, find_blocks
from ..quant.tokens import count_tokens
from .checkpoint import (
    CheckpointError,
    ShardWriter,
    check_materialized,
    checkpoint_contents,
    declared_dtype,
    empty_model,
    header_tensors,
    is_causal_lm_config,
    missing_tensors,
    model_config,
    read_generation_config,
    weight_files,
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


def _quantized_folder(folder: str | Path) -> bool:
    """Whether ``folder``'s ``config.json`` declares a quantization
    (:func:`quantization_method`)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and quantization_method(config) is not None


def streams_by_default(folder: str | Path, processes: int = 1) -> tuple[bool, str]:
    """Whether ``kbbq-pl quantize`` streams the model of ``folder`` when neither ``--stream``
    nor ``--no-stream`` is given: when its safetensors weights (held by each of ``processes``
    on this machine) exceed half of :func:`available_memory`.  Returns the answer and one line
    saying why."""
    try:
        weights = SafetensorsSource(folder).total_bytes
    except CheckpointError:
        return False, ""
    if _quantized_folder(folder):  # streaming reads full-precision weights only
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

    Given the ``model`` they are read into, a tensor is asked for by the model's name and found
    as transformers' ``from_pretrained`` finds it: through the architecture's conversion mapping
    (renamed, e.g. Mixtral's ``block_sparse_moe`` as ``mlp``; made of several stored tensors,
    e.g. a mixture-of-experts layer's fused ``experts.gate_up_proj`` of each expert's
    ``gate_proj`` and ``up_proj``; or one of the pieces of a stored tensor, e.g. Kimi K2.5's
    vision ``attn.q_proj`` / ``k_proj`` / ``v_proj`` of its ``wqkv``), with the base-model
    prefix removed or added (a bare encoder read from a checkpoint saved with its head, and the
    reverse).  Without ``model``, names are the stored ones.  :meth:`from_tensors` maps
    tensors already read the same way."""

    def __init__(self, folder: str | Path, model: nn.Module | None = None,
                 loaded: dict[str, Tensor] | None = None) -> None:
        self.folder = Path(folder)
        self.model = model
        self._loaded = loaded
        index = self.folder / SOURCE_INDEX
        if loaded is not None:
            self.files = dict.fromkeys(loaded, self.folder)
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as error:
                raise CheckpointError(f"{index} is not a safetensors index ({error})") from None
            self.files = {name: self.folder / file for name, file in weight_map.items()}
            self._check_index(index)
        elif (self.folder / SOURCE_FILE).is_file():
            with self._open(self.folder / SOURCE_FILE) as handle:
                self.files = dict.fromkeys(handle.keys(), self.folder / SOURCE_FILE)
        else:
            raise CheckpointError(f"{self.folder}: no {SOURCE_FILE} or {SOURCE_INDEX} (streaming "
                                  "reads safetensors checkpoints)")
        self._sources: dict[str, list[tuple[str, str | None]]] = {}
        self._converters: dict[str, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._made_with: dict[str, str] = {}  # a piece of a split: the name its converter runs as
        self._parameters: _MappedParameters | None = None
        if model is None:
            self._sources = {name: [(name, None)] for name in self.files}
        else:
            self._map_names(model)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], model: nn.Module,
                     folder: str | Path) -> SafetensorsSource:
        """The stored ``tensors`` of ``folder``, already read, under ``model``'s names: each is
        taken out of ``tensors`` when :meth:`read` converts it."""
        return cls(folder, model, loaded=tensors)

    def unread(self) -> dict[str, Tensor]:
        """The tensors given to :meth:`from_tensors` that :meth:`read` has not taken."""
        return dict(self._loaded or {})

    def _map_names(self, model: nn.Module) -> None:
        """Map each of ``model``'s tensor names to the stored tensors it is made of, as
        transformers' ``convert_and_load_state_dict_in_model`` does (the same functions, the
        stored names in the same order), with the converter that makes it where there is one."""
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        mapping = get_model_conversion_mapping(model) if isinstance(model, PreTrainedModel) else []
        renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
        converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
        by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
        expected = model.state_dict()
        self._parameters = _MappedParameters(model, expected)
        prefix = getattr(model, "base_model_prefix", "")
        for key in sorted(self.files, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
            if name not in expected and key in expected:
                name, pattern = key, None
            elif name not in expected:
                name, pattern = rename_source_key(key, [], [], prefix, expected)
            self._sources.setdefault(name, []).append((key, pattern))
            if pattern is None:
                continue
            converter = by_pattern[pattern]
            # a one-to-many converter maps the stored tensor to its first target; the others
            # are the same stored tensor's other pieces (transformers names them alike)
            first, *others = converter.target_patterns
            pieces = [name] + [name.replace(first, other) for other in others
                               if len(converter.source_patterns) == 1]
            for piece in pieces:
                if piece in expected:
                    self._sources[piece] = self._sources[name]
                    self._converters[piece] = converter
                    self._shapes[piece] = tuple(expected[piece].shape)
                    self._made_with[piece] = name

    def _check_index(self, index: Path) -> None:
        """Raise a CheckpointError, before any work, where the index maps a tensor to a shard
        that does not hold it (each shard's header read once)."""
        held: dict[Path, set[str]] = {}
        for file in dict.fromkeys(self.files.values()):
            with self._open(file) as handle:
                held[file] = set(handle.keys())
        wrong = [name for name, file in self.files.items() if name not in held[file]]
        if wrong:
            raise CheckpointError(f"{index} maps {len(wrong)} tensors to shards that do not "
                                  f"hold them (first: {wrong[0]} to {self.files[wrong[0]].name})")

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

    def __contains__(self, name: str) -> bool:
        """Whether the checkpoint holds the model's tensor ``name``."""
        return name in self._sources

    def _stored_counts(self, name: str) -> str:
        """How many stored tensors of each pattern make the model's tensor ``name``."""
        counts: dict[str, int] = {}
        for _, pattern in self._sources[name]:
            counts[str(pattern)] = counts.get(str(pattern), 0) + 1
        return ", ".join(f"{count} {pattern}" for pattern, count in counts.items())

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The tensors ``names`` (the model's names), each file opened once; an error names the
        tensors the checkpoint lacks."""
        names = list(names)
        missing = [name for name in names if name not in self._sources]
        if missing:
            raise missing_tensors(self.folder, missing)
        by_file: dict[Path, list[str]] = {}
        for name in names:
            for key, _ in self._sources[name]:
                by_file.setdefault(self.files[key], []).append(key)
        stored: dict[str, Tensor] = {}
        for file, keys in by_file.items():
            if self._loaded is not None:
                stored.update((key, self._loaded.pop(key)) for key in dict.fromkeys(keys))
                continue
            with self._open(file) as handle:
                for key in dict.fromkeys(keys):
                    stored[key] = handle.get_tensor(key)
        tensors: dict[str, Tensor] = {}
        converted: dict[str, dict[str, Any]] = {}  # by the name each converter ran as
        for name in names:
            if name not in self._converters:
                tensors[name] = stored.pop(self._sources[name][0][0])
                continue
            made_with = self._made_with[name]
            if made_with not in converted:
                converter = deepcopy(self._converters[name])
                for key, pattern in self._sources[name]:
                    converter.add_tensor(made_with, key, pattern, stored.pop(key))
                try:
                    converted[made_with] = converter.convert(
                        made_with, model=self._parameters, config=self.model.config)
                except (RuntimeError, ValueError, KeyError, IndexError) as error:
                    raise CheckpointError(f"{self.folder}: {name} cannot be made of its stored "
                                          f"tensors ({self._stored_counts(name)}): {error}"
                                          ) from None
            value = converted[made_with].pop(name, None)
            if value is None:
                raise CheckpointError(f"{self.folder}: the stored tensors of {made_with} "
                                      f"({self._stored_counts(name)}) do not make {name}")
            value = value[0] if isinstance(value, list) else value
            if tuple(value.shape) != self._shapes[name]:
                raise CheckpointError(
                    f"{self.folder}: the stored tensors ({self._stored_counts(name)}) make {name} "
                    f"{list(value.shape)}, the model's config makes it {list(self._shapes[name])}")
            tensors[name] = value
        return tensors


class _MappedParameters:
    """What transformers' conversion operations ask of the model (a parameter's shape and dtype
    by name, ``get_parameter``), as the model was when its names were mapped: the pipeline may
    since have made its fused experts linear layers (Qwen3-VL-MoE's experts are stored fused and
    transposed, and its conversion compares them with the fused parameter's shape)."""

    def __init__(self, model: nn.Module, state: dict[str, Tensor]) -> None:
        self.config = model.config
        self._meta = {name: torch.empty(value.shape, dtype=value.dtype, device="meta")
                      for name, value in state.items()}

    def get_parameter(self, name: str) -> Tensor:
        if name not in self._meta:
            raise AttributeError(f"the model has no parameter {name}")
        return self._meta[name]


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
        if current.is_floating_point() and (not value.is_floating_point()
                                            or value.element_size() == 1):
            raise CheckpointError(f"{lead + name}: stored as {value.dtype} {list(value.shape)} "
                                  f"for a {current.dtype} parameter: quantized codes, whose "
                                  "scales streaming does not apply (quantize the model in "
                                  "memory, --no-stream, or its full-precision checkpoint)")
        state[name] = value.to(device=device, dtype=current.dtype)
    module.load_state_dict(state, strict=False, assign=True)


def quantization_method(config: Any) -> str | None:
    """The ``quant_method`` of a config's ``quantization_config`` (a folder quantized by
    transformers' quantizers, llm-compressor, kbbq-pl), None for full-precision weights;
    ``config`` a transformers config or the dict of a ``config.json``."""
    block = (config.get("quantization_config") if isinstance(config, dict)
             else getattr(config, "quantization_config", None))
    if block is None:
        return None
    method = block.get("quant_method") if isinstance(block, dict) else getattr(
        block, "quant_method", None)
    return str(getattr(method, "value", method) or "unknown")


def stored_dtype(folder: str | Path, config: Any) -> torch.dtype:
    """The dtype transformers' ``dtype="auto"`` gives the model of ``folder``: its config's
    ``dtype``, else that of the first floating-point tensor stored, else float32."""
    declared = declared_dtype(config)
    if declared is not None:
        return declared
    stored = header_tensors(weight_files(folder)).values()
    return next((t.dtype for t in stored if t.is_floating_point()), torch.float32)


def model_skeleton(folder: str | Path, *, causal: bool | None = None,
                   dtype: torch.dtype | None = torch.float32, trust_remote_code: bool = False
                   ) -> tuple[nn.Module, SafetensorsSource]:
    """The model of ``folder``'s ``config.json`` in eval mode, with the parameters of its blocks
    on the meta device (no memory) and everything else (embeddings, final norm, head, buffers)
    read from its checkpoint, in ``dtype`` (None: as stored, :func:`stored_dtype`) as
    :func:`kbbq_pl.io.models.load_model` loads it; and the checkpoint, for
    :class:`StreamedBlocks`.  ``trust_remote_code``: a model of the folder's own code
    (``auto_map``) is built from it."""
    config = model_config(folder, trust_remote_code)
    method = quantization_method(config)
    if method is not None:
        raise CheckpointError(
            f"{folder} is quantized (quantization_config quant_method {method!r}): streaming "
            "reads full-precision weights; quantize it in memory (--no-stream), where "
            "transformers dequantizes it, or quantize its full-precision checkpoint")
    dtype = stored_dtype(folder, config) if dtype is None else dtype
    model = empty_model(config, is_causal_lm_config(config) if causal is None else causal, dtype,
                        trust_remote_code=trust_remote_code)
    read_generation_config(model, folder)
    source = SafetensorsSource(folder, model)
    blocks_name, _ = find_blocks(model)
    outside = [name for name in model.state_dict()
               if not name.startswith(blocks_name + ".") and name in source]
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
    ``shards`` None; full-precision tensors as held) and the block is replaced by a
    :class:`ReleasedBlock` (its memory freed)."""

    def __init__(self, source: SafetensorsSource, shards: ShardWriter | None) -> None:
        self.source = source
        self.shards = shards

    def load(self, step: BlockStep) -> None:
        experts = {f"{step.name}.{name}": module for name, module in step.module.named_modules()
                   if isinstance(module, ExpertLinears)}
        names = [f"{step.name}.{name}" for name in step.module.state_dict()]
        names = [name for name in names if not any(name.startswith(f"{e}.") for e in experts)]
        fused = [f"{name}.{param}" for name, module in experts.items()
                 for param in module.fused_parameters]
        tensors = self.source.read(names + fused)
        for name, module in experts.items():  # stored fused or expert by expert: as fused
            state = module.unfused_state({param: tensors.pop(f"{name}.{param}")
                                          for param in module.fused_parameters})
            tensors.update({f"{name}.{key}": value for key, value in state.items()})
        _materialize(step.module, tensors, step.runner.device, step.name)

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
    dtype: torch.dtype | None = torch.float32,
    compute_dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> QuantizationReport:
    """Quantize the model of ``source_dir`` with ``config`` block by block from disk into the
    checkpoint folder ``out_dir`` (module docstring); returns the report.

    ``batches``: the calibration batches, or a function of the (empty) model that makes them
    (e.g. to read its vocabulary size).  ``device`` runs each block; ``recipe`` is stored in
    ``quantization_config.json``; ``extra_files(report)`` names files written beside (reports);
    ``collectives`` and ``shard``: several processes, as
    :func:`~kbbq_pl.quant.pipeline.quantize_model` takes them (every rank reads the blocks,
    rank 0 alone writes).  ``dtype``: the dtype the model is held in (None: as stored), in
    which its full-precision tensors are written; ``compute_dtype``: what each block computes
    in (None: as held), as ``kbbq-pl quantize`` holds, computes and writes an in-memory model.
    ``trust_remote_code``: a model of the folder's own code is built from it (and the
    checkpoint holds that code).  ``source_dir`` is only read."""
    collectives = collectives or Collectives()
    out = check_output(out_dir, overwrite=overwrite, sources=[source_dir])
    model, source = model_skeleton(source_dir, causal=causal, dtype=dtype,
                                   trust_remote_code=trust_remote_code)
    log.info("%s: streaming %d MiB of weights from %s", type(model).__name__,
             source.total_bytes >> 20, source_dir)
    calibration = batches(model) if callable(batches) else list(batches)

    def run(shards: ShardWriter | None) -> QuantizationReport:
        report = quantize_model(model, calibration, config, device=device,
                                residency=StreamedBlocks(source, shards),
                                collectives=collectives, shard=shard,
                                progress=progress and collectives.rank == 0,
                                compute_dtype=compute_dtype)
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
                               extra_files=extra_files(report) if extra_files else None,
                               source_dir=source_dir)

    write_folder(out, write, kind="checkpoint", overwrite=overwrite, sources=[source_dir])
    assert report is not None
    return report
