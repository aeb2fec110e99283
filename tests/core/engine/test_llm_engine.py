"""One request path: every front end runs requests through the engine's one add -> step loop (``Engine.run``).

``LLM.generate``, ``LLM.stream``, ``trace_request``, the profiler's ``drive`` and ``AsyncLLM`` must all step
the engine through ``llm.engine.step`` and agree token for token; leaving the loop by an exception must
leave no request (and no KV block) behind. float64 so scheduling never changes a token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import closing

import pytest
from conftest import assert_memory_returned

from labkit import LLM, SamplingParams
from labkit.core.engine.base import Engine, StepFailedError
from labkit.core.sequence import Sequence
from labkit.measure.loadgen.runner import run_sync
from labkit.measure.profiling import drive
from labkit.measure.profiling.request_trace import trace_request
from labkit.serving import AsyncLLM, TokenDelta

PROMPTS = ["Once upon a time", "The little fox"]
PARAMS = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),  # finishes by length
          SamplingParams(max_tokens=8, temperature=0.0, stop=[" "])]  # by a stop string
LONG = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("labkit-tiny", engine="chunked", dtype="float64", max_model_len=128, block_size=4, max_num_seqs=2)


@pytest.fixture
def steps(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts calls of ``llm.engine.step``: a front end with a loop of its own would not show up."""
    calls: list[int] = []
    real = llm.engine.step

    def counted() -> list[Sequence]:
        calls.append(1)
        return real()

    monkeypatch.setattr(llm.engine, "step", counted)
    yield calls
    assert_memory_returned([llm])


def test_every_front_end_runs_the_one_loop_and_agrees(llm: LLM, steps: list[int]) -> None:
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    want = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]
    assert [w[2] for w in want] == ["length", "stop"]
    assert steps, "generate did not step the engine"

    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        steps.clear()
        assert "".join(llm.stream(prompt, params)) == want[i][1] and steps, f"stream, prompt {i}"
        steps.clear()
        trace = trace_request(llm, prompt, params)
        assert (trace.output_token_ids, trace.text, trace.finish_reason) == want[i] and steps, f"trace, prompt {i}"

    steps.clear()
    assert drive(llm, PROMPTS, PARAMS) == [w[1] for w in want] and steps

    steps.clear()
    async_llm = AsyncLLM(llm).start()
    try:
        for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
            deltas = run_sync(collect(async_llm, prompt, params))
            got = ([t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas[-1].finish_reason)
            assert got == want[i], f"AsyncLLM, prompt {i}"
    finally:
        async_llm.shutdown()
    assert steps, "AsyncLLM's engine thread did not step the engine"


async def collect(async_llm: AsyncLLM, prompt: str, params: SamplingParams) -> list[TokenDelta]:
    return [d async for d in async_llm.generate(prompt, params)]


def _raise_on_call(n: int, error: BaseException) -> Callable[[], None]:
    calls = {"n": 0}

    def hook() -> None:
        calls["n"] += 1
        if calls["n"] == n:
            raise error

    return hook


@pytest.mark.parametrize("error", [RuntimeError("driver bug"), KeyboardInterrupt()])
def test_an_exception_mid_loop_leaves_no_request_behind(llm: LLM, steps: list[int], error: BaseException) -> None:
    groups = llm.input_processor.make_sequences(PROMPTS, [LONG] * 2)
    with pytest.raises(type(error)), closing(llm.engine.run(groups, before_step=_raise_on_call(3, error))) as run:
        for _ in run:
            pass
    assert not llm.engine.has_unfinished_requests() and all(s.finish_reason.value == "abort" for g in groups for s in g)
    assert len(steps) == 2
    assert_memory_returned([llm])
    with pytest.raises(type(error)):  # the profiler's driver, through the same loop
        drive(llm, PROMPTS, [LONG] * 2, before_step=_raise_on_call(2, error))
    assert not llm.engine.has_unfinished_requests()


def test_an_uncontained_engine_error_aborts_the_call(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine whose step raises something other than StepFailedError: generate aborts its requests."""
    real, calls = llm.engine.step, {"n": 0}

    def broken() -> list[Sequence]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real()

    monkeypatch.setattr(llm.engine, "step", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(PROMPTS, [LONG] * 2, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_memory_returned([llm])


def test_closing_the_loop_before_an_arrival_never_queues_it(llm: LLM) -> None:
    groups = llm.input_processor.make_sequences(PROMPTS, [LONG] * 2)
    start = time.perf_counter()
    with closing(llm.engine.run(groups, arrival_times=[0.0, 60.0], start=start)) as run:
        next(run)  # the first request is running; the second arrives in a minute
        assert llm.engine.unfinished_seq_ids() == [groups[0][0].seq_id]
    assert not llm.engine.has_unfinished_requests() and groups[0][0].finish_reason.value == "abort"
    assert groups[1][0].status.value == "waiting" and not groups[1][0].output_token_ids  # it never joined
    assert isinstance(llm.engine, Engine) and not hasattr(llm, "llm_engine")  # LLM holds one engine


def test_a_step_that_fails_after_finishing_a_request_still_reports_it(llm: LLM,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault after a sequence got its last token (here: recording the step's statistics) fails the others,
    but the finished one comes back with the error too, complete: a stream waiting for it must not hang."""
    done_now = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0))[0]
    still_running = llm.add_request(PROMPTS[1], LONG)[0]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("statistics bug")

    monkeypatch.setattr(llm.engine, "record_step", broken)
    with pytest.raises(StepFailedError, match="statistics bug") as info:
        llm.engine.step()
    stepped = info.value.failed + info.value.finished
    assert done_now in stepped and done_now.finish_reason is not None
    assert done_now.finish_reason.value == "length" and done_now.num_output_tokens == 1
    assert still_running in stepped and still_running.finish_reason.value == "error"
    assert not llm.engine.has_unfinished_requests()
    assert_memory_returned([llm])
