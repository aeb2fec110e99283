"""Bad input gets an exception that names the problem and the limit, before any work starts."""

from __future__ import annotations

import pytest

from labkit import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(bundled_path) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(bundled_path), engine="naive", max_model_len=64)


def test_empty_prompt(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0 is an empty token list"):
        llm.generate([[]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_prompt_longer_than_the_context(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt 0 has 70 tokens.*max_model_len 64"):
        llm.generate([[5] * 70], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"60 prompt tokens \+ max_tokens 10 exceeds max_model_len 64.*at most 4"):
        llm.generate([[5] * 60], SamplingParams(max_tokens=10), use_tqdm=False)


def test_bad_token_ids(llm: LLM) -> None:
    vocab = llm.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"token id {vocab} is outside the vocabulary \[0, {vocab}\)"):
        llm.generate([[1, vocab]], use_tqdm=False)
    with pytest.raises(TypeError, match="token ids must be ints, got str"):
        llm.generate([[1, "2"]], use_tqdm=False)
    with pytest.raises(TypeError, match="must be a string or a list of token ids"):
        llm.generate([3.5], use_tqdm=False)


def test_a_bad_request_stops_the_batch_before_any_work(llm: LLM) -> None:
    llm.engine.step_stats.clear()
    with pytest.raises(ValueError):
        llm.generate(["good", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.step_stats == [] and not llm.engine.has_unfinished_requests()
    assert llm.generate(["good"], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": -3}, ValueError, "max_tokens must be >= 1, got -3"),
        ({"max_tokens": 2.5}, TypeError, "max_tokens must be an int"),
        ({"temperature": -0.1}, ValueError, r"temperature must be >= 0.*got -0.1"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, ValueError, "top_k must be -1 .* or an integer >= 1, got 0"),
        ({"top_k": -2}, ValueError, "top_k must be -1"),
        ({"n": 0}, ValueError, "n must be >= 1, got 0"),
        ({"stop": [""]}, ValueError, "stop strings must be non-empty"),
        ({"seed": "42"}, TypeError, "seed must be an int or None, got str"),
        ({"seed": 1.5}, TypeError, "seed must be an int or None, got float 1.5"),
        ({"seed": -1}, ValueError, r"seed must be in \[0, 9223372036854775807\] .*got -1"),
        ({"seed": 2**63 - 1, "n": 2}, ValueError, r"seed must be in \[0, 9223372036854775806\] \(n=2 samples"),
        ({"temperature": float("nan")}, ValueError, "temperature must be >= 0 .*finite, got nan"),
        ({"temperature": float("inf")}, ValueError, "temperature must be >= 0 .*finite, got inf"),
        ({"temperature": 1e-9}, ValueError, r"temperature must be 0 \(greedy\) or >= 1e-05, got 1e-09"),
        ({"temperature": "hot"}, TypeError, "temperature must be a number, got str 'hot'"),
        ({"top_p": float("nan")}, ValueError, r"top_p must be in \(0, 1\], got nan"),
        ({"top_k": 2.5}, ValueError, "top_k must be -1 .*got 2.5"),
        ({"n": 1.0}, TypeError, "n must be an int, got float 1.0"),
        ({"max_tokens": True}, TypeError, "max_tokens must be an int, got bool True"),
        ({"stop": [3]}, ValueError, "stop strings must be non-empty strings, got 3"),
        ({"stop": 3}, TypeError, "stop must be a list, got int 3"),
        ({"stop_token_ids": [-1]}, ValueError, "stop_token_ids must be non-negative ints, got -1"),
        ({"stop_token_ids": 7}, TypeError, "stop_token_ids must be a list, got int 7"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos must be True or False, got 1"),
        ({"skip_special_tokens": None}, TypeError, "skip_special_tokens must be True or False, got None"),
        ({"max_token": 5}, TypeError, r"SamplingParams got unknown option\(s\) max_token; it accepts: n, "),
    ],
)
def test_sampling_params_are_checked(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_unknown_engine_and_option(bundled_path) -> None:
    with pytest.raises(ValueError, match="unknown engine 'turbo'; engines are .*naive"):
        LLM(str(bundled_path), engine="turbo")
    with pytest.raises(ValueError, match="does not take option.*max_num_seqs.*accepts: max_model_len"):
        LLM(str(bundled_path), engine="naive", max_num_seqs=4)
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 2048\]"):
        LLM(str(bundled_path), engine="naive", max_model_len=4096)


def test_params_list_must_match_prompts(llm: LLM) -> None:
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_unknown_device_is_named(bundled_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(str(bundled_path), engine="naive", device="cuda")


def test_sampling_params_are_checked_again_when_used(llm: LLM) -> None:
    """Fields can be changed after construction; LLM re-checks them before any work."""
    params = SamplingParams(max_tokens=2)
    params.top_p = 0.0
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        llm.generate("good", params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
