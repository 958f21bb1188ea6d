"""Quantized checkpoints: a folder that reloads bit-exactly.

``save_quantized(model, out_dir)`` writes, atomically (a temporary sibling folder, then a
rename):

* ``config.json``: the HuggingFace model config with a ``quantization_config`` of
  ``quant_method`` ``"kbbq"`` (:func:`quantization_block`: the format version and every
  quantized layer's metadata), by which transformers loads the folder once kbbq-pl is imported
  (:mod:`kbbq_pl.io.hf_quantizer`), and an ``auto_map`` naming :data:`LOADER`'s classes, by
  which transformers loads it with ``trust_remote_code=True`` where nothing imports kbbq-pl
  (lm-eval's ``lm_eval`` command); the tokenizer's files when given; and the source's
  processor files and sentence-transformers modules (:data:`SENTENCE_TRANSFORMERS_FILES`);
* ``kbbq_pl_loader.py`` (:func:`remote_code_loader`): those classes, transformers' own config
  and model classes under their own names, in a module that imports kbbq-pl;
* ``model.safetensors`` (a model streamed from disk: one shard per block, with
  ``model.safetensors.index.json``): every tensor of the model.  A quantized layer ``L`` stores
  ``L.weight`` (its packed codes: uint8 ``[N, K/2]``, two E2M1 codes per byte, element ``2i``
  in the low nibble; a reader without kbbq-pl finds a tensor of the wrong shape and refuses the
  folder instead of loading the layer with random weights), ``L.weight_scale`` (E4M3 or E8M0
  block scales), ``L.weight_global_scale`` (NVFP4: the FP32 dequantization multiplier
  ``amax / (448 * 6)``, torchao's ``per_tensor_scale``; the reciprocal of compressed-tensors'
  ``weight_global_scale``), ``L.input_transform`` (the online block transform),
  ``L.input_global_scale`` (static NVFP4 activation scale) and ``L.bias``;
* ``quantization_config.json``: the format, the recipe, one entry per quantized layer, tied
  weights, and the size and SHA-256 of every tensor file (checked on load).

In memory (:func:`checkpoint_contents`) the codes and the transform are named
``L.weight_packed`` and ``L.transform``, as format 1 stored them; :func:`disk_names` and
:func:`memory_names` translate at the write and read edges, so format-1 folders still load.

:func:`kbbq_pl.io.models.from_pretrained` rebuilds the architecture from ``config.json``, puts
quantized layers where the JSON says and loads the tensors: its outputs are bit-identical to the
in-memory model that was saved.  A truncated or corrupted file gives an error naming it.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor, nn

from ..formats import Format, QuantizedTensor, get_format, quantize
from ..quant.experts import unfuse_experts
from ..quant.layers import QuantizedLinear, swap_module
from ..quant.sequential import trim_heap
from ..quant.siblings import group_sibling_linears
from ..quant.w4a4 import W4A4Weight
from .fileio import MARKER_NAME, check_output, save_safetensors, sha256_file, write_folder

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt",
                   "vocab.json", "spiece.model")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json",
                   "video_preprocessor_config.json")
"""An image-text model's processor files (its image processor's settings), which a server
needs beside the tokenizer."""
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json",
                               "config_sentence_transformers.json")
"""A sentence-transformers model's files: its modules after the transformer (pooling,
normalization, a dense head, each in the folder ``modules.json`` names) and its sequence
length, by which ``SentenceTransformer(folder)`` and servers of embedding models (vLLM) pool
and normalize the quantized model as they did the source."""
CONFIG_NAME = "quantization_config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
FORMAT_TAG = "kbbq-pl"
FORMAT_VERSION = 2
"""Format 2 stores each quantized layer's codes under ``L.weight`` and its transform under
``L.input_transform``; format 1 (still read) stored them under ``L.weight_packed`` and
``L.transform`` and wrote no ``quantization_config`` into ``config.json``."""
READABLE_VERSIONS = (1, 2)
QUANT_METHOD = "kbbq"
"""The ``quant_method`` of the ``quantization_config`` in a checkpoint's ``config.json``."""
LOADER = "kbbq_pl_loader"
"""The module of a checkpoint folder that transformers imports for ``trust_remote_code=True``
(:func:`remote_code_loader`)."""


class CheckpointError(ValueError):
    """A quantized checkpoint folder that cannot be read: missing, truncated or corrupted."""


