"""Checkers for notebook 14 (``14_quantization``): the weight quantizer (Task 1) and the int8 KV pool (Task 2)."""

from labkit.course.ch14_quantization.kv_pool import KV_HINTS, check_int8_kv_pool
from labkit.course.ch14_quantization.quantizer import QUANTIZER_HINTS, check_quantize_weight

__all__ = ["KV_HINTS", "QUANTIZER_HINTS", "check_int8_kv_pool", "check_quantize_weight"]
