"""Engine ``kvcache``: transformers' greedy tokens, batch-independent outputs, visible static-batch waste."""

from __future__ import annotations

import pytest
from conftest import RANDOM_KINDS, hf_greedy
from test_naive_engine import PROMPTS

from labkit import LLM, SamplingParams

MIXED = [[1, 40, 41, 42, 43], [1, 99, 7], list(range(3, 40)), [1, 5]]


def test_bundled_single_and_batched_greedy_equal_transformers(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="kvcache", device="cpu", max_num_seqs=3)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)  # one padded batch of three different lengths
    assert len({len(o.prompt_token_ids) for o in outs}) > 1
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, 20)
    single = llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert single.outputs[0].token_ids == outs[1].outputs[0].token_ids


@pytest.mark.parametrize("kind", list(RANDOM_KINDS))
def test_random_checkpoint_batched_greedy_equals_transformers(random_checkpoint, kind: str) -> None:
    path = random_checkpoint(kind)
    llm = LLM(str(path), engine="kvcache", max_num_seqs=4)
    outs = llm.generate(MIXED, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(MIXED, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 10)


def test_batching_never_changes_outputs_float64(random_checkpoint) -> None:
    path = random_checkpoint("qwen2")
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 3, 7, 9)]
    results = []
    for engine, options in (("naive", {}), ("kvcache", {"max_num_seqs": 1}), ("kvcache", {"max_num_seqs": 3})):
        llm = LLM(str(path), engine=engine, dtype="float64", **options)
        results.append([o.outputs[0].token_ids for o in llm.generate(MIXED, params, use_tqdm=False)])
    assert results[0] == results[1] == results[2]
    assert [len(r) for r in results[0]] == [12, 3, 7, 9]


def test_seeded_sampling_is_independent_of_batch_composition(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="kvcache", max_num_seqs=4)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=11, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True) for m in (4, 15)]
    batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others[0], p, others[1]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone


def test_static_batch_keeps_finished_rows_and_pads_prompts(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="kvcache", max_num_seqs=4)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (2, 6, 4)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.engine.step_stats
    assert len(stats) == 6  # the batch runs until its longest request is done
    assert all(s.num_seqs == 3 for s in stats)  # finished rows keep their slot
    assert [s.num_idle_slots for s in stats] == [0, 0, 1, 1, 2, 2]
    assert [s.num_new_tokens for s in stats] == [3, 3, 2, 2, 1, 1]
    lens = [len(o.prompt_token_ids) for o in outs]
    assert stats[0].is_prefill and stats[0].num_computed_tokens == 3 * max(lens)
    assert stats[0].num_padding_tokens == sum(max(lens) - n for n in lens)
    assert not stats[1].is_prefill and stats[1].num_computed_tokens == 3
    # Every row started at the same time and the slow request set the batch's end.
    assert len({o.metrics.first_scheduled_time for o in outs}) == 1


def test_requests_beyond_max_num_seqs_wait_for_the_next_batch(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="kvcache", max_num_seqs=2)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert outs[2].metrics.first_scheduled_time >= max(o.metrics.finished_time for o in outs[:2])
    assert not llm.engine.has_unfinished_requests()


def test_stop_strings_and_stream_with_the_cache(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="kvcache")
    full = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    stop = " ".join(words[3:5])  # a stop string that spans several tokens
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    streamed = "".join(llm.stream(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0, stop=[stop])))
    assert streamed == out.text


def test_max_num_seqs_is_checked(bundled_path) -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be an int >= 1, got 0"):
        LLM(str(bundled_path), engine="kvcache", max_num_seqs=0)


def test_subclasses_prepare_prefill_and_attention_mask_run_inside_the_engine(bundled_path) -> None:
    from labkit.core.engine.kvcache import KVCacheEngine
    from labkit.core.kv.contiguous import ContiguousKVCache

    batches: list[list[int]] = []
    masks: list[tuple[int, ...]] = []

    class MyEngine(KVCacheEngine):  # notebook 05's Task 2
        def prepare_prefill(self, seqs):  # type: ignore[no-untyped-def]
            batches.append([s.num_prompt_tokens for s in seqs])
            return super().prepare_prefill(seqs)

    class MyCache(ContiguousKVCache):  # notebook 05's Task 3
        def attention_mask(self, valid, start):  # type: ignore[no-untyped-def]
            mask = super().attention_mask(valid, start)
            masks.append(tuple(mask.shape))
            return mask

    llm = LLM(str(bundled_path), engine=MyEngine, kv_cache_cls=MyCache, max_num_seqs=2)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    lens = [len(o.prompt_token_ids) for o in outs]
    assert batches == [lens[:2], lens[2:]]
    assert masks == [(2, 1, max(lens[:2]), max(lens[:2])), (2, 1, 1, max(lens[:2]) + 1),
                     (2, 1, 1, max(lens[:2]) + 2), (1, 1, lens[2], lens[2]), (1, 1, 1, lens[2] + 1),
                     (1, 1, 1, lens[2] + 2)]
    for out in outs:
        assert out.outputs[0].token_ids == hf_greedy(bundled_path, out.prompt_token_ids, 3)