def checkpoint_layers(model: nn.Module) -> dict[str, QuantizedLinear]:
    """The quantized layers a checkpoint of ``model`` stores, by qualified name: its
    ``QuantizedLinear`` modules, and each ``nn.Linear`` whose weight torchao's ``quantize_``
    made a ``W4A4Weight`` (:class:`kbbq_pl.quant.torchao.KBBQConfig`, whose modules stay
    ``nn.Linear``) as a ``QuantizedLinear`` of the same weight, built here and not put in the
    model (the folder loads it as a ``QuantizedLinear``, computing the same product)."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            layers[name] = module
        elif isinstance(module, nn.Linear) and isinstance(module.weight, W4A4Weight):
            layers[name] = QuantizedLinear(module.in_features, module.out_features,
                                           module.weight.fmt, module.weight, module.bias,
                                           name=name)
    return layers


def layer_metadata(layer: QuantizedLinear) -> dict[str, Any]:
    """What is needed to rebuild an empty ``layer`` before loading its tensors."""
    transform = layer.transform
    return {
        "in_features": layer.in_features,
        "out_features": layer.out_features,
        "padded_in": layer.padded_in,
        "format": layer.fmt.name,
        "transform": None if transform is None else list(transform.shape),
        "act_scale": layer.act_scale,
        "bias": layer.bias is not None,
        "dtype": str(layer.weight.dtype if layer.trainable
                     else layer.weight.orig_dtype).replace("torch.", ""),
    }


def empty_layer(meta: dict[str, Any], fmt: Format | None = None, name: str = "",
                trainable: bool = False) -> QuantizedLinear:
    """A :class:`QuantizedLinear` of the given shape whose tensors are placeholders."""
    fmt = fmt or get_format(meta["format"])
    dtype = getattr(torch, meta.get("dtype", "float32"))
    out_features, padded = meta["out_features"], meta["padded_in"]
    weight: QuantizedTensor | Tensor
    if trainable:
        weight = torch.zeros(out_features, padded, dtype=dtype)
    else:
        weight = quantize(torch.zeros(out_features, padded, dtype=dtype), fmt)
    bias = torch.zeros(out_features, dtype=dtype) if meta["bias"] else None
    transform = torch.zeros(meta["transform"]) if meta["transform"] else None
    scale = torch.ones(()) if meta["act_scale"] == "static" else None
    return QuantizedLinear(meta["in_features"], out_features, fmt, weight, bias, transform,
                           meta["act_scale"], scale, trainable=trainable, name=name)


def install_empty_layers(model: nn.Module, layers: dict[str, dict[str, Any]],
                         trainable: bool = False, stored: Iterable[str] = ()) -> None:
    """Swap every listed layer of ``model`` for an empty :class:`QuantizedLinear`, after the
    fused experts that the checkpoint stores expert by expert (its ``layers`` or the names of
    its ``stored`` tensors) are made linear layers (:func:`kbbq_pl.quant.experts.
    unfuse_experts`)."""
    unfuse_experts(model, [*layers, *stored])
    for name, meta in layers.items():
        try:
            model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"the checkpoint quantizes {name!r}, which "
                                  f"{type(model).__name__} does not have") from None
        swap_module(model, name, empty_layer(meta, name=name, trainable=trainable))


def checkpoint_contents(
    model: nn.Module, prefix: str = "", dtype: torch.dtype | None = None,
) -> tuple[dict[str, Tensor], dict[str, dict[str, Any]], dict[str, str]]:
    """What a checkpoint of ``model`` holds: every tensor to store (the layout of the module
    docstring), each quantized layer's :func:`layer_metadata`, and tied names (alias -> stored
    name).  ``prefix``: ``model``'s name in the whole model, for a block written on its own
    (:class:`kbbq_pl.io.streaming.StreamedBlocks`).  ``dtype``: the floating dtype of the
    full-precision tensors (embeddings, norms, unquantized layers; None: as held), for a model
    held in another dtype than it computed in.  :func:`save_quantized` and
    :func:`kbbq_pl.io.compressed_tensors.save_compressed_tensors` both write from it."""
    tensors: dict[str, Tensor] = {}
    if prefix:
        tensors, layers, tied = checkpoint_contents(model, dtype=dtype)
        return ({f"{prefix}.{k}": v for k, v in tensors.items()},
                {f"{prefix}.{k}": v for k, v in layers.items()},
                {f"{prefix}.{k}": f"{prefix}.{v}" for k, v in tied.items()})
    layers = checkpoint_layers(model)
    layer_params = layer_state_names(layers)
    tied = tied_names(model, layers)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in layer_params or name in tied or tensor is None:
            continue
        tensor = tensor.detach()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.contiguous().cpu()
    for name, layer in layers.items():
        tensors.update({key: value.cpu() for key, value in layer_tensors(name, layer).items()})
    return tensors, {name: layer_metadata(layer) for name, layer in layers.items()}, tied


def layer_state_names(layers: Iterable[str]) -> set[str]:
    """The state-dict names of the quantized ``layers``' own tensors (stored codes, or a
    trainable master weight and its transform and activation scale), which
    :func:`layer_tensors` replaces in a checkpoint."""
    return {f"{n}.{p}" for n in layers for p in ("weight", "bias", "transform",
                                                  "act_global_scale", "weight_global_scale")}


def tied_names(model: nn.Module, layers: Iterable[str] | None = None) -> dict[str, str]:
    """The tensors of ``model``'s state (the quantized ``layers``' own aside; None: its
    :func:`checkpoint_layers`) that are another one's, stored once: alias -> the first name
    holding it."""
    skip = layer_state_names(checkpoint_layers(model) if layers is None else layers)
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in skip or tensor is None or not tensor.numel():
            continue
        key = (tensor.data_ptr(), tensor.shape, tensor.dtype)
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
    return tied


def layer_tensors(name: str, layer: QuantizedLinear) -> dict[str, Tensor]:
    """The tensors that store quantized ``layer`` (named ``name``), on its device, as
    :func:`checkpoint_contents` names them (the module docstring)."""
    codes = layer.codes()
    tensors = {f"{name}.weight_packed": codes.qdata.contiguous(),
               f"{name}.weight_scale": codes.scale.contiguous()}
    if codes.global_scale is not None:
        tensors[f"{name}.weight_global_scale"] = codes.global_scale.reshape(1)
    if layer.transform is not None:
        tensors[f"{name}.transform"] = layer.transform.contiguous()
    if layer.act_global_scale is not None:
        tensors[f"{name}.input_global_scale"] = layer.act_global_scale.reshape(1)
    if layer.bias is not None:
        tensors[f"{name}.bias"] = layer.bias.detach().contiguous()
    return tensors


DISK_NAMES = {"weight_packed": "weight", "transform": "input_transform"}
"""How format 2 stores what :func:`checkpoint_contents` names ``L.weight_packed`` and
``L.transform`` (the other names are the same)."""


def disk_names(tensors: dict[str, Tensor], layers: Iterable[str]) -> dict[str, Tensor]:
    """``tensors`` named as :func:`checkpoint_contents` names them, renamed as format 2 stores
    them (:data:`DISK_NAMES`): each quantized layer's codes ``L.weight_packed`` become
    ``L.weight``, its transform ``L.transform`` becomes ``L.input_transform``."""
    renamed = {f"{name}.{old}": f"{name}.{new}" for name in layers
               for old, new in DISK_NAMES.items()}
    return {renamed.get(key, key): value for key, value in tensors.items()}


def memory_names(tensors: dict[str, Tensor], metadata: dict[str, Any]) -> dict[str, Tensor]:
    """The tensors of a checkpoint folder (``metadata``: its :func:`read_metadata`) named as
    :func:`checkpoint_contents` names them: the inverse of :func:`disk_names` for format 2,
    unchanged for format 1."""
    if metadata.get("version", FORMAT_VERSION) < 2:
        return tensors
    renamed = {f"{name}.{new}": f"{name}.{old}" for name in metadata["layers"]
               for old, new in DISK_NAMES.items()}
    return {renamed.get(key, key): value for key, value in tensors.items()}


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside ``torch.compile``'s and the data-parallel wrappers (DDP, FSDP,
    DeepSpeed; accelerate's ``extract_model_from_parallel``), whose layer names a checkpoint
    holds: a compiled model's are prefixed ``_orig_mod.``, which no reader has."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_torch_compile=False)


def save_quantized(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    recipe: dict[str, Any] | None = None,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = False,
    source_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the quantized ``model`` to ``out_dir`` (see the module docstring); returns the
    resolved folder.  ``dtype``: the dtype of its full-precision tensors on disk (None, as
    ``kbbq-pl quantize`` writes them: as held, the source's dtype unless ``--dtype`` converted
    it).

    ``extra_files`` maps file names (plain names, none of the checkpoint's own) to text written
    beside (e.g. reports).  ``source_dir`` is the folder the model was loaded from (without it,
    the local folder the model's ``name_or_path`` names, if any): an output equal to it, inside
    it or containing it is refused, and its processor files (:data:`PROCESSOR_FILES`) and
    sentence-transformers modules are copied.  An existing ``out_dir`` is an error unless
    ``overwrite``, and even then only a folder kbbq-pl wrote is replaced
    (:func:`kbbq_pl.io.fileio.check_output`).
    """
    model = unwrapped(model)
    loaded_from = getattr(model, "name_or_path", None)
    side_files = source_dir or (loaded_from if loaded_from and Path(loaded_from).is_dir()
                                else None)
    check_output(out_dir, overwrite=overwrite, sources=[side_files])
    check_extra_file_names(extra_files or {})
    if not checkpoint_layers(model):
        raise ValueError("the model has no quantized layers to save")

    def write(staging: Path) -> None:
        shards = ShardWriter(staging)
        shards.add(checkpoint_contents(model, dtype=dtype))
        write_checkpoint_files(staging, model, shards, tokenizer=tokenizer, recipe=recipe,
                               extra_files=extra_files, dtype=dtype, source_dir=side_files)

    return write_folder(out_dir, write, kind="checkpoint", overwrite=overwrite,
                        sources=[side_files])


