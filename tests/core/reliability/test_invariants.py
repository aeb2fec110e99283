"""Invariant checks: the test suite runs the paged engines in debug mode (the block manager's books checked
after every step), debug mode catches broken books and raises the engine bug as itself rather than failing a
request, and the suite's memory check (``assert_memory_returned``) catches a leaked KV block.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import assert_memory_returned

from .reliability_common import PAGED, PROMPTS, greedy, make


def test_the_suite_runs_paged_engines_in_debug_mode(tiny: Path) -> None:
    assert os.environ.get("LABKIT_DEBUG_CHECKS") == "1"
    assert all(make(tiny, e).engine.config.debug_checks for e in PAGED)  # type: ignore[attr-defined]
    assert not make(tiny, "chunked", debug_checks=False).engine.config.debug_checks  # type: ignore[attr-defined]


def test_debug_mode_catches_broken_books_and_is_not_swallowed(tiny: Path) -> None:
    llm = make(tiny, "chunked", block_size=2)
    llm.add_request(PROMPTS[0], greedy(6))
    llm.step()
    bm = llm.engine.block_manager  # type: ignore[attr-defined]
    block = bm.blocks[bm.free_block_ids[0]]
    block.ref_count += 1  # a leak: taken by nobody
    with pytest.raises(AssertionError, match=rf"block {block.block_id}: ref_count 1, free=True"):
        llm.step()  # an engine bug must surface as itself, never as a failed request
    block.ref_count -= 1
    llm.engine.abort_all()


def test_the_memory_check_catches_a_leaked_block(tiny: Path) -> None:
    llm = make(tiny, "paged", block_size=2)
    llm.generate(PROMPTS[0], greedy(3), use_tqdm=False)
    bm = llm.engine.block_manager  # type: ignore[attr-defined]
    leaked = bm._take_free_block()
    with pytest.raises(AssertionError, match="still holds 1 of"):
        assert_memory_returned([llm])
    bm._release(leaked)
    assert_memory_returned([llm])
