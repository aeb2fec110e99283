"""Notebook 11 for every laptop: the PyTorch twin of the kernel's two parts runs under the same checker as the Triton
parts, with no triton import. The checker passes labkit's twin parts, fails the same planted mistakes with the same
messages, reports a stub as not started, and the engine runs the learner's twin parts."""

from __future__ import annotations

import re

import pytest
import torch

from labkit.course import CheckResult
from labkit.course.ch11_attention_kernels import check_attend_tile, check_merge_splits
from labkit.course.ch11_torch_twin import (
    TwinAttentionBackend,
    attend_tile,
    merge_splits,
    paged_decode_twin,
    twin_backend,
)
from labkit.measure.attention_bytes import DecodeAttentionShape, paged_batch, torch_split


def assert_one_failure_matching(result: CheckResult, expected: str) -> None:
    assert not result.passed and len(result.failures) == 1, result.message()
    assert re.search(expected, result.failures[0]), result.failures[0]


def test_twin_matches_labkits_split_path_for_any_split_count() -> None:
    data = paged_batch(DecodeAttentionShape(3, 70, 8, 2, 32, block_size=8, dtype=torch.float32), torch.device("cpu"))
    want = torch_split(data)()
    for splits in (1, 2, 5):
        got = paged_decode_twin(data.q, data.k_pool, data.v_pool, data.block_tables, data.context_lens, splits)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_twin_parts_pass_the_same_checker() -> None:
    for result in (check_attend_tile(attend_tile, twin=True), check_merge_splits(merge_splits, twin=True)):
        assert result.passed, result.message()


def tile_no_rescale(q, m_i, l_i, acc, pos, valid, table, k_pool, v_pool, scale, block_size):  # type: ignore[no-untyped-def]
    block = table[torch.where(valid, pos // block_size, 0)]
    k, v = k_pool[block, pos % block_size].float(), v_pool[block, pos % block_size].float()
    scores = torch.where(valid[None, :], (q @ k.T) * scale, float("-inf"))
    m_new = torch.maximum(m_i, scores.max(1).values)
    alpha = torch.exp(m_i - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l_i + p.sum(1), acc * alpha[:, None] + p @ v  # BUG: the running sum is not rescaled


def tile_table_off_by_one(q, m_i, l_i, acc, pos, valid, table, k_pool, v_pool, scale, block_size):  # type: ignore[no-untyped-def]
    shifted = torch.cat([table[1:], table[:1]])  # BUG: the next entry of the table
    return attend_tile(q, m_i, l_i, acc, pos, valid, shifted, k_pool, v_pool, scale, block_size)


def tile_no_mask(q, m_i, l_i, acc, pos, valid, table, k_pool, v_pool, scale, block_size):  # type: ignore[no-untyped-def]
    block = table[torch.where(valid, pos // block_size, 0)]
    zero = valid[:, None].float()  # masked loads give K = V = 0, as in the Triton kernel
    k, v = k_pool[block, pos % block_size].float() * zero, v_pool[block, pos % block_size].float() * zero
    scores = (q @ k.T) * scale  # BUG: positions past the end keep a score (of 0)
    m_new = torch.maximum(m_i, scores.max(1).values)
    alpha = torch.exp(m_i - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l_i * alpha + p.sum(1), acc * alpha[:, None] + p @ v


def merge_unweighted_sums(o_parts, m_parts, l_parts):  # type: ignore[no-untyped-def]
    w = torch.exp(m_parts - m_parts.max(0).values[None, :])
    return (o_parts * w[:, :, None]).sum(0) / l_parts.sum(0)[:, None]  # BUG: l not weighted


def merge_without_the_max(o_parts, m_parts, l_parts):  # type: ignore[no-untyped-def]
    w = torch.exp(m_parts)  # BUG: exp of the raw maxima overflows for large scores
    return (o_parts * w[:, :, None]).sum(0) / (l_parts * w).sum(0)[:, None]


def merge_normalises_each_split(o_parts, m_parts, l_parts):  # type: ignore[no-untyped-def]
    w = torch.exp(m_parts - m_parts.max(0).values[None, :]) * l_parts  # (S, G)
    return ((o_parts / l_parts[:, :, None]) * w[:, :, None]).sum(0) / w.sum(0)[:, None]  # BUG: 0 / 0 when empty


@pytest.mark.parametrize("bug,expected", [
    (tile_no_rescale, "three tiles in one split.*must shrink by the same factor"),
    (tile_table_off_by_one, "one tile.*table\\[pos // BLOCK_SIZE \\+ 1\\].*off-by-one"),
    (tile_no_mask, "one tile.*positions past the context's end scoring 0"),
])
def test_twin_inner_loop_mistakes_fail_with_their_message(bug, expected: str) -> None:  # type: ignore[no-untyped-def]
    assert_one_failure_matching(check_attend_tile(bug, twin=True), expected)


@pytest.mark.parametrize("bug,expected", [
    (merge_unweighted_sums, "two splits.*common max"),
    (merge_without_the_max, "scores hundreds apart.*(inf or nan|overflows)"),
    (merge_normalises_each_split, "an empty split.*must weigh nothing, and nothing may divide by a split's own sum"),
])
def test_twin_merge_mistakes_fail_with_their_message(bug, expected: str) -> None:  # type: ignore[no-untyped-def]
    assert_one_failure_matching(check_merge_splits(bug, twin=True), expected)


def test_twin_stubs_are_not_started() -> None:
    def attend_tile(q, m_i, l_i, acc, pos, valid, table, k_pool, v_pool, scale, block_size):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def merge_splits(o_parts, m_parts, l_parts):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    assert check_attend_tile(attend_tile, twin=True).status == "not started"
    assert check_merge_splits(merge_splits, twin=True).status == "not started"


def test_the_learners_twin_parts_are_the_ones_the_engine_runs() -> None:
    backend = twin_backend(tile_fn=tile_no_rescale, merge_fn=merge_unweighted_sums)
    assert issubclass(backend, TwinAttentionBackend)
    assert backend.tile_fn is tile_no_rescale and backend.merge_fn is merge_unweighted_sums
    assert twin_backend().tile_fn is attend_tile


def test_without_triton_the_checker_takes_the_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    """A laptop with no triton wheel: the default (``twin=None``) checks the learner's PyTorch parts."""
    import labkit.core.attention as attention

    monkeypatch.setattr(attention, "triton_missing", lambda: "No module named 'triton'")
    assert attention.TRITON_MISSING is not None
    assert check_merge_splits(merge_splits).passed
    assert check_attend_tile(tile_no_rescale).status == "failed"