def check_extra_file_names(extra_files: dict[str, str]) -> None:
    """A ``ValueError`` unless every name of ``extra_files`` is a plain file name (no folder,
    so nothing is written outside the checkpoint's folder)."""
    for name in extra_files:
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name \
                or "\\" in name:
            raise ValueError(f"extra_files: {name!r} is not a plain file name; each extra file "
                             "is written inside the checkpoint's folder")
        if name == MARKER_NAME:
            raise ValueError(f"extra_files: {name!r} is a file of the checkpoint itself; name "
                             "the extra file otherwise")


class ShardWriter:
    """The checkpoint's tensors, written to safetensors files as they come: one file
    (``model.safetensors``) when everything is added at once, else one shard per :meth:`add`
    (a block of a streamed model) named as HuggingFace names them
    (``model-00001-of-00031.safetensors``) with ``model.safetensors.index.json``.  It also
    gathers the layers' metadata and the tied names of what it wrote."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.parts: list[Path] = []
        self.weight_map: dict[str, int] = {}
        self.layers: dict[str, dict[str, Any]] = {}
        self.tied: dict[str, str] = {}
        self.total_bytes = 0

    def add(self, contents: tuple[dict[str, Tensor], dict[str, dict[str, Any]],
                                  dict[str, str]]) -> None:
        """Write ``contents`` (:func:`checkpoint_contents`) as the next shard, under the names
        format 2 stores (:func:`disk_names`)."""
        tensors, layers, tied = contents
        tensors = disk_names(tensors, layers)
        clash = sorted(set(tensors) & set(self.weight_map))
        if clash:
            raise ValueError(f"tensors written twice: {clash[:3]}")
        part = self.folder / f"model-{len(self.parts) + 1:05d}.part"
        save_safetensors(tensors, part, metadata={"format": FORMAT_TAG})
        self.parts.append(part)
        self.weight_map.update(dict.fromkeys(tensors, len(self.parts)))
        self.total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        self.layers.update(layers)
        self.tied.update(tied)

    def finish(self) -> dict[str, dict[str, Any]]:
        """Give the shards their final names (and write the index); returns each file's size
        and SHA-256, as ``quantization_config.json`` lists them."""
        count = len(self.parts)
        names = ([WEIGHTS_NAME] if count == 1 else
                 [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)])
        for part, name in zip(self.parts, names):
            part.rename(self.folder / name)
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": {k: names[i - 1] for k, i in sorted(self.weight_map.items())}}
            (self.folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        return {name: {"bytes": (self.folder / name).stat().st_size,
                       "sha256": sha256_file(self.folder / name)} for name in names}


def write_checkpoint_files(staging: Path, model: nn.Module, shards: ShardWriter, *,
                           tokenizer: Any = None, recipe: dict[str, Any] | None = None,
                           extra_files: dict[str, str] | None = None,
                           dtype: torch.dtype | None = None,
                           source_dir: str | Path | None = None) -> None:
    """Finish a checkpoint in ``staging`` whose tensors ``shards`` wrote: the HuggingFace files
    of ``model`` (its config, architecture and tokenizer; ``dtype``: the dtype its
    full-precision tensors were written in; the processor files of ``source_dir``, the folder
    it was read from), ``quantization_config.json`` and the ``extra_files``."""
    write_hf_files(staging, model, tokenizer, dtype)
    if source_dir is not None:
        for name in PROCESSOR_FILES:
            if (Path(source_dir) / name).is_file() and not (staging / name).exists():
                shutil.copyfile(Path(source_dir) / name, staging / name)
        copy_sentence_transformers_files(Path(source_dir), staging)
    hf_config = staging / "config.json"
    if hf_config.is_file():
        document = json.loads(hf_config.read_text())
        written = dtype or getattr(model, "dtype", None)
        if document.get("dtype") is None and isinstance(written, torch.dtype):
            # as save_pretrained writes it: from_pretrained(dtype="auto") reads it here
            document["dtype"] = str(written).removeprefix("torch.")
        document["quantization_config"] = quantization_block(shards.layers, shards.tied, recipe)
        # transformers' classes compute this checkpoint, not a source's own code (whose files
        # the folder does not hold): the loader's entries replace its auto_map; a source's own
        # code (held beside) keeps its entries, the config's through the loader
        stored_map = document.pop("auto_map", None)
        auto_map = without_loader(stored_map) if is_source_code(model) else {}
        loader = remote_code_loader(model)
        if loader is not None:
            entries, source = loader
            auto_map.update(entries)
            (staging / f"{LOADER}.py").write_text(source)
        if auto_map:
            document["auto_map"] = auto_map
        hf_config.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    files = shards.finish()
    metadata = {
        "format": FORMAT_TAG,
        "version": FORMAT_VERSION,
        "model_class": type(model).__name__,
        "causal_lm": is_causal_model(model),
        "recipe": recipe or {},
        "layers": shards.layers,
        "tied": shards.tied,
        "files": files,
    }
    (staging / CONFIG_NAME).write_text(json.dumps(metadata, indent=2) + "\n")
    check_extra_file_names(extra_files or {})
    for file_name, text in (extra_files or {}).items():
        if (staging / file_name).exists():
            raise ValueError(f"extra_files: {file_name!r} is a file of the checkpoint itself; "
                             "name the extra file otherwise")
        (staging / file_name).write_text(text)


def copy_sentence_transformers_files(source: Path, target: Path) -> None:
    """Copy :data:`SENTENCE_TRANSFORMERS_FILES` and the folders of the modules that
    ``modules.json`` lists from ``source`` into ``target``, for a sentence-transformers model
    whose transformer is the folder itself (module path ``""``, as every model since
    sentence-transformers 2 stores it); nothing for any other folder."""
    try:
        modules = json.loads((source / "modules.json").read_text())
        paths = [str(module.get("path", "")) for module in modules]
    except (OSError, ValueError, TypeError, AttributeError):
        return  # not a sentence-transformers folder (or not one that can be read)
    if "" not in paths:  # the transformer in a folder of its own: the source's weights
        return
    root = source.resolve()
    for path in filter(None, paths):
        folder = (source / path).resolve()
        if not folder.is_relative_to(root) or folder == root:
            raise CheckpointError(f"{source / 'modules.json'}: module path {path!r} is not a "
                                  "folder inside the model folder")
        if folder.is_dir():
            shutil.copytree(folder, target / path, dirs_exist_ok=True)
    for name in SENTENCE_TRANSFORMERS_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)


def quantization_block(layers: dict[str, dict[str, Any]], tied: dict[str, str],
                       recipe: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``quantization_config`` of a checkpoint's ``config.json``: ``quant_method``
    :data:`QUANT_METHOD`, the format ``version``, the recipe's ``method`` label (when the
    recipe names one), the ``formats`` used, each quantized layer's :func:`layer_metadata`
    (``layers``) and the ``tied`` names: what a reader needs to put the quantized layers in
    place before it loads the tensors (:mod:`kbbq_pl.io.hf_quantizer`)."""
    block: dict[str, Any] = {"quant_method": QUANT_METHOD, "version": FORMAT_VERSION}
    label = recipe_label(recipe)
    if label:
        block["method"] = label
    block.update(formats=sorted({meta["format"] for meta in layers.values()}), layers=layers,
                 tied=tied)
    return block


