"""kbbq-pl: FP4 (NVFP4, MXFP4) W4A4 quantization of HuggingFace transformers with KBBQ."""

from . import _compat  # noqa: F401,E402  (imports torchao quietly before anything else does)
from ._version import __version__  # noqa: F401
from .io.checkpoint import save_quantized  # noqa: E402
from .io.compressed_tensors import export_compressed_tensors, save_compressed_tensors  # noqa: E402
from .io.hf_quantizer import register as _register_hf_quantizer  # noqa: E402
from .io.models import from_pretrained, upgrade_checkpoint
from .io.streaming import quantize_checkpoint  # noqa: E402
from .quant import (  # noqa: E402
    AutoBrakeConfig,
    FormatConfig,
    LayersConfig,
    QuantizationConfig,
    TransformConfig,
    WeightsConfig,
    quantize_model,
)
from .quant.layers import exclude_quantized_from_ddp_sync  # noqa: E402

_register_hf_quantizer()  # transformers' from_pretrained reads kbbq-pl checkpoints from now on

__all__ = ["AutoBrakeConfig", "FormatConfig", "LayersConfig", "QuantizationConfig",
           "TransformConfig", "WeightsConfig", "exclude_quantized_from_ddp_sync",
           "export_compressed_tensors", "from_pretrained",
           "quantize_checkpoint", "quantize_model", "save_compressed_tensors", "save_quantized",
           "upgrade_checkpoint"]
