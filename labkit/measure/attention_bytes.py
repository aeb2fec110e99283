"""Decode attention as a bandwidth problem: the bytes one decode step's attention must read, a paged batch to read
them from, and each implementation of paged decode attention as a callable to time side by side.

One layer's decode attention reads every cached K and V of every sequence once: batch x context x n_kv_heads x
head_dim x 2 (K and V) x dtype bytes; the query and the output are a rounding error next to it. The paths:
``"torch split"`` (labkit's PyTorch split-KV: gathers each block, ~25 operations), ``"torch padded"`` (the CUDA-graph
path: gathers every row padded to the widest table), ``"cpp"`` (labkit's compiled C++ kernel reading blocks in place:
the in-place kernel of a CPU, float32 or float64, where it builds), ``"triton"`` (one kernel reading blocks in place;
only where triton imports). Used by notebook 11 (``11_attention_kernels``) and ``scripts/gpu_check.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.core.attention.decode import decode_attention, decode_mask, split_decode_attention, split_decode_blocks


@dataclass(frozen=True)
class DecodeAttentionShape:
    """One layer's decode attention: a batch of sequences of one context length. Notebook 11."""

    batch: int
    context_len: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16

    @property
    def kv_bytes(self) -> int:
        """K and V bytes the layer must read: the floor of any implementation's traffic."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.batch * self.context_len * self.n_kv_heads * self.head_dim * itemsize


@dataclass
class PagedBatch:
    """A decode batch over a paged pool whose blocks are handed out in random order (as after churn)."""

    q: torch.Tensor  # (B, n_heads, d)
    k_pool: torch.Tensor  # (num_blocks, block_size, n_kv, d)
    v_pool: torch.Tensor
    tables: list[list[int]]
    block_tables: torch.Tensor  # (B, W) int32
    context_lens: torch.Tensor  # (B,) int32
    max_context_len: int


def paged_batch(shape: DecodeAttentionShape, device: torch.device, seed: int = 0) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    n_blocks = -(-shape.context_len // shape.block_size)
    total = shape.batch * n_blocks
    order = torch.randperm(total, generator=gen).view(shape.batch, n_blocks)
    pool_shape = (total, shape.block_size, shape.n_kv_heads, shape.head_dim)
    k_pool = torch.randn(pool_shape, device=device).to(shape.dtype)
    v_pool = torch.randn(pool_shape, device=device).to(shape.dtype)
    q = torch.randn(shape.batch, shape.n_heads, shape.head_dim, device=device).to(shape.dtype)
    lens = torch.full((shape.batch,), shape.context_len, dtype=torch.int32, device=device)
    return PagedBatch(q, k_pool, v_pool, order.tolist(), order.to(device=device, dtype=torch.int32), lens,
                      shape.context_len)


DecodePath = Callable[[PagedBatch], Callable[[], torch.Tensor]]


def torch_split(batch: PagedBatch) -> Callable[[], torch.Tensor]:
    """labkit's PyTorch split-KV path; its per-step index tensors are built once, outside the timed call."""
    lens = batch.context_lens.tolist()
    split = split_decode_blocks(batch.tables, lens, batch.k_pool.shape[1], batch.k_pool.shape[2], batch.k_pool.dtype,
                                batch.q.device)
    return lambda: split_decode_attention(batch.q, batch.k_pool, batch.v_pool, split)


def torch_padded(batch: PagedBatch) -> Callable[[], torch.Tensor]:
    """The CUDA-graph decode path: every row gathered to the widest table, one masked SDPA."""
    tables = batch.block_tables.long()
    mask = decode_mask(tables, batch.k_pool.shape[1], batch.context_lens.long())
    return lambda: decode_attention(batch.q, batch.k_pool, batch.v_pool, tables, mask)


def triton_kernel(batch: PagedBatch) -> Callable[[], torch.Tensor]:
    from labkit.core.attention.triton_decode import paged_decode_attention

    return lambda: paged_decode_attention(batch.q, batch.k_pool, batch.v_pool, batch.block_tables,
                                          batch.context_lens, batch.max_context_len)


def cpp_kernel(batch: PagedBatch) -> Callable[[], torch.Tensor]:
    """labkit's C++ kernel (attention backend ``"cpp"``, the default on a CPU in float32): blocks read in place."""
    from labkit.core.attention.cpp_decode import paged_decode_attention

    return lambda: paged_decode_attention(batch.q, batch.k_pool, batch.v_pool, batch.block_tables,
                                          batch.context_lens)


def decode_paths(device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> dict[str, DecodePath]:
    """Every decode-attention path this machine can run, by name: "cpp" for a CPU ``device`` and a float32 or float64
    ``dtype`` where its kernel builds (both must be given: the kernel runs nowhere else); "triton" where triton
    imports."""
    from labkit.core.attention import TRITON_MISSING
    from labkit.core.attention.cpp_decode import KERNEL_DTYPES, cpp_missing

    paths: dict[str, DecodePath] = {"torch split": torch_split, "torch padded": torch_padded}
    if device is not None and torch.device(device).type == "cpu" and dtype in KERNEL_DTYPES and cpp_missing() is None:
        paths["cpp"] = cpp_kernel
    if TRITON_MISSING is None:
        paths["triton"] = triton_kernel
    return paths


def kernels_per_call(fn: Callable[[], object]) -> int:
    """CUDA kernels one call launches, counted by PyTorch's profiler (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
