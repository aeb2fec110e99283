"""Per-output-channel symmetric int8: one float32 scale per row of an (out, in) weight.

Row ``r`` is stored as ``q[r] = clamp(round(w[r] / s[r]), -127, 127)`` with ``s[r] = max|w[r]| / 127``, so the row's
largest magnitude maps to +-127 and every other value to within ``s[r] / 2`` of itself. The scale is per output
channel (a row), never per input column: each output is then one integer dot product times one scale. A row of
zeros gets scale 1 (any positive number works; a zero scale would divide by zero). -128 is never produced, which
keeps the range symmetric. Introduced in notebook 14 (``14_quantization``).
"""

from __future__ import annotations

import torch

INT8_MAX = 127


def int8_scales(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (out,) float32: max |w| of each row / 127 (1 for a row of zeros)."""
    amax = weight.detach().float().abs().amax(dim=1)  # (out,)
    return torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))


def quantize_int8(weight: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> (q (out, in) int8, scales (out,) float32). ``scales`` given (e.g. clipped ones): values
    past +-127 saturate rather than wrap around."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int8 takes an (out, in) weight, got shape {tuple(weight.shape)}")
    scales = int8_scales(weight) if scales is None else scales.float()
    q = torch.round(weight.detach().float() / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX)  # (out, in)
    return q.to(torch.int8), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(out, in) int8, (out,) -> (out, in) in ``dtype``."""
    return (q.float() * scales[:, None].float()).to(dtype)
