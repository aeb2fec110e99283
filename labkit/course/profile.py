"""Smoke mode and the model profile: how big the experiments are on this machine, and on this card.

Introduced in notebook 00 (``00_setup_and_hardware``). Smoke mode (``LABKIT_SMOKE=1``, set by the
test command and CI) shrinks every experiment so the notebooks run on a 2-core CPU in minutes.

On a CUDA GPU the profile depends on the card: ``gpu_profile`` picks it from the memory this process can
use and the compute capability, a pure function that the tests drive with mocked device properties.
Notebook 00's table lists what each class of card gets (a test checks the table against ``CARD_CLASSES``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from labkit.core.device import resolve_device
from labkit.core.kv.paged_pool import kv_bytes_per_token
from labkit.core.model.config import ModelConfig
from labkit.core.model.presets import PRESETS

GB = 10**9  # cards are sold (and classed here) in decimal gigabytes


def smoke_mode() -> bool:
    """True when LABKIT_SMOKE is 1/true/yes, or when running under CI (CI=true)."""
    flag = os.environ.get("LABKIT_SMOKE", "").lower()
    if flag in ("0", "false", "no"):
        return False
    return flag in ("1", "true", "yes") or os.environ.get("CI", "").lower() == "true"


@dataclass(frozen=True)
class Profile:
    """Which models and how much work the notebooks use here. Notebook 00."""

    name: str  # "smoke", "cpu", "mps" or "gpu" (notebooks key their sizes on it)
    device: str
    dtype: str
    model: str  # a real checkpoint: text must read well (the bundled model everywhere)
    perf_model: str  # a preset of a real architecture's shape, for roofline and profiling work
    num_requests: int  # size of workloads in batching experiments
    max_tokens: int  # output length in single-request experiments
    smoke: bool
    # Where the engine lessons of notebooks 01 and 06-09 run: on a GPU the bundled 3.5M-parameter model is bound by
    # the host (every step costs the same launches), so stalls, prefix-cache savings and batching gains vanish there.
    engine_model: str = "labkit-tiny"
    card: str = "none"  # the class of GPU (a row of notebook 00's table); "none" off CUDA
    max_batch: int = 256  # the largest decode batch notebook 04 sweeps (its temporaries fit this card)


@dataclass(frozen=True)
class CardClass:
    """A class of CUDA card by the memory this process can use, and what the notebooks run on it. Notebook 00."""

    name: str
    min_memory: int  # bytes (decimal GB: a "16 GB" T4 reports 15.8e9)
    examples: str
    num_requests: int


CARD_CLASSES = (  # smallest first; a card belongs to the last class whose min_memory it reaches (or the first)
    CardClass("8-12 GB", 8 * GB, "RTX 3060, RTX 4060 Ti, RTX 2080 Ti", 128),
    CardClass("16 GB", 14 * GB, "T4, V100 16GB, RTX A4000, RTX 4080", 256),
    CardClass("24 GB", 20 * GB, "L4, A10, RTX 3090, RTX 4090", 256),
    CardClass("40-48 GB", 32 * GB, "A100 40GB, L40S, RTX A6000", 256),
    CardClass("80 GB", 64 * GB, "A100 80GB, H100", 256),
    CardClass("141 GB+", 120 * GB, "H200, B200", 256),
)
GPU_MODEL = "llama3.2-1b"  # ~1.2B parameters: device-bound on any card, 2.5 GB of bf16 weights fit them all
SWEEP_PROMPT_LEN, SWEEP_DECODE_STEPS = 512, 16  # notebook 04's longest prompt on a GPU, decode steps per run
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # notebook 04's GPU batch sizes (up to max_batch)
MEMORY_SHARE = 0.7  # of the usable memory, for notebook 04's sweep: the rest for the CUDA context and fragmentation


def card_class(memory: int) -> CardClass:
    """The class of a card with ``memory`` usable bytes (a card under 8 GB gets the smallest class)."""
    fits = [c for c in CARD_CLASSES if memory >= c.min_memory]
    return fits[-1] if fits else CARD_CLASSES[0]


def sweep_bytes(config: ModelConfig, batch: int, prompt_len: int, decode_steps: int, dtype_bytes: int) -> int:
    """Device memory of notebook 04's ``kvcache`` run at one (batch, prompt): the weights, the contiguous KV cache
    for prompt + decode tokens, and the prefill's temporaries (per token: the residual, the MLP's gate/up output,
    activation and product, K/V repeated for attention, times 1.5 for the allocator's fragmentation)."""
    weights = config.num_params * dtype_bytes
    kv_per_token = kv_bytes_per_token(config, dtype_bytes)
    kv_cache = batch * (prompt_len + decode_steps + 1) * kv_per_token
    per_token = (config.hidden_size + 4 * config.intermediate_size
                 + 2 * config.num_attention_heads * config.head_dim) * dtype_bytes
    return weights + kv_cache + int(1.5 * per_token * batch * prompt_len)


def max_sweep_batch(memory: int, model: str = GPU_MODEL, dtype_bytes: int = 2) -> int:
    """The largest batch of ``SWEEP_BATCHES`` whose notebook-04 run fits ``MEMORY_SHARE`` of ``memory`` bytes."""
    config = PRESETS[model]
    fits = [b for b in SWEEP_BATCHES
            if sweep_bytes(config, b, SWEEP_PROMPT_LEN, SWEEP_DECODE_STEPS, dtype_bytes) <= MEMORY_SHARE * memory]
    return fits[-1] if fits else 1


def gpu_profile(memory: int, capability: tuple[int, int]) -> Profile:
    """The profile of a CUDA card with ``memory`` usable bytes and compute capability ``capability``: bfloat16 from
    Ampere (8.0) on, float16 before; the ~1B preset for engine lessons and performance work on every card; the
    workloads and notebook 04's largest batch sized to the card."""
    card = card_class(memory)
    dtype = "bfloat16" if capability >= (8, 0) else "float16"
    return Profile("gpu", "cuda", dtype, "labkit-tiny", GPU_MODEL, card.num_requests, 128, False,
                   engine_model=GPU_MODEL, card=card.name, max_batch=max_sweep_batch(card.min_memory))


def usable_memory(device: torch.device) -> int:
    """Bytes this process can use on a CUDA device: the card's total, less what other processes hold (free memory
    plus this process's own cache)."""
    total = torch.cuda.get_device_properties(device).total_memory
    free, _ = torch.cuda.mem_get_info(device)
    return min(total, free + torch.cuda.memory_reserved(device))


def pick_profile(device: str | torch.device = "auto", smoke: bool | None = None) -> Profile:
    """Smoke: tiny everything. CPU: the bundled model and SmolLM2-135M's shape. GPU: by card (``gpu_profile``)."""
    dev = resolve_device(device)
    smoke = smoke_mode() if smoke is None else smoke
    if smoke:
        dtype = "bfloat16" if dev.type == "cuda" else "float32"  # what dtype="auto" picks there
        return Profile("smoke", dev.type, dtype, "labkit-tiny", "smollm2-135m", 8, 16, True, max_batch=4)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        return gpu_profile(usable_memory(dev), (props.major, props.minor))
    if dev.type == "mps":
        return Profile("mps", "mps", "float32", "labkit-tiny", "qwen2.5-0.5b", 64, 64, False, max_batch=32)
    return Profile("cpu", "cpu", "float32", "labkit-tiny", "smollm2-135m", 32, 64, False, max_batch=16)
