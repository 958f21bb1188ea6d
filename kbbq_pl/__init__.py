"""kbbq-pl: FP4 (NVFP4, MXFP4) W4A4 quantization of HuggingFace transformers with KBBQ."""

__version__ = "0.1.0"

from . import _compat  # noqa: F401,E402  (imports torchao quietly before anything else does)
from .io.checkpoint import from_pretrained, save_quantized  # noqa: E402
from .io.compressed_tensors import export_compressed_tensors, save_compressed_tensors  # noqa: E402
from .quant.quantize import QuantizationConfig, quantize_model  # noqa: E402

__all__ = ["QuantizationConfig", "export_compressed_tensors", "from_pretrained", "quantize_model",
           "save_compressed_tensors", "save_quantized"]
