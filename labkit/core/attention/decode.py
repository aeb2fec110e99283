"""Decode attention over the paged pool, in three forms (one new token per sequence).

``decode_attention`` pads every sequence's blocks to the widest block table and runs one masked SDPA:
its shapes depend only on the batch size, so a CUDA graph can replay it (notebook 10), but a short
sequence next to a long one pays for the padding. ``split_decode_attention`` pads nothing: it attends
to each (sequence, block) pair on its own and then merges the pairs of a sequence exactly, with the
log-sum-exp trick. That is flash-decoding's split-and-combine, and it is close to what vLLM's paged
kernel does when it reads blocks in place. ``uniform_decode_attention`` serves equal lengths (one
sequence, for instance) with one gather. Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model.attention import sdpa


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``. On CUDA: from pinned memory, without making the host wait for the device's queue
    (a copy from ordinary memory blocks until the GPU is idle). On the CPU: the tensor itself, no copy."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def split_host_ints(pieces: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Lists of ints -> int64 tensors on ``device``, moved in one copy (each result is a view of it)."""
    if not pieces:
        return []
    sizes = [len(p) for p in pieces]
    flat = host_to_device(torch.tensor(list(chain.from_iterable(pieces)), dtype=torch.long), device)  # (sum,)
    return list(flat.split(sizes))


def decode_mask(tables: torch.Tensor, block_size: int, context_lens: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, S) boolean: which of the gathered slots hold a sequence's context (padding blocks do not)."""
    k_pos = torch.arange(tables.shape[1] * block_size, device=tables.device)  # (S,)
    return (k_pos[None, :] < context_lens[:, None])[:, None, None, :]


def folded_decode_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor:
    """One new token per sequence, GQA folded into the query dimension: q (B, n_heads, d), keys and values
    (B, S, n_kv, d), mask broadcastable to (B, 1, 1, S) -> (B, n_heads, d).

    The G query heads that share a KV head become G query *positions* of that one head: the call has as many query
    heads as K/V heads, so no K/V head is repeated (``repeat_kv`` would copy each G times), and on CUDA the fused
    memory-efficient kernel, which takes a mask but not GQA, runs it. One token has no causal order among its heads,
    so the folding changes nothing but the layout.
    """
    b, n_heads, d = q.shape
    n_kv = keys.shape[2]
    q_folded = q.view(b, n_kv, n_heads // n_kv, d).transpose(1, 2)  # (B, G, n_kv, d): head kv * G + g -> (g, kv)
    out = sdpa(q_folded, keys, values, mask=mask, is_causal=False)  # (B, G, n_kv, d)
    return out.transpose(1, 2).reshape(b, n_heads, d)


def decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                     mask: torch.Tensor) -> torch.Tensor:
    """One new token per sequence, batched: q (B, n_heads, d) -> (B, n_heads, d).

    Shapes depend only on B and the table width, never on the data, so a CUDA graph can replay it. The GQA group is
    folded into the query dimension (``folded_decode_sdpa``), so the masked call needs no repeated K/V heads.
    """
    keys = k_pool[tables].flatten(1, 2)  # (B, S, n_kv, d): gather each sequence's blocks
    values = v_pool[tables].flatten(1, 2)
    return folded_decode_sdpa(q, keys, values, mask)  # (B, n_heads, d)


@dataclass
class DecodeSplit:
    """The (sequence, block) pairs a step's decodes read: P pairs, built once per step for every layer."""

    row: torch.Tensor  # (P,) the decode row (sequence) each pair belongs to
    block: torch.Tensor  # (P,) the pool block each pair reads
    bias: torch.Tensor  # (P * n_kv, 1, block_size) additive mask: 0 for slots that hold context, -inf past its end