def recipe_label(recipe: dict[str, Any] | None) -> str | None:
    """The label of a checkpoint's recipe (``RTN-KBBQ nvfp4, lambda 0.75``), or None when it
    names none."""
    from ..quant.config import QuantizationConfig

    config = (recipe or {}).get("config", recipe)
    if not config:
        return None
    try:
        return QuantizationConfig.from_dict(config).label
    except (TypeError, ValueError):
        return None


def config_block(folder: str | Path) -> dict[str, Any] | None:
    """The ``quantization_config`` of ``folder``'s ``config.json`` when its ``quant_method`` is
    :data:`QUANT_METHOD`, else None."""
    try:
        block = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get(
            "quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return block if isinstance(block, dict) and block.get("quant_method") == QUANT_METHOD else None


def model_config(folder: str | Path, trust_remote_code: bool = False) -> Any:
    """The transformers config of the model folder ``folder``; for a folder of its own code
    (``auto_map``) read without ``trust_remote_code``, an error saying how to allow it."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except ValueError as error:
        if trust_remote_code or "trust_remote_code" not in str(error):
            raise
        raise ValueError(f"{folder} holds its own model code (config.json's auto_map), which "
                         "runs only when allowed: pass --trust_remote_code (kbbq-pl), "
                         "trust_remote_code=True (Python)") from None


def declared_kind(config_file: str | Path) -> SimpleNamespace:
    """The ``architectures`` and ``model_type`` a ``config.json`` declares, read as JSON: what
    :func:`is_causal_lm_config` reads, known before any model code (a folder's own, which runs
    only when allowed) or class is loaded."""
    document = json.loads(Path(config_file).read_text())
    return SimpleNamespace(architectures=document.get("architectures"),
                           model_type=document.get("model_type"))


def is_source_code(model: nn.Module) -> bool:
    """Whether ``model``'s class is its folder's own code (loaded with
    ``trust_remote_code=True``; not transformers' class, nor :data:`LOADER`'s): a checkpoint
    of it holds that code and names it in ``auto_map``, as ``save_pretrained`` writes it."""
    module = type(model).__module__
    return module.startswith("transformers_modules.") and module.rpartition(".")[2] != LOADER


def remote_code_loader(model: nn.Module) -> tuple[dict[str, str], str] | None:
    """What loads a checkpoint of ``model`` through transformers' ``trust_remote_code=True``
    where nothing imports kbbq-pl (``lm_eval --model hf --model_args
    pretrained=FOLDER,trust_remote_code=True``): the ``auto_map`` of ``config.json`` and the
    text of :data:`LOADER`'s file.  The file imports kbbq_pl, which registers the ``kbbq``
    quantization method (transformers names a missing kbbq-pl in its error), and subclasses
    the model's and its config's transformers classes under their own names: ``AutoConfig``
    imports it first (lm-eval reads the ``quantization_config`` before it builds the model),
    then the model's auto class builds transformers' model.  A model of its folder's own code
    (:func:`is_source_code`) keeps its classes: the file imports kbbq_pl and gives ``AutoConfig``
    the folder's own config class, as imported from the folder's module.  None where the
    model's class is not the one its auto class builds for its config, or where its own code
    runs with a transformers config (which a loader would register for ``trust_remote_code``
    everywhere)."""
    config = getattr(model, "config", None)
    if is_source_code(model):
        config_module = type(config).__module__
        if not config_module.startswith("transformers_modules."):
            return None
        config_name, module = type(config).__name__, config_module.rpartition(".")[2]
        source = f'''"""Loads this kbbq-pl checkpoint where transformers runs a folder's own code
(``trust_remote_code=True``, lm-eval's ``--model_args pretrained=FOLDER,trust_remote_code=True``)
where nothing imports kbbq-pl: importing it registers the "kbbq" quantization method, which
reads the quantized layers, before the model is built.  kbbq-pl must be installed.  The
config class is the folder's own, from {module}.py."""

import kbbq_pl  # noqa: F401

from .{module} import {config_name}  # noqa: F401
'''
        return {"AutoConfig": f"{LOADER}.{config_name}"}, source

    def own(cls: type) -> type | None:  # the transformers class a (loaded) subclass extends
        return next((c for c in cls.__mro__ if c.__module__.startswith("transformers.models.")),
                    None)

    base = own(type(model))
    config_base = own(type(config)) if config is not None else None
    if base is None or config_base is None:
        return None
    auto = auto_class(config, is_causal_model(model))
    try:
        built = auto._model_mapping[config_base]
    except KeyError:
        return None
    if base not in (built if isinstance(built, tuple) else (built,)):
        return None
    name, config_name = base.__name__, config_base.__name__
    source = f'''"""Loads this kbbq-pl checkpoint where transformers runs a folder's own code:
``{auto.__name__}.from_pretrained(folder, trust_remote_code=True)``, lm-eval's
``--model_args pretrained=FOLDER,trust_remote_code=True``.  kbbq-pl must be installed:
importing it registers the "kbbq" quantization method, which reads the quantized layers.
The classes are transformers' own {config_name} and {name}."""

import kbbq_pl  # noqa: F401
from {config_base.__module__} import {config_name} as _{config_name}
from {base.__module__} import {name} as _{name}


class {config_name}(_{config_name}):
    """transformers' {config_name}."""


class {name}(_{name}):
    """transformers' {name}, with kbbq-pl's quantized layers."""
'''
    return {"AutoConfig": f"{LOADER}.{config_name}", auto.__name__: f"{LOADER}.{name}"}, source


def without_loader(auto_map: dict[str, Any] | None) -> dict[str, Any]:
    """``auto_map`` less the entries that name :data:`LOADER` (a folder that does not hold
    its file, or whose readers do not need kbbq-pl, must not name it)."""
    return {key: value for key, value in (auto_map or {}).items()
            if not str(value).startswith(f"{LOADER}.")}


def drop_loader(config_file: Path) -> None:
    """Remove the entries naming :data:`LOADER` from ``config_file``'s ``auto_map``."""
    document = json.loads(config_file.read_text())
    if "auto_map" not in document:
        return
    auto_map = without_loader(document.pop("auto_map"))
    if auto_map:
        document["auto_map"] = auto_map
    config_file.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")


def write_hf_files(folder: Path, model: nn.Module, tokenizer: Any = None,
                   dtype: torch.dtype | None = None) -> None:
    """The HuggingFace files beside the weights: ``config.json`` (its ``dtype``: the one given,
    for tensors written in another dtype than the model is held in, else the model's, as
    ``save_pretrained`` writes it, even where ``model.to(dtype)`` left the config's behind; no
    ``auto_map`` entry naming :data:`LOADER`), ``generation_config.json`` (for models that
    generate) and the tokenizer's files."""
    config = getattr(model, "config", None)
    if config is not None:
        if not getattr(config, "architectures", None):  # as PreTrainedModel.save_pretrained
            config.architectures = [type(model).__name__]
        if is_source_code(model):  # its modeling files, as PreTrainedModel.save_pretrained
            from transformers.dynamic_module_utils import custom_object_save

            custom_object_save(model, folder, config=config)
        held = getattr(config, "dtype", None)
        model_dtype = getattr(model, "dtype", None)
        written = dtype if dtype is not None else (
            model_dtype if isinstance(model_dtype, torch.dtype) else None)
        if written is not None:
            config.dtype = written
        try:
            config.save_pretrained(folder)
        finally:
            config.dtype = held
        drop_loader(folder / "config.json")
        # the config of a model loaded with trust_remote_code copies its module beside
        (folder / f"{LOADER}.py").unlink(missing_ok=True)
    generation = getattr(model, "generation_config", None)
    if generation is not None and is_causal_model(model):
        generation.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)


def _image_text_classes() -> dict[str, str]:
    """transformers' image-text-to-text classes by model type."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return dict(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def is_multimodal_config(config: Any) -> bool:
    """Whether ``config`` is that of an image-text-to-text model (a language model with a
    vision tower: Llava, Gemma 3, Qwen2.5-VL, Mistral 3, ...), which generates text as a causal
    LM does: its ``architectures`` name one, or (a config made in code) its model type has
    one."""
    if config.architectures:
        return any(a in _image_text_classes().values() for a in config.architectures)
    return config.model_type in _image_text_classes()


def declared_dtype(config: Any) -> torch.dtype | None:
    """The dtype a HuggingFace ``config`` declares (``dtype``, or the older ``torch_dtype``),
    None where it declares none."""
    declared = getattr(config, "dtype", None) or config.__dict__.get("torch_dtype")
    if isinstance(declared, str):
        declared = getattr(torch, declared.removeprefix("torch."), None)
    return declared if isinstance(declared, torch.dtype) else None


def is_causal_lm_config(config: Any) -> bool:
    """Whether ``config`` names a model that generates text: a causal LM, or an
    image-text-to-text model (:func:`is_multimodal_config`)."""
    return (any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in config.architectures or [])
            or is_multimodal_config(config))


def is_causal_model(model: nn.Module) -> bool:
    name = type(model).__name__
    return (name.endswith(("ForCausalLM", "LMHeadModel"))
            or name in _image_text_classes().values())


def auto_class(config: Any, causal: bool) -> Any:
    """The transformers auto class that builds the model of ``config``: the bare model
    (``causal`` False), an image-text-to-text model where the config names one, else a causal
    LM."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

    if not causal:
        return AutoModel
    return AutoModelForImageTextToText if is_multimodal_config(config) else AutoModelForCausalLM


def source_class(config: Any, causal: bool) -> Any:
    """The class that builds the model of a full-precision folder's ``config``: a causal LM
    (:func:`auto_class`), else the class its ``architectures`` names where transformers has
    it (a classification, token-classification, question-answering or masked-LM head on an
    encoder, kept whole), else the bare model."""
    named = None if causal else transformers_class((config.architectures or [None])[0], config)
    return named or auto_class(config, causal)


def transformers_class(name: str | None, config: Any) -> type | None:
    """transformers' model class ``name`` where it exists and builds models of ``config``
    (a checkpoint's ``model_class``); None otherwise."""
    import transformers

    cls = getattr(transformers, name, None) if name else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) and \
            isinstance(config, cls.config_class):
        return cls
    return None


def read_metadata(folder: str | Path) -> dict[str, Any]:
    """The checked ``quantization_config.json`` of a quantized checkpoint folder."""
    folder = Path(folder)
    path = folder / CONFIG_NAME
    if not path.is_file():
        block = config_block(folder)
        if block is None:
            if not folder.is_dir():
                raise CheckpointError(f"{folder} does not exist (or is not a folder)")
            raise CheckpointError(f"{folder} is not a kbbq-pl checkpoint: no {CONFIG_NAME}")
        return block_metadata(folder, block)
    try:
        metadata = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"{path} is not valid JSON ({error}); the file is corrupted") from None
    if metadata.get("format") != FORMAT_TAG:
        raise CheckpointError(f"{path}: not a kbbq-pl quantization config")
    check_version(metadata.get("version"), path)
    block = config_block(folder)
    if block is not None and rewritten_by_transformers(folder):
        log.warning("%s: the weights were written again since (by transformers' "
                    "save_pretrained): read as that folder, from config.json's "
                    "quantization_config, with no file sizes or SHA-256 to check", path)
        return block_metadata(folder, block)
    for name, expected in metadata.get("files", {}).items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"{file} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{file} is truncated or padded: {size} bytes, expected "
                                  f"{expected['bytes']}")
        if sha256_file(file) != expected["sha256"]:
            raise CheckpointError(f"{file} is corrupted: its SHA-256 does not match "
                                  f"{CONFIG_NAME}")
    return metadata


def rewritten_by_transformers(folder: Path) -> bool:
    """Whether ``folder``'s weights were written by transformers' ``save_pretrained`` (into a
    folder kbbq-pl wrote, whose ``quantization_config.json`` then lists the files it replaced):
    their first file's header lacks the tag every kbbq-pl checkpoint file holds."""
    files = weight_files(folder)
    if not files or not files[0].is_file():
        return False
    try:
        with safe_open(str(files[0]), framework="pt") as handle:
            return (handle.metadata() or {}).get("format") != FORMAT_TAG
    except (SafetensorError, OSError):
        return False  # unreadable: the file checks below say which and why


def check_version(version: Any, source: str | Path) -> None:
    """A CheckpointError unless ``version`` is a checkpoint format this kbbq-pl reads."""
    if version in READABLE_VERSIONS:
        return
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise CheckpointError(f"{source}: kbbq-pl checkpoint format {version}, written by a "
                              f"newer kbbq-pl; this one reads formats "
                              f"{', '.join(map(str, READABLE_VERSIONS))}: upgrade kbbq-pl")
    raise CheckpointError(f"{source}: unknown kbbq-pl checkpoint format {version!r}")


def block_metadata(folder: Path, block: dict[str, Any]) -> dict[str, Any]:
    """The metadata :func:`read_metadata` returns, from the ``quantization_config`` of
    ``folder``'s ``config.json`` alone (a folder written by transformers' ``save_pretrained``
    of a model it loaded with kbbq-pl's quantizer: no ``quantization_config.json``, so no file
    sizes or SHA-256 to check)."""
    source = folder / "config.json"
    check_version(block.get("version"), source)
    if not isinstance(block.get("layers"), dict):
        raise CheckpointError(f"{source}: quantization_config has no layers")
    config = declared_kind(source)
    return {"format": FORMAT_TAG, "version": block["version"],
            "model_class": (config.architectures or [""])[0],
            "causal_lm": is_causal_lm_config(config), "recipe": {},
            "layers": block["layers"], "tied": block.get("tied") or {}, "files": {}}


def load_safetensors(file: str | Path) -> dict[str, Tensor]:
    """Every tensor of one safetensors ``file`` (a CheckpointError when unreadable)."""
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{file} cannot be read ({error})") from None


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
}
"""The torch dtype of each safetensors dtype name kbbq-pl checks."""


def header_tensors(files: Iterable[str | Path]) -> dict[str, Tensor]:
    """Every tensor of the safetensors ``files`` as an empty tensor of its stored shape and
    dtype on the meta device, read from the files' headers alone (for
    :func:`check_layer_tensors` before anything is loaded)."""
    tensors: dict[str, Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    piece = handle.get_slice(key)
                    dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                    if dtype is not None:
                        tensors[key] = torch.empty(piece.get_shape(), dtype=dtype, device="meta")
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file} cannot be read ({error})") from None
    return tensors


def weight_files(folder: str | Path) -> list[Path]:
    """``folder``'s safetensors files: the shards its ``model.safetensors.index.json`` names,
    else ``model.safetensors``."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index} is not a safetensors index ({error})") from None
        return [folder / name for name in sorted(set(weight_map.values()))]
    return [folder / WEIGHTS_NAME]


def read_tensors(folder: str | Path) -> dict[str, Tensor]:
    """Every tensor of ``folder``'s safetensors file or shards (a CheckpointError when
    unreadable)."""
    tensors: dict[str, Tensor] = {}
    for file in weight_files(folder):
        tensors.update(load_safetensors(file))
    return tensors


def _layout(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{list(shape)} {str(dtype).replace('torch.', '')}"


def check_layer_tensors(layers: dict[str, dict[str, Any]], tensors: dict[str, Tensor]) -> None:
    """Check every quantized layer's metadata (format, widths, dtype, transform, scales) against
    the shapes and dtypes of its stored tensors, before any layer is built; a CheckpointError
    names the layer, the tensor, what the metadata implies and what is stored."""
    for name, meta in layers.items():
        _check_layer(name, meta, tensors)


def _check_layer(name: str, meta: dict[str, Any], tensors: dict[str, Tensor]) -> None:
    def fail(message: str) -> CheckpointError:
        return CheckpointError(f"{name}: {message} (the checkpoint's layer metadata and its "
                               "stored tensors disagree)")

    try:
        fmt = get_format(meta["format"])
        out_features, in_features = int(meta["out_features"]), int(meta["in_features"])
        padded = int(meta["padded_in"])
        dtype = getattr(torch, str(meta["dtype"]), None)
    except (KeyError, TypeError, ValueError) as error:
        raise fail(f"unusable metadata {meta!r} ({error})") from None
    block = fmt.block_size or 1
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise fail(f"dtype {meta['dtype']!r} is not float32, bfloat16 or float16")
    if padded % block or not in_features <= padded < in_features + block:
        raise fail(f"padded_in {padded} is not in_features {in_features} rounded up to the "
                   f"{fmt.name} block {block}")
    reference = quantize(torch.zeros(1, padded), fmt)
    expected = {"weight_packed": ((out_features, *reference.qdata.shape[1:]),
                                  reference.qdata.dtype),
                "weight_scale": ((out_features, *reference.scale.shape[1:]),
                                 reference.scale.dtype)}
    for suffix, (shape, kind) in expected.items():
        stored = tensors.get(f"{name}.{suffix}")
        if stored is None:
            raise fail(f"{name}.{suffix} is missing")
        if tuple(stored.shape) != tuple(shape) or stored.dtype != kind:
            raise fail(f"{suffix} is {_layout(stored.shape, stored.dtype)}, but format "
                       f"{fmt.name} with out_features {out_features} and padded_in {padded} "
                       f"stores {_layout(shape, kind)}")
    has_global = f"{name}.weight_global_scale" in tensors
    if has_global != bool(fmt.global_scale):
        raise fail(f"weight_global_scale is {'present' if has_global else 'missing'}, but "
                   f"format {fmt.name} {'has' if fmt.global_scale else 'has no'} per-tensor "
                   "scale")
    transform = tensors.get(f"{name}.transform")
    declared = meta.get("transform")
    if (transform is None) != (declared is None):
        raise fail(f"transform is {'missing' if transform is None else 'stored'}, but the "
                   f"metadata says {declared!r}")
    if transform is not None:
        shape = tuple(transform.shape)
        blocks_ok = len(shape) == 3 and shape[1] == shape[2] and shape[0] * shape[1] == padded
        dense_ok = shape == (padded, padded)
        if shape != tuple(declared) or not (blocks_ok or dense_ok):
            raise fail(f"transform is {list(shape)}, metadata says {declared}; padded_in "
                       f"{padded} needs [{padded} / d, d, d] or [{padded}, {padded}]")
    bias = tensors.get(f"{name}.bias")
    if (bias is not None) != bool(meta.get("bias")):
        raise fail(f"bias is {'stored' if bias is not None else 'missing'}, but the metadata "
                   f"says bias={meta.get('bias')!r}")
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise fail(f"bias is {list(bias.shape)}, out_features is {out_features}")
    if f"{name}.input_global_scale" in tensors and meta.get("act_scale") != "static":
        raise fail(f"input_global_scale is stored, but act_scale is {meta.get('act_scale')!r}")


def stored_weight(tensors: dict[str, Tensor], name: str, meta: dict[str, Any]) -> QuantizedTensor:
    """The stored codes of layer ``name`` as a :class:`QuantizedTensor` (its tensors are
    taken out of ``tensors``)."""
    global_scale = tensors.pop(f"{name}.weight_global_scale", None)
    return QuantizedTensor(
        tensors.pop(f"{name}.weight_packed"), tensors.pop(f"{name}.weight_scale"),
        get_format(meta["format"]), getattr(torch, meta["dtype"]), meta["padded_in"],
        None if global_scale is None else global_scale.reshape(()))


def load_tensors(model: nn.Module, tensors: dict[str, Tensor], metadata: dict[str, Any],
                 source: str | Path) -> None:
    """Load checkpoint ``tensors`` (the layout of the module docstring) into ``model`` whose
    quantized layers are already in place; ``source`` names where they came from in errors."""
    state: dict[str, Any] = {}
    for name, meta in metadata["layers"].items():
        state[f"{name}.weight"] = stored_weight(tensors, name, meta)
        if f"{name}.transform" in tensors:
            state[f"{name}.transform"] = tensors.pop(f"{name}.transform")
        if f"{name}.input_global_scale" in tensors:
            scale = tensors.pop(f"{name}.input_global_scale")
            state[f"{name}.act_global_scale"] = scale.reshape(())
        if f"{name}.bias" in tensors:
            state[f"{name}.bias"] = tensors.pop(f"{name}.bias")
    state.update(tensors)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if m not in metadata.get("tied", {})]
    if missing or unexpected:
        raise CheckpointError(f"{source}: tensors do not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    if metadata.get("tied"):
        model.tie_weights()
    check_materialized(model, source)


def empty_model(config: Any, causal: bool, dtype: torch.dtype = torch.float32,
                model_class: str | None = None, trust_remote_code: bool = False) -> nn.Module:
    """The architecture of a HuggingFace ``config`` (the transformers class named
    ``model_class`` where it builds this config, such as a classification head; else
    :func:`source_class`) with its parameters on the meta
    device (no memory, no initialization; loading assigns them) and its buffers (rotary
    frequencies) computed as the model computes them; ``trust_remote_code``: a config whose
    ``auto_map`` names the folder's own classes builds them."""
    from accelerate import init_empty_weights
    from transformers import PreTrainedModel

    cls = transformers_class(model_class, config) or source_class(config, causal)
    with init_empty_weights(include_buffers=False):
        if issubclass(cls, PreTrainedModel):
            model = cls._from_config(config, dtype=dtype)
        else:
            model = cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # not all architectures tie their embeddings when built empty (Gemma 3)
    return model


def read_generation_config(model: nn.Module, folder: Path) -> None:
    """Give ``model`` the ``generation_config.json`` of ``folder`` where it has one and the
    model generates, as ``from_pretrained`` does (a chat model's end-of-turn tokens, its
    sampling defaults); a model built from its config alone has transformers' defaults."""
    from transformers import GenerationConfig

    if (Path(folder) / "generation_config.json").is_file() and \
            getattr(model, "can_generate", lambda: False)():
        model.generation_config = GenerationConfig.from_pretrained(folder)


def check_materialized(model: nn.Module, source: str | Path, skip: str | None = None) -> None:
    """A CheckpointError naming the parameters of ``model`` that loading left on the meta
    device (the checkpoint lacks them), except those under ``skip`` (blocks still on disk)."""
    left = [name for name, p in model.named_parameters()
            if p.is_meta and not (skip and name.startswith(skip + "."))]
    if left:
        raise missing_tensors(source, left)


def missing_tensors(source: str | Path, names: list[str]) -> CheckpointError:
    """The error for tensors ``names`` that the checkpoint ``source`` lacks (three named)."""
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return CheckpointError(f"{source}: the checkpoint has no tensor {', '.join(names[:3])}{more}")


def build_quantized_model(folder: Path, metadata: dict[str, Any], tensors: dict[str, Tensor],
                          device: str | torch.device = "cpu",
                          dtype: torch.dtype | None = None,
                          trust_remote_code: bool = False) -> nn.Module:
    """The model of ``folder``'s ``config.json`` with the quantized layers of ``metadata`` and
    the checkpoint ``tensors`` loaded, in eval mode: built on the meta device and assigned the
    stored tensors, so no dense model is made first (memory: the quantized size), its sibling
    linears grouped (:func:`~kbbq_pl.quant.siblings.group_sibling_linears`).  ``dtype``:
    the stored floating-point tensors outside the quantized codes, scales and transforms are
    cast to the dtype the architecture gives them in ``dtype``, as transformers'
    ``from_pretrained(dtype=...)`` does (None: as stored).  ``trust_remote_code``: a model
    whose folder holds its own code (``auto_map``) is built from it, as transformers builds
    it."""
    check_layer_tensors(metadata["layers"], tensors)
    config = model_config(folder, trust_remote_code)
    declared = declared_dtype(config)
    model = empty_model(config, metadata["causal_lm"], dtype or torch.float32,
                        metadata.get("model_class"), trust_remote_code)
    if dtype is None and declared is not None:
        model.config.dtype = declared  # building set the dtype it was built in
    read_generation_config(model, folder)
    if dtype is not None:
        dense = {name: value.dtype for name, value in model.state_dict().items()}
        tensors = {name: value.to(dense[name])
                   if name in dense and value.is_floating_point() else value
                   for name, value in tensors.items()}
    install_empty_layers(model, metadata["layers"], stored=tensors)
    load_tensors(model, tensors, metadata, folder)
    del tensors
    trim_heap()  # the placeholders' memory back to the system
    model.to(device)
    model.eval()
    group_sibling_linears(model)  # q/k/v, gate/up: two launches a group on the kernels
    return model
