"""``split_decode_attention``: block-by-block decode attention over the paged pool, combined with the
log-sum-exp trick, equals plain softmax(q k^T / sqrt(d)) v over each sequence's own context; so does
``uniform_decode_attention`` (equal lengths), and ``TorchAttentionBackend`` picks the right one."""

from __future__ import annotations

import math
import random

import pytest
import torch

from labkit.core.attention import PagedAttentionMetadata, TorchAttentionBackend
from labkit.core.attention.decode import (
    DecodeSplit,
    UniformDecode,
    decode_attention,
    decode_mask,
    split_decode_attention,
    split_decode_blocks,
    uniform_decode_attention,
)
from labkit.core.kv.paged_pool import PagedKVPool

CPU = torch.device("cpu")


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]],
              context_lens: list[int]) -> torch.Tensor:
    """Per sequence, the straightforward way: its first context_len slots, each query head on its KV head."""
    n_heads, n_kv = q.shape[1], k_pool.shape[2]
    outs = []
    for i, (table, ctx) in enumerate(zip(tables, context_lens)):
        keys = k_pool[table].flatten(0, 1)[:ctx]  # (ctx, n_kv, d)
        values = v_pool[table].flatten(0, 1)[:ctx]
        heads = []
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            scores = keys[:, kv] @ q[i, h] / math.sqrt(q.shape[-1])  # (ctx,)
            heads.append(torch.softmax(scores, 0) @ values[:, kv])  # (d,)
        outs.append(torch.stack(heads))
    return torch.stack(outs)  # (B, n_heads, d)


