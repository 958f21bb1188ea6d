"""Quantized checkpoints: a folder that reloads bit-exactly.

``save_quantized(model, out_dir)`` writes, atomically (a temporary sibling folder, then a
rename):

* ``config.json``: the HuggingFace model config (and the tokenizer's files when given);
* ``model.safetensors``: every tensor of the model.  A quantized layer ``L`` stores
  ``L.weight_packed`` (uint8, two E2M1 codes per byte, element ``2i`` in the low nibble),
  ``L.weight_scale`` (E4M3 or E8M0 block scales), ``L.weight_global_scale`` (NVFP4: the FP32
  dequantization multiplier ``amax / (448 * 6)``, torchao's ``per_tensor_scale``; the reciprocal
  of compressed-tensors' ``weight_global_scale``), ``L.transform`` (the online block transform),
  ``L.input_global_scale`` (static NVFP4 activation scale) and ``L.bias``;
* ``quantization_config.json``: the format, the recipe, one entry per quantized layer, tied
  weights, and the size and SHA-256 of every tensor file (checked on load).

``from_pretrained(dir)`` rebuilds the architecture from ``config.json``, puts quantized layers
where the JSON says and loads the tensors: its outputs are bit-identical to the in-memory model
that was saved.  A truncated or corrupted file gives an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from .fileio import sha256_file, write_folder
from .formats import Format, QuantizedTensor, get_format, quantize
from .layers import QuantizedLinear, quantized_linears, swap_module

CONFIG_NAME = "quantization_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_TAG = "kbbq-pl"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A quantized checkpoint folder that cannot be read: missing, truncated or corrupted."""


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
        "dtype": str(_weight_codes(layer).orig_dtype).replace("torch.", ""),
    }


def _weight_codes(layer: QuantizedLinear) -> QuantizedTensor:
    if isinstance(layer.weight, QuantizedTensor):
        return layer.weight
    return quantize(layer.weight.detach(), layer.fmt, name=f"{layer.name}.weight")


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
                         trainable: bool = False) -> None:
    """Swap every listed layer of ``model`` for an empty :class:`QuantizedLinear`."""
    for name, meta in layers.items():
        try:
            model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"the checkpoint quantizes {name!r}, which "
                                  f"{type(model).__name__} does not have") from None
        swap_module(model, name, empty_layer(meta, name=name, trainable=trainable))


