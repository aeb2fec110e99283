"""Smoke mode and the model profile: how big the experiments are on this machine.

Introduced in notebook 00 (``00_setup_and_hardware``). Smoke mode (``LABKIT_SMOKE=1``, set by the
test command and CI) shrinks every experiment so the notebooks run on a 2-core CPU in minutes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from labkit.device import resolve_device


def smoke_mode() -> bool:
    """True when LABKIT_SMOKE is 1/true/yes, or when running under CI (CI=true)."""
    flag = os.environ.get("LABKIT_SMOKE", "").lower()
    if flag in ("0", "false", "no"):
        return False
    return flag in ("1", "true", "yes") or os.environ.get("CI", "").lower() == "true"


@dataclass(frozen=True)
class Profile:
    """Which models and how much work the notebooks use here. Notebook 00."""

    name: str
    device: str
    dtype: str
    model: str  # a real checkpoint: text must read well (the bundled model everywhere)
    perf_model: str  # a preset of a real architecture's shape, for roofline and profiling work
    num_requests: int  # size of workloads in batching experiments
    max_tokens: int  # output length in single-request experiments
    smoke: bool


def pick_profile(device: str | torch.device = "auto", smoke: bool | None = None) -> Profile:
    """Smoke: tiny everything. CPU: the bundled model and SmolLM2-135M's shape. GPU: Llama-3.2-1B's shape."""
    dev = resolve_device(device)
    smoke = smoke_mode() if smoke is None else smoke
    if smoke:
        dtype = "bfloat16" if dev.type == "cuda" else "float32"  # what dtype="auto" picks there
        return Profile("smoke", dev.type, dtype, "labkit-tiny", "smollm2-135m", 8, 16, True)
    if dev.type == "cuda":
        return Profile("gpu", "cuda", "bfloat16", "labkit-tiny", "llama3.2-1b", 256, 128, False)
    if dev.type == "mps":
        return Profile("mps", "mps", "float32", "labkit-tiny", "qwen2.5-0.5b", 64, 64, False)
    return Profile("cpu", "cpu", "float32", "labkit-tiny", "smollm2-135m", 32, 64, False)
