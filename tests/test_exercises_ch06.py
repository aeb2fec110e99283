"""Notebook 06's checkers pass labkit's reference, fail planted bugs, and report an untouched stub."""

from __future__ import annotations

from labkit.cache.block_manager import hash_block
from labkit.exercises import use_or_reference
from labkit.exercises.ch06 import check_block_hashes, check_slot, reference_slot, use_slot
from labkit.analysis.kv_memory import block_hashes


def stub(*args):  # type: ignore[no-untyped-def]
    raise NotImplementedError


def test_slot_checker_passes_the_reference() -> None:
    assert check_slot(reference_slot).passed


def test_slot_checker_fails_planted_bugs() -> None:
    def forgets_block_width(table, position, block_size):  # type: ignore[no-untyped-def]
        return table[position // block_size] + position % block_size

    def ignores_the_table(table, position, block_size):  # type: ignore[no-untyped-def]
        return position  # the contiguous layout: every sequence would write over the others

    def swaps_block_and_offset(table, position, block_size):  # type: ignore[no-untyped-def]
        return table[position % block_size % len(table)] * block_size + position // block_size

    for bug in (forgets_block_width, ignores_the_table, swaps_block_and_offset):
        result = check_slot(bug)
        assert result.status == "failed" and result.failures, bug.__name__


def test_slot_stub_is_not_started_and_falls_back(capsys) -> None:
    result = check_slot(stub)
    assert result.status == "not started"
    assert use_or_reference(result, stub, reference_slot) is reference_slot
    assert "uses labkit's reference" in capsys.readouterr().out


def test_use_slot_plugs_into_the_engine_and_back(bundled_path) -> None:
    from labkit import LLM

    llm = LLM(str(bundled_path), engine="paged", block_size=4, num_gpu_blocks=16)
    calls = []

    def spy(table, position, block_size):  # type: ignore[no-untyped-def]
        calls.append(position)
        return reference_slot(table, position, block_size)

    use_slot(llm, spy)
    llm.generate([[1, 5, 6, 7, 8]], use_tqdm=False)
    assert calls[:5] == [0, 1, 2, 3, 4]
    use_slot(llm, None)
    calls.clear()
    llm.generate([[1, 5, 6]], use_tqdm=False)
    assert calls == []


def test_block_hash_checker_passes_the_reference() -> None:
    assert check_block_hashes(block_hashes).passed


def test_block_hash_checker_fails_planted_bugs() -> None:
    def not_chained(token_ids, block_size):  # type: ignore[no-untyped-def]
        return [hash_block(None, tuple(token_ids[i * block_size:(i + 1) * block_size]))
                for i in range(len(token_ids) // block_size)]

    def hashes_the_partial_block(token_ids, block_size):  # type: ignore[no-untyped-def]
        out, parent = [], None
        for i in range(0, len(token_ids), block_size):
            parent = hash_block(parent, tuple(token_ids[i:i + block_size]))
            out.append(parent)
        return out

    def off_by_one(token_ids, block_size):  # type: ignore[no-untyped-def]
        out, parent = [], None
        for i in range(len(token_ids) // block_size):
            parent = hash_block(parent, tuple(token_ids[i * block_size + 1:(i + 1) * block_size + 1]))
            out.append(parent)
        return out

    for bug in (not_chained, hashes_the_partial_block, off_by_one):
        result = check_block_hashes(bug)
        assert result.status == "failed" and result.failures, bug.__name__


def test_block_hash_stub_is_not_started() -> None:
    assert check_block_hashes(stub).status == "not started"
