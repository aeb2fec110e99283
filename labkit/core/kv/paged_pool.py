"""The paged KV pool: one preallocated K and V tensor per layer, shaped (num_blocks, block_size, n_kv_heads, head_dim).

The block manager (``block_manager.py``) decides which blocks a sequence owns; attention backends
(``labkit.core.attention``) read and write K/V through the block tables. Introduced in notebook 06
(``06_paged_attention``).
"""

from __future__ import annotations

import torch

from labkit.core.model.config import ModelConfig


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of K and V one token leaves in the cache, over all layers. Notebook 03's KV calculator.

    2 (K and V) x layers x kv_heads x head_dim x dtype_bytes. Grouped-query attention divides it by
    num_attention_heads / num_key_value_heads compared with giving every query head its own K/V. The one copy of
    the formula: the engine sizes its pool with it (``kv_block_bytes``), and ``labkit.measure.roofline`` re-exports it.
    """
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers: K and V, every layer, every KV head."""
    return kv_bytes_per_token(config, torch.empty((), dtype=dtype).element_size()) * block_size


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
