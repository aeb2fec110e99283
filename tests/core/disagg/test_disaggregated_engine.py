"""Engine ``disaggregated``: two processes on a gloo link give transformers' (and ``chunked``'s) tokens; a failed
prefill, a cut transfer and a killed prefill worker fail only their own requests, with an error naming what
happened; no KV block is left behind on either side; the prefill process always ends.

Few engines are started (each is a process start): one on the bundled model shared by the module, one on a random
GQA checkpoint, one per fault that kills the worker."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import hf_greedy
from faulty_worker import CUT_TOKEN, FAIL_TOKEN, HOLD_TOKEN, FaultyPrefillWorker
from worker_processes import workers_left_by_killed_parent

from labkit import ENGINES, LLM, SamplingParams
from labkit.core.engine.base import StepFailedError
from labkit.core.engine.errors import EngineDeadError
from labkit.core.engine.output_processor import RequestFailedError
from labkit.measure.corpus import story_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks, "a decode-side block leaked"
    engine.block_manager.check_invariants([])
    assert engine.prefill_blocks_in_use == 0, "a prefill-side block leaked"


@pytest.fixture(scope="module")
def disagg(bundled_path):  # type: ignore[no-untyped-def]
    # A small pool (24 blocks of 8 tokens) so long requests preempt each other and received KV waits for blocks.
    with LLM(str(bundled_path), engine="disaggregated", block_size=8, num_gpu_blocks=24, max_num_seqs=4,
             debug_checks=True) as llm:
        yield llm


def test_listed_after_chunked_which_stays_the_default(bundled_path) -> None:
    assert list(ENGINES)[-2:] == ["chunked", "disaggregated"]
    assert LLM(str(bundled_path), engine="naive").engine_name == "naive"
    from labkit.core.presets import default_engine
    assert default_engine() == "chunked"


def test_greedy_equals_transformers_and_chunked(disagg, bundled_path) -> None:
    prompts = story_prompts(4, seed=3)
    outs = disagg.generate(prompts, GREEDY, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, 12)
        assert out.metrics.ttft > 0
    records = disagg.engine.transfers[-len(prompts):]  # every prompt went through the prefill worker, in blocks
    block_bytes = 2 * 8 * disagg.model_config.num_hidden_layers * disagg.model_config.num_key_value_heads * \
        disagg.model_config.head_dim * 4  # float32, block_size 8
    for out, rec in zip(outs, records):
        assert rec.num_prompt_tokens == len(out.prompt_token_ids)
        assert rec.num_bytes == -(-rec.num_prompt_tokens // 8) * block_bytes
    assert all(r.prefill_start <= r.prefill_end <= r.send_start <= r.received for r in disagg.engine.transfers)
    assert_no_leaks(disagg)


def test_preemption_and_waiting_for_blocks_keep_the_tokens(disagg, bundled_path) -> None:
    prompts = story_prompts(4, seed=5)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    engine = disagg.engine
    preemptions = engine.num_preemptions
    groups = disagg.input_processor.make_sequences(prompts, [params] * len(prompts))
    engine.add_sequences(seq for group in groups for seq in group)
    # Every prompt's KV into the pool before the first decode step, however fast the link and the decodes are: then
    # four requests grow together in a pool too small for all of them (4 x ~8 blocks, 24 blocks), so one must be
    # preempted and recomputed. (Left to the engine, a fast quiet machine may finish one pair before the next arrives.)
    while engine.to_prefill or engine.in_transit:
        engine._dispatch()
        failed: list[object] = []
        engine._take(engine.client.wait(), time.perf_counter(), [], failed)
        assert not failed
        engine._admit_arrived()
    assert len(engine.scheduler.running) == len(prompts)
    while engine.has_unfinished_requests():
        engine.step()
    for out in disagg.output_processor.make_outputs(groups):
        assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, 32)
    assert engine.num_preemptions > preemptions  # someone was recomputed, and its tokens are still transformers'
    assert_no_leaks(disagg)


def test_seeded_sampling_and_n_equal_chunked(disagg, bundled_path) -> None:
    prompts = story_prompts(3, seed=8)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=11, n=2)
    with LLM(str(bundled_path), engine="chunked", block_size=8) as chunked:
        expected = [[c.token_ids for c in o.outputs] for o in chunked.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in disagg.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert_no_leaks(disagg)


def test_abort_while_in_transit_drops_the_kv(disagg, bundled_path) -> None:
    seqs = disagg.add_request(story_prompts(1, seed=1)[0], GREEDY)
    disagg.engine._dispatch()  # handed to the prefill worker
    assert disagg.engine.abort_request(seqs[0].seq_id) is seqs[0]
    assert not disagg.engine.has_unfinished_requests()
    prompt = story_prompts(1, seed=2)[0]
    (out,) = disagg.generate([prompt], GREEDY, use_tqdm=False)  # its KV arrives meanwhile and is dropped
    assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, 12)
    assert disagg.engine.measure_link(1 << 16) > 0  # waits out any answer still on its way
    assert_no_leaks(disagg)


def test_bad_options_are_named() -> None:
    from labkit.core.disagg import DisaggregatedConfig
    with pytest.raises(ValueError, match="max_num_inflight_prefills"):
        DisaggregatedConfig(max_num_inflight_prefills=0)
    with pytest.raises(ValueError, match="async_scheduling"):
        DisaggregatedConfig(async_scheduling=True)
    with pytest.raises(TypeError, match="prefill_worker_cls"):
        DisaggregatedConfig(prefill_worker_cls=int)  # type: ignore[arg-type]


def test_random_gqa_checkpoint_equals_transformers_and_close_ends_the_worker(random_checkpoint) -> None:
    path = random_checkpoint("qwen3")  # GQA (4 query heads, 2 KV heads), q/k norm
    prompts = [[1, 40, 41, 42, 43], [1, 99, 7], list(range(3, 40)), [1, 5]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with LLM(str(path), engine="disaggregated", block_size=5, dtype="float32") as llm:
        process = llm.engine.client.process
        outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)
        assert_no_leaks(llm)
    assert not process.is_alive() and process.exitcode == 0  # STOP: a clean exit


def test_failed_prefill_and_cut_transfer_fail_only_their_request(bundled_path) -> None:
    with LLM(str(bundled_path), engine="disaggregated", prefill_worker_cls=FaultyPrefillWorker) as llm:
        good = [[1, 200, 201, 202], [1, 300, 301]]
        expected = [hf_greedy(bundled_path, p, 12) for p in good]
        with pytest.raises(RequestFailedError) as info:
            llm.generate([good[0], [1, 50, FAIL_TOKEN], good[1]], GREEDY, use_tqdm=False)
        outs = info.value.outputs
        assert outs[1].outputs[0].finish_reason == "error"
        assert "prefill failed on the prefill worker: RuntimeError: planted prefill fault" in outs[1].outputs[0].error
        assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected
        assert_no_leaks(llm)  # the failed prefill's blocks went back on the prefill side too

        # A transfer cut off half-way (the worker dies after the header) while another request decodes.
        decoding = llm.add_request(good[0], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
        while not decoding.output_token_ids:
            llm.step()
        cut = llm.add_request([1, 60, CUT_TOKEN], GREEDY)[0]
        with pytest.raises(StepFailedError, match="prefill worker .* exited with code 3") as step_info:
            while True:
                llm.step()
        assert step_info.value.failed == [cut] and cut.finish_reason.value == "error"
        while not decoding.is_finished:  # the decode worker keeps serving what it holds
            llm.step()
        assert decoding.output_token_ids == hf_greedy(bundled_path, good[0], 30)
        assert not llm.is_alive()
        with pytest.raises(EngineDeadError, match="exited with code 3"):  # the engine is dead: every later call
            llm.generate([good[1]], GREEDY, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_killed_prefill_worker_fails_the_request_in_transit(bundled_path) -> None:
    with LLM(str(bundled_path), engine="disaggregated", prefill_worker_cls=FaultyPrefillWorker) as llm:
        decoding = llm.add_request([1, 200, 201], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
        while not decoding.output_token_ids:
            llm.step()
        slow = llm.add_request([1, 70, HOLD_TOKEN], GREEDY)[0]
        llm.step()  # dispatched: the worker holds it in its prefill until it is killed, however fast it is
        os.kill(llm.engine.client.pid, signal.SIGKILL)
        with pytest.raises(StepFailedError, match=r"exited with code -9"):
            while True:
                llm.step()
        assert slow.finish_reason.value == "error" and "-9" in slow.error
        while not decoding.is_finished:
            llm.step()
        assert decoding.output_token_ids == hf_greedy(bundled_path, [1, 200, 201], 40)
        assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_prefill_worker_exits_when_its_parent_dies(bundled_path, tmp_path) -> None:
    left = workers_left_by_killed_parent(tmp_path, bundled_path, 'engine="disaggregated"', "[llm.engine.client.pid]")
    assert left == [], f"prefill worker {left} outlived its parent"
