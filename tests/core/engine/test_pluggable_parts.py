"""The learner's class is the one that runs: ``scheduler_cls``, ``block_manager_cls``, ``attention_backend`` and
``kv_cache_cls`` passed to ``LLM`` (or to the server) are the instances the engine uses, and tokens do not change."""

from __future__ import annotations

import httpx
import pytest
from pluggable_parts import CountingAttention, CountingBlockManager, CountingScheduler, CountingStaticScheduler

from labkit import (
    ATTENTION_BACKENDS,
    LLM,
    BlockManager,
    ContiguousKVCache,
    RequestFailedError,
    SamplingParams,
    Scheduler,
)
from labkit.serving import ServerThread
from labkit.serving.cli import make_async_llm, parse_args

PROMPTS = ["Once upon a time", "The dog ran to the park and", "One day, Lily"]
PARAMS = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
# A small pool forces preemption, so the scheduler's and the block manager's every path runs.
SMALL_POOL = dict(max_num_seqs=3, num_gpu_blocks=12, block_size=4)


@pytest.fixture(scope="module")
def reference_tokens() -> list[list[int]]:
    llm = LLM(engine="naive", device="cpu")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("engine,async_scheduling", [("paged", False), ("continuous", False), ("chunked", False),
                                                     ("continuous", True), ("chunked", True)])
def test_scheduler_and_block_manager_subclasses_are_the_ones_used(engine: str, async_scheduling: bool,
                                                                 reference_tokens: list[list[int]]) -> None:
    scheduler_cls = CountingStaticScheduler if engine == "paged" else CountingScheduler
    options = dict(SMALL_POOL, async_scheduling=True) if async_scheduling else dict(SMALL_POOL)
    llm = LLM(engine=engine, device="cpu", scheduler_cls=scheduler_cls, block_manager_cls=CountingBlockManager,
              **options)
    scheduler, bm = llm.engine.scheduler, llm.engine.block_manager
    assert type(scheduler) is scheduler_cls and type(bm) is CountingBlockManager
    assert scheduler.block_manager is bm and llm.engine.runner.block_manager is bm
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == reference_tokens
    assert scheduler.num_schedule_calls >= 20  # one call per step, at least one step per output token
    assert bm.num_allocate_calls >= len(PROMPTS) and bm.num_free_calls >= len(PROMPTS)
    assert llm.engine.num_preemptions > 0  # the small pool made the preemption path run too
    assert bm.num_used_blocks == 0


def test_attention_backend_by_name_and_by_class(reference_tokens: list[list[int]]) -> None:
    assert "torch" in ATTENTION_BACKENDS
    before = CountingAttention.num_steps
    llm = LLM(engine="chunked", device="cpu", attention_backend=CountingAttention)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == reference_tokens
    assert CountingAttention.num_steps - before >= PARAMS.max_tokens
    assert llm.engine.runner.attention_backend is CountingAttention


def test_kv_cache_class_of_engine_kvcache(reference_tokens: list[list[int]]) -> None:
    made: list[ContiguousKVCache] = []

    class Recording(ContiguousKVCache):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, **kwargs)
            made.append(self)

    llm = LLM(engine="kvcache", device="cpu", kv_cache_cls=Recording)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == reference_tokens and len(made) == 1


@pytest.mark.parametrize("option,value,message", [
    ("scheduler_cls", BlockManager, "scheduler_cls must be a subclass of labkit.Scheduler"),
    ("block_manager_cls", Scheduler, "block_manager_cls must be a subclass of labkit.BlockManager"),
    ("scheduler_cls", "nowhere.Nothing", "scheduler_cls='nowhere.Nothing' cannot be imported"),
    ("attention_backend", "flash", "attention_backend 'flash' is not registered; registered backends: torch"),
    ("attention_backend", int, "attention_backend must be a name in ATTENTION_BACKENDS"),
])
def test_a_wrong_part_gets_a_clear_error(option: str, value: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(engine="chunked", device="cpu", **{option: value})


def test_kvcache_and_naive_refuse_the_paged_parts() -> None:
    with pytest.raises(ValueError, match="engine 'kvcache' does not take option.*scheduler_cls"):
        LLM(engine="kvcache", device="cpu", scheduler_cls=CountingScheduler)


def test_server_options_take_import_paths() -> None:
    config = parse_args(["--engine", "continuous", "--scheduler-cls", "pluggable_parts.CountingScheduler",
                         "--block-manager-cls", "pluggable_parts.CountingBlockManager",
                         "--attention-backend", "torch"])
    async_llm = make_async_llm(config)
    engine = async_llm.llm.engine
    assert type(engine.scheduler).__name__ == "CountingScheduler"
    assert type(engine.block_manager).__name__ == "CountingBlockManager"


def test_a_server_runs_the_learners_scheduler(reference_tokens: list[list[int]]) -> None:
    with ServerThread(engine="chunked", scheduler_cls=CountingScheduler, block_manager_cls=CountingBlockManager,
                      **SMALL_POOL) as server:
        engine = server.async_llm.llm.engine
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": server.served_model_name, "prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert isinstance(engine.scheduler, CountingScheduler) and engine.scheduler.num_schedule_calls >= 20
        assert engine.block_manager.num_allocate_calls >= 1
        text = reply.json()["choices"][0]["text"]
    want = LLM(engine="naive", device="cpu").tokenizer.decode(reference_tokens[0])
    assert text == want


class NeverAdmits(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]  # a learner's bug
        return None


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_scheduler_that_never_admits_fails_the_requests_instead_of_hanging(async_scheduling: bool) -> None:
    llm = LLM(engine="continuous", device="cpu", scheduler_cls=NeverAdmits, async_scheduling=async_scheduling)
    with pytest.raises(RequestFailedError, match="NeverAdmits scheduled nothing while 3 request"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_used_blocks == 0
