"""One entry point for both weight formats: ``quantize_weight(weight, method, group_size)``.

int8 is group-wise quantization whose group is a whole row (one scale per output channel, range +-127); int4 has
groups of ``group_size`` inputs (range -8..7) and packs two values per byte. ``QuantizedLinear.from_linear`` calls
this (or a learner's function of the same signature: notebook 14's Build task, run inside the engine with
``quantize_model(..., quantizer=...)``). Introduced in notebook 14 (``14_quantization``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.core.quant.int4 import dequantize_int4, int4_scales, pack_int4
from labkit.core.quant.int4 import quantize_int4 as _quantize_int4
from labkit.core.quant.int8 import dequantize_int8
from labkit.core.quant.int8 import quantize_int8 as _quantize_int8

Quantizer = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (weight, method, group_size, scales) -> (q, scales)


def quantize_weight(weight: torch.Tensor, method: str, group_size: int = 32,
                    scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> (qweight, scales). "int8": int8 (out, in), scales (out,); "int4": uint8 (out, in / 2),
    scales (out, in / group_size). ``scales`` given (clipped ones, say): values beyond the range saturate."""
    if method == "int8":
        return _quantize_int8(weight, scales)
    if scales is None:
        return _quantize_int4(weight, group_size)
    w = weight.detach().float().reshape(weight.shape[0], -1, group_size)  # (out, groups, group_size)
    q = torch.round(w / scales[:, :, None].float()).clamp_(-8, 7).flatten(1)  # (out, in)
    return pack_int4(q), scales.float()


def dequantize_weight(qweight: torch.Tensor, scales: torch.Tensor, method: str, group_size: int = 32,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse: (out, in) in ``dtype``."""
    if method == "int8":
        return dequantize_int8(qweight, scales, dtype)
    return dequantize_int4(qweight, scales, group_size, dtype)


__all__ = ["Quantizer", "dequantize_weight", "int4_scales", "quantize_weight"]
