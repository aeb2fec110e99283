"""Weight-only quantization options: vLLM's ``quantization=`` name, and the group size of int4.

``LLM(..., quantization="int8")`` stores every linear layer's weight as int8 with one float32 scale per output
channel (row); ``"int4"`` stores two 4-bit values per byte with one float32 scale per ``group_size`` inputs of a row.
A ``QuantizationConfig`` names the group size (``QuantizationConfig("int4", group_size=64)``) and what decode-shaped
calls on a CPU multiply the weights by: float32 inputs (``activations="float"``, the default), inputs rounded to int16
(``"int16"``, int8 or int4 weights: one scale per 32 inputs, erring less than float16 inputs would (tested), so still
weight-only in vLLM's W8A16 / W4A16 sense; an integer dot-product instruction does the multiplying), or, for
int4, inputs rounded to int8 (``"int8"``: llama.cpp's Q4_0 x Q8_0 scheme, not weight-only). The weights are stored the
same way in all three; prefill keeps float activations, and a model rebuilt from its ``state_dict`` in another
process gets float activations. The embedding
table stays in the model's dtype: a lookup reads one row per token, so there are no bytes to save in decode.
``lm_head`` (the largest single matrix of a small model, tied or not) is quantized like the rest unless
``lm_head=False``.
Introduced in notebook 14 (``14_quantization``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QUANTIZATION_METHODS = ("int8", "int4")  # vLLM's option name quantization=..., labkit's two weight-only formats
INT4_GROUP_SIZES = (32, 64, 128)  # inputs per int4 scale: multiples of 32, the kernel's unit (16 bytes)
DEFAULT_INT4_GROUP_SIZE = 32
ACTIVATION_FORMATS = ("float", "int16", "int8")  # what a quantized layer's decode kernel multiplies the weights by
ACTIVATION_SUFFIXES = {"float": "", "int16": "a16", "int8": "a8"}  # in format names (int8-a16) and kernel names
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # dtypes a quantized layer computes in


@dataclass(frozen=True)
class QuantizationConfig:
    """Which format, and for int4 how many inputs share a scale. Notebook 14."""

    method: str
    group_size: int = DEFAULT_INT4_GROUP_SIZE  # int4 only; int8 has one scale per output channel
    lm_head: bool = True  # quantize lm_head too (the embedding table never is)
    activations: str = "float"  # "int16" / "int8" (int4 only): round a decode call's inputs (one scale per 32 inputs)

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={self.method!r} is not supported; choose None (the model's dtype) or "
                             f"one of {', '.join(repr(m) for m in QUANTIZATION_METHODS)}")
        if self.method == "int4" and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {', '.join(map(str, INT4_GROUP_SIZES))} (a multiple "
                             f"of 32 inputs), got {self.group_size!r}")
        if self.activations not in ACTIVATION_FORMATS:
            raise ValueError(f"activations must be one of {', '.join(map(repr, ACTIVATION_FORMATS))}, got "
                             f"{self.activations!r}")
        if self.activations == "int8" and self.method != "int4":
            raise ValueError("activations='int8' is implemented for int4 weights (method='int4'), not for "
                             f"{self.method!r} (whose activations can be 'float' or 'int16')")

    @property
    def name(self) -> str:
        """Short label: "int8", "int4-g32"; "-a16" (int16 activations) or "-a8" (int8 activations) added."""
        suffix = ACTIVATION_SUFFIXES[self.activations]
        return ("int8" if self.method == "int8" else f"int4-g{self.group_size}") + (f"-{suffix}" if suffix else "")

    @property
    def bits(self) -> float:
        """Bits per weight, scales counted (float32 scales: 32 bits over a row, or over a group)."""
        return 8.0 if self.method == "int8" else 4.0 + 32.0 / self.group_size


def gemv_kernel_name(method: str, activations: str) -> str:
    """The GEMV kernel a quantized layer's decode calls run, named as in ``labkit.core.quant.gemv`` and its C++
    module: "gemv_int8", "gemv_int8_a16", "gemv_int4", "gemv_int4_a16" or "gemv_int4_a8"."""
    suffix = ACTIVATION_SUFFIXES[activations]
    return f"gemv_{method}" + (f"_{suffix}" if suffix else "")


def resolve_quantization(value: str | QuantizationConfig | None) -> QuantizationConfig | None:
    """``LLM``'s ``quantization=`` argument as a config (None: no quantization), or a clear error."""
    if value is None or isinstance(value, QuantizationConfig):
        return value
    if not isinstance(value, str):
        raise TypeError(f"quantization must be None, a string ({', '.join(QUANTIZATION_METHODS)}) or a "
                        f"QuantizationConfig, got {type(value).__name__}")
    return QuantizationConfig(value)


def check_compute_dtype(dtype: torch.dtype) -> None:
    """A quantized model computes in float32, bfloat16 or float16; float64 (labkit's exact-test dtype) is refused:
    int8/int4 weights carry far less precision than float64 could show, so "exact" would mean nothing."""
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"a quantized model computes in float32, bfloat16 or float16, not {dtype}: float64 is for "
                         "exact tests of the unquantized model (use dtype='float32' with quantization)")
