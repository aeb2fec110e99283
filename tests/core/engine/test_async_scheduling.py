"""Async scheduling (``async_scheduling=True``, notebook 10): step N+1 is planned while step N runs.

It must change no token and no finish reason, waste no step on a request whose length is known (one that stops
on a token already placed in the next step costs that step's token, discarded, as in vLLM), keep faults and aborts
contained, and return every KV block. The overlap itself is checked too: the scheduler must run while the device's
part of the previous step has not finished. That step N+1 is launched before the host reads step N's tokens is
checked in tests/core/engine/test_async_device_tokens.py.
The long randomised run (faults, aborts, preemption, prefix caching, n > 1, stop strings) with and
without async scheduling is in tests/core/engine/test_stress.py.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
from conftest import assert_memory_returned, hf_greedy

from labkit import LLM, SamplingParams
from labkit.core.engine.base import StepFailedError
from labkit.core.llm import RequestFailedError

ASYNC_ENGINES = ["continuous", "chunked"]
PROMPTS = ["Once upon a time", "The little fox ran to the", "One day, Lily went to the park with her mom",
           "There once was a kind seal", "A big red"]


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)


def completions(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[list[tuple]]:  # type: ignore[type-arg]
    return [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny(random_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return random_checkpoint("llama")


@pytest.mark.parametrize("engine", ASYNC_ENGINES)
def test_greedy_tokens_equal_transformers(bundled_path: Path, engine: str) -> None:
    llm = LLM("labkit-tiny", engine=engine, dtype="float32", async_scheduling=True, max_num_seqs=3,
              max_num_batched_tokens=16 if engine == "chunked" else None)
    lengths = [9, 3, 14, 1, 6]
    outs = llm.generate(PROMPTS, [greedy(n) for n in lengths], use_tqdm=False)
    for out, n in zip(outs, lengths):
        assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, n)


def random_requests(seed: int, count: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 2000) for _ in range(12)]
    prompts, params = [], []
    for i in range(count):
        body = [rng.randrange(3, 2000) for _ in range(rng.randint(1, 40))]
        prompts.append(shared + body if i % 3 == 0 else body)
        kind = rng.random()
        if kind < 0.4:
            params.append(greedy(rng.randint(1, 30), ignore_eos=False))
        elif kind < 0.7:
            params.append(SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.9, top_p=0.9,
                                         seed=rng.randrange(1000), n=rng.choice([1, 2]),
                                         stop=[rng.choice(["e", "the", "."])]))
        else:
            params.append(greedy(rng.randint(1, 30)))
    return prompts, params


@pytest.mark.parametrize("engine", ASYNC_ENGINES)
@pytest.mark.parametrize("options", [
    {},
    {"max_num_seqs": 3, "block_size": 2, "num_gpu_blocks": 40, "enable_prefix_caching": True},
    {"max_num_seqs": 6, "block_size": 4, "num_gpu_blocks": 30},
], ids=["roomy", "tight-cached", "tight"])
def test_async_changes_no_completion(tiny: Path, engine: str, options: dict) -> None:
    """float64, so any difference is a scheduling bug: sampled tokens, stop strings and EOS included."""
    prompts, params = random_requests(7, 24)
    budget = {"max_num_batched_tokens": 8 if engine == "chunked" else 80}
    runs, computed = {}, {}
    for mode in (False, True):
        llm = LLM(str(tiny), engine=engine, dtype="float64", async_scheduling=mode, **budget, **options)
        runs[mode] = completions(llm, prompts, params)
        computed[mode] = sum(s.num_computed_tokens for s in llm.engine.step_stats)
        discarded = getattr(llm.engine, "num_discarded_tokens", 0)
    assert runs[True] == runs[False]
    if not options:  # no preemption: nothing recomputed; a request that stops ran one more step, whose token is dropped
        assert discarded > 0 and computed[True] == computed[False] + discarded
    reasons = {c[1] for out in runs[True] for c in out}
    assert {"stop", "length"} <= reasons  # the early-stop path (a pending token that ends its request) ran


def test_no_position_is_computed_twice_when_lengths_are_known(tiny: Path) -> None:
    """With ignore_eos every request's length is known: async scheduling computes exactly what sync does."""
    params = [greedy(n) for n in (1, 7, 2, 12, 5)]
    computed = {}
    for mode in (False, True):
        llm = LLM(str(tiny), engine="chunked", dtype="float64", async_scheduling=mode, max_num_batched_tokens=8)
        prepared = []
        real_prepare = llm.engine.runner.prepare_step
        llm.engine.runner.prepare_step = (  # type: ignore[method-assign]
            lambda batch, prepared=prepared, real_prepare=real_prepare: prepared.append(1) or real_prepare(batch))
        llm.generate(PROMPTS, params, use_tqdm=False)
        computed[mode] = sum(s.num_computed_tokens for s in llm.engine.step_stats)
        # A request is never planned into a step that its last token makes useless (no step prepared twice).
        assert len(prepared) == len(llm.engine.step_stats)
    assert computed[True] == computed[False]


