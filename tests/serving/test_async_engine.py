"""AsyncLLM: the engine loop in a background thread, requests added and streamed concurrently, aborts.

float64 so scheduling never changes a token: every request must stream exactly what offline
``LLM.generate`` returns for it alone.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_gates import commands_waiting, wait_for

from labkit import LLM, SamplingParams
from labkit.core.engine.base import StepFailedError
from labkit.core.sched.stop import fail
from labkit.core.sequence import Sequence
from labkit.measure.loadgen.runner import run_sync
from labkit.serving import AsyncLLM, EngineDeadError, ServerMetrics, TokenDelta

PROMPTS = ["Once upon a time", "The little fox", "One day, Lily went to the park", "There once was a kind seal"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("labkit-tiny", engine="chunked", dtype="float64", max_model_len=256, max_num_seqs=3,
               max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def offline(llm: LLM) -> list[list[int]]:
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.fixture
def engine(llm: LLM, offline: list[list[int]]):  # type: ignore[no-untyped-def]
    async_llm = AsyncLLM(llm, ServerMetrics("labkit-tiny")).start()
    try:
        yield async_llm
    finally:
        async_llm.shutdown()
    assert not llm.engine.has_unfinished_requests()


async def collect(async_llm: AsyncLLM, prompt: str, params: SamplingParams = GREEDY) -> list[TokenDelta]:
    return [d async for d in async_llm.generate(prompt, params)]


def test_one_request_streams_one_token_per_delta(engine: AsyncLLM, offline: list[list[int]]) -> None:
    deltas = run_sync(collect(engine, PROMPTS[0]))
    assert [t for d in deltas for t in d.token_ids] == offline[0]
    assert all(len(d.token_ids) == 1 for d in deltas) and [d.num_output_tokens for d in deltas] == list(range(1, 13))
    assert [d.finished for d in deltas] == [False] * 11 + [True] and deltas[-1].finish_reason == "length"
    assert "".join(d.text for d in deltas).strip() and all(a.time <= b.time for a, b in zip(deltas, deltas[1:]))


def test_concurrent_requests_join_a_running_batch(engine: AsyncLLM, offline: list[list[int]]) -> None:
    async def main() -> list[list[TokenDelta]]:
        async def one(i: int) -> list[TokenDelta]:
            await asyncio.sleep(0.02 * i)  # later requests arrive while earlier ones decode
            return await collect(engine, PROMPTS[i])

        return list(await asyncio.gather(*(one(i) for i in range(4))))

    results = run_sync(main())
    for i, deltas in enumerate(results):
        assert [t for d in deltas for t in d.token_ids] == offline[i], f"request {i}"
    # max_num_seqs=3: the fourth waited for a slot, then joined while others were still running
    assert engine.engine_state().num_running == 0


def test_a_short_request_added_mid_run_finishes_first(engine: AsyncLLM) -> None:
    async def main() -> list[str]:
        finished: list[str] = []

        async def run(name: str, prompt: str, params: SamplingParams, wait_for: asyncio.Event | None,
                      signal: asyncio.Event | None) -> None:
            if wait_for is not None:
                await wait_for.wait()
            async for d in engine.generate(prompt, params):
                if signal is not None and d.num_output_tokens == 2:
                    signal.set()  # the long one is decoding: now send the short one
            finished.append(name)

        started = asyncio.Event()
        # Once the long one has 2 tokens, the engine waits for the short one's add before its next step: on a busy
        # machine the event loop might otherwise send it only after the long one's 60 tokens.
        admit_after_two(engine)
        long_params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        short_params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        await asyncio.gather(run("long", PROMPTS[0], long_params, None, started),
                             run("short", PROMPTS[1], short_params, started, None))
        return finished

    try:
        assert run_sync(main()) == ["short", "long"]  # iteration-level scheduling: it did not wait for the long one
    finally:
        engine.llm.engine.fault_hook = None


def admit_after_two(engine: AsyncLLM) -> None:
    """The first time a request has 2 tokens, the engine thread waits until another request's add was sent."""
    done = {"waited": False}

    def hold(seqs: list[Sequence]) -> None:
        if not done["waited"] and any(s.num_output_tokens >= 2 for s in seqs):
            # (taken in already, or sent and waiting for the engine thread)
            wait_for(lambda: len(seqs) > 1 or commands_waiting(engine), "the short request's add")
            done["waited"] = True

    engine.llm.engine.fault_hook = hold


def test_closing_the_stream_aborts_and_frees_blocks_at_once(engine: AsyncLLM) -> None:
    long_params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        stream = engine.generate(PROMPTS[2], long_params)
        got = [await stream.__anext__() for _ in range(3)]
        assert engine.engine_state().kv_blocks_used > 0  # it holds KV blocks while running
        await stream.aclose()  # the consumer leaves (a client disconnect does this)
        assert len(got) == 3

    run_sync(main())
    state = engine.engine_state()  # commands run in order: this snapshot comes after the abort
    assert state.unfinished_request_ids == () and state.kv_blocks_used == 0
    assert 'finished_reason="abort"' in engine.metrics.exposition().decode()


