"""``speculative_config``: vLLM's keys, clear errors for bad values and unsupported engines; prompt lookup;
sampled requests run speculatively (seeded ones reproducibly) and give every block back."""

from __future__ import annotations

import pytest

from labkit import LLM, SamplingParams
from labkit.core.spec_decode.config import SpeculativeConfig
from labkit.core.spec_decode.ngram_proposer import ngram_lookup

QUOTE = ("Once upon a time, there was a proud boy. His name was Harry. Every day, Nora would play the drum with his "
         "mom. One foggy morning, He saw a basket of cookies to the water. Soon, Once upon a time")


def test_ngram_lookup_takes_the_latest_longest_match() -> None:
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], k=2, min_n=1, max_n=3) == [7, 5]
    assert ngram_lookup([4, 5, 6, 4, 5], k=3, min_n=1, max_n=3) == [6, 4, 5]  # the suffix (4, 5) recurs at 0
    assert ngram_lookup([1, 2, 3, 4], k=3, min_n=1, max_n=3) == []  # nothing recurs
    assert ngram_lookup([8, 1, 9, 1], k=3, min_n=2, max_n=3) == []  # only a 1-gram recurs, below min_n
    assert ngram_lookup([8, 1, 9, 1], k=3, min_n=1, max_n=3) == [9, 1]
    assert ngram_lookup([5], k=3, min_n=1, max_n=3) == []


@pytest.mark.parametrize("option, message", [
    ({"method": "eagle"}, "method must be one of ngram, draft_model"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an int >= 1"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min 4 exceeds prompt_lookup_max 2"),
    ({"model": "some/draft"}, "a separate draft checkpoint"),
    ({"num_spec_tokens": 3}, "unknown key(s) num_spec_tokens"),
    ({"rejection_sampler_cls": int}, "subclass of labkit.core.spec_decode.RejectionSampler"),
])
def test_bad_options_are_named(option: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_option(option)


def test_engines_that_cannot_speculate_say_so(bundled_path) -> None:
    with pytest.raises(ValueError, match="does not take option"):
        LLM(str(bundled_path), engine="paged", speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="async_scheduling"):
        LLM(str(bundled_path), engine="chunked", async_scheduling=True, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="draft_num_layers 4 must be below the target's 4 layers"):
        LLM(str(bundled_path), engine="chunked", speculative_config={"method": "draft_model", "draft_num_layers": 4})


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_sampled_requests_speculate_reproducibly(bundled_path, method: str) -> None:
    spec = {"method": method, "num_speculative_tokens": 3, "draft_num_layers": 2}
    llm = LLM(str(bundled_path), engine="chunked", block_size=4, num_gpu_blocks=40, debug_checks=True,
              speculative_config=spec)
    params = [SamplingParams(max_tokens=10, temperature=t, top_k=k, top_p=p, seed=s, ignore_eos=True)
              for t, k, p, s in ((0.8, -1, 1.0, 1), (1.0, 20, 0.9, 2), (0.0, -1, 1.0, None), (0.5, -1, 0.8, 3))]
    prompts = [QUOTE, QUOTE, QUOTE, "The little dog"]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert first == again  # run again, seeded requests (and the greedy one) draw the same tokens
    assert all(len(t) == 10 and all(0 <= x < 2048 for x in t) for t in first)
    assert llm.engine.spec_decoding_stats.num_accepted_tokens > 0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks
