"""``python -m labkit.core.quant``: build the C++ GEMV kernels now (``make env`` does), or say why not."""

from labkit.core.quant.gemv import load_result

built = load_result()
print("labkit's C++ GEMV kernels (float32, int8, int4): " + ("ready" if built.module is not None else
                                                             f"not built ({built.missing}); quantized layers "
                                                             "dequantize and call F.linear"))
