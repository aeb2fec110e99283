"""Notebook 11's Build tasks: the checkers pass labkit's kernel parts, fail the mistakes learners make (each named
by the probe that exposes it), report an untouched stub as not started, and the learner's parts are the ones the
engine runs."""

from __future__ import annotations

import re

import pytest

# labkit's Triton module first: on a machine without a GPU it chooses Triton's interpreter, which must happen
# before triton itself is imported.
pytest.importorskip("labkit.core.attention.triton_decode")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from labkit.core.attention.triton_decode import TritonAttentionBackend  # noqa: E402
from labkit.core.attention.triton_kernels import attend_tile, merge_splits  # noqa: E402
from labkit.course import CheckResult  # noqa: E402
from labkit.course.ch11_attention_kernels import check_attend_tile, check_merge_splits, kernel_backend  # noqa: E402


def test_reference_parts_pass() -> None:
    for result in (check_attend_tile(attend_tile), check_merge_splits(merge_splits)):
        assert result.passed, result.message()


def assert_one_failure_matching(result: CheckResult, expected: str) -> None:
    """The checker failed with exactly one message, and it names the mistake (``expected``, a regex)."""
    assert not result.passed and len(result.failures) == 1
    assert re.search(expected, result.failures[0]), result.failures[0]


# ---- mistakes learners make in the inner loop (each attend_tile with one step changed) ----
# The steps they get right are these device functions, each a piece of attend_tile as it is.

