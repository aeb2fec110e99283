"""The Triton paged decode kernel, run by Triton's CPU interpreter, equals softmax(q k^T / sqrt(d)) v over each
sequence's own context, read through its block table.

Tolerances: float32 pools within 1e-5 of a float64 reference (the kernel computes in float32); bfloat16 pools within
2e-2 (relative and absolute) of the float64 reference on the same bfloat16 inputs: the result is rounded once to
bfloat16 (steps of 2^-8 relative), so anything computed in bfloat16 inside the kernel would show far above it.
Every case loads its loop bounds from memory (the context lengths): the Triton / NumPy pair that crashes there
(Triton 3.6 with NumPy >= 2.4) fails every test here, which is why requirements.txt pins Triton 3.7.1.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

# labkit's Triton module first: on a machine without a GPU it chooses Triton's interpreter, which must happen
# before triton itself is imported.
pytest.importorskip("labkit.core.attention.triton_decode")

from labkit.core.attention.triton_decode import (  # noqa: E402
    default_num_splits,
    device_function,
    is_interpreting,
    paged_decode_attention,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]],
              context_lens: list[int]) -> torch.Tensor:
    """Per sequence and query head, in float64: its first context_len slots, on KV head h // group."""
    n_heads, n_kv = q.shape[1], k_pool.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (table, ctx) in enumerate(zip(tables, context_lens)):
        keys = k_pool[table].flatten(0, 1)[:ctx].double()  # (ctx, n_kv, d)
        values = v_pool[table].flatten(0, 1)[:ctx].double()
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            scores = keys[:, kv] @ q[i, h].double() / math.sqrt(q.shape[-1])  # (ctx,)
            out[i, h] = torch.softmax(scores, 0) @ values[:, kv]
    return out


def make_case(group: int, d: int, block_size: int, context_lens: list[int], dtype: torch.dtype, seed: int,
              n_kv: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """q, pools full of random values (a slot read by mistake shows) and shuffled tables, some with a spare block."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) + 1 for c in context_lens) + 2
    k_pool = (torch.randn(num_blocks, block_size, n_kv, d, generator=gen) * 2).to(dtype)
    v_pool = (torch.randn(num_blocks, block_size, n_kv, d, generator=gen) * 3).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block_size) + rng.randint(0, 1))] for c in context_lens]
    q = torch.randn(len(context_lens), group * n_kv, d, generator=gen).to(dtype)
    return q, k_pool, v_pool, tables


def run_kernel(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]],
               context_lens: list[int], **options: object) -> torch.Tensor:
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # (B, W)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return paged_decode_attention(q, k_pool, v_pool, padded, lens, max(context_lens), **options)  # type: ignore[arg-type]


def assert_matches(out: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == want.shape
    torch.testing.assert_close(out.double(), want, rtol=TOL[dtype], atol=TOL[dtype])


def test_runs_under_the_interpreter_on_this_cpu_machine() -> None:
    assert is_interpreting()  # labkit chose the interpreter before triton was imported: no GPU here


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_equals_softmax_attention(dtype: torch.dtype, group: int, d: int) -> None:
    """GQA groups 1, 3, 4 and 7 (Qwen2.5-0.5B's, padded to 16) by head_dim 32, 64 and 128; block sizes 8 and 16 in
    turn; one ragged batch of lengths 1, a block boundary, one past it, two blocks and a longer one."""
    block_size = 8 if (group + d // 32) % 2 else 16
    context_lens = [1, block_size, block_size + 1, 2 * block_size, 37 + group]
    q, k_pool, v_pool, tables = make_case(group, d, block_size, context_lens, dtype, seed=group * 1000 + d)
    out = run_kernel(q, k_pool, v_pool, tables, context_lens)
    assert_matches(out, reference(q, k_pool, v_pool, tables, context_lens), dtype)


@pytest.mark.parametrize("num_splits,block_n", [(1, 16), (3, 16), (5, 16), (2, 32), (8, 16)])
def test_any_number_of_splits_and_tile_width(num_splits: int, block_n: int) -> None:
    """One split (nothing to merge), an odd count (padded to a power of two in the merge), more splits than a short
    sequence has tiles (empty splits: m = -inf, l = 0), and a tile wider than a block."""
    context_lens = [3, 16, 70, 100, 1]
    q, k_pool, v_pool, tables = make_case(4, 32, 8, context_lens, torch.float32, seed=num_splits)
    out = run_kernel(q, k_pool, v_pool, tables, context_lens, num_splits=num_splits, block_n=block_n)
    assert_matches(out, reference(q, k_pool, v_pool, tables, context_lens), torch.float32)


def test_head_dim_not_a_power_of_two_and_one_kv_head() -> None:
    context_lens = [9, 24]
    q, k_pool, v_pool, tables = make_case(8, 48, 16, context_lens, torch.float32, seed=48, n_kv=1)
    assert_matches(run_kernel(q, k_pool, v_pool, tables, context_lens),
                   reference(q, k_pool, v_pool, tables, context_lens), torch.float32)


def test_sequences_sharing_blocks_and_far_apart_scores() -> None:
    """Prefix caching: tables share blocks. One block's scores are hundreds above the rest: exp must never overflow,
    in a tile (the running max) or in the merge (the largest split max)."""
    context_lens = [40, 33, 17]
    q, k_pool, v_pool, tables = make_case(2, 32, 8, context_lens, torch.float32, seed=7)
    tables[1][:2] = tables[0][:2]
    tables[2][:2] = tables[0][:2]
    k_pool[tables[0][1]] *= 60
    q = q * 10
    out = run_kernel(q, k_pool, v_pool, tables, context_lens, num_splits=3)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k_pool, v_pool, tables, context_lens), rtol=1e-4, atol=1e-4)


def test_device_functions_are_wrapped_once_and_anything_else_is_refused() -> None:
    def tile(*args: object) -> None:
        return None

    wrapped = device_function(tile, "tile_fn")
    assert wrapped is device_function(tile, "tile_fn") and wrapped.fn is tile
    assert device_function(wrapped, "tile_fn") is wrapped  # already @triton.jit: used as it is
    with pytest.raises(TypeError, match="tile_fn must be a Python function"):
        device_function(len, "tile_fn")


def test_splits_default_to_two_under_the_interpreter() -> None:
    cpu = torch.device("cpu")
    assert default_num_splits(64, 2, 4096, 16, cpu) == 2
    assert default_num_splits(1, 2, 10, 16, cpu) == 1  # one tile: nothing to split