def test_cancelling_the_consumer_aborts(engine: AsyncLLM) -> None:
    long_params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        first = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate(PROMPTS[3], long_params):
                first.set()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_sync(main())
    state = engine.engine_state()
    assert state.unfinished_request_ids == () and state.kv_blocks_used == 0


def test_invalid_requests_raise_before_reaching_the_engine(engine: AsyncLLM) -> None:
    with pytest.raises(ValueError, match="max_model_len 256"):
        engine.make_request("word " * 300, GREEDY)
    with pytest.raises(ValueError, match="n=1"):
        engine.make_request("hi", SamplingParams(n=2))
    assert len(run_sync(collect(engine, PROMPTS[0]))) == 12  # still serving


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine: AsyncLLM, llm: LLM,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = llm.engine.step
    calls = {"n": 0}

    def flaky_step():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(llm.engine, "step", flaky_step)
    with pytest.raises(RuntimeError, match="device lost"):
        run_sync(collect(engine, PROMPTS[0]))
    assert engine.engine_state().kv_blocks_used == 0  # the failed request's blocks went back
    assert len(run_sync(collect(engine, PROMPTS[1]))) == 12 and engine.is_running


def test_a_contained_step_failure_fails_only_the_named_requests(engine: AsyncLLM, llm: LLM, offline: list[list[int]],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    real_step = llm.engine.step
    calls = {"n": 0}
    victim = engine.make_request(PROMPTS[3], GREEDY)

    def step_failing_one():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 4 and victim.seq_id in llm.engine.unfinished_seq_ids():
            # What a fault-containing engine does (StepFailedError's contract): the failed sequence is out of
            # the engine, its memory returned, finished with reason "error"; the others are untouched.
            cause = RuntimeError("device lost")
            llm.engine.abort_request(victim.seq_id)
            fail(victim, cause, calls["n"] - 1, time.perf_counter())
            raise StepFailedError(calls["n"] - 1, [victim], cause)
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step_failing_one)

    async def main() -> tuple[object, object]:
        async def victim_deltas() -> list[TokenDelta]:
            return [d async for d in engine.generate(victim)]

        return tuple(await asyncio.gather(collect(engine, PROMPTS[0]), victim_deltas(), return_exceptions=True))

    survivor, failed = run_sync(main())
    assert isinstance(failed, RuntimeError) and "device lost" in str(failed)
    assert [t for d in survivor for t in d.token_ids] == offline[0]  # the other request never noticed
    assert engine.engine_state().kv_blocks_used == 0


def test_metrics_count_every_token(engine: AsyncLLM) -> None:
    async def main() -> None:
        await asyncio.gather(*(collect(engine, p) for p in PROMPTS[:3]))

    run_sync(main())
    m = engine.metrics
    assert m is not None
    samples = {s.name + str(sorted(s.labels.items())): s.value for f in m.registry.collect() for s in f.samples}
    label = "[('model_name', 'labkit-tiny')]"
    assert samples["labkit:time_to_first_token_seconds_count" + label] == 3
    assert samples["labkit:inter_token_latency_seconds_count" + label] == 3 * 11
    assert samples["labkit:generation_tokens_total" + label] == 36
    assert samples["labkit:num_requests_running" + label] == 0 and samples["labkit:kv_blocks_used" + label] == 0


def test_shutdown_ends_streams_and_refuses_new_requests(llm: LLM) -> None:
    async_llm = AsyncLLM(llm).start()

    async def main() -> None:
        stream = async_llm.generate(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, async_llm.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    run_sync(main())
    assert not llm.engine.has_unfinished_requests()  # shutdown dropped what was running
    with pytest.raises(EngineDeadError, match="start"):
        run_sync(collect(async_llm, PROMPTS[0]))


def test_an_async_scheduling_engine_streams_the_same_tokens(offline: list[list[int]]) -> None:
    """Async scheduling under the server's engine loop: aborts between steps, requests joining mid-run."""
    llm = LLM("labkit-tiny", engine="chunked", dtype="float64", max_model_len=256, max_num_seqs=3,
              max_num_batched_tokens=32, async_scheduling=True)
    async_llm = AsyncLLM(llm, ServerMetrics("labkit-tiny")).start()
    try:
        async def main() -> list[list[TokenDelta]]:
            async def one(i: int) -> list[TokenDelta]:
                await asyncio.sleep(0.02 * i)
                return await collect(async_llm, PROMPTS[i])

            async def abandoned() -> None:
                async for _ in async_llm.generate(PROMPTS[1], SamplingParams(max_tokens=50, temperature=0.0)):
                    break  # the client goes away after one token: the request is aborted mid-run

            results = await asyncio.gather(*(one(i) for i in range(4)), abandoned())
            return list(results[:4])

        for i, deltas in enumerate(run_sync(main())):
            assert [t for d in deltas for t in d.token_ids] == offline[i], f"request {i}"
    finally:
        async_llm.shutdown()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks  # type: ignore[attr-defined]