def make_pool(num_blocks: int, block_size: int, n_kv: int, d: int, dtype: torch.dtype,
              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Large values everywhere: any slot past a context's end that leaks into the result shows.
    k_pool = torch.randn(num_blocks, block_size, n_kv, d, generator=gen, dtype=torch.float64) * 3
    v_pool = torch.randn(num_blocks, block_size, n_kv, d, generator=gen, dtype=torch.float64) * 100
    return k_pool.to(dtype), v_pool.to(dtype)


def random_batch(rng: random.Random, num_blocks: int, block_size: int,
                 context_lens: list[int]) -> list[list[int]]:
    """Tables with distinct blocks per sequence, in random order, some with a spare block past the context."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = []
    for ctx in context_lens:
        n = -(-ctx // block_size) + rng.randint(0, 1)
        tables.append([free.pop() for _ in range(n)])
    return tables


def run_split(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]],
              context_lens: list[int]) -> torch.Tensor:
    split = split_decode_blocks(tables, context_lens, k_pool.shape[1], k_pool.shape[2], k_pool.dtype, CPU)
    return split_decode_attention(q, k_pool, v_pool, split)


@pytest.mark.parametrize("n_heads,n_kv", [(8, 8), (8, 4), (8, 2), (8, 1), (4, 2)])
@pytest.mark.parametrize("block_size", [1, 4, 7, 16])
def test_equals_per_sequence_softmax_float64(n_heads: int, n_kv: int, block_size: int) -> None:
    rng = random.Random(block_size * 100 + n_kv)
    d = 8
    # Exact multiples of the block size, a single token, one slot past a block boundary, and longer ones.
    context_lens = [block_size, 2 * block_size, 1, block_size + 1, 3 * block_size - 1, 37, rng.randint(1, 60)]
    k_pool, v_pool = make_pool(200, block_size, n_kv, d, torch.float64, seed=block_size + n_kv)
    tables = random_batch(rng, 200, block_size, context_lens)
    q = torch.randn(len(context_lens), n_heads, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = run_split(q, k_pool, v_pool, tables, context_lens)
    assert out.shape == (len(context_lens), n_heads, d) and out.dtype == torch.float64
    torch.testing.assert_close(out, reference(q, k_pool, v_pool, tables, context_lens), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("context_len", [1, 5, 16, 17, 64])
def test_one_sequence(context_len: int) -> None:
    k_pool, v_pool = make_pool(20, 16, 2, 32, torch.float64, seed=context_len)
    tables = [[19, 3, 7, 11, 0][: -(-context_len // 16)]]
    q = torch.randn(1, 8, 32, dtype=torch.float64)
    torch.testing.assert_close(run_split(q, k_pool, v_pool, tables, [context_len]),
                               reference(q, k_pool, v_pool, tables, [context_len]), rtol=1e-12, atol=1e-10)


def test_sequences_sharing_blocks() -> None:
    """Prefix caching and parallel sampling: several tables name the same blocks, each reads them in full."""
    k_pool, v_pool = make_pool(12, 4, 2, 16, torch.float64, seed=3)
    tables = [[5, 6, 1], [5, 6, 2], [5, 6], [6], [5, 6, 1]]
    context_lens = [10, 12, 8, 3, 10]
    q = torch.randn(len(tables), 8, 16, dtype=torch.float64)
    out = run_split(q, k_pool, v_pool, tables, context_lens)
    torch.testing.assert_close(out, reference(q, k_pool, v_pool, tables, context_lens), rtol=1e-12, atol=1e-10)
    # The same query on the same context gives the same answer, wherever the row sits in the batch.
    q[4] = q[0]
    out = run_split(q, k_pool, v_pool, tables, context_lens)
    torch.testing.assert_close(out[4], out[0], rtol=0, atol=0)
    assert not torch.allclose(out[0], run_split(q, k_pool, v_pool, tables, [9, 12, 8, 3, 9])[0])


def test_blocks_far_apart_in_score_combine_without_overflow() -> None:
    """Scores of hundreds: exp(score) overflows, the per-block max and the log-sum-exp combine must not."""
    k_pool, v_pool = make_pool(8, 4, 1, 8, torch.float32, seed=5)
    k_pool[2] *= 50  # one block with far larger scores than the others
    tables, context_lens = [[0, 1, 2, 3], [2, 4], [4, 5]], [16, 7, 6]
    q = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(2)) * 20
    out = run_split(q, k_pool, v_pool, tables, context_lens)
    assert torch.isfinite(out).all()
    expected = reference(q.double(), k_pool.double(), v_pool.double(), tables, context_lens)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-3)


def test_matches_the_padded_decode_attention_float32() -> None:
    """The CUDA-graph path (padded tables, one masked SDPA) and the split path agree."""
    rng = random.Random(0)
    block_size = 16
    context_lens = [rng.randint(1, 300) for _ in range(16)] + [32, 1]
    k_pool, v_pool = make_pool(600, block_size, 2, 32, torch.float32, seed=9)
    tables = random_batch(rng, 600, block_size, context_lens)
    q = torch.randn(len(tables), 8, 32, generator=torch.Generator().manual_seed(9))  # own RNG: no order effects
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    mask = decode_mask(padded, block_size, torch.tensor(context_lens))
    expected = decode_attention(q, k_pool, v_pool, padded, mask)
    torch.testing.assert_close(run_split(q, k_pool, v_pool, tables, context_lens), expected, rtol=1e-4, atol=1e-4)


def test_bfloat16_pool_computes_in_float32_and_returns_bfloat16() -> None:
    k_pool, v_pool = make_pool(30, 8, 2, 16, torch.bfloat16, seed=4)
    rng = random.Random(4)
    context_lens = [1, 8, 50, 23]
    tables = random_batch(rng, 30, 8, context_lens)
    q = torch.randn(4, 4, 16).to(torch.bfloat16)
    split = split_decode_blocks(tables, context_lens, 8, 2, torch.bfloat16, CPU)
    assert split.bias.dtype == torch.float32
    out = split_decode_attention(q, k_pool, v_pool, split)
    assert out.dtype == torch.bfloat16
    expected = reference(q.double(), k_pool.double(), v_pool.double(), tables, context_lens)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=0.5)  # v is ~100: bf16 steps of ~0.5


def test_split_reads_only_the_blocks_that_hold_context() -> None:
    tables = [[4, 9, 2], [7], [3, 8, 1, 6]]  # the first and last tables own a spare block
    split = split_decode_blocks(tables, [8, 3, 9], block_size=4, n_kv=2, dtype=torch.float64, device=CPU)
    assert split.row.tolist() == [0, 0, 1, 2, 2, 2]
    assert split.block.tolist() == [4, 9, 7, 3, 8, 1]
    assert split.bias.shape == (6 * 2, 1, 4) and split.bias.dtype == torch.float64
    valid = (split.bias[::2, 0] == 0).sum(-1).tolist()  # context slots of each pair's block
    assert valid == [4, 4, 3, 4, 4, 1]
    assert torch.equal(split.bias[::2], split.bias[1::2])  # both KV heads see the same slots


@pytest.mark.parametrize("n_heads,n_kv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("batch,context_len", [(1, 1), (1, 16), (1, 37), (3, 16), (4, 29)])
def test_uniform_lengths_equal_per_sequence_softmax(n_heads: int, n_kv: int, batch: int, context_len: int) -> None:
    rng = random.Random(batch * 1000 + context_len)
    k_pool, v_pool = make_pool(60, 16, n_kv, 8, torch.float64, seed=context_len)
    tables = random_batch(rng, 60, 16, [context_len] * batch)  # some own a spare block past the context
    q = torch.randn(batch, n_heads, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    n = -(-context_len // 16)
    decode = UniformDecode(torch.tensor([b for t in tables for b in t[:n]]), context_len)
    torch.testing.assert_close(uniform_decode_attention(q, k_pool, v_pool, decode),
                               reference(q, k_pool, v_pool, tables, [context_len] * batch), rtol=1e-12, atol=1e-10)


@pytest.mark.parametrize("context_lens,kind", [([9], UniformDecode), ([9, 9, 9], UniformDecode),
                                               ([9, 10], DecodeSplit), ([3, 9, 9], DecodeSplit)])
def test_paged_attention_picks_the_form_and_both_agree(context_lens: list[int], kind: type) -> None:
    """A decode-only step through ``TorchAttentionBackend``: the new K/V land in their slots and each row attends to
    its own context, whichever form the step's lengths pick."""
    from labkit.core.model.config import ModelConfig

    config = ModelConfig(model_type="llama", vocab_size=16, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=64)
    pool = PagedKVPool(config, 30, 4, CPU, torch.float64)
    gen = torch.Generator().manual_seed(5)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen, dtype=torch.float64))
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen, dtype=torch.float64))
    tables = random_batch(random.Random(len(context_lens)), 30, 4, context_lens)
    slots = [t[(c - 1) // 4] * 4 + (c - 1) % 4 for t, c in zip(tables, context_lens)]  # each new token's slot
    meta = PagedAttentionMetadata([1] * len(tables), list(context_lens), tables, torch.tensor(slots))
    attention = TorchAttentionBackend(pool, meta)
    assert isinstance(attention.decode, kind)
    b = len(tables)
    q = torch.randn(1, b, 4, 8, generator=gen, dtype=torch.float64)
    k, v = torch.randn(1, b, 2, 8, generator=gen, dtype=torch.float64), torch.randn(1, b, 2, 8, generator=gen,
                                                                                   dtype=torch.float64)
    out = attention.attend(0, q, k, v)[0]
    torch.testing.assert_close(pool.k[0].flatten(0, 1)[slots], k[0], rtol=0, atol=0)
    torch.testing.assert_close(out, reference(q[0], pool.k[0], pool.v[0], tables, list(context_lens)),
                               rtol=1e-12, atol=1e-10)
