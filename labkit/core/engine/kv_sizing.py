"""How many KV blocks an engine gets: an explicit size anywhere, vLLM's sizing on CUDA, a bounded budget on the CPU.

On CUDA the pool is what ``gpu_memory_utilization`` of the card's *total* memory leaves after everything else that
lives there: other processes (and the CUDA context), this process's live tensors (the weights, and the pools of
engines still in use), the activations of the largest forward pass, measured by running one, and the memory the
decode steps' CUDA graphs will keep (``graph_capture_peak``). It is never larger
than ``max_num_seqs`` sequences of ``max_model_len`` tokens can use. Memory that PyTorch's caching allocator keeps
from an engine that was closed or replaced counts as free, so a notebook that builds seven engines in a row gives
each the same pool (sizing by *free* memory, as labkit once did, shrank every later pool). Introduced in notebook
06 (``06_paged_attention``); the GPU track in notebook 10.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch

from labkit.core.engine.config import PagedConfig
from labkit.core.engine.cuda_graphs import graph_widths
from labkit.core.kv.quantized_pool import check_kv_device, kv_cache_block_bytes
from labkit.core.model import CausalLM
from labkit.core.model.attention import CausalAttention

CPU_KV_BUDGET = 1 << 30  # bytes: the CPU default when neither num_gpu_blocks nor kv_cache_memory is given


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as this process sees it, in bytes. GPU track."""

    total: int
    free: int
    reserved: int  # held by this process's caching allocator (live tensors and cached free blocks)
    allocated: int  # this process's live tensors

    @property
    def others(self) -> int:
        """Used outside this process's allocator: other processes and the CUDA context."""
        return max(0, self.total - self.free - self.reserved)


def cuda_memory(device: torch.device) -> DeviceMemory:
    gc.collect()  # an engine that was replaced may still wait in a reference cycle: let its pool go first
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=total, free=free, reserved=torch.cuda.memory_reserved(device),
                        allocated=torch.cuda.memory_allocated(device))


@torch.inference_mode()
def profile_activation_peak(model: CausalLM, num_tokens: int) -> int:
    """Bytes of temporaries one forward pass over ``num_tokens`` tokens needs beyond what is already allocated
    (vLLM's profiling run); 0 off CUDA."""
    if model.device.type != "cuda":
        return 0
    torch.cuda.synchronize(model.device)
    torch.cuda.reset_peak_memory_stats(model.device)
    before = torch.cuda.memory_allocated(model.device)
    ids = torch.zeros(1, num_tokens, dtype=torch.long, device=model.device)  # (1, N)
    positions = torch.arange(num_tokens, device=model.device)[None]  # (1, N)
    hidden = model(ids, positions, CausalAttention())  # (1, N, hidden)
    model.compute_logits(hidden[0, -1:])
    torch.cuda.synchronize(model.device)
    peak = torch.cuda.max_memory_allocated(model.device) - before
    del hidden
    torch.cuda.empty_cache()
    return max(0, peak)


def graph_capture_peak(model: CausalLM, config: PagedConfig) -> int:
    """Bytes the CUDA graphs of decode steps keep in their private memory pool, 0 where they are not captured: the
    temporaries of the largest captured step (the largest capture size, the widest block table), which the smaller
    graphs reuse. Estimated from the shapes, since the graphs are captured after the pool exists: the padded gather
    of one layer's K and V (``decode_attention``) and its mask, plus a dense forward's activations for that many
    tokens. On a ~1B model with 256 sequences and 2048-token tables the gather alone is 1 GiB; left out, graph
    capture could fail for memory the pool already took."""
    if not config.use_cuda_graphs(model.device.type):
        return 0
    assert config.max_model_len is not None and config.cuda_graph_sizes
    batch = max(config.cuda_graph_sizes)
    tokens = graph_widths(-(-config.max_model_len // config.block_size))[-1] * config.block_size  # widest table
    c = model.config
    gather = 2 * batch * tokens * c.num_key_value_heads * c.head_dim * model.dtype.itemsize  # (B, S, n_kv, d) x 2
    return gather + batch * tokens + profile_activation_peak(model, batch)  # + the (B, S) bool mask


def cuda_kv_budget(memory: DeviceMemory, utilization: float, activation_peak: int, graph_peak: int = 0) -> int:
    """Bytes for the KV pool: utilization x total, less what others use, our live tensors, the activations of the
    largest forward pass and the CUDA graphs' memory pool (both live at once: the graphs keep theirs)."""
    return int(memory.total * utilization) - memory.others - memory.allocated - activation_peak - graph_peak


def system_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): let the allocator decide
        return None


def pool_num_blocks(model: CausalLM, config: PagedConfig, max_num_batched_tokens: int) -> int:
    """How many KV blocks the engine gets. A pool larger than the device's memory is refused here, with the option
    and the limit, rather than by the allocator."""
    assert config.max_model_len is not None
    check_kv_device(config.kv_cache_dtype, model.device, model.dtype)  # before sizing: fp8 where it cannot live
    block_bytes = kv_cache_block_bytes(model.config, config.block_size, model.dtype, config.kv_cache_dtype)
    needed = config.max_num_seqs * -(-config.max_model_len // config.block_size)  # every slot at full length
    cuda = model.device.type == "cuda"
    memory = cuda_memory(model.device) if cuda else None
    device_bytes = memory.free + memory.reserved - memory.allocated if memory is not None else system_memory()
    if config.num_gpu_blocks is not None:
        option, num_blocks = "num_gpu_blocks", config.num_gpu_blocks
    else:
        if config.kv_cache_memory is not None:
            budget = config.kv_cache_memory
        elif memory is not None:
            # The largest step of one sequence: a static batch's budget (max_num_seqs x max_model_len) would ask one
            # profiling pass for millions of tokens on a long-context model and run out of memory itself.
            num_tokens = min(max_num_batched_tokens, config.max_model_len)
            budget = cuda_kv_budget(memory, config.gpu_memory_utilization, profile_activation_peak(model, num_tokens),
                                    graph_capture_peak(model, config))
        else:  # enough for every slot at full length, within a modest CPU budget
            budget = min(CPU_KV_BUDGET, config.max_num_seqs * config.max_model_len * block_bytes // config.block_size)
        option, num_blocks = "kv_cache_memory", budget // block_bytes
        if config.kv_cache_memory is None and cuda:
            num_blocks = min(num_blocks, needed)  # more would never be used
        if num_blocks < 1:
            where = (f" ({config.gpu_memory_utilization:.0%} of {memory.total / 2**30:.1f} GiB, less "
                     f"{memory.others / 2**30:.1f} GiB used elsewhere and {memory.allocated / 2**30:.1f} GiB of this "
                     "process's tensors: close engines you no longer use, or raise gpu_memory_utilization)"
                     if memory is not None and config.kv_cache_memory is None else "")
            raise ValueError(f"a KV budget of {budget} bytes holds no block ({block_bytes} bytes each at "
                             f"block_size {config.block_size}){where}; raise kv_cache_memory or num_gpu_blocks")
    if device_bytes is not None and num_blocks * block_bytes > device_bytes:
        kind = "free memory" if cuda else "memory"
        raise ValueError(
            f"{option}={getattr(config, option)} asks for a KV pool of {num_blocks} blocks x {block_bytes} bytes "
            f"(block_size {config.block_size}) = {num_blocks * block_bytes / 2**30:.1f} GiB, more than this "
            f"{model.device.type} device's {device_bytes / 2**30:.1f} GiB of {kind}; at most "
            f"{device_bytes // block_bytes} blocks fit: lower {option}")
    return num_blocks
