"""KBBQ as a transformers quantization method: ``from_pretrained`` of a kbbq-pl checkpoint.

Importing :mod:`kbbq_pl` calls :func:`register`, which registers :class:`KbbqHfConfig` and
:class:`KbbqHfQuantizer` under ``quant_method`` ``"kbbq"`` (transformers'
``register_quantization_config`` and ``register_quantizer``, the hooks of out-of-tree methods).
A checkpoint's ``config.json`` names the method (:func:`kbbq_pl.io.checkpoint.quantization_block`),
so after ``import kbbq_pl``::

    model = AutoModelForCausalLM.from_pretrained(folder)   # or AutoModel for an encoder

returns the model :func:`kbbq_pl.from_pretrained` returns: the same quantized layers, computing
the same logits bit for bit, with ``dtype`` (the layers outside the quantized ones; the codes,
transforms and scales are used as stored) and ``device_map`` (one device: ``"cpu"``, where the
product is kbbq-pl's exact emulation, or ``"cuda"``, where it runs on ``kbbq_pl.kernels``).
``generate``, ``pipeline`` and ``transformers serve`` load it the same way,
``save_pretrained`` writes a folder that loads again and ``dequantize()`` gives the dense
weight-only model; :func:`attach_quantizer` gives the models :func:`kbbq_pl.quantize_model` and
:func:`kbbq_pl.from_pretrained` return the same.  Where nothing imports kbbq_pl (lm-eval's
``lm_eval`` command), ``from_pretrained(folder, trust_remote_code=True)`` imports the folder's
``kbbq_pl_loader.py`` (:func:`kbbq_pl.io.checkpoint.remote_code_loader`), which imports it.

How: before the weights load, :meth:`KbbqHfQuantizer._process_model_before_weight_loading`
checks the stored shapes and dtypes (from the safetensors headers) against the layers'
metadata and replaces each listed linear layer of the skeleton (on the meta device) by a
:class:`~kbbq_pl.quant.layers.QuantizedLinear` placeholder; the loader gathers each layer's
stored tensors (``weight``: the packed codes, ``weight_scale``, ``weight_global_scale``,
``input_transform``, ``input_global_scale``) into one :class:`KbbqDeserialize` call, which
builds its :class:`~kbbq_pl.quant.w4a4.W4A4Weight`; after they load, the sibling linears
(q/k/v, gate/up) are grouped (:func:`~kbbq_pl.quant.siblings.group_sibling_linears`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from transformers import modeling_utils
from transformers.core_model_loading import ConversionOps
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..formats import get_format, quantize
from ..quant.act_scale import effective_act_scale
from ..quant.experts import FUSED_PARAMETERS, ExpertLinears, fuse_experts, unfuse_experts
from ..quant.layers import QuantizedLinear, quantized_linears, swap_module
from ..quant.pipeline import ON_QUANTIZED
from ..quant.siblings import group_sibling_linears
from ..quant.w4a4 import W4A4Weight
from .checkpoint import (
    DISK_NAMES,
    FORMAT_VERSION,
    LOADER,
    QUANT_METHOD,
    CheckpointError,
    check_layer_tensors,
    check_version,
    disk_names,
    header_tensors,
    layer_metadata,
    layer_state_names,
    layer_tensors,
    memory_names,
    quantization_block,
    stored_weight,
    tied_names,
    without_loader,
)

STORED_SUFFIXES = ("weight", "weight_scale", "weight_global_scale", "input_transform",
                   "input_global_scale")
"""What a quantized layer stores besides its bias (the loader gathers them into one call)."""
_MEMORY_NAMES = {disk: memory for memory, disk in DISK_NAMES.items()}


def register() -> None:
    """Register :class:`KbbqHfConfig` and :class:`KbbqHfQuantizer` with transformers under
    ``quant_method`` ``"kbbq"`` (:mod:`kbbq_pl` calls it on import; calling it again
    registers these classes anew)."""
    AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)
    AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
    register_quantization_config(QUANT_METHOD)(KbbqHfConfig)
    register_quantizer(QUANT_METHOD)(KbbqHfQuantizer)
    # from_pretrained(dtype=None) reads the first file's header on the meta device, through a
    # table of safetensors dtypes that lacks E8M0 (an MX weight's scales): it stopped there
    names = getattr(modeling_utils, "str_to_torch_dtype", None)
    if isinstance(names, dict):
        names.setdefault("F8_E8M0", torch.float8_e8m0fnu)
    if _attach_after_quantizing not in ON_QUANTIZED:
        ON_QUANTIZED.append(_attach_after_quantizing)


def attach_quantizer(model: nn.Module, recipe: dict[str, Any] | None = None) -> None:
    """Give a transformers ``model`` that kbbq-pl quantized or read (:func:`kbbq_pl.
    quantize_model`, :func:`kbbq_pl.from_pretrained`) what ``from_pretrained`` gives a model
    it loads with the ``kbbq`` method: ``hf_quantizer``, ``config.quantization_config`` (of
    ``recipe``, as :func:`~kbbq_pl.io.checkpoint.quantization_block` writes it) and
    ``is_quantized``.  Its ``save_pretrained`` then writes a folder that loads again, and
    ``dequantize()`` gives the weight-only model.  Nothing happens to other modules, to a model
    without quantized layers or one whose layers are not in memory (streamed to disk)."""
    from transformers import PreTrainedModel

    layers = quantized_linears(model)
    if (not isinstance(model, PreTrainedModel) or not layers
            or any(layer.weight.is_meta for layer in layers.values())):
        return
    block = quantization_block({name: layer_metadata(layer) for name, layer in layers.items()},
                               tied_names(model, layers), recipe)
    del block["quant_method"]
    config = KbbqHfConfig(**block)
    model.hf_quantizer = KbbqHfQuantizer(config)
    model.is_quantized = True
    model.quantization_method = QUANT_METHOD
    model.config.quantization_config = config
    _forget_loader(model)  # transformers' own classes: save_pretrained writes no loader


def _attach_after_quantizing(model: nn.Module, recipe: Any) -> None:
    attach_quantizer(model, recipe.to_dict())


class KbbqHfConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a kbbq-pl checkpoint's ``config.json``
    (:func:`kbbq_pl.io.checkpoint.quantization_block`).

    Args:
        layers: each quantized layer's metadata by module name (in and out features, padded
            input width, format, transform shape, activation scale, bias, dtype).
        version: the checkpoint format (:data:`kbbq_pl.io.checkpoint.FORMAT_VERSION`).
        tied: tied parameter names (alias -> stored name).
        formats, method: what the checkpoint holds, for readers of the file.
    """

    def __init__(self, layers: dict[str, dict[str, Any]] | None = None,
                 version: int = FORMAT_VERSION,
                 tied: dict[str, str] | None = None, formats: list[str] | None = None,
                 method: str | None = None, **kwargs: Any) -> None:
        self.quant_method = QUANT_METHOD
        self.version = version
        if method is not None:
            self.method = method
        self.formats = formats if formats is not None else sorted(
            {str(meta.get("format")) for meta in (layers or {}).values()
             if isinstance(meta, dict)})
        self.layers = layers
        self.tied = tied or {}
        self.post_init()

    def post_init(self) -> None:
        """Check the version and that every layer names a known format."""
        check_version(self.version, "quantization_config")
        if not isinstance(self.layers, dict) or not self.layers:
            raise ValueError("quantization_config (kbbq): no quantized layers listed")
        for name, meta in self.layers.items():
            try:
                get_format(meta["format"])
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"quantization_config (kbbq): layer {name!r} has unusable "
                                 f"metadata {meta!r} ({error})") from None


