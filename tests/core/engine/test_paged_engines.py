"""Engines ``paged``, ``continuous`` and ``chunked``: same tokens as transformers and as each other,
whatever the block size, budget, pool size, preemptions or prefix caching; every block comes back."""

from __future__ import annotations

import random

import pytest
from conftest import RANDOM_KINDS, hf_greedy

from labkit import ENGINES, LLM, SamplingParams
from labkit.measure.corpus import long_text, story_prompts

PAGED_ENGINES = ["paged", "continuous", "chunked"]


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    engine.block_manager.check_invariants([])


def test_chunked_is_the_default_and_last_engine(bundled_path) -> None:
    # "disaggregated" (notebook 12, two processes) comes after it in teaching order but is never the default.
    assert list(ENGINES) == ["naive", "kvcache", "paged", "continuous", "chunked", "disaggregated"]
    assert LLM(str(bundled_path)).engine_name == "chunked"


@pytest.mark.parametrize("engine", PAGED_ENGINES)
@pytest.mark.parametrize("block_size", [1, 16, 7])
def test_bundled_greedy_equals_transformers(bundled_path, engine: str, block_size: int) -> None:
    prompts = story_prompts(4, seed=3)
    llm = LLM(str(bundled_path), engine=engine, block_size=block_size, debug_checks=True)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, 12)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kind", list(RANDOM_KINDS))
@pytest.mark.parametrize("engine", PAGED_ENGINES)
@pytest.mark.parametrize("caching", [False, True])
def test_random_checkpoints_greedy_equals_transformers(random_checkpoint, kind: str, engine: str,
                                                       caching: bool) -> None:
    path = random_checkpoint(kind)
    prompts = [[1, 40, 41, 42, 43], [1, 99, 7], list(range(3, 40)), [1, 5]]
    budget = {"max_num_batched_tokens": 16} if engine == "chunked" else {}
    llm = LLM(str(path), engine=engine, block_size=5, enable_prefix_caching=caching, debug_checks=True, **budget)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for _ in range(2):  # the second round reuses cached prefix blocks when caching is on
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)
    assert (llm.engine.block_manager.hit_rate > 0) == caching
    assert_all_blocks_free(llm)


