"""The Triton paged decode-attention kernel: split-KV flash decoding, one GQA group per program.

Stage 1 (``paged_decode_stage1``): program (sequence b, KV head, split s) takes the query heads that share that KV
head (its GQA group, padded to max(16, next power of two) rows: ``tl.dot`` needs at least 16), walks its share of
the sequence's context tile by tile, reading each position's K/V *in place* through the block table, and keeps an
online softmax: a running max ``m``, a running sum ``l`` and an unnormalised output ``acc``. It writes them as the
split's partial result. Stage 2 (``paged_decode_stage2``): program (b, KV head) merges its group's partials with the
log-sum-exp rule.

The two parts a learner writes in notebook 11 are device functions, passed to the kernels as ``constexpr``
arguments: ``attend_tile`` (the inner loop's body) and ``merge_splits`` (stage 2's arithmetic). They are written
here as plain functions (so they read, and can be shown, like any Python function); the launcher wraps them in
``triton.jit``.
Every product and sum runs in float32: Triton's CPU interpreter computes bfloat16 arithmetic wrongly, and float32
keeps the softmax's sums accurate on a GPU. There ``tl.dot`` rounds its float32 inputs to TF32 by default: exact for
``q @ K^T`` when queries and K/V are bfloat16 (TF32 keeps bfloat16's 8-bit exponent and more than its 7-bit
mantissa), but not for ``p @ V``, whose probabilities ``p`` are float32 and lose bits in TF32. So the launcher sets
the precision every ``tl.dot`` here compiles with from the pool's dtype (``triton_decode.dot_precision``): IEEE
float32 for a float32 pool, TF32 for a 16-bit one (whose output is rounded more coarsely than TF32 rounds ``p``).
``NUM_SPLITS`` is a compile-time constant: the launcher buckets it to a power of two, one compilation per bucket.
Introduced in notebook 11 (``11_attention_kernels``).
"""

from __future__ import annotations

import triton
import triton.language as tl


def attend_tile(q, m_i, l_i, acc, pos, valid, table_row, k_head, v_head, stride_slot, offs_d, d_valid, scale,
                BLOCK_SIZE):
    """One tile of context positions ``pos`` (BLOCK_N,): find their slots through the block table, read K and V,
    update the online softmax. q (G, D) float32; m_i, l_i (G,); acc (G, D). Returns the new (m_i, l_i, acc).
    Notebook 11."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)  # (BLOCK_N,) pool block of each position
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # (BLOCK_N,) its slot in the flat pool
    kv_mask = valid[:, None] & d_valid[None, :]  # (BLOCK_N, D)
    k = tl.load(k_head + slot[:, None] * stride_slot + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    v = tl.load(v_head + slot[:, None] * stride_slot + offs_d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    scores = tl.dot(q, tl.trans(k)) * scale  # (G, BLOCK_N)
    scores = tl.where(valid[None, :], scores, float("-inf"))  # positions past the split's end count for nothing
    m_new = tl.maximum(m_i, tl.max(scores, 1))  # (G,) finite: every tile holds >= 1 valid position
    alpha = tl.exp(m_i - m_new)  # (G,) rescales what was summed under the old max (0 on the first tile)
    p = tl.exp(scores - m_new[:, None])  # (G, BLOCK_N)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v)  # (G, D)
    return m_new, l_i, acc


def merge_splits(o_parts, m_parts, l_parts):
    """Stage 2 for one GQA group: the splits' unnormalised outputs o (S, G, D), maxima m (S, G) and sums l (S, G)
    -> the attention output (G, D). An empty split has m = -inf and l = 0 (its weight is 0). Notebook 11."""
    big_m = tl.max(m_parts, 0)  # (G,) the largest max: finite, split 0 always holds the first position
    w = tl.exp(m_parts - big_m[None, :])  # (S, G) each split's weight, <= 1 (no overflow)
    return tl.sum(o_parts * w[:, :, None], 0) / tl.sum(l_parts * w, 0)[:, None]


@triton.jit
def paged_decode_stage1(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, mid_o, mid_m, mid_l, scale,
                        stride_q_seq, stride_table, stride_slot,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        ATTEND_TILE: tl.constexpr):
    """Grid (B, n_kv_heads, NUM_SPLITS). q (B, n_heads, D); K/V pools (num_blocks, BLOCK_SIZE, n_kv, D); tables
    (B, W) int32; lens (B,) int32; partials mid_o (B, n_heads, NUM_SPLITS, D), mid_m and mid_l (B, n_heads,
    NUM_SPLITS) float32."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)  # the group's query heads, padded to max(16, pow2): tl.dot needs 16 rows
    offs_d = tl.arange(0, D_PAD)
    g_valid, d_valid = offs_g < GROUP, offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # (G,) query head h reads KV head h // GROUP
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * HEAD_DIM + offs_d[None, :],
                mask=g_valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32)  # (G, D)
    context_len = tl.load(lens_ptr + seq)
    per_split = (context_len + NUM_SPLITS - 1) // NUM_SPLITS
    split_len = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # whole tiles per split
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)  # start >= end: an empty split (a short sequence)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    table_row = table_ptr + seq * stride_table
    k_head, v_head = k_ptr + kv_head * HEAD_DIM, v_ptr + kv_head * HEAD_DIM
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)  # (BLOCK_N,) context positions of this tile
        m_i, l_i, acc = ATTEND_TILE(q, m_i, l_i, acc, pos, pos < end, table_row, k_head, v_head, stride_slot,
                                    offs_d, d_valid, scale, BLOCK_SIZE)
    row = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split  # (G,) index into (B, n_heads, S)
    tl.store(mid_m + row, m_i, mask=g_valid)
    tl.store(mid_l + row, l_i, mask=g_valid)
    tl.store(mid_o + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=g_valid[:, None] & d_valid[None, :])


@triton.jit
def paged_decode_stage2(mid_o, mid_m, mid_l, out_ptr, stride_out_seq, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        SPLITS_PAD: tl.constexpr, MERGE: tl.constexpr):
    """Grid (B, n_kv_heads): merge one GQA group's NUM_SPLITS partials into out (B, n_heads, D)."""
    seq, kv_head = tl.program_id(0), tl.program_id(1)
    offs_s, offs_g, offs_d = tl.arange(0, SPLITS_PAD), tl.arange(0, GROUP_PAD), tl.arange(0, D_PAD)
    heads = kv_head * GROUP + offs_g  # (G,)
    s_valid, g_valid, d_valid = offs_s < NUM_SPLITS, offs_g < GROUP, offs_d < HEAD_DIM
    sg_valid = s_valid[:, None] & g_valid[None, :]  # (S, G)
    row = (seq * tl.num_programs(1) * GROUP + heads[None, :]) * NUM_SPLITS + offs_s[:, None]  # (S, G)
    m_parts = tl.load(mid_m + row, mask=sg_valid, other=float("-inf"))  # (S, G) padded splits: weight 0
    l_parts = tl.load(mid_l + row, mask=sg_valid, other=0.0)
    o_parts = tl.load(mid_o + row[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                      mask=sg_valid[:, :, None] & d_valid[None, None, :], other=0.0)  # (S, G, D)
    # Padded heads (never stored) get a finite max and a nonzero sum, so that they compute 0, not 0 / 0.
    m_parts = tl.where(g_valid[None, :], m_parts, 0.0)
    l_parts = tl.where(g_valid[None, :], l_parts, 1.0)
    out = MERGE(o_parts, m_parts, l_parts)  # (G, D)
    tl.store(out_ptr + seq * stride_out_seq + heads[:, None] * HEAD_DIM + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_valid[:, None] & d_valid[None, :])