def placeholder_layer(meta: dict[str, Any], name: str, linear: nn.Module) -> QuantizedLinear:
    """A :class:`QuantizedLinear` of the shape ``meta`` describes whose tensors are on the meta
    device (no memory); ``linear``: the skeleton's layer it replaces (its bias's dtype)."""
    fmt = get_format(meta["format"])
    out_features, padded = int(meta["out_features"]), int(meta["padded_in"])
    reference = quantize(torch.zeros(1, padded, device="cpu"), fmt)  # the codes' layout

    def empty(like: Tensor | None, *shape: int) -> Tensor | None:
        if like is None:
            return None
        return torch.empty(*shape, *like.shape[1:], dtype=like.dtype, device="meta")

    act_scale = effective_act_scale(fmt, meta["act_scale"])
    transform = meta.get("transform")
    weight = W4A4Weight(
        empty(reference.qdata, out_features), empty(reference.scale, out_features), fmt,
        getattr(torch, meta["dtype"]), padded, int(meta["in_features"]), act_scale,
        None if reference.global_scale is None else torch.empty((), device="meta"),
        None if not transform else torch.empty(transform, device="meta"),
        torch.empty((), device="meta") if act_scale == "static" else None, name)
    bias = getattr(linear, "bias", None)
    if meta.get("bias") and bias is None:
        bias = torch.empty(out_features, device="meta")
    return QuantizedLinear(weight.in_features, out_features, fmt, weight,
                           bias if meta.get("bias") else None, name=name)


