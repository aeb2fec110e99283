"""Notebook 11's kernel for every laptop: a PyTorch twin of the Triton split-KV decode kernel, program by program.

Triton has wheels for Linux only, so a learner on macOS or Windows writes the same two parts in PyTorch: the inner
loop ``attend_tile`` (one tile of the online softmax, read through the block table) and the merge ``merge_splits``
(the log-sum-exp rule). ``paged_decode_twin`` runs them exactly as the Triton kernel's grid does: one "program" per
(sequence, KV head, split), tiles of ``block_n`` positions, a partial (m, l, acc) per split, then the merge per
(sequence, KV head); the same probe cases and the same checker (``labkit.course.ch11_attention_kernels``) judge
both. The loops run in Python, so it is slow: it checks the math, not the speed. ``twin_backend`` puts the parts in
the engine (``LLM(..., attention_backend=...)``). Notebook 11 (``11_attention_kernels``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.core.attention.metadata import PagedAttentionMetadata
from labkit.core.attention.torch_sdpa import TorchAttentionBackend
from labkit.core.kv.paged_pool import PagedKVPool

TileFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
MergeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attend_tile(q: torch.Tensor, m_i: torch.Tensor, l_i: torch.Tensor, acc: torch.Tensor, pos: torch.Tensor,
                valid: torch.Tensor, table: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, scale: float,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile of context positions ``pos`` (BLOCK_N,) int64, ``valid`` (BLOCK_N,) bool: find their slots through
    the sequence's block ``table`` (W,), read K and V from this KV head's pools (num_blocks, block_size, D), update
    the online softmax. q (G, D) float32; m_i, l_i (G,); acc (G, D). Returns the new (m_i, l_i, acc). Notebook 11."""
    block = table[torch.where(valid, pos // block_size, 0)]  # (BLOCK_N,) pool block of each position (0: padding)
    k = k_pool[block, pos % block_size].float()  # (BLOCK_N, D), float32 like the Triton kernel
    v = v_pool[block, pos % block_size].float()
    scores = (q @ k.T) * scale  # (G, BLOCK_N)
    scores = torch.where(valid[None, :], scores, float("-inf"))  # positions past the split's end count for nothing
    m_new = torch.maximum(m_i, scores.max(1).values)  # (G,) finite: every tile holds >= 1 valid position
    alpha = torch.exp(m_i - m_new)  # (G,) rescales what was summed under the old max (0 on the first tile)
    p = torch.exp(scores - m_new[:, None])  # (G, BLOCK_N)
    return m_new, l_i * alpha + p.sum(1), acc * alpha[:, None] + p @ v


def merge_splits(o_parts: torch.Tensor, m_parts: torch.Tensor, l_parts: torch.Tensor) -> torch.Tensor:
    """The splits' unnormalised outputs o (S, G, D), maxima m (S, G) and sums l (S, G) -> the output (G, D). An empty
    split has m = -inf and l = 0 (its weight is 0). Notebook 11."""
    big_m = m_parts.max(0).values  # (G,) the largest max: finite, split 0 always holds the first position
    w = torch.exp(m_parts - big_m[None, :])  # (S, G) each split's weight, <= 1 (no overflow)
    return (o_parts * w[:, :, None]).sum(0) / (l_parts * w).sum(0)[:, None]


def paged_decode_twin(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, num_splits: int = 1, block_n: int = 16,
                      tile_fn: TileFn = attend_tile, merge_fn: MergeFn = merge_splits) -> torch.Tensor:
    """q (B, n_heads, D); pools (num_blocks, block_size, n_kv, D); block_tables (B, W); context_lens (B,) ->
    (B, n_heads, D) in q's dtype. The Triton kernel's grid in Python loops, with the same split bounds."""
    batch, n_heads, head_dim = q.shape
    n_kv, block_size = k_pool.shape[2], k_pool.shape[1]
    group, scale = n_heads // n_kv, head_dim ** -0.5
    out = torch.empty_like(q)
    for b in range(batch):
        context_len = int(context_lens[b])
        per_split = -(-context_len // num_splits)
        split_len = -(-per_split // block_n) * block_n  # whole tiles per split, as the kernel
        table = block_tables[b].long()
        for kv in range(n_kv):
            qg = q[b, kv * group:(kv + 1) * group].float()  # (G, D) the query heads that share KV head kv
            k_head, v_head = k_pool[:, :, kv], v_pool[:, :, kv]  # (num_blocks, block_size, D)
            parts = []
            for split in range(num_splits):
                start, end = split * split_len, min((split + 1) * split_len, context_len)
                m_i = torch.full((group,), float("-inf"), device=q.device)
                l_i = torch.zeros(group, device=q.device)
                acc = torch.zeros(group, head_dim, device=q.device)
                for tile in range(start, end, block_n):  # start >= end: an empty split, the loop never runs
                    pos = torch.arange(tile, tile + block_n, device=q.device)
                    m_i, l_i, acc = tile_fn(qg, m_i, l_i, acc, pos, pos < end, table, k_head, v_head, scale,
                                            block_size)
                parts.append((acc, m_i, l_i))
            o_parts, m_parts, l_parts = (torch.stack(x) for x in zip(*parts))  # (S, G, D), (S, G), (S, G)
            out[b, kv * group:(kv + 1) * group] = merge_fn(o_parts, m_parts, l_parts).to(q.dtype)
    return out


class TwinAttentionBackend(TorchAttentionBackend):
    """Attention backend running ``paged_decode_twin`` for decodes (prefill chunks take the PyTorch path): what a
    learner's twin parts run in inside the engine. Notebook 11."""

    name = "torch twin"
    tile_fn: TileFn = staticmethod(attend_tile)
    merge_fn: MergeFn = staticmethod(merge_splits)
    num_splits = 2  # two splits, so that the merge is exercised on every decode

    def __init__(self, pool: PagedKVPool, meta: PagedAttentionMetadata) -> None:
        super().__init__(pool, meta)
        rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
        lens = [meta.context_lens[i] for i in rows]
        width = max((-(-c // pool.block_size) for c in lens), default=1)
        tables = [meta.block_tables[i][:width] + [0] * (width - len(meta.block_tables[i][:width])) for i in rows]
        self.twin_tables = torch.tensor(tables, dtype=torch.long, device=pool.device).view(len(rows), width)
        self.twin_lens = torch.tensor(lens, dtype=torch.long)

    def _attend_decodes(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        # q: (B_decode, n_heads, d)
        return paged_decode_twin(q, k_pool, v_pool, self.twin_tables, self.twin_lens, self.num_splits, 16,
                                 type(self).tile_fn, type(self).merge_fn)


def twin_backend(tile_fn: TileFn | None = None, merge_fn: MergeFn | None = None) -> type:
    """The twin backend with the learner's parts in it (``LLM(..., attention_backend=...)``)."""
    parts = {k: staticmethod(v) for k, v in (("tile_fn", tile_fn), ("merge_fn", merge_fn)) if v is not None}
    return type("LearnersTwinAttention", (TwinAttentionBackend,), parts)