def test_the_next_step_is_scheduled_while_the_device_runs(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny), engine="chunked", dtype="float64", async_scheduling=True)
    engine = llm.engine
    cond = threading.Condition()
    counts = {"scheduled": 0}
    overlapped = []
    real_execute, real_schedule = engine.runner.execute, engine.scheduler.schedule
    real_prepare = engine.runner.prepare_step
    scheduled_before: dict[int, int] = {}  # id(inputs) -> schedule calls up to the one that planned the step

    def prepare_step(batch):  # type: ignore[no-untyped-def]  # the host, right after scheduling the step
        inputs = real_prepare(batch)
        scheduled_before[id(inputs)] = counts["scheduled"]
        return inputs

    def execute(inputs, clock):  # type: ignore[no-untyped-def]
        assert threading.current_thread() is not threading.main_thread()
        # Wait until the host schedules the next step. A synchronous engine would only schedule after this
        # returns, so the wait would time out.
        launched_after = scheduled_before[id(inputs)]
        with cond:
            overlapped.append(cond.wait_for(lambda: counts["scheduled"] > launched_after, timeout=10))
        return real_execute(inputs, clock)

    def schedule(*args, **kwargs):  # type: ignore[no-untyped-def]
        batch = real_schedule(*args, **kwargs)
        with cond:
            counts["scheduled"] += 1
            cond.notify_all()
        return batch

    monkeypatch.setattr(engine.runner, "prepare_step", prepare_step)
    monkeypatch.setattr(engine.runner, "execute", execute)
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    outs = llm.generate(PROMPTS[:2], [greedy(6), greedy(3)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 3]
    assert len(overlapped) >= 6 and all(overlapped)


def test_engine_paged_refuses_async_scheduling() -> None:
    with pytest.raises(ValueError, match="async_scheduling=True needs an iteration-level scheduler: use engine "
                                         "'continuous' or 'chunked'"):
        LLM("labkit-tiny", engine="paged", async_scheduling=True)


@pytest.mark.parametrize("engine", ASYNC_ENGINES)
def test_a_fault_on_the_device_fails_only_the_launched_step(tiny: Path, engine: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker raises: the sequences of that step fail (seen when its tokens are awaited), the rest go on."""
    params = [greedy(5 + i) for i in range(len(PROMPTS))]
    ref = LLM(str(tiny), engine=engine, dtype="float64", max_num_seqs=2)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(str(tiny), engine=engine, dtype="float64", async_scheduling=True, max_num_seqs=2)
    real_execute = llm.engine.runner.execute
    calls = {"n": 0}
    hit: list = []

    def execute(inputs, clock):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 4:
            hit[:] = [id(s) for s in inputs.samplers]
            raise MemoryError("device out of memory")
        return real_execute(inputs, clock)

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    with pytest.raises(RequestFailedError, match="MemoryError: device out of memory") as info:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert hit
    for out, w in zip(info.value.outputs, want):
        c = out.outputs[0]
        if c.finish_reason == "error":
            assert c.token_ids == w[: len(c.token_ids)] and "device out of memory" in (c.error or "")
        else:
            assert c.token_ids == w
    assert sum(o.outputs[0].finish_reason == "error" for o in info.value.outputs) >= 1
    assert sum(o.outputs[0].finish_reason == "length" for o in info.value.outputs) >= 1
    assert_memory_returned([llm])
    monkeypatch.setattr(llm.engine.runner, "execute", real_execute)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want


@pytest.mark.parametrize("fault_at", [3, 6])
def test_a_fault_taking_tokens_back_settles_the_step_launched_behind_it(tiny: Path, fault_at: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Step N's tokens cannot be handed over (``update_from_output`` raises) while step N+1, launched behind it, ran:
    N's sequences fail, N+1's token for them is dropped, N+1's other sequences keep theirs and go on."""
    params = [greedy(4 + i) for i in range(len(PROMPTS))]
    ref = LLM(str(tiny), engine="chunked", dtype="float64", max_num_seqs=2, max_num_batched_tokens=16)
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(str(tiny), engine="chunked", dtype="float64", async_scheduling=True, max_num_seqs=2,
              max_num_batched_tokens=16, debug_checks=True)
    engine = llm.engine
    real_update, real_settle = engine.scheduler.update_from_output, engine._settle_behind  # type: ignore[attr-defined]
    calls = {"n": 0}
    settled: list[bool] = []

    def update_from_output(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == fault_at:
            raise RuntimeError("bad bookkeeping")
        return real_update(*args, **kwargs)

    def settle(step):  # type: ignore[no-untyped-def]
        settled.append(step.future.exception() is None)  # the step behind ran: its tokens are taken
        return real_settle(step)

    monkeypatch.setattr(engine.scheduler, "update_from_output", update_from_output)
    monkeypatch.setattr(engine, "_settle_behind", settle)
    with pytest.raises(RequestFailedError, match="bad bookkeeping") as info:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert settled == [True] and engine.num_preemptions == 0  # taken as they were, not recomputed
    reasons = [o.outputs[0].finish_reason for o in info.value.outputs]
    assert "error" in reasons and "length" in reasons
    for out, w in zip(info.value.outputs, want):
        c = out.outputs[0]
        assert c.token_ids == (w[: len(c.token_ids)] if c.finish_reason == "error" else w)
    assert_memory_returned([llm])


def test_a_device_fault_leaves_no_unwritten_block_in_the_prefix_cache(tiny: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A block enters the prefix cache only once a finished step wrote its K/V: step N+1 (launched) writes the K/V of
    step N's token, so its blocks wait for it. Here step N+1 fails; requests that extend the failed ones' tokens
    then hit the cache and must still get the tokens a fresh engine gives."""
    llm = LLM(str(tiny), engine="chunked", dtype="float64", async_scheduling=True, block_size=2,
              enable_prefix_caching=True)
    real_execute = llm.engine.runner.execute
    calls = {"n": 0}

    def execute(inputs, clock):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 4:
            raise MemoryError("device out of memory")
        return real_execute(inputs, clock)

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    with pytest.raises(RequestFailedError, match="device out of memory") as info:
        llm.generate(PROMPTS[:3], greedy(8), use_tqdm=False)
    failed = [o for o in info.value.outputs if o.outputs[0].finish_reason == "error"]
    assert len(failed) == 3 and all(o.outputs[0].token_ids for o in failed)
    monkeypatch.setattr(llm.engine.runner, "execute", real_execute)
    # One token more than they had: every block holding their known tokens is a prefix the cache may serve.
    extended = [o.prompt_token_ids + o.outputs[0].token_ids * 2 for o in failed]
    ref = LLM(str(tiny), engine="chunked", dtype="float64")
    want = [o.outputs[0].token_ids for o in ref.generate(extended, greedy(4), use_tqdm=False)]
    hits_before = llm.engine.block_manager.num_hit_tokens
    assert [o.outputs[0].token_ids for o in llm.generate(extended, greedy(4), use_tqdm=False)] == want
    assert llm.engine.block_manager.num_hit_tokens > hits_before  # the cache was used
    assert_memory_returned([llm])


def test_a_fault_before_launch_raises_step_failed_error(tiny: Path) -> None:
    llm = LLM(str(tiny), engine="chunked", dtype="float64", async_scheduling=True, max_num_seqs=2)
    seqs = [llm.add_request(p, greedy(4))[0] for p in PROMPTS[:3]]
    calls = {"n": 0}

    def hook(batch: list) -> None:  # type: ignore[type-arg]
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("bad batch")

    llm.engine.fault_hook = hook
    llm.step()  # launches step 0
    with pytest.raises(StepFailedError, match=r"failed with ValueError: bad batch") as info:
        llm.step()  # resolves step 0, then step 1 fails before it launches
    assert [s.seq_id for s in info.value.failed] == [s.seq_id for s in seqs[:2]]
    assert all(s.finish_reason.value == "error" and not s.block_table for s in seqs[:2])
    while llm.engine.has_unfinished_requests():
        llm.step()
    assert seqs[2].finish_reason.value == "length" and len(seqs[2].output_token_ids) == 4
    assert_memory_returned([llm])


@pytest.mark.parametrize("engine", ASYNC_ENGINES)
def test_aborting_a_request_whose_step_is_running(tiny: Path, engine: str) -> None:
    params = greedy(8)
    ref = LLM(str(tiny), engine=engine, dtype="float64")
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS[:3], [params] * 3, use_tqdm=False)]
    llm = LLM(str(tiny), engine=engine, dtype="float64", async_scheduling=True)
    seqs = [llm.add_request(p, params)[0] for p in PROMPTS[:3]]
    for _ in range(3):
        llm.step()
    in_flight = llm.engine._in_flight  # type: ignore[attr-defined]
    assert in_flight is not None and seqs[1] in in_flight.out.seqs
    assert llm.engine.abort_request(seqs[1].seq_id) is seqs[1]
    assert not seqs[1].block_table
    while llm.engine.has_unfinished_requests():
        llm.step()
    assert seqs[1].finish_reason.value == "abort"
    assert seqs[1].output_token_ids == want[1][: len(seqs[1].output_token_ids)]
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids] == [want[0], want[2]]
    assert seqs[1].num_pending_tokens == 0
    assert_memory_returned([llm])


def test_an_interrupt_aborts_the_launched_step_and_frees_its_blocks(tiny: Path) -> None:
    llm = LLM(str(tiny), engine="chunked", dtype="float64", async_scheduling=True, max_num_seqs=2)
    calls = {"n": 0}

    def hook(batch: list) -> None:  # type: ignore[type-arg]
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt

    llm.engine.fault_hook = hook
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    assert llm.engine._in_flight is None  # type: ignore[attr-defined]
    assert_memory_returned([llm])
    llm.engine.fault_hook = None
    outs = llm.generate(PROMPTS[:2], greedy(6), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
