"""Weight-only quantization (int8 per output channel, int4 group-wise) and labkit's CPU GEMV kernels.

``LLM(..., quantization="int8" | "int4")`` quantizes every linear layer at load (``apply.quantize_model``); the
formats are in ``int8`` and ``int4``, the layer in ``linear``, the kernels in ``gemv``. Introduced in notebook 14
(``14_quantization``).
"""

from labkit.core.quant.apply import quantize_like, quantize_model, weight_bytes
from labkit.core.quant.config import QUANTIZATION_METHODS, QuantizationConfig, resolve_quantization
from labkit.core.quant.int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from labkit.core.quant.int8 import dequantize_int8, quantize_int8
from labkit.core.quant.linear import QuantizedLinear, QuantizedMergedLinear

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "QuantizedLinear", "QuantizedMergedLinear",
           "dequantize_int4", "dequantize_int8", "pack_int4", "quantize_int4", "quantize_int8", "quantize_like",
           "quantize_model", "resolve_quantization", "unpack_int4", "weight_bytes"]
