"""Speculative decoding is exact under greedy decoding: the same tokens as plain decoding and as transformers, for
both proposers, in engines ``continuous`` and ``chunked``, in float32 and float64, with chunking and preemption
forced by small budgets; every proposal path (accepted, rejected) is exercised and every block comes back."""

from __future__ import annotations

import pytest
from conftest import hf_greedy

from labkit import LLM, SamplingParams

# A story the bundled model tells, quoted before it starts again (prompt lookup finds what follows), and plain
# prompts (it mostly misses).
QUOTE = ("Once upon a time, there was a proud boy. His name was Harry. Every day, Nora would play the drum with his "
         "mom. One foggy morning, He saw a basket of cookies to the water. Soon, ")
PROMPTS = [QUOTE + "Once upon a time", "Once upon a time", QUOTE + "Every day,", "The little dog"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1}
MAX_TOKENS = 16


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def assert_all_blocks_free(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    engine.block_manager.check_invariants([])


@pytest.fixture(scope="module")
def float64_plain(bundled_path):  # type: ignore[no-untyped-def]
    llm = LLM(str(bundled_path), engine="kvcache", dtype="float64", max_num_seqs=1)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
@pytest.mark.parametrize("engine", ["continuous", "chunked"])
def test_float32_equals_transformers(bundled_path, engine: str, spec: dict) -> None:
    llm = LLM(str(bundled_path), engine=engine, block_size=4, debug_checks=True, speculative_config=spec)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, MAX_TOKENS)
    stats = llm.engine.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "both accepted and rejected proposals"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("spec", [NGRAM, DRAFT], ids=["ngram", "draft"])
@pytest.mark.parametrize("engine", ["continuous", "chunked"])
def test_float64_under_pressure_equals_plain(bundled_path, float64_plain, engine: str, spec: dict) -> None:
    """A pool of 20 blocks of 4 tokens cannot hold four requests with their lookahead: preemptions; a 12-token
    budget (chunked) splits the prompts and squeezes the lookahead."""
    budget = {"max_num_batched_tokens": 12} if engine == "chunked" else {}
    llm = LLM(str(bundled_path), engine=engine, dtype="float64", block_size=4, num_gpu_blocks=20,
              debug_checks=True, speculative_config=spec, **budget)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == float64_plain
    assert llm.engine.num_preemptions > 0
    assert llm.engine.spec_decoding_stats.num_accepted_tokens > 0
    if engine == "chunked":
        assert any(0 < s.num_prefill_tokens < s.num_computed_tokens for s in llm.engine.step_stats), (
            "some step mixed a prefill chunk with speculative decodes")
    assert_all_blocks_free(llm)


def test_stops_mid_proposal_and_prefix_caching(bundled_path) -> None:
    """max_tokens not a multiple of k + 1, a stop token, parallel samples sharing prompt blocks (copy-on-write) and
    prefix caching: the output is still plain decoding's, token for token."""
    prompts = PROMPTS[:2] * 2
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 7, 11)]
    plain = LLM(str(bundled_path), engine="chunked", block_size=4, enable_prefix_caching=True)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    stop = want[3][5]
    stop_params = SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    want_stop = plain.generate(prompts[3], stop_params, use_tqdm=False)[0].outputs[0].token_ids
    # The draft proposer: it reads the blocks copy-on-write fills, so it must run the step's copies first.
    llm = LLM(str(bundled_path), engine="chunked", block_size=4, enable_prefix_caching=True, debug_checks=True,
              speculative_config=DRAFT)
    for _ in range(2):  # the second round hits the prefix cache
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert llm.generate(prompts[3], stop_params, use_tqdm=False)[0].outputs[0].token_ids == want_stop
    assert want_stop[-1] == stop
    n2 = SamplingParams(n=2, max_tokens=9, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts[0], n2, use_tqdm=False)[0].outputs
    assert outs[0].token_ids == outs[1].token_ids == want[2][:7] + outs[0].token_ids[7:]
    assert llm.engine.block_manager.hit_rate > 0
    assert_all_blocks_free(llm)