def _in_model(model: nn.Module, names: list[str]) -> dict[str, str]:
    """A checkpoint's module ``names`` as ``model`` names them, as transformers maps its
    tensors: a head model's checkpoint (``model.layers.0...``) loaded as the bare model
    (``AutoModel``) loses the ``base_model_prefix`` (and its head's layers, which the bare model
    does not load), a bare model's checkpoint loaded under a head gains it."""
    prefix = getattr(model, "base_model_prefix", "")
    if not prefix:
        return {name: name for name in names}
    stored_headed = any(name.startswith(prefix + ".") for name in names)
    if stored_headed and not hasattr(model, prefix):
        return {name: name.removeprefix(prefix + ".") for name in names
                if name.startswith(prefix + ".")}
    if not stored_headed and hasattr(model, prefix):
        return {name: f"{prefix}.{name}" for name in names}
    return {name: name for name in names}


def _target(model: nn.Module, name: str) -> Tensor:
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)


def _forget_loader(model: nn.Module) -> None:
    """``model``'s config names no :data:`~kbbq_pl.io.checkpoint.LOADER` any more: what
    ``save_pretrained`` writes does not hold the loader's file (it writes the config only)."""
    auto_map = without_loader(getattr(model.config, "auto_map", None))
    if auto_map:
        model.config.auto_map = auto_map
    elif hasattr(model.config, "auto_map"):
        del model.config.auto_map


class KbbqDeserialize(ConversionOps):
    """The load operation of :class:`KbbqHfQuantizer`: one call per parameter named ``weight``
    with the tensors stored beside it.  A quantized layer's (``weight``: its packed codes,
    ``weight_scale``, ...) become its :class:`~kbbq_pl.quant.w4a4.W4A4Weight`, checked against
    its metadata first (a CheckpointError naming the layer); any other ``weight`` is cast to its
    parameter's dtype, as transformers casts it."""

    def __init__(self, hf_quantizer: KbbqHfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], source_patterns: list[str] | None = None,
                target_patterns: list[str] | None = None, model: nn.Module | None = None,
                full_layer_name: str | None = None, **kwargs: Any) -> dict[str, Tensor]:
        assert model is not None and full_layer_name is not None
        tensors = {key: value[0] if isinstance(value, list) else value
                   for key, value in input_dict.items()}
        name = full_layer_name.removesuffix(".weight")
        meta = self.hf_quantizer.quantization_config.layers.get(name)
        if meta is None:
            if set(tensors) != {"weight"}:
                raise CheckpointError(f"{name}: stores {sorted(tensors)}, but the "
                                      "quantization_config does not list it as quantized")
            return {full_layer_name: tensors["weight"].to(_target(model, full_layer_name).dtype)}
        stored = {f"{name}.{_MEMORY_NAMES.get(key, key)}": value for key, value in tensors.items()}
        check_layer_tensors({name: {**meta, "bias": False}}, stored)
        transform = stored.pop(f"{name}.transform", None)
        act_global_scale = stored.pop(f"{name}.input_global_scale", None)
        weight = W4A4Weight.from_quantized(
            stored_weight(stored, name, meta), in_features=int(meta["in_features"]),
            transform=transform, act_scale=meta["act_scale"], act_global_scale=act_global_scale,
            layer_name=name)
        return {full_layer_name: nn.Parameter(weight, requires_grad=False)}

    @property
    def reverse_op(self) -> ConversionOps:
        return _AsStored()


