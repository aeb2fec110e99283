"""Coalescing a lagging stream (``AsyncLLM(coalesce=True)``, ``--stream-coalesce``): a consumer that fell behind
gets every delta waiting for it as one, with the same tokens and text in the same order; an error that was waiting
behind them still comes after them; a consumer that keeps up, or a server without the option, gets one token per
delta. float64, so scheduling never changes a token."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from labkit import LLM, SamplingParams
from labkit.core.sequence import Sequence
from labkit.measure.loadgen.runner import run_sync
from labkit.serving import AsyncLLM, TokenDelta
from labkit.serving.cli import parse_args

PROMPT = "Once upon a time"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("labkit-tiny", engine="chunked", dtype="float64", max_model_len=256, max_num_seqs=3)


@pytest.fixture(scope="module")
def offline(llm: LLM) -> tuple[list[int], str]:
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.text


def block_until(done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Hold the event loop (as a slow client's writes or a busy loop would) until ``done()``: tokens pile up."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the engine thread made no progress"
        time.sleep(0.005)


async def lagging(async_llm: AsyncLLM) -> list[TokenDelta]:
    # The engine waits after the first token until the consumer has read it, so the first read is that token alone
    # on any machine (a fast engine could otherwise have queued three before the consumer's first read).
    first_read = threading.Event()

    def hold(seqs: list[Sequence]) -> None:
        if any(s.num_output_tokens >= 1 for s in seqs):
            first_read.wait(60)

    async_llm.llm.engine.fault_hook = hold
    deltas = []
    try:
        async for delta in async_llm.generate(PROMPT, GREEDY):
            deltas.append(delta)
            if len(deltas) == 1:  # behind from the first token on: every later token waits for the next read
                first_read.set()
                block_until(lambda: not async_llm.llm.engine.has_unfinished_requests())
    finally:
        async_llm.llm.engine.fault_hook = None
    return deltas


@pytest.mark.parametrize("coalesce", [False, True])
def test_a_lagging_consumer_gets_the_same_tokens_in_fewer_deltas_only_when_asked(
        llm: LLM, offline: tuple[list[int], str], coalesce: bool) -> None:
    async_llm = AsyncLLM(llm, coalesce=coalesce).start()
    try:
        deltas = run_sync(lagging(async_llm))
    finally:
        async_llm.shutdown()
    tokens, text = offline
    assert [t for d in deltas for t in d.token_ids] == tokens
    assert "".join(d.text for d in deltas) == text
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].num_output_tokens == len(tokens) and deltas[-1].finish_reason == "length"
    counts = [d.num_output_tokens for d in deltas]
    assert counts == sorted(counts) and all(a.time <= b.time for a, b in zip(deltas, deltas[1:]))
    if coalesce:  # the first token, then the eleven that waited, as one
        assert [len(d.token_ids) for d in deltas] == [1, len(tokens) - 1]
    else:
        assert all(len(d.token_ids) == 1 for d in deltas)
    assert not llm.engine.has_unfinished_requests()


def test_an_error_waiting_behind_tokens_comes_after_them(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = llm.engine.step
    calls = {"n": 0}

    failed = threading.Event()

    def flaky_step():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 6:  # the prefill's token and four decodes, then the device fails
            failed.set()
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", flaky_step)
    async_llm = AsyncLLM(llm, coalesce=True).start()
    got: list[TokenDelta] = []

    async def main() -> None:
        async for delta in async_llm.generate(PROMPT, GREEDY):
            got.append(delta)
            block_until(failed.is_set)  # the four later tokens wait for the next read, the error behind them

    try:
        with pytest.raises(RuntimeError, match="device lost"):
            run_sync(main())
    finally:
        async_llm.shutdown()
    assert sum(len(d.token_ids) for d in got) == 5 and not any(d.finished for d in got)
    assert len(got) == 2  # the first token, then the four that waited, as one delta before the error


def test_merged_keeps_order_and_the_later_state() -> None:
    a = TokenDelta(7, [1], "Once", False, None, 3, 1, time=1.0)
    b = TokenDelta(7, [2, 3], " upon a", True, "length", 3, 3, time=2.0)
    m = a.merged(b)
    assert (m.token_ids, m.text, m.finished, m.finish_reason, m.num_output_tokens) == ([1, 2, 3], "Once upon a",
                                                                                        True, "length", 3)
    assert m.time == 1.0 and (a.token_ids, b.token_ids) == ([1], [2, 3])  # the oldest token's time; inputs kept


def test_the_option_is_off_by_default_and_named_on_the_command_line() -> None:
    assert not parse_args([]).stream_coalesce
    assert parse_args(["--stream-coalesce"]).stream_coalesce
    assert not parse_args(["--no-stream-coalesce"]).stream_coalesce
