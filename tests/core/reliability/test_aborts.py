"""Aborts and disconnects, for every engine: aborting a running or a waiting request frees its KV memory and
leaves the other requests' outputs unchanged (aborting twice, or an unknown id, does nothing), and a stream that
is closed or dropped by its client frees its memory too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_memory_returned

from .reliability_common import ALL, PAGED, PROMPTS, Reference, greedy, make


@pytest.mark.parametrize("engine", ALL)
def test_abort_frees_memory_and_spares_the_others(tiny: Path, reference: Reference, engine: str) -> None:
    llm = make(tiny, engine, **({"block_size": 2} if engine in PAGED else {}))
    params = greedy(8)
    want = reference(PROMPTS[:4], [params] * 4)
    seqs = [llm.add_request(p, params)[0] for p in PROMPTS[:4]]
    for _ in range(3):
        llm.step()
    running, waiting = seqs[0], seqs[3]  # the first has started; the last has not (small batches)
    assert running.output_token_ids and not waiting.output_token_ids
    for seq in (running, waiting):
        assert llm.engine.abort_request(seq.seq_id) is seq
        assert seq.finish_reason.value == "abort" and not seq.block_table
        assert llm.engine.abort_request(seq.seq_id) is None  # twice: nothing left to abort
    assert llm.engine.abort_request(10**9) is None
    while llm.engine.has_unfinished_requests():
        llm.step()
    assert [s.output_token_ids for s in seqs[1:3]] == [w[0] for w in want[1:3]]
    assert running.output_token_ids == want[0][0][: len(running.output_token_ids)]
    assert_memory_returned([llm])


@pytest.mark.parametrize("engine", ALL)
def test_a_disconnected_stream_frees_its_memory(tiny: Path, engine: str) -> None:
    import gc

    llm = make(tiny, engine, **({"block_size": 2} if engine in PAGED else {}))
    for leave in ("close", "drop"):
        stream = llm.stream(PROMPTS[2], greedy(40))
        next(stream), next(stream)
        assert llm.engine.has_unfinished_requests()
        if engine in PAGED:
            assert llm.engine.block_manager.num_used_blocks > 0  # type: ignore[attr-defined]
        if leave == "close":
            stream.close()  # what a client disconnect or a `break` does
        else:
            del stream
            gc.collect()
        assert not llm.engine.has_unfinished_requests(), leave
        assert_memory_returned([llm])
