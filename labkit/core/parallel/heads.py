"""Which attention heads, MLP features and KV-pool share each tensor-parallel rank holds.

Attention splits by head: rank r computes query heads [r * H/N, (r + 1) * H/N) and the K/V heads they read. With
grouped-query attention there are fewer K/V heads (KV) than query heads:

* KV >= N: each rank holds KV/N K/V heads (N must divide KV), and its query heads are exactly the groups that read
  them: the KV pool splits N ways too (each rank stores 1/N of every token's K/V).
* KV < N (say 1 K/V head, N = 2): K/V heads are **replicated**: each rank holds the one K/V head its query heads
  read (N must be a multiple of KV), computes it itself, and stores it in its own pool (vLLM does the same). The KV
  pool then no longer shrinks with N: each rank keeps a whole copy of its K/V head.

The MLP splits its intermediate features (gate/up column-parallel, down row-parallel). Embeddings, norms and the
lm_head stay replicated on every rank: the lm_head is not vocab-parallel, so the driver computes the logits alone
and no gather is needed (at the cost of vocab x hidden weights per rank; vLLM shards it by vocabulary).
Introduced in notebook 15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from labkit.core.model.config import ModelConfig


@dataclass(frozen=True)
class HeadShard:
    """One rank's share of a layer: query heads, K/V heads (replicated or split) and MLP features. Notebook 15."""

    rank: int
    world_size: int
    q_heads: tuple[int, int]  # [start, end) of the query heads
    kv_heads: tuple[int, int]  # [start, end) of the K/V heads
    kv_replicated: bool  # fewer K/V heads than ranks: each K/V head is held by N/KV ranks
    intermediate: tuple[int, int]  # [start, end) of the MLP's intermediate features

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """A clear error if ``world_size`` ranks cannot split this model evenly, naming what and the limit."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {world_size!r}")
    h, kv, i = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if h % world_size:
        divisors = [d for d in range(1, h + 1) if h % d == 0]
        raise ValueError(f"tensor_parallel_size={world_size} must divide num_attention_heads={h} (each rank takes "
                         f"an equal share of the heads); this model allows {divisors}")
    if kv >= world_size and kv % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide num_key_value_heads={kv} (or be a multiple "
                         "of it, when the K/V heads are replicated)")
    if kv < world_size and world_size % kv:
        raise ValueError(f"tensor_parallel_size={world_size} is larger than num_key_value_heads={kv} but not a "
                         "multiple of it: each K/V head must be replicated on a whole number of ranks")
    if i % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide intermediate_size={i} (the MLP is split "
                         "by feature)")


def head_shard(config: ModelConfig, world_size: int, rank: int) -> HeadShard:
    """Rank ``rank``'s share of every layer (the same in every layer)."""
    check_tensor_parallel(config, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    h, kv, i = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    q_per, i_per = h // world_size, i // world_size
    if kv >= world_size:
        kv_per = kv // world_size
        kv_heads, replicated = (rank * kv_per, (rank + 1) * kv_per), False
    else:
        kv_index = rank * kv // world_size  # ranks r with the same r * KV // N share one K/V head
        kv_heads, replicated = (kv_index, kv_index + 1), True
    return HeadShard(rank, world_size, (rank * q_per, (rank + 1) * q_per), kv_heads, replicated,
                     (rank * i_per, (rank + 1) * i_per))


def local_config(config: ModelConfig, shard: HeadShard) -> ModelConfig:
    """The config one rank's model and KV pool see: its heads and features (the pool is sized from it, so each
    rank holds its heads' share of the KV pool)."""
    return dataclasses.replace(config, num_attention_heads=shard.num_heads, num_key_value_heads=shard.num_kv_heads,
                               intermediate_size=shard.intermediate[1] - shard.intermediate[0])


def head_rows(heads: tuple[int, int], head_dim: int) -> torch.Tensor:
    """The weight rows of heads [start, end) in a (heads * head_dim, in) projection: each head's rows together."""
    return torch.arange(heads[0] * head_dim, heads[1] * head_dim)