class _AsStored(ConversionOps):
    """Saving: :meth:`KbbqHfQuantizer.get_state_dict_and_metadata` already gave the stored
    layout, which goes to disk as it is."""

    def convert(self, input_dict: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return input_dict


class KbbqHfQuantizer(HfQuantizer):
    """Loads kbbq-pl checkpoints in transformers' ``from_pretrained`` (module docstring).

    Pre-quantized checkpoints only (KBBQ calibrates: ``kbbq-pl quantize`` or
    :func:`kbbq_pl.quantize_model` make them); one device (no CPU or disk offload of
    quantized layers); serializable with ``save_pretrained``; compileable (``generate``'s
    compiled static-cache decoding); trainable by transformers' ``Trainer`` as by the ``KBBQ``
    Lightning callback."""

    requires_calibration = True
    quantization_config: KbbqHfConfig
    serialized_names: ClassVar[dict[str, list[str]]] = {"weight": list(STORED_SUFFIXES)}

    def validate_environment(self, device_map: Any = None, **kwargs: Any) -> None:
        if isinstance(device_map, dict) and len({str(d) for d in device_map.values()}) > 1:
            raise ValueError("kbbq quantized models load on one device: pass device_map='cpu', "
                             "'cuda' or 'cuda:N', not a map over several devices "
                             f"({sorted({str(d) for d in device_map.values()})})")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise ValueError("kbbq quantized models do not offload to disk")

    def _process_model_before_weight_loading(self, model: nn.Module, **kwargs: Any) -> None:
        layers = self.quantization_config.layers
        files = kwargs.get("checkpoint_files")
        stored = {}
        if files:  # the stored shapes and dtypes against the metadata, before any load
            stored = memory_names(header_tensors(files),
                                  {"version": self.quantization_config.version, "layers": layers})
            with torch.device("cpu"):  # from_pretrained builds the skeleton under "meta"
                check_layer_tensors(layers, stored)
        rename = _in_model(model, list(layers))
        layers = self.quantization_config.layers = {
            rename[name]: meta for name, meta in layers.items() if name in rename}
        if not model.is_remote_code():  # loaded after import kbbq_pl, not through the loader
            _forget_loader(model)
        unfuse_experts(model, [*layers, *_in_model(model, list(stored)).values()])
        for name, meta in layers.items():
            try:
                linear = model.get_submodule(name)
            except AttributeError:
                raise CheckpointError(f"the checkpoint quantizes {name!r}, which "
                                      f"{type(model).__name__} does not have") from None
            swap_module(model, name, placeholder_layer(meta, name, linear))

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        """The sibling linears (q/k/v, gate/up) grouped: on the kernels' decode path each group
        runs in two launches (:mod:`kbbq_pl.quant.siblings`)."""
        group_sibling_linears(model)
        return model

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        module_name, _, tensor_name = param_name.rpartition(".")
        return tensor_name == "weight" and module_name in self.quantization_config.layers

    @property
    def quantized_element_size(self) -> float:
        return 0.5

    def get_load_operations(self) -> dict[str, type]:
        return {"deserialize": KbbqDeserialize}

    def update_weight_conversions(self, weight_conversions: list, model: nn.Module) -> list:
        """The model's weight conversions, less those that merge per-expert tensors into the
        3-D weights of experts that the checkpoint stores expert by expert (unfused before
        loading, :mod:`kbbq_pl.quant.experts`): their tensors load as they are stored."""
        from transformers.core_model_loading import WeightConverter

        fused = [f"{name}.{param}" for name, module in model.named_modules()
                 if isinstance(module, ExpertLinears) for param in FUSED_PARAMETERS]
        kept = [conversion for conversion in weight_conversions
                if not (isinstance(conversion, WeightConverter) and any(
                    name.endswith(target) for target in conversion._original_target_patterns
                    for name in fused))]
        return super().update_weight_conversions(kept, model)

    def get_state_dict_and_metadata(self, model: nn.Module) -> tuple[dict[str, Tensor], dict]:
        """What ``save_pretrained`` writes: the model's state, each quantized layer's own
        tensors replaced by those that store it (a trainable master weight as its codes)."""
        layers = quantized_linears(model)
        own = layer_state_names(layers)
        state = {key: value for key, value in model.state_dict().items() if key not in own}
        for name, layer in layers.items():
            state.update(disk_names(layer_tensors(name, layer), [name]))
        return state, {}

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        """``model.dequantize()``: every quantized linear becomes an ``nn.Linear`` holding the
        weight it multiplies its input by, ``Q(W T^-1) T`` in ``dtype``
        (:func:`~kbbq_pl.io.compressed_tensors.dense_model`): the weight-only model, whose
        activations are no longer rounded, a plain transformers model that ``save_pretrained``
        writes for any reader (experts unfused to be quantized are transformers' fused experts
        module again, :func:`~kbbq_pl.quant.experts.fuse_experts`)."""
        from .compressed_tensors import dense_model

        if isinstance(dtype, str):  # a config's dtype, as config.json names it
            dtype = getattr(torch, dtype)
        _forget_loader(model)  # a plain model: its folder needs no kbbq-pl
        for obj in (model, model.config):  # loaded by the loader: transformers' own classes
            if type(obj).__module__.rpartition(".")[2] == LOADER:
                obj.__class__ = type(obj).__mro__[1]  # (the loader's subclass them, renamed)
        dense = dense_model(model, dtype)
        fuse_experts(dense)
        return dense

    def is_serializable(self, **kwargs: Any) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        """Whether transformers' ``Trainer`` may train the model: yes, as the ``KBBQ``
        callback trains it (:attr:`is_qat_trainable`)."""
        return True

    @property
    def is_qat_trainable(self) -> bool:
        """Whether the quantized model trains as it is, without adapters: yes.  A layer that
        :func:`kbbq_pl.quantize_model` made with ``trainable=True`` trains its master weight
        through the FP4 rounding (straight-through); stored codes stay as they are (they
        require no gradient) while the rest of the model trains."""
        return True

    @property
    def is_compileable(self) -> bool:
        """Whether transformers may ``torch.compile`` the model (``generate`` with a static
        cache on a GPU, ``transformers serve --compile``): yes, each quantized linear reaches
        the compiler as one custom operator (:func:`kbbq_pl.quant.w4a4.compiled_linear`)."""
        return True


__all__ = ["KbbqDeserialize", "KbbqHfConfig", "KbbqHfQuantizer", "attach_quantizer",
           "placeholder_layer", "register"]
