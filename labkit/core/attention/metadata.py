"""What an attention backend needs to know about one ragged step, and the interface every paged backend has.

A step's batch is *ragged*: all sequences' new tokens are concatenated into one row of N tokens (no
padding), each new K/V goes to the slot ``slot_mapping`` names, and each sequence attends to its own
blocks. Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from labkit.core.attention.decode import DecodeOnlyAttention
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model.attention import AttentionBackend


@dataclass
class PagedAttentionMetadata:
    """Describes one ragged step: per sequence, how many new tokens, how long, which blocks. Notebook 06."""

    query_lens: list[int]  # new tokens of each sequence this step
    context_lens: list[int]  # tokens of each sequence in the cache after this step (cached + new)
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor  # (N,) pool slot of each new token
    block_table_tensor: torch.Tensor | None = None  # (B, max_blocks) the tables padded with block 0, if prebuilt

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class PagedAttentionBackend(ABC):
    """An attention backend over the paged pool: built once per step from its metadata, then ``attend`` is
    called by every layer (``labkit.core.model.attention.Attention``). Register a subclass in
    ``labkit.core.attention.ATTENTION_BACKENDS`` or pass the class as ``LLM(..., attention_backend=MyBackend)``.
    Notebook 06.
    """

    name: ClassVar[str]

    def __init__(self, pool: PagedKVPool, meta: PagedAttentionMetadata) -> None:
        self.pool = pool
        self.meta = meta

    @classmethod
    def graph_decode(cls, pool: PagedKVPool, slot_mapping: torch.Tensor, tables: torch.Tensor,
                     context_lens: torch.Tensor) -> AttentionBackend:
        """The attention of a CUDA-graph decode step (``DecodeGraphs``, notebook 10): held in tensors whose shapes
        are fixed per (batch, table width) bucket. PyTorch's padded decode by default; a backend whose decode kernel
        can be captured returns its own, so that graph and eager decodes run the same kernel. slot_mapping (B,);
        tables (B, W) padded with the scratch block; context_lens (B,)."""
        return DecodeOnlyAttention(pool, slot_mapping, tables, context_lens)

    @abstractmethod
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write this step's K/V into their slots, then attend. q: (1, N, n_heads, d); k, v: (1, N, n_kv_heads, d)
        -> (1, N, n_heads, d)."""


def captures_own_decode(backend: type) -> bool:
    """Whether ``backend`` brings its own ``graph_decode`` (the "triton" kernel does), so that CUDA graphs capture
    its decode instead of bypassing it with labkit's PyTorch path."""
    own = getattr(backend, "graph_decode", None)
    return own is not None and own.__func__ is not PagedAttentionBackend.graph_decode.__func__
