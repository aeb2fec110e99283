"""Notebook 06's Task 2 checker names the actual fault first: a solution whose only fault is hashing the partial
last block (or an empty block after the last full one) is told exactly that, not sent to fix its chaining."""

from __future__ import annotations

import pytest
from planted_block_hashes import HashesThePartialBlock, NotChained

from labkit import BlockManager
from labkit.core.kv.block_manager import hash_block
from labkit.course.ch06_paged_attention import check_block_hashes, count_fault


class HashesOneBlockTooMany(BlockManager):
    """Chained correctly; loops over len // block_size + 1 blocks (a partial block, or an empty one)."""

    def block_hashes(self, token_ids):  # type: ignore[no-untyped-def]
        out, parent, bs = [], None, self.block_size
        for i in range(len(token_ids) // bs + 1):
            parent = hash_block(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
            out.append(parent)
        return out


class MissesTheLastFullBlock(BlockManager):
    def block_hashes(self, token_ids):  # type: ignore[no-untyped-def]
        return super().block_hashes(token_ids)[:-1]


@pytest.mark.parametrize("bug", [HashesThePartialBlock, HashesOneBlockTooMany], ids=lambda c: c.__name__)
def test_a_partial_block_bug_is_named_and_not_blamed_on_the_chaining(bug: type[BlockManager]) -> None:
    result = check_block_hashes(bug)
    assert result.status == "failed"
    assert "block" in result.failures[0] and ("partial last block" in result.failures[0]
                                              or "empty block" in result.failures[0]), result.failures
    assert not any("chain" in f or "parent" in f for f in result.failures), result.failures
    assert len(result.failures) == 1, result.failures  # one fault, one message: no cascade


def test_the_partial_block_message_gives_the_numbers() -> None:
    failures = check_block_hashes(HashesThePartialBlock).failures
    assert failures[0].startswith("9 tokens in blocks of 4 make 2 full block(s): expected 2 hash(es), got 3.")
    assert "partial last block (1 of 4 tokens)" in failures[0]


def test_a_missed_full_block_is_named() -> None:
    failures = check_block_hashes(MissesTheLastFullBlock).failures
    assert "misses full blocks" in failures[0]
    assert not any("chain" in f for f in failures), failures


def test_an_unchained_hash_is_still_told_to_chain() -> None:
    failures = check_block_hashes(NotChained).failures
    assert failures and "chain each hash to its parent" in failures[0]
    assert not any("partial" in f for f in failures), failures


@pytest.mark.parametrize(("num_tokens", "block_size", "num_hashes", "expect"), [
    (9, 4, 2, ""), (8, 4, 2, ""), (0, 4, 0, ""),
    (9, 4, 3, "partial last block (1 of 4 tokens)"), (8, 4, 3, "empty block"), (8, 4, 1, "misses full blocks"),
    (9, 4, 5, "a partial last block gets no hash"),
])
def test_count_fault(num_tokens: int, block_size: int, num_hashes: int, expect: str) -> None:
    fault = count_fault(num_tokens, block_size, num_hashes)
    assert (expect in fault and fault) if expect else fault == ""