def split_decode_blocks(block_tables: list[list[int]], context_lens: list[int], block_size: int, n_kv: int,
                        dtype: torch.dtype, device: torch.device) -> DecodeSplit:
    """One pair per block that holds context. NumPy does the index arithmetic: each torch op costs microseconds."""
    ctx = np.array(context_lens, dtype=np.int64)  # (B,)
    n_blocks = -(-ctx // block_size)  # (B,) blocks holding context (a table may own more)
    row = np.repeat(np.arange(len(ctx)), n_blocks)  # (P,)
    nth = np.arange(len(row)) - (np.cumsum(n_blocks) - n_blocks)[row]  # (P,) the block's place in its table
    block = np.fromiter(chain.from_iterable(t[:n] for t, n in zip(block_tables, n_blocks.tolist())), np.int64,
                        count=len(row))  # (P,)
    n_valid = np.minimum(ctx[row] - nth * block_size, block_size)  # (P,) slots that hold context
    past_end = np.where(np.arange(block_size) < n_valid[:, None], 0.0, -np.inf)  # (P, block_size)
    bias = np.repeat(past_end, n_kv, axis=0)[:, None, :]  # (P * n_kv, 1, block_size): same for every KV head
    bias = torch.from_numpy(bias.astype(np.float64 if dtype == torch.float64 else np.float32))
    index = host_to_device(torch.from_numpy(np.stack([row, block])), device)  # (2, P)
    return DecodeSplit(index[0], index[1], host_to_device(bias, device))


def split_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                           split: DecodeSplit) -> torch.Tensor:
    """One new token per sequence, no padding: q (B, n_heads, d) -> (B, n_heads, d).

    Each (sequence, block) pair gets its own small softmax: a max m, a sum l of exp(score - m) and an
    unnormalised output o = sum exp(score - m) v. A sequence's pairs then merge exactly: scale each by
    exp(m - M), with M the sequence's largest m, and divide the summed o by the summed l.
    """
    n_pairs, (b, n_heads, d), n_kv = split.row.shape[0], q.shape, k_pool.shape[2]
    dtype = split.bias.dtype  # float32 for 16-bit models: exp and sums need the range
    # Gather each pair's block with its KV heads first: (P, n_kv, block_size, d), one copy, no padding.
    keys = k_pool.transpose(1, 2).index_select(0, split.block).view(n_pairs * n_kv, -1, d).to(dtype)
    values = v_pool.transpose(1, 2).index_select(0, split.block).view(n_pairs * n_kv, -1, d).to(dtype)
    # Query heads h = kv * group + g share KV head kv (GQA): a free view puts each group next to its head.
    q_rows = q.index_select(0, split.row).view(n_pairs * n_kv, -1, d).to(dtype)  # (P * n_kv, group, d)
    scores = torch.baddbmm(split.bias, q_rows, keys.transpose(1, 2), alpha=d ** -0.5)  # (P * n_kv, group, bs)
    m = scores.amax(-1, keepdim=True)  # every block holds >= 1 context slot: finite
    p = scores.sub_(m).exp_()  # (P * n_kv, group, bs) in place; exp(-inf) = 0 past the context's end
    o = torch.bmm(p, values).view(n_pairs, n_heads, d)  # (P, n_heads, d) unnormalised
    total, m = p.sum(-1).view(n_pairs, n_heads), m.view(n_pairs, n_heads)  # (P, n_heads): l and m
    # Combine each sequence's pairs: M = its largest m, then weights exp(m - M) <= 1 (no overflow).
    rows = split.row[:, None].expand(n_pairs, n_heads)  # (P, n_heads)
    big_m = m.new_full((b, n_heads), float("-inf")).scatter_reduce_(0, rows, m, "amax")  # (B, n_heads)
    w = torch.exp(m - big_m.index_select(0, split.row))  # (P, n_heads)
    out = o.new_zeros(b, n_heads, d).index_add_(0, split.row, o * w[..., None])  # (B, n_heads, d)
    denom = total.new_zeros(b, n_heads).index_add_(0, split.row, total * w)  # (B, n_heads)
    return (out / denom[..., None]).to(q.dtype)


@dataclass
class UniformDecode:
    """Decodes that all hold the same number of tokens (always so for one sequence): nothing to pad."""

    table: torch.Tensor  # (B * n_blocks,) each sequence's blocks holding context, one sequence after the other
    context_len: int


def uniform_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             decode: UniformDecode) -> torch.Tensor:
    """One new token per sequence, equal context lengths: q (B, n_heads, d) -> (B, n_heads, d). One gather
    and one unmasked SDPA: a handful of operations, where the split form needs some thirty (small batches)."""
    b, n_kv, d = q.shape[0], k_pool.shape[2], k_pool.shape[3]
    keys = k_pool.index_select(0, decode.table).view(b, -1, n_kv, d)[:, : decode.context_len]  # (B, ctx, n_kv, d)
    values = v_pool.index_select(0, decode.table).view(b, -1, n_kv, d)[:, : decode.context_len]
    return sdpa(q[:, None], keys, values, mask=None, is_causal=False)[:, 0]


class DecodeOnlyAttention:
    """The attention of a CUDA-graph decode step: like a backend's ``attend``, but for a decode step held entirely in
    tensors (no Python lists), so that a CUDA
    graph can capture it once and replay it with new contents in the same buffers. Notebook 10."""

    def __init__(self, pool: PagedKVPool, slot_mapping: torch.Tensor, tables: torch.Tensor,
                 context_lens: torch.Tensor) -> None:
        self.pool = pool
        self.slot_mapping = slot_mapping  # (B,)
        self.tables = tables  # (B, max_blocks)
        self.context_lens = context_lens  # (B,)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (1, B, n_heads, d); k, v: (1, B, n_kv_heads, d)
        k_pool, v_pool = self.pool.k[layer_idx], self.pool.v[layer_idx]
        k_pool.flatten(0, 1)[self.slot_mapping] = k[0]
        v_pool.flatten(0, 1)[self.slot_mapping] = v[0]
        mask = decode_mask(self.tables, self.pool.block_size, self.context_lens)  # inside the graph: lengths change
        return decode_attention(q[0], k_pool, v_pool, self.tables, mask)[None]
