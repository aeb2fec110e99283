"""Choosing a device and dtype, and synchronising before reading a clock.

Introduced in notebook 00 (``00_setup_and_hardware``).
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``auto`` picks cuda, then mps, then cpu; anything else must exist on this machine."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available on this machine; use 'cpu' or 'auto'")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} requested but MPS is not available on this machine; use 'cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` picks bfloat16 on GPUs that support it (float16 on older ones), float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose 'auto' or one of {', '.join(DTYPES)}")
    if dtype == "float64" and device.type != "cpu":
        raise ValueError(f"float64 is for exact tests on the CPU; device {device} should use float32/bfloat16/float16")
    return DTYPES[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a clock read afterwards includes it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