@triton.jit
def pool_kv(block, pos, valid, k_head, v_head, stride_slot, offs_d, d_valid, BLOCK_SIZE):  # type: ignore[no-untyped-def]
    """K and V (BLOCK_N, D) at each position's slot, given its pool block, in the pool's dtype."""
    slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_mask = valid[:, None] & d_valid[None, :]
    k = tl.load(k_head + slot[:, None] * stride_slot + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_head + slot[:, None] * stride_slot + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def float32_kv(table_row, pos, valid, k_head, v_head, stride_slot, offs_d, d_valid, BLOCK_SIZE):  # type: ignore[no-untyped-def]
    """The block-table lookup and the loads, right: K and V (BLOCK_N, D) in float32."""
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
    k, v = pool_kv(block, pos, valid, k_head, v_head, stride_slot, offs_d, d_valid, BLOCK_SIZE)
    return k.to(tl.float32), v.to(tl.float32)


@triton.jit
def rescaled_update(scores, m_i, l_i, acc, v):  # type: ignore[no-untyped-def]
    """The online-softmax update, right: what was summed under the old max shrinks by alpha."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


def tile_no_rescale(q, m_i, l_i, acc, pos, valid, table_row, k_head, v_head, stride_slot, offs_d, d_valid, scale,  # type: ignore[no-untyped-def]
                    BLOCK_SIZE):
    k, v = float32_kv(table_row, pos, valid, k_head, v_head, stride_slot, offs_d, d_valid, BLOCK_SIZE)
    scores = tl.where(valid[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i + tl.sum(p, 1)  # BUG: the running sum is not rescaled by alpha
    acc = acc * alpha[:, None] + tl.dot(p, v)
    return m_new, l_i, acc


def tile_table_off_by_one(q, m_i, l_i, acc, pos, valid, table_row, k_head, v_head, stride_slot, offs_d, d_valid,  # type: ignore[no-untyped-def]
                          scale, BLOCK_SIZE):
    block = tl.load(table_row + pos // BLOCK_SIZE + 1, mask=valid, other=0)  # BUG: the next entry of the table
    k, v = pool_kv(block, pos, valid, k_head, v_head, stride_slot, offs_d, d_valid, BLOCK_SIZE)
    k, v = k.to(tl.float32), v.to(tl.float32)
    scores = tl.where(valid[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
    return rescaled_update(scores, m_i, l_i, acc, v)


def tile_no_mask(q, m_i, l_i, acc, pos, valid, table_row, k_head, v_head, stride_slot, offs_d, d_valid, scale,  # type: ignore[no-untyped-def]
                 BLOCK_SIZE):
    k, v = float32_kv(table_row, pos, valid, k_head, v_head, stride_slot, offs_d, d_valid, BLOCK_SIZE)
    scores = tl.dot(q, tl.trans(k)) * scale  # BUG: positions past the end keep a score (of 0)
    return rescaled_update(scores, m_i, l_i, acc, v)


def tile_in_bfloat16(q, m_i, l_i, acc, pos, valid, table_row, k_head, v_head, stride_slot, offs_d, d_valid, scale,  # type: ignore[no-untyped-def]
                     BLOCK_SIZE):
    block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0)
    k, v = pool_kv(block, pos, valid, k_head, v_head, stride_slot, offs_d, d_valid, BLOCK_SIZE)  # BUG: pool dtype
    scores = tl.where(valid[None, :], tl.dot(q.to(k.dtype), tl.trans(k)) * scale, float("-inf"))
    return rescaled_update(scores, m_i, l_i, acc, v)


@pytest.mark.parametrize("bug,expected", [
    (tile_no_rescale, "three tiles in one split.*must shrink by the same factor"),
    (tile_table_off_by_one, "one tile.*table\\[pos // BLOCK_SIZE \\+ 1\\].*off-by-one"),
    (tile_no_mask, "one tile.*positions past the context's end scoring 0"),
    (tile_in_bfloat16, "a bfloat16 pool.*float32"),
])
def test_inner_loop_mistakes_fail_with_their_hint(bug, expected: str) -> None:  # type: ignore[no-untyped-def]
    assert_one_failure_matching(check_attend_tile(bug), expected)


# ---- mistakes in the merge ----

def merge_unweighted_sums(o_parts, m_parts, l_parts):  # type: ignore[no-untyped-def]
    big_m = tl.max(m_parts, 0)
    w = tl.exp(m_parts - big_m[None, :])
    return tl.sum(o_parts * w[:, :, None], 0) / tl.sum(l_parts, 0)[:, None]  # BUG: l not weighted


def merge_without_the_max(o_parts, m_parts, l_parts):  # type: ignore[no-untyped-def]
    w = tl.exp(m_parts)  # BUG: exp of the raw maxima overflows for large scores
    return tl.sum(o_parts * w[:, :, None], 0) / tl.sum(l_parts * w, 0)[:, None]


@pytest.mark.parametrize("bug,expected", [
    (merge_unweighted_sums, "two splits.*common max"),
    (merge_without_the_max, "scores hundreds apart.*(inf or nan|overflows)"),
])
def test_merge_mistakes_fail_with_their_hint(bug, expected: str) -> None:  # type: ignore[no-untyped-def]
    assert_one_failure_matching(check_merge_splits(bug), expected)


def test_stubs_are_not_started() -> None:
    def attend_tile(q, m_i, l_i, acc, pos, valid, table_row, k_head, v_head, stride_slot, offs_d, d_valid, scale,  # type: ignore[no-untyped-def]
                    BLOCK_SIZE):
        raise NotImplementedError

    def merge_splits(o_parts, m_parts, l_parts):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    assert check_attend_tile(attend_tile).status == "not started"
    assert check_merge_splits(merge_splits).status == "not started"


def test_a_failure_prints_the_hint_for_its_class_and_no_code() -> None:
    from labkit.course.ch11_attention_kernels import TILE_HINTS

    printed = check_attend_tile(tile_no_rescale).message()
    assert TILE_HINTS.by_failure["rescale"] in printed and TILE_HINTS.code not in printed
    assert "tl.load(" not in printed and "tl.exp(" not in printed, printed


def test_the_learners_parts_are_the_ones_the_backend_runs() -> None:
    backend = kernel_backend(tile_fn=tile_no_rescale, merge_fn=merge_unweighted_sums)
    assert issubclass(backend, TritonAttentionBackend)
    assert backend.tile_fn is tile_no_rescale and backend.merge_fn is merge_unweighted_sums
    assert kernel_backend().tile_fn is attend_tile  # nothing given: labkit's parts
