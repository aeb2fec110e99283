"""``LLM(..., tensor_parallel_size=2)``: two processes over gloo give transformers' greedy tokens (and N=1's) in
float64 on the bundled model and on a held-out random GQA checkpoint with fewer K/V heads than ranks; a rank killed
mid-run ends every request with an error naming it and leaves no process behind; the ranks exit when their parent
dies. Few engines are started (each is a process start), and each runs short requests: CI has 2 cores."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import hf_greedy
from worker_processes import wait_gone, workers_left_by_killed_parent

from labkit import LLM, SamplingParams
from labkit.core.engine.errors import EngineDeadError
from labkit.core.engine.output_processor import RequestFailedError
from labkit.core.parallel import TensorParallelEngineCore

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def test_bundled_model_float64_equals_transformers_and_n1(bundled_path) -> None:
    prompts = [[1, 200, 201, 202], [1, 300, 301], list(range(5, 45))]  # the long one is chunked (budget 16)
    with LLM(str(bundled_path), engine="chunked", dtype="float64", tensor_parallel_size=2,
             max_num_batched_tokens=16) as llm:
        assert isinstance(llm.engine, TensorParallelEngineCore)
        assert llm.engine.pool.k[0].shape[2] == llm.model_config.num_key_value_heads // 2  # its heads' share
        pids = llm.engine.executor.pids
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(str(bundled_path), engine="chunked", dtype="float64", max_num_batched_tokens=16) as single:
        ones = single.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out, one in zip(prompts, outs, ones):
        assert out.outputs[0].token_ids == one.outputs[0].token_ids == hf_greedy(bundled_path, prompt, 10)
    assert wait_gone(pids) == []  # close() stopped the rank


def test_held_out_gqa_with_fewer_kv_heads_than_ranks(random_checkpoint) -> None:
    path = random_checkpoint("llama3-rope")  # 4 query heads, 1 K/V head (replicated on both ranks), untied lm_head
    prompts = [[1, 40, 41, 42, 43], [1, 99, 7], list(range(3, 30))]
    with LLM(str(path), engine="continuous", dtype="float64", tensor_parallel_size=2, block_size=4) as llm:
        assert llm.engine.pool.k[0].shape[2] == 1
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 10)


def test_a_killed_rank_fails_every_request_and_leaves_no_process(bundled_path) -> None:
    with LLM(str(bundled_path), engine="continuous", tensor_parallel_size=2) as llm:
        engine = llm.engine
        pids = engine.executor.pids

        def kill_at_step_3(seqs: list) -> None:  # type: ignore[type-arg]
            if engine.num_steps == 3:
                os.kill(pids[0], signal.SIGKILL)

        engine.fault_hook = kill_at_step_3
        with pytest.raises(RequestFailedError) as info:
            llm.generate([[1, 200, 201], [1, 300], [1, 5, 6, 7]], SamplingParams(max_tokens=30, temperature=0,
                                                                                  ignore_eos=True), use_tqdm=False)
        for out in info.value.outputs:
            completion = out.outputs[0]
            assert completion.finish_reason == "error"
            assert "engine is dead" in completion.error and "rank 1" in completion.error
            assert "exited with code -9" in completion.error
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        assert wait_gone(pids) == []
        assert not llm.is_alive()
        with pytest.raises(EngineDeadError, match="rank 1"):  # every later call says why
            llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


def test_ranks_exit_when_their_parent_dies(bundled_path, tmp_path) -> None:
    left = workers_left_by_killed_parent(tmp_path, bundled_path, 'engine="continuous", tensor_parallel_size=2',
                                         "llm.engine.executor.pids")
    assert left == [], f"rank(s) {left} outlived their parent"
