"""Bad input, for every engine: a bad prompt, token id or ``SamplingParams`` anywhere in a batch rejects the
whole batch with a clear error naming the field, the value and the limit, before the engine runs a step (the
valid prompts, submitted alone, are unaffected); integer-like token ids and tuples are accepted, prompts of only
special tokens generate normally, and ``SamplingParams`` and the engine options name unknown or bad options.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from labkit import LLM, SamplingParams

from .reliability_common import ALL, PAGED, PROMPTS, Reference, greedy, tokens


def bad_prompts(vocab: int) -> list[tuple[object, type[Exception], str]]:
    return [
        ("", ValueError, r"prompt 1 is empty"),
        ([], ValueError, r"prompt 1 is an empty token list"),
        ([5] * 70, ValueError,
         r"prompt 1 has 70 tokens, which leaves no room .* max_model_len 64; shorten it to at most 63"),
        ([1, vocab], ValueError, rf"prompt 1: token id {vocab} is outside the vocabulary \[0, {vocab}\)"),
        ([1, -1], ValueError, rf"prompt 1: token id -1 is outside the vocabulary \[0, {vocab}\)"),
        ([1, "2"], TypeError, r"prompt 1: token ids must be ints, got str '2'"),
        ([1, 2.0], TypeError, r"prompt 1: token ids must be ints, got float 2.0"),
        ([1, True], TypeError, r"prompt 1: token ids must be ints, got bool True"),
        ([1, None], TypeError, r"prompt 1: token ids must be ints, got NoneType None"),
        ([1, [2]], TypeError, r"prompt 1: token ids must be ints, got list \[2\]"),
        (3.5, TypeError, r"prompt 1 must be a string or a list of token ids, got float"),
        (None, TypeError, r"prompt 1 must be a string or a list of token ids, got NoneType"),
        ({"prompt": "hi"}, TypeError, r"prompt 1 must be a string or a list of token ids, got dict"),
        (b"hi", TypeError, r"prompt 1 must be a string or a list of token ids, got bytes"),
    ]


def mutated(**changes: object) -> SamplingParams:
    """SamplingParams checks itself when made; LLM checks again, since its fields can be changed later."""
    p = greedy(4)
    for name, value in changes.items():
        setattr(p, name, value)
    return p


BAD_PARAMS: list[tuple[object, object, type[Exception], str]] = [
    ([5] * 60, greedy(10), ValueError,
     r"prompt 1: 60 prompt tokens \+ max_tokens 10 exceeds max_model_len 64; lower max_tokens to at most 4"),
    ("Hello", mutated(max_tokens=0), ValueError, r"max_tokens must be >= 1, got 0"),
    ("Hello", mutated(max_tokens=-2), ValueError, r"max_tokens must be >= 1, got -2"),
    ("Hello", mutated(temperature=-0.5), ValueError, r"temperature must be >= 0 .*got -0.5"),
    ("Hello", mutated(temperature=float("nan")), ValueError, r"temperature must be >= 0 .* finite, got nan"),
    ("Hello", mutated(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    ("Hello", mutated(top_k=0), ValueError, r"top_k must be -1 \(disabled\) or an integer >= 1, got 0"),
    ("Hello", mutated(n=0), ValueError, r"n must be >= 1, got 0"),
    ("Hello", mutated(stop=[""]), ValueError, r"stop strings must be non-empty strings, got ''"),
    ("Hello", mutated(seed="7"), TypeError, r"seed must be an int or None, got str '7'"),
    ("Hello", "greedy", TypeError, r"sampling params 1 must be a SamplingParams, got str"),
]


@pytest.mark.parametrize("engine", ALL)
def test_one_bad_prompt_rejects_the_batch_before_any_work(llms: Callable[[str], LLM], engine: str) -> None:
    llm = llms(engine)
    alone = tokens(llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False))
    for bad, error, message in bad_prompts(llm.model_config.vocab_size):
        steps = llm.engine.num_steps
        with pytest.raises(error, match=message):
            llm.generate([PROMPTS[0], bad, PROMPTS[1]], greedy(4), use_tqdm=False)
        assert llm.engine.num_steps == steps, f"{bad!r}: the engine ran before the bad prompt was found"
        assert not llm.engine.has_unfinished_requests()
    # The valid ones, submitted alone, are unaffected.
    assert tokens(llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)) == alone


@pytest.mark.parametrize("engine", ALL)
def test_one_bad_sampling_params_rejects_the_batch_before_any_work(llms: Callable[[str], LLM], engine: str) -> None:
    llm = llms(engine)
    alone = tokens(llm.generate(PROMPTS[0], greedy(4), use_tqdm=False))
    for bad_prompt, bad_params, error, message in BAD_PARAMS:
        steps = llm.engine.num_steps
        with pytest.raises(error, match=message):
            llm.generate([PROMPTS[0], bad_prompt], [greedy(4), bad_params], use_tqdm=False)  # type: ignore[list-item]
        assert llm.engine.num_steps == steps and not llm.engine.has_unfinished_requests()
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them, got str"):
        llm.generate(PROMPTS[0], "greedy", use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(PROMPTS[:2], [greedy(4)], use_tqdm=False)
    with pytest.raises(TypeError, match="prompts must be a string, a list of token ids, or a list of those; got int"):
        llm.generate(7, use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"stream takes n=1 \(one sequence\), got n=2"):
        next(llm.stream(PROMPTS[0], SamplingParams(n=2)))
    assert llm.engine.num_steps == steps and not llm.engine.has_unfinished_requests()
    assert tokens(llm.generate(PROMPTS[0], greedy(4), use_tqdm=False)) == alone


@pytest.mark.parametrize("engine", ALL)
def test_integer_like_token_ids_and_tuples_are_accepted(llms: Callable[[str], LLM], engine: str) -> None:
    np = pytest.importorskip("numpy")
    llm = llms(engine)
    ids = llm.encode(PROMPTS[0])
    want = tokens(llm.generate([ids], greedy(3), use_tqdm=False))
    assert tokens(llm.generate([list(np.array(ids))], greedy(3), use_tqdm=False)) == want
    assert tokens(llm.generate(tuple(ids), greedy(3), use_tqdm=False)) == want  # one prompt, as a tuple


@pytest.mark.parametrize("engine", ALL)
def test_prompts_of_only_special_tokens_generate_normally(llms: Callable[[str], LLM], reference: Reference,
                                                          engine: str) -> None:
    """Accepted, as in vLLM (they are not empty): EOS in the prompt does not stop generation."""
    llm = llms(engine)
    tok = llm.tokenizer
    end = tok.convert_tokens_to_ids("<|end|>")
    prompts = [[tok.bos_token_id], [tok.eos_token_id], [tok.eos_token_id] * 3, [tok.pad_token_id], "<|user|><|end|>",
               "<|end|>"]
    assert llm.encode("<|end|>") == [tok.bos_token_id, end]  # special tokens in text are parsed as such
    for ignore_eos in (False, True):
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=ignore_eos)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert tokens(outs) == reference(prompts, [params] * len(prompts))
        for out in outs:
            c = out.outputs[0]
            assert out.finished and c.error is None and isinstance(c.text, str)
            assert 1 <= len(c.token_ids) <= 6
            if not ignore_eos and c.token_ids[-1] in llm.eos_token_ids:
                assert c.finish_reason == "stop"
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 6
            assert not any(s in c.text for s in tok.all_special_tokens)  # skip_special_tokens=True


def test_sampling_params_name_unknown_options_and_bad_types() -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) max_token; it accepts: n, temperature"):
        SamplingParams(max_token=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"stop must be a list, got int 5"):
        SamplingParams(stop=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ignore_eos must be True or False, got 'yes'"):
        SamplingParams(ignore_eos="yes")  # type: ignore[arg-type]
    assert SamplingParams(stop="The end").stop == ["The end"]  # one string is one stop string, as in vLLM
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ALL)
def test_engine_options_are_checked(tiny: Path, engine: str) -> None:
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 512\] .* got '64'"):
        LLM(str(tiny), engine=engine, max_model_len="64")
    with pytest.raises(ValueError, match=rf"engine '{engine}' does not take option\(s\) max_num_seq; it accepts: "):
        LLM(str(tiny), engine=engine, max_num_seq=4)
    if engine in PAGED:
        with pytest.raises(ValueError, match=r"block_size must be an int >= 1, got 0"):
            LLM(str(tiny), engine=engine, block_size=0)
        with pytest.raises(ValueError, match=r"num_gpu_blocks must be an int >= 1, got 0"):
            LLM(str(tiny), engine=engine, num_gpu_blocks=0)
