"""The PyTorch attention backend (``"torch"``): gathers blocks and calls PyTorch's scaled-dot-product attention.

The readable reference: decodes attend together through ``labkit.core.attention.decode``; each prefill (chunk)
gathers its cached prefix and attends causally over cache + new tokens. vLLM's kernels read blocks in
place instead (notebook 11 writes one). Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.core.attention.decode import (
    DecodeSplit,
    UniformDecode,
    split_decode_attention,
    split_decode_blocks,
    split_host_ints,
    uniform_decode_attention,
)
from labkit.core.attention.metadata import PagedAttentionBackend, PagedAttentionMetadata
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model.attention import sdpa


@dataclass
class PrefillSlice:
    """One prefill (chunk) of a ragged step: where its new tokens sit and what it attends to."""

    start: int  # index of its first new token in the step's N tokens
    num_new: int
    context_len: int  # cached + new tokens
    table: torch.Tensor | None = None  # block ids holding the context; None when nothing was cached before
    mask: torch.Tensor | None = None  # (num_new, context_len) causal over cache + new


class TorchAttentionBackend(PagedAttentionBackend):
    """Attention backend ``"torch"``: paged attention in PyTorch for one step's ragged batch. Notebook 06.

    Sequences with one new token (decodes) attend together, block by block (``split_decode_attention``), or
    with one gather when their lengths are equal (``uniform_decode_attention``: one sequence, for instance);
    each prefill (chunk) attends on its own to its cached prefix plus its new tokens, causally. Everything
    that only depends on the step (block indices, masks) is built once here and reused by every layer.
    """

    name = "torch"

    def __init__(self, pool: PagedKVPool, meta: PagedAttentionMetadata) -> None:
        super().__init__(pool, meta)
        self.block_size = pool.block_size
        device = pool.device
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        self.num_tokens = starts[-1]
        decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
        prefill_rows = [i for i, n in enumerate(meta.query_lens) if n != 1]
        # Every small index tensor of the step is built on the host and moved to the device in one copy (pinned,
        # non-blocking on CUDA); each piece is a view of it. One list of ints per piece, in this order:
        pieces: list[list[int]] = []
        uniform = False
        if decode_rows and prefill_rows:  # where each decode's token sits among the step's N tokens
            pieces.append([starts[i] for i in decode_rows])
        if decode_rows:
            lens = [meta.context_lens[i] for i in decode_rows]
            uniform = len(set(lens)) == 1  # nothing would be padded: one gather and plain attention
            if uniform:
                n = -(-lens[0] // self.block_size)
                pieces.append([b for i in decode_rows for b in meta.block_tables[i][:n]])
        cached = [i for i in prefill_rows if meta.context_lens[i] != meta.query_lens[i]]  # prefills onto a cache
        for i in cached:
            pieces.append(meta.block_tables[i][: -(-meta.context_lens[i] // self.block_size)])
        views = iter(split_host_ints(pieces, device))
        self.decode_token_idx = next(views) if decode_rows and prefill_rows else None
        self.decode: DecodeSplit | UniformDecode | None = None
        if uniform:
            self.decode = UniformDecode(next(views), meta.context_lens[decode_rows[0]])
        elif decode_rows:  # once per step, for every layer
            k_pool = pool.k[0]  # (num_blocks, block_size, n_kv, d)
            self.decode = split_decode_blocks([meta.block_tables[i] for i in decode_rows],
                                              [meta.context_lens[i] for i in decode_rows],
                                              self.block_size, k_pool.shape[2], k_pool.dtype, device)
        self.prefills: list[PrefillSlice] = []
        for i in prefill_rows:
            n, ctx = meta.query_lens[i], meta.context_lens[i]
            if ctx == n:  # nothing cached before this chunk
                self.prefills.append(PrefillSlice(starts[i], n, ctx))
                continue
            q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]  # new tokens sit at the end
            mask = torch.arange(ctx, device=device)[None, :] <= q_pos  # (n, ctx): causal over cache + new
            self.prefills.append(PrefillSlice(starts[i], n, ctx, next(views), mask))
        self.only_decodes = not self.prefills

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (1, N, n_heads, d); k, v: (1, N, n_kv_heads, d) -- every sequence's new tokens, concatenated
        k_pool, v_pool = self.pool.k[layer_idx], self.pool.v[layer_idx]
        k_pool.flatten(0, 1)[self.meta.slot_mapping] = k[0]  # write new K/V into their slots
        v_pool.flatten(0, 1)[self.meta.slot_mapping] = v[0]
        if self.only_decodes:
            return self._attend_decodes(q[0], k_pool, v_pool)[None]
        out = torch.empty_like(q)  # (1, N, n_heads, d)
        if self.decode is not None:
            assert self.decode_token_idx is not None
            out[0, self.decode_token_idx] = self._attend_decodes(q[0, self.decode_token_idx], k_pool, v_pool)
        for p in self.prefills:
            new = slice(p.start, p.start + p.num_new)
            if p.table is None:  # its own K/V are all it attends to: plain causal attention, no gather
                out[:, new] = sdpa(q[:, new], k[:, new], v[:, new], mask=None, is_causal=True)
                continue
            keys = k_pool.index_select(0, p.table).flatten(0, 1)[None, : p.context_len]  # (1, ctx, n_kv, d)
            values = v_pool.index_select(0, p.table).flatten(0, 1)[None, : p.context_len]
            out[:, new] = sdpa(q[:, new], keys, values, mask=p.mask, is_causal=False)
        return out

    def _attend_decodes(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        # q: (B_decode, n_heads, d)
        if isinstance(self.decode, UniformDecode):
            return uniform_decode_attention(q, k_pool, v_pool, self.decode)
        assert self.decode is not None
        return split_decode_attention(q, k_pool, v_pool, self.decode)