def _flat_tensors(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """All tensors to store, and tied names (alias -> stored name)."""
    tensors: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    layers = quantized_linears(model)
    layer_params = {f"{n}.{p}" for n in layers for p in ("weight", "bias", "transform",
                                                          "act_global_scale")}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in layer_params or tensor is None:
            continue
        tensor = tensor.detach()
        key = (tensor.data_ptr(), tensor.shape, tensor.dtype) if tensor.numel() else None
        if key is not None and key in seen:
            tied[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = tensor.contiguous().cpu()
    for name, layer in layers.items():
        codes = _weight_codes(layer)
        tensors[f"{name}.weight_packed"] = codes.qdata.contiguous().cpu()
        tensors[f"{name}.weight_scale"] = codes.scale.contiguous().cpu()
        if codes.global_scale is not None:
            tensors[f"{name}.weight_global_scale"] = codes.global_scale.reshape(1).cpu()
        if layer.transform is not None:
            tensors[f"{name}.transform"] = layer.transform.contiguous().cpu()
        if layer.act_global_scale is not None:
            tensors[f"{name}.input_global_scale"] = layer.act_global_scale.reshape(1).cpu()
        if layer.bias is not None:
            tensors[f"{name}.bias"] = layer.bias.detach().contiguous().cpu()
    return tensors, tied


def save_quantized(
    model: nn.Module,
    out_dir: str | Path,
    *,
    tokenizer: Any = None,
    recipe: dict[str, Any] | None = None,
    extra_files: dict[str, str] | None = None,
    overwrite: bool = True,
    source_dir: str | Path | None = None,
) -> Path:
    """Write the quantized ``model`` to ``out_dir`` (see the module docstring).

    ``extra_files`` maps file names to text written beside (e.g. reports).  ``source_dir`` is
    the folder the model was loaded from: writing into it is refused.
    """
    target = Path(out_dir).resolve()
    if source_dir is not None and Path(source_dir).resolve() == target:
        raise ValueError(f"refusing to write the quantized model over its source {target}")
    layers = quantized_linears(model)
    if not layers:
        raise ValueError("the model has no quantized layers to save")

    def write(staging: Path) -> None:
        config = getattr(model, "config", None)
        if config is not None:
            config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        tensors, tied = _flat_tensors(model)
        weights = staging / WEIGHTS_NAME
        save_file(tensors, str(weights), metadata={"format": FORMAT_TAG})
        metadata = {
            "format": FORMAT_TAG,
            "version": FORMAT_VERSION,
            "model_class": type(model).__name__,
            "causal_lm": _is_causal(model),
            "recipe": recipe or {},
            "layers": {name: layer_metadata(layer) for name, layer in layers.items()},
            "tied": tied,
            "files": {WEIGHTS_NAME: {"bytes": weights.stat().st_size,
                                     "sha256": sha256_file(weights)}},
        }
        (staging / CONFIG_NAME).write_text(json.dumps(metadata, indent=2) + "\n")
        for file_name, text in (extra_files or {}).items():
            (staging / file_name).write_text(text)

    write_folder(target, write, overwrite=overwrite)
    return target


def _is_causal(model: nn.Module) -> bool:
    return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def read_metadata(folder: str | Path) -> dict[str, Any]:
    """The checked ``quantization_config.json`` of a quantized checkpoint folder."""
    folder = Path(folder)
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(f"{folder} is not a kbbq-pl checkpoint: no {CONFIG_NAME}")
    try:
        metadata = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(
            f"{path} is not valid JSON ({error}); the file is corrupted") from None
    if metadata.get("format") != FORMAT_TAG or metadata.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: not a kbbq-pl v{FORMAT_VERSION} quantization config")
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


def load_quantized_state(model: nn.Module, folder: Path, metadata: dict[str, Any]) -> None:
    """Load ``model.safetensors`` into ``model`` whose quantized layers are already in place."""
    try:
        tensors = load_file(str(folder / WEIGHTS_NAME))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"{folder / WEIGHTS_NAME} cannot be read ({error})") from None
    state: dict[str, Any] = {}
    layers = metadata["layers"]
    for name, meta in layers.items():
        fmt = get_format(meta["format"])
        packed = tensors.pop(f"{name}.weight_packed")
        scale = tensors.pop(f"{name}.weight_scale")
        global_scale = tensors.pop(f"{name}.weight_global_scale", None)
        dtype = getattr(torch, meta["dtype"])
        state[f"{name}.weight"] = QuantizedTensor(
            packed, scale, fmt, dtype, meta["padded_in"],
            None if global_scale is None else global_scale.reshape(()))
        if f"{name}.transform" in tensors:
            state[f"{name}.transform"] = tensors.pop(f"{name}.transform")
        if f"{name}.input_global_scale" in tensors:
            scale = tensors.pop(f"{name}.input_global_scale")
            state[f"{name}.act_global_scale"] = scale.reshape(())
        if f"{name}.bias" in tensors:
            state[f"{name}.bias"] = tensors.pop(f"{name}.bias")
    state.update(tensors)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in metadata.get("tied", {})]
    if missing or unexpected:
        raise CheckpointError(f"{folder}: tensors do not match the model: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")


def from_pretrained(folder: str | Path, device: str | torch.device = "cpu") -> nn.Module:
    """The quantized model saved in ``folder`` by :func:`save_quantized`, in eval mode."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    folder = Path(folder)
    metadata = read_metadata(folder)
    config = AutoConfig.from_pretrained(folder)
    loader = AutoModelForCausalLM if metadata["causal_lm"] else AutoModel
    model = loader.from_config(config)
    install_empty_layers(model, metadata["layers"])
    load_quantized_state(model, folder, metadata)
    if metadata.get("tied"):
        model.tie_weights()
    model.to(device)
    model.eval()
    return model
