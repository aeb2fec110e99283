"""Decode steps through ``DecodeGraphs``: padded to batch-size buckets and power-of-two table widths,
padding rows confined to the scratch block. Off CUDA the same static-shape path runs eagerly, so its
padding logic is checked here on every machine; tests/core/engine/test_cuda_paths.py replays real graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.core.engine.model_runner import ModelRunner
from labkit.core.kv.block_manager import BlockManager


def run(path, graphs: bool, **options) -> tuple[list[list[int]], LLM]:  # type: ignore[no-untyped-def]
    llm = LLM(str(path), engine="chunked", dtype="float64", block_size=4, debug_checks=True, **options)
    if graphs:
        llm.engine.runner.use_decode_graphs((1, 2, 4, 8), max_blocks=llm.engine.block_manager.blocks_needed(256),
                                            capture=False)
    prompts = [[1, 40, 41, 42, 43], [1, 99, 7], list(range(3, 40)), [1, 5], list(range(50, 61))]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (9, 3, 14, 6, 11)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("prepare_inputs", ["loop", "vectorized"])
def test_padded_static_decode_gives_the_same_tokens(random_checkpoint, prepare_inputs: str) -> None:
    path = random_checkpoint("llama")
    reference, _ = run(path, graphs=False)
    tokens, llm = run(path, graphs=True, prepare_inputs=prepare_inputs)
    assert tokens == reference
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.num_runs > 0  # decode steps really went through the padded path
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_scratch_block_is_never_handed_out(random_checkpoint) -> None:
    path = random_checkpoint("llama")
    llm = LLM(str(path), engine="chunked", block_size=4, num_gpu_blocks=6)
    engine = llm.engine
    assert engine.runner.pool.num_blocks == engine.block_manager.num_blocks + 1 == 7
    graphs = engine.runner.use_decode_graphs((1, 2), max_blocks=6, capture=False)
    assert graphs.scratch_block == 6
    scratch_before = engine.runner.pool.k[0][6].clone()
    outs = llm.generate([[1, 2, 3, 4, 5, 6, 7]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 12
    # Only padding rows may write the scratch block; a batch of one in bucket 1 has none.
    assert torch.equal(engine.runner.pool.k[0][6], scratch_before)
    assert graphs.num_runs > 0


def test_decode_graphs_need_a_scratch_block(random_checkpoint) -> None:
    engine = LLM(str(random_checkpoint("llama")), engine="chunked", block_size=4).engine
    pool = engine.runner.pool
    runner = ModelRunner(engine.model, pool, BlockManager(pool.num_blocks, 4))  # no block left over
    with pytest.raises(ValueError, match="scratch block"):
        runner.use_decode_graphs((1, 2), max_blocks=4, capture=False)
