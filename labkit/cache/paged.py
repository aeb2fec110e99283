"""The paged KV pool and paged attention: K/V read and written through block tables.

One preallocated pool per layer, shaped (num_blocks, block_size, n_kv_heads, head_dim). A step's
batch is *ragged*: all sequences' new tokens are concatenated into one row of N tokens (no padding),
each new K/V goes to the slot ``slot_mapping`` names, and each sequence attends to its own blocks.
This is the readable, gather-based reference (vLLM's kernels read blocks in place instead).
Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.model.attention import sdpa
from labkit.model.config import ModelConfig


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers: K and V, every layer, every KV head."""
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


class PagedKVPool:
    """Per-layer K and V block pools. Notebook 06."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (src -> dst) in every layer."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for pool in self.k + self.v:
            pool[dst] = pool[src]


@dataclass
class PagedAttentionMetadata:
    """Describes one ragged step: per sequence, how many new tokens, how long, which blocks. Notebook 06."""

    query_lens: list[int]  # new tokens of each sequence this step
    context_lens: list[int]  # tokens of each sequence in the cache after this step (cached + new)
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # (N,) pool slot of each new token

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class PagedAttention:
    """``AttentionBackend`` over a ``PagedKVPool`` for one step's ragged batch. Notebook 06."""

    def __init__(self, pool: PagedKVPool, meta: PagedAttentionMetadata) -> None:
        self.pool = pool
        self.meta = meta
        self.block_size = pool.block_size
        if meta.is_decode_only:  # precompute once per step, reused by every layer
            max_blocks = max(len(bt) for bt in meta.block_tables)
            tables = [bt + [0] * (max_blocks - len(bt)) for bt in meta.block_tables]  # pad with any valid block
            self.tables = torch.tensor(tables, device=pool.device)  # (B, max_blocks)
            k_pos = torch.arange(max_blocks * self.block_size, device=pool.device)  # (S,)
            lens = torch.tensor(meta.context_lens, device=pool.device)[:, None]  # (B, 1)
            self.decode_mask = (k_pos[None, :] < lens)[:, None, None, :]  # (B, 1, 1, S)

    def _gather(self, pool: torch.Tensor, block_table: list[int], length: int) -> torch.Tensor:
        """One sequence's first ``length`` cached K (or V): (length, n_kv_heads, head_dim)."""
        blocks = pool[torch.tensor(block_table, device=pool.device)]  # (n_blocks, block_size, n_kv, d)
        return blocks.flatten(0, 1)[:length]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (1, N, n_heads, d); k, v: (1, N, n_kv_heads, d) -- every sequence's new tokens, concatenated
        k_pool, v_pool = self.pool.k[layer_idx], self.pool.v[layer_idx]
        k_pool.flatten(0, 1)[self.meta.slot_mapping] = k[0]  # write new K/V into their slots
        v_pool.flatten(0, 1)[self.meta.slot_mapping] = v[0]
        if self.meta.is_decode_only:
            b = len(self.meta.query_lens)
            keys = k_pool[self.tables].flatten(1, 2)  # (B, S, n_kv, d): gather each sequence's blocks
            values = v_pool[self.tables].flatten(1, 2)
            out = sdpa(q[0][:, None], keys, values, mask=self.decode_mask, is_causal=False)  # (B, 1, n_heads, d)
            return out.reshape(1, b, *out.shape[2:])
        outs, start = [], 0
        for n, ctx, table in zip(self.meta.query_lens, self.meta.context_lens, self.meta.block_tables):
            keys = self._gather(k_pool, table, ctx)[None]  # (1, ctx, n_kv, d)
            values = self._gather(v_pool, table, ctx)[None]
            q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]  # new tokens sit at the end
            mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos  # (n, ctx): causal over cache + new
            outs.append(sdpa(q[:, start : start + n], keys, values, mask=mask, is_causal=False))
            start += n
        return torch.cat(outs, dim=1)  # (1, N, n_heads, d)