def random_workload(seed: int, n: int) -> tuple[list[str], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [long_text(rng.randint(3, 60), seed=seed * 100 + i) for i in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 20), temperature=0, ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def float64_reference(bundled_path):  # type: ignore[no-untyped-def]
    # The simplest schedule: one request at a time over a contiguous cache (itself checked against naive).
    ref = LLM(str(bundled_path), engine="kvcache", dtype="float64", max_num_seqs=1)
    cache: dict[int, list[list[int]]] = {}

    def run(seed: int, n: int) -> list[list[int]]:
        if seed not in cache:
            prompts, params = random_workload(seed, n)
            cache[seed] = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
        return cache[seed]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scheduling_never_changes_outputs_float64(bundled_path, float64_reference, seed: int) -> None:
    """Randomised workloads, engines and options, exact dtype: outputs must equal the naive engine's."""
    rng = random.Random(1000 + seed)
    prompts, params = random_workload(seed, 12)
    want = float64_reference(seed, 12)
    for _ in range(3):
        engine = rng.choice(PAGED_ENGINES)
        block_size = rng.choice([1, 2, 3, 8, 16])
        opts: dict = {"block_size": block_size, "max_num_seqs": rng.randint(1, 8),
                      "enable_prefix_caching": rng.random() < 0.5}
        longest = max(len(o) for o in want) + 120
        opts["num_gpu_blocks"] = rng.randint(-(-longest // block_size) + 1, -(-longest // block_size) * 4)
        if engine == "chunked":
            opts["max_num_batched_tokens"] = rng.choice([1, 3, 9, 64])  # budgets smaller than one prompt too
        llm = LLM(str(bundled_path), engine=engine, dtype="float64", debug_checks=True, **opts)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, f"{engine} {opts}"
        assert_all_blocks_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("engine", PAGED_ENGINES)
def test_small_pool_completes_every_request_through_preemption(bundled_path, engine: str) -> None:
    prompts = story_prompts(8, seed=5)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    big = LLM(str(bundled_path), engine=engine, dtype="float64")
    want = [o.outputs[0].token_ids for o in big.generate(prompts, params, use_tqdm=False)]
    lens = [len(big.encode(p)) for p in prompts]
    blocks = -(-(max(lens) + 40) // 4) + 2  # room for the longest request alone, and little more
    small = LLM(str(bundled_path), engine=engine, dtype="float64", block_size=4, num_gpu_blocks=blocks,
                max_num_seqs=8, debug_checks=True)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert small.engine.num_preemptions > 0
    assert max(s.kv_blocks_used for s in small.engine.step_stats) <= blocks
    assert_all_blocks_free(small)


def test_prefix_caching_skips_the_shared_prefill(bundled_path) -> None:
    system = long_text(120, seed=9)
    prompts = [system + " " + q for q in ("The cat", "A dog ran", "Then Lily said")]
    llm = LLM(str(bundled_path), engine="chunked", enable_prefix_caching=True, block_size=16, debug_checks=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate(prompts[0], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    llm.engine.step_stats.clear()
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    shared = len(llm.encode(system)) // 16 * 16
    assert all(o.num_cached_tokens >= shared - 16 for o in rest) and shared > 64
    computed = sum(s.num_prefill_tokens for s in llm.engine.step_stats)
    assert computed < sum(len(o.prompt_token_ids) for o in rest) - shared
    assert llm.engine.block_manager.hit_rate > 0
    for out in rest:  # served partly from the cache, still transformers' tokens
        assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, 6)
    assert_all_blocks_free(llm)


def test_continuous_admits_into_freed_slots_while_static_waits(bundled_path) -> None:
    prompts = story_prompts(3, seed=1)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 12, 4)]
    static = LLM(str(bundled_path), engine="paged", max_num_seqs=2)
    cont = LLM(str(bundled_path), engine="continuous", max_num_seqs=2)
    s_out = static.generate(prompts, params, use_tqdm=False)
    c_out = cont.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in s_out] == [o.outputs[0].token_ids for o in c_out]
    # Static: the third request waits for the whole first batch; continuous: only for the short one.
    assert s_out[2].metrics.first_scheduled_time >= s_out[1].metrics.finished_time
    assert c_out[2].metrics.first_scheduled_time < c_out[1].metrics.finished_time
    assert len(cont.engine.step_stats) < len(static.engine.step_stats)


def test_chunked_prefill_respects_the_token_budget(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="chunked", max_num_batched_tokens=32)
    prompts = [long_text(200, seed=3), "Once upon a time"]
    llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.step_stats
    assert max(s.num_computed_tokens for s in stats) <= 32
    assert sum(s.is_prefill for s in stats) > 3  # the long prompt was split over several steps


def test_pool_too_small_names_the_numbers(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="chunked", block_size=16, num_gpu_blocks=2)
    with pytest.raises(ValueError, match=r"needs 3 KV blocks .* but the pool has only 2"):
        llm.generate([[1] * 30], SamplingParams(max_tokens=10), use_tqdm=False)
    cont = LLM(str(bundled_path), engine="continuous", max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="max_num_batched_tokens 16.*'chunked'"):
        cont.generate([[1] * 30], SamplingParams(max_tokens=10), use_tqdm=False)


def test_abort_frees_blocks(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="chunked", debug_checks=True)
    for i, _ in enumerate(llm.stream("Once upon a time", SamplingParams(max_tokens=30, temperature=0))):
        if i == 3:
            break
    assert_all_blocks_free(llm)


def test_requests_arriving_over_time_are_measured_from_their_arrival(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="chunked")
    prompts = story_prompts(3, seed=2)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False, arrival_times=[0.0, 0.3, 0.15])
    arrivals = [o.metrics.arrival_time for o in outs]
    assert arrivals[1] - arrivals[0] == pytest.approx(0.3) and arrivals[2] - arrivals[0] == pytest.approx(0.15)
    for o in outs:  # nobody is scheduled before it arrives; TTFT counts from its own arrival
        assert o.metrics.first_scheduled_time >= o.metrics.arrival_time
        assert o.metrics.ttft == pytest.approx(o.metrics.token_times[0] - o.metrics.arrival_time)
    alone = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    with pytest.raises(ValueError, match="arrival_times\\[1\\] must be a number of seconds >= 0"):
        llm.generate(prompts[:2], params, arrival_times=[0.0, -1.0])


@pytest.mark.parametrize("engine", PAGED_ENGINES)
def test_parallel_samples_share_the_prompt_and_copy_on_write(bundled_path, engine: str) -> None:
    prompt = long_text(40, seed=4)  # not a multiple of the block size: the last prompt block is shared, partial
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=21, ignore_eos=True)
    want = LLM(str(bundled_path), engine="naive", dtype="float64").generate(prompt, params, use_tqdm=False)[0]
    n_prompt = len(want.prompt_token_ids)
    block_size = 8 if n_prompt % 8 else 7
    llm = LLM(str(bundled_path), engine=engine, dtype="float64", block_size=block_size, debug_checks=True)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds seed, seed+1, seed+2 differ
    bm = llm.engine.block_manager
    assert n_prompt % block_size != 0
    assert bm.num_forked_tokens == 2 * (n_prompt - 1)  # two samples reused the parent's prompt K/V
    assert bm.num_copies >= 2  # the shared partial block was copied before being written
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("engine", PAGED_ENGINES)
def test_step_stats_count_prefill_and_decode_tokens(bundled_path, engine: str) -> None:
    llm = LLM(str(bundled_path), engine=engine)
    prompts = story_prompts(3, seed=6)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = llm.engine.step_stats
    assert stats[0].is_prefill and stats[0].num_prefill_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert all(not s.is_prefill and s.num_prefill_tokens == 0 for s in stats[1:])
    assert stats[-1].kv_blocks_used > 0  # measured before the finishing sequences gave their blocks back
