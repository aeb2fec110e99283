"""Group-wise symmetric int4, two values per byte.

Each row of an (out, in) weight is cut into groups of ``group_size`` inputs (32 by default); a group's values are
stored as ``q = clamp(round(w / s), -8, 7)`` with ``s = max|w over the group| / 7`` (1 for a group of zeros), so each
lands within ``s / 2`` of itself. Smaller groups follow the weights' local scale more closely (lower error) at the
cost of more scales: 32 float32 bits per group, 1 bit per weight at group 32.

Packing (the nibble order): byte ``j`` of a row holds element ``2j`` in its low nibble (bits 0-3) and element
``2j + 1`` in its high nibble (bits 4-7), each as ``q + 8`` (offset binary, 0..15). An (out, in) weight packs to
(out, in / 2) uint8. Introduced in notebook 14 (``14_quantization``).
"""

from __future__ import annotations

import torch

INT4_MIN, INT4_MAX = -8, 7
INT4_OFFSET = 8  # stored nibble = q + 8


def check_group_size(in_features: int, group_size: int, name: str = "the layer") -> None:
    """int4 needs whole groups: no padding, a clear error instead."""
    if in_features % group_size:
        raise ValueError(f"int4 with group_size {group_size} needs in_features divisible by {group_size}: {name} "
                         f"has in_features={in_features} (labkit does not pad; use a group size that divides it, "
                         "or quantization='int8')")


def int4_scales(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """(out, in) -> (out, in / group_size) float32: max |w| of each group / 7 (1 for a group of zeros)."""
    out, n = weight.shape
    amax = weight.detach().float().abs().reshape(out, n // group_size, group_size).amax(dim=2)  # (out, groups)
    return torch.where(amax > 0, amax / INT4_MAX, torch.ones_like(amax))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(out, in) integers in [-8, 7] -> (out, in / 2) uint8: element 2j in the low nibble, 2j + 1 in the high."""
    u = (q.to(torch.int16) + INT4_OFFSET).to(torch.uint8)  # (out, in), 0..15
    return u[:, 0::2] | (u[:, 1::2] << 4)  # (out, in / 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(out, in / 2) uint8 -> (out, in) int8 in [-8, 7]."""
    low = (packed & 0x0F).to(torch.int8) - INT4_OFFSET  # elements 0, 2, 4, ...
    high = (packed >> 4).to(torch.int8) - INT4_OFFSET  # elements 1, 3, 5, ...
    return torch.stack((low, high), dim=2).flatten(1)  # (out, in): interleaved back


def quantize_int4(weight: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float -> (packed (out, in / 2) uint8, scales (out, in / group_size) float32)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_int4 takes an (out, in) weight, got shape {tuple(weight.shape)}")
    check_group_size(weight.shape[1], group_size)
    scales = int4_scales(weight, group_size)  # (out, groups)
    w = weight.detach().float().reshape(weight.shape[0], -1, group_size)  # (out, groups, group_size)
    q = torch.round(w / scales[:, :, None]).clamp_(INT4_MIN, INT4_MAX).flatten(1)  # (out, in)
    return pack_int4(q), scales


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group_size: int = 32,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(out, in / 2) uint8, (out, in / group_size) -> (out, in) in ``dtype``."""
    q = unpack_int4(packed).float()  # (out, in)
    out = q.shape[0]
    w = q.reshape(out, -1, group_size) * scales[:, :, None].float()  # (out, groups, group_size)
    return w.reshape(out, -1).to(dtype)
