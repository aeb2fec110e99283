"""Notebook 06's checkers pass labkit's BlockManager, fail planted bugs (by hand and inside the engine), and
report an untouched stub; the learner's class is the one the engine runs."""

from __future__ import annotations

import pytest
from planted_block_hashes import HashesThePartialBlock, NotChained

from labkit import LLM, BlockManager, SamplingParams
from labkit.core.kv.block_manager import hash_block
from labkit.course import use_or_reference
from labkit.course.ch06_paged_attention import check_block_hashes, check_slot


def test_slot_checker_passes_the_reference() -> None:
    result = check_slot(BlockManager)
    assert result.passed, result.message()


class OffByOne(BlockManager):
    def slot(self, seq, position):  # type: ignore[no-untyped-def]
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size + 1


class ForgetsBlockWidth(BlockManager):
    def slot(self, seq, position):  # type: ignore[no-untyped-def]
        return seq.block_table[position // self.block_size] + position % self.block_size


class IgnoresTheTable(BlockManager):
    def slot(self, seq, position):  # type: ignore[no-untyped-def]
        return position  # the contiguous layout: every sequence would write over the others


class SwapsBlockAndOffset(BlockManager):
    def slot(self, seq, position):  # type: ignore[no-untyped-def]
        table = seq.block_table
        return table[position % self.block_size % len(table)] * self.block_size + position // self.block_size


class WrongOnlyInTheEngine(BlockManager):
    """Right on the checker's hand-made tables, off by one on the engine's sequences: only the engine run sees it."""

    def slot(self, seq, position):  # type: ignore[no-untyped-def]
        return super().slot(seq, position) + int(hasattr(seq, "seq_id"))


@pytest.mark.parametrize("bug", [OffByOne, ForgetsBlockWidth, IgnoresTheTable, SwapsBlockAndOffset,
                                 WrongOnlyInTheEngine], ids=lambda c: c.__name__)
def test_slot_checker_fails_planted_bugs(bug: type[BlockManager]) -> None:
    result = check_slot(bug)
    assert result.status == "failed" and result.failures, bug.__name__


def test_slot_checker_names_the_wrong_slot() -> None:
    result = check_slot(OffByOne)
    assert "token 0 should be in slot 28, got 29" in result.failures[0]
    assert "differ from labkit's" in check_slot(WrongOnlyInTheEngine).failures[0]


def test_slot_stub_is_not_started_and_falls_back(capsys: pytest.CaptureFixture[str]) -> None:
    class Stub(BlockManager):
        def slot(self, seq, position):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    result = check_slot(Stub)
    assert result.status == "not started"
    assert use_or_reference(result, Stub, BlockManager) is BlockManager
    assert "uses labkit's reference labkit.core.kv.block_manager.BlockManager" in capsys.readouterr().out


def test_a_function_instead_of_a_class_is_explained() -> None:
    result = check_slot(lambda table, position, block_size: 0)  # type: ignore[arg-type]
    assert result.status == "failed" and "subclass of labkit.BlockManager" in result.failures[0]


def test_the_learners_slot_runs_inside_the_engine(bundled_path) -> None:  # type: ignore[no-untyped-def]
    calls: list[int] = []

    class Spy(BlockManager):
        def slot(self, seq, position):  # type: ignore[no-untyped-def]
            calls.append(position)
            return super().slot(seq, position)

    llm = LLM(str(bundled_path), engine="paged", block_size=4, num_gpu_blocks=16, block_manager_cls=Spy,
              prepare_inputs="loop")
    llm.generate([[1, 5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert calls == [0, 1, 2, 3, 4, 5, 6]  # the prompt, then one decode position per step


def test_block_hash_checker_passes_the_reference() -> None:
    result = check_block_hashes(BlockManager)
    assert result.passed, result.message()


def chained(token_ids: list[int], block_size: int, start: int = 0) -> list[int]:
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, tuple(token_ids[i * block_size + start:(i + 1) * block_size + start]))
        out.append(parent)
    return out


class OffByOneBoundaries(BlockManager):
    def block_hashes(self, token_ids):  # type: ignore[no-untyped-def]
        return chained(token_ids, self.block_size, start=1)


class NotChainedOnlyInTheEngine(NotChained):
    """Right by hand, unchained when prefix caching is on: only the engine run (hits, registered hashes) sees it."""

    def block_hashes(self, token_ids):  # type: ignore[no-untyped-def]
        return super().block_hashes(token_ids) if self.enable_prefix_caching else chained(token_ids, self.block_size)


@pytest.mark.parametrize("bug", [NotChained, HashesThePartialBlock, OffByOneBoundaries, NotChainedOnlyInTheEngine],
                         ids=lambda c: c.__name__)
def test_block_hash_checker_fails_planted_bugs(bug: type[BlockManager]) -> None:
    result = check_block_hashes(bug)
    assert result.status == "failed" and result.failures, bug.__name__


def test_block_hash_checker_compares_the_prefix_cache_with_labkits() -> None:
    failures = check_block_hashes(NotChainedOnlyInTheEngine).failures
    assert any("prompt tokens in the prefix cache with your hashes" in f for f in failures)
    assert any("registered" in f for f in failures)


def test_block_hash_stub_is_not_started() -> None:
    class Stub(BlockManager):
        def block_hashes(self, token_ids):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    assert check_block_hashes(Stub).status == "not started"
