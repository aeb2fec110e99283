"""Reliability through ``LLM``, for every engine: bad input, memory pressure, faults, interrupts, aborts.

Outputs are compared in float64 with a reference that runs one request at a time over a contiguous
cache, so any corruption left behind by a fault, an abort or a preemption shows up as a changed token.
(The test suite's conftest also runs paged engines with per-step invariant checks and verifies that
every engine gives all its KV blocks back after each test.)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import assert_memory_returned
from labkit import ENGINES, LLM, RequestOutput, SamplingParams
from labkit.engine.base import StepFailedError
from labkit.llm import RequestFailedError
from labkit.sequence import Sequence

ALL = list(ENGINES)
PAGED = ["paged", "continuous", "chunked"]
PROMPTS = ["Once upon a time", "The little fox ran to the", "One day, Lily went to the park with her mom",
           "There once was a kind seal", "A big red"]

Reference = Callable[[list, list[SamplingParams]], list[list[list[int]]]]


def batch_options(engine: str) -> dict[str, object]:
    """Small batches, so a fault or an interrupt hits some requests and not others."""
    return {} if engine == "naive" else {"max_num_seqs": 2}


def tokens(outs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(random_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return random_checkpoint("llama")


@pytest.fixture(scope="module")
def reference(tiny: Path) -> Reference:
    """Each prompt's completions from the simplest schedule: one request at a time, contiguous cache, float64."""
    ref = LLM(str(tiny), engine="kvcache", dtype="float64", max_num_seqs=1)

    def run(prompts: list, params: list[SamplingParams]) -> list[list[list[int]]]:  # type: ignore[type-arg]
        return tokens(ref.generate(prompts, params, use_tqdm=False))

    return run


@pytest.fixture(scope="module")
def llms(tiny: Path) -> Callable[[str], LLM]:
    """One float64 LLM per engine with a 64-token context, shared by the bad-input tests."""
    made: dict[str, LLM] = {}

    def get(engine: str) -> LLM:
        if engine not in made:
            made[engine] = LLM(str(tiny), engine=engine, dtype="float64", max_model_len=64, **batch_options(engine))
        return made[engine]

    return get


def make(tiny: Path, engine: str, **options: object) -> LLM:
    return LLM(str(tiny), engine=engine, dtype="float64", **{**batch_options(engine), **options})


# ---- 1. bad input: a clear error naming the field, the value and the limit, before any work ----


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


# ---- 2. memory pressure: pools from one block up ----

POOLS = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (1, 4), (2, 4), (3, 5), (2, 8), (4, 8)]


def fitting_workload(rng: random.Random, block_size: int, num_blocks: int, n: int
                     ) -> tuple[list[list[int]], list[SamplingParams]]:
    """Requests that each fit the pool alone (prompt + max_tokens - 1 tokens); the first two, when the pool
    has 4+ blocks, each grow to the whole pool, so running them together needs a preemption."""
    capacity = block_size * num_blocks
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    if num_blocks >= 4:
        filler = (num_blocks // 2) * block_size - 1 if block_size > 1 else num_blocks // 2
        for _ in range(2):
            prompts.append([1] + [rng.randrange(3, 2000) for _ in range(filler - 1)])
            params.append(greedy(capacity - filler + 1))
    while len(prompts) < n:
        total = rng.randint(2, capacity + 1)  # prompt + max_tokens
        prompt_len = rng.randint(1, total - 1)
        prompts.append([rng.randrange(3, 2000) for _ in range(prompt_len)])
        if rng.random() < 0.5:
            params.append(greedy(total - prompt_len))
        else:
            params.append(SamplingParams(max_tokens=total - prompt_len, temperature=0.9, top_k=rng.choice([-1, 20]),
                                         seed=rng.randrange(1000), n=rng.choice([1, 2])))
    return prompts, params


@pytest.mark.parametrize("engine", PAGED)
@pytest.mark.parametrize(("block_size", "num_blocks"), POOLS)
def test_tiny_pools_complete_every_request_that_fits(tiny: Path, reference: Reference, engine: str,
                                                     block_size: int, num_blocks: int) -> None:
    capacity = block_size * num_blocks
    budget = {"max_num_batched_tokens": 3} if engine == "chunked" else {}
    llm = make(tiny, engine, block_size=block_size, num_gpu_blocks=num_blocks, max_num_seqs=4, **budget)
    # A prompt that cannot fit even alone, and one that fits but whose output would not: clear errors, no work.
    need = -(-(capacity + 1) // block_size)
    with pytest.raises(ValueError, match=rf"the prompt alone needs {need} KV blocks \({capacity + 1} tokens at "
                                         rf"block_size {block_size}\) but the pool has only {num_blocks} "
                                         rf"\({capacity} tokens\)"):
        llm.generate([[1], [1] * (capacity + 1)], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match=rf"max_tokens 2 at block_size {block_size}\) but the pool has only "
                                         rf"{num_blocks}; lower max_tokens to at most 1"):
        llm.generate([[1] * capacity], greedy(2), use_tqdm=False)
    assert llm.engine.num_steps == 0
    # Everything that fits completes, through waiting and preemption, with the reference's tokens.
    prompts, params = fitting_workload(random.Random(capacity * 100 + num_blocks), block_size, num_blocks, 8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == reference(prompts, params)
    assert all(c.finish_reason in ("stop", "length") for o in outs for c in o.outputs)
    assert max(s.kv_blocks_used or 0 for s in llm.engine.step_stats) <= num_blocks
    if num_blocks >= 4:
        assert llm.engine.num_preemptions > 0


# ---- 3. faults: a failing step fails only its requests; the engine keeps serving ----


class Fault:
    """Fault hook: raises ``error`` at the ``at``-th step (counting from 1), remembering that step's sequences."""

    def __init__(self, at: int, error: BaseException) -> None:
        self.at, self.error, self.calls = at, error, 0
        self.hit: list[Sequence] = []

    def __call__(self, seqs: list[Sequence]) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.hit = list(seqs)
            raise self.error


def check_failed_run(outs: list[RequestOutput], want: list[list[list[int]]], failed_ids: set[int], reason: str,
                     message: str | None) -> None:
    """Failed sequences end with ``reason`` and a prefix of their tokens; every other one is untouched."""
    assert failed_ids
    seen_ok = 0
    for out, w in zip(outs, want):
        for j, c in enumerate(out.outputs):
            if int(out.request_id) + j in failed_ids:
                assert c.finish_reason == reason and c.token_ids == w[j][: len(c.token_ids)]
                if message is not None:
                    assert c.error is not None and message in c.error
            else:
                assert c.finish_reason == "length" and c.token_ids == w[j] and c.error is None
                seen_ok += 1
    assert seen_ok > 0, "the fault should have spared some requests"


@pytest.mark.parametrize("engine", ALL)
def test_a_failing_step_fails_only_its_requests(tiny: Path, reference: Reference, engine: str) -> None:
    llm = make(tiny, engine, **({"block_size": 2} if engine in PAGED else {}))
    params = [greedy(6 + i) for i in range(len(PROMPTS))]
    want = reference(PROMPTS, params)
    fault = Fault(at=3, error=RuntimeError("injected fault"))
    llm.engine.fault_hook = fault
    with pytest.raises(RequestFailedError, match=r"sequences failed \(prompt \d: engine step \d+ failed: "
                                                 r"RuntimeError: injected fault") as info:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert info.value.__cause__ is fault.error  # the traceback leads to where it happened
    failed = {s.seq_id for s in fault.hit}
    assert {i for i, _ in info.value.failed} == {i for i, o in enumerate(info.value.outputs)
                                                 if int(o.request_id) in failed}
    check_failed_run(info.value.outputs, want, failed, "error", "failed: RuntimeError: injected fault")
    assert_memory_returned([llm])
    llm.engine.fault_hook = None  # the same engine keeps serving, with unchanged outputs
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == want


@pytest.mark.parametrize("engine", ALL)
def test_a_fault_inside_the_forward_pass(tiny: Path, reference: Reference, engine: str,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The model raises half-way through a step (K/V partly written): the step's requests fail, nothing leaks."""
    llm = make(tiny, engine, **({"block_size": 3, "enable_prefix_caching": True} if engine in PAGED else {}))
    params = [greedy(5 + i) for i in range(len(PROMPTS))]
    want = reference(PROMPTS, params)
    layers = llm.model.model.layers
    real_forward = layers[1].forward
    calls = {"n": 0}
    current: list[Sequence] = []  # the running step's sequences, as the hook saw them
    hit: list[Sequence] = []
    llm.engine.fault_hook = lambda seqs: current.__setitem__(slice(None), seqs)

    def second_layer(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 4:  # the first layer of this step has already written its K/V
            hit[:] = current
            raise MemoryError("out of memory in layer 1")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(layers[1], "forward", second_layer)
    with pytest.raises(RequestFailedError) as info:
        llm.generate(PROMPTS, params, use_tqdm=False)
    check_failed_run(info.value.outputs, want, {s.seq_id for s in hit}, "error",
                     "MemoryError: out of memory in layer 1")
    assert_memory_returned([llm])
    monkeypatch.setattr(layers[1], "forward", real_forward)
    llm.engine.fault_hook = None
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == want


@pytest.mark.parametrize("engine", ["kvcache", *PAGED])  # naive has no scheduling to fail
def test_a_fault_while_scheduling_fails_what_was_running(tiny: Path, reference: Reference, engine: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Before a batch is known, a fault fails every sequence that holds engine state; waiting ones carry on."""
    llm = make(tiny, engine, **({"block_size": 2} if engine in PAGED else {}))
    params = [greedy(4 + i) for i in range(len(PROMPTS))]
    want = reference(PROMPTS, params)
    engine_obj = llm.engine
    running: list[Sequence] = []
    if engine in PAGED:
        target, name = engine_obj.scheduler, "schedule"  # type: ignore[attr-defined]
    else:
        target, name = engine_obj, "_start_batch"  # kvcache: the third static batch fails as it starts
    real = getattr(target, name)
    calls = {"n": 0}

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        result = real(*args, **kwargs)  # blocks (or a cache) are already handed out when it fails
        if calls["n"] == 3:
            running[:] = result.seqs if engine == "kvcache" else engine_obj.running_sequences()
            raise RuntimeError("scheduler bug")
        return result

    monkeypatch.setattr(target, name, flaky)
    with pytest.raises(RequestFailedError, match="RuntimeError: scheduler bug") as info:
        llm.generate(PROMPTS, params, use_tqdm=False)
    check_failed_run(info.value.outputs, want, {s.seq_id for s in running}, "error", "scheduler bug")
    assert_memory_returned([llm])
    monkeypatch.setattr(target, name, real)
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == want


def test_a_failing_step_raises_step_failed_error_from_step(tiny: Path) -> None:
    """The low-level path (add_request / step) sees the failure as StepFailedError naming the sequences."""
    llm = make(tiny, "chunked")
    seqs = [llm.add_request(p, greedy(4))[0] for p in PROMPTS[:3]]
    llm.engine.fault_hook = Fault(at=1, error=ValueError("bad batch"))
    with pytest.raises(StepFailedError, match=r"engine step 0 failed with ValueError: bad batch; failed its 2 "
                                              r"sequence\(s\) \(ids \d+, \d+\), the engine keeps serving") as info:
        llm.step()
    assert info.value.failed == seqs[:2] and all(s.finish_reason.value == "error" for s in seqs[:2])
    assert seqs[0].error == "engine step 0 failed: ValueError: bad batch"
    while llm.engine.has_unfinished_requests():
        llm.step()
    assert seqs[2].finish_reason.value == "length" and len(seqs[2].output_token_ids) == 4


@pytest.mark.parametrize("engine", ALL)
def test_a_failing_step_in_stream_raises_request_failed(tiny: Path, engine: str) -> None:
    llm = make(tiny, engine)
    llm.engine.fault_hook = Fault(at=3, error=RuntimeError("boom"))
    got: list[str] = []
    with pytest.raises(RequestFailedError, match="RuntimeError: boom") as info:
        got.extend(llm.stream(PROMPTS[0], greedy(10)))
    completion = info.value.outputs[0].outputs[0]
    assert completion.finish_reason == "error" and len(completion.token_ids) == 2  # two steps ran before the fault
    assert "".join(got) == completion.text  # what came before the fault was streamed
    assert_memory_returned([llm])


# ---- KeyboardInterrupt (the notebook's ■ button), aborts and disconnects ----


@pytest.mark.parametrize("engine", ALL)
def test_keyboard_interrupt_mid_step_leaves_the_engine_usable(tiny: Path, reference: Reference, engine: str) -> None:
    llm = make(tiny, engine, **({"block_size": 2} if engine in PAGED else {}))
    params = [greedy(6 + i) for i in range(len(PROMPTS))]
    want = reference(PROMPTS, params)
    fault = Fault(at=4, error=KeyboardInterrupt())
    llm.engine.fault_hook = fault
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert fault.hit and all(s.finish_reason.value == "abort" for s in fault.hit)
    assert not llm.engine.has_unfinished_requests()  # the whole call's requests were dropped
    assert_memory_returned([llm])
    llm.engine.fault_hook = None  # "the next cell"
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == want
    fault = Fault(at=2, error=KeyboardInterrupt())
    llm.engine.fault_hook = fault
    with pytest.raises(KeyboardInterrupt):
        for _ in llm.stream(PROMPTS[1], greedy(8)):
            pass
    assert not llm.engine.has_unfinished_requests()
    llm.engine.fault_hook = None
    assert tokens(llm.generate(PROMPTS[1], greedy(8), use_tqdm=False)) == reference([PROMPTS[1]], [greedy(8)])


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own Ctrl-C handler, as in a terminal or a notebook kernel. A process started in the background by
    a script (``cmd &``) inherits SIGINT ignored, and there the engine rightly leaves Ctrl-C alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
@pytest.mark.usefixtures("default_sigint")
@pytest.mark.parametrize("engine", ["kvcache", "chunked"])
def test_real_ctrl_c_at_random_moments(tiny: Path, reference: Reference, engine: str) -> None:
    """SIGINT from another thread at random moments of a run: the engine is consistent after every one."""
    llm = make(tiny, engine, **({"block_size": 2, "num_gpu_blocks": 40} if engine == "chunked" else {}))
    params = [greedy(60) for _ in PROMPTS]
    want = reference(PROMPTS, params)
    rng = random.Random(7)
    main = threading.get_ident()
    def interrupt(started: threading.Event, delay: float) -> None:
        started.wait(30)
        time.sleep(delay)
        signal.pthread_kill(main, signal.SIGINT)

    for _ in range(4):
        started = threading.Event()
        llm.engine.fault_hook = lambda seqs, started=started: started.set()  # type: ignore[misc]
        thread = threading.Thread(target=interrupt, args=(started, rng.uniform(0.0, 0.05)))
        thread.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS, params, use_tqdm=False)
                time.sleep(5)  # in case the run ended first (it is far longer than the delay): the signal lands here
        finally:
            thread.join()
        assert not llm.engine.has_unfinished_requests()
        assert_memory_returned([llm])
    llm.engine.fault_hook = None
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == want


@pytest.mark.skipif(not hasattr(signal, "raise_signal"), reason="needs signals")
@pytest.mark.usefixtures("default_sigint")
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_a_step_waits_for_its_end_unless_pressed_twice(tiny: Path, presses: int) -> None:
    """One Ctrl-C mid-step takes effect once the step is done (its tokens are kept); a second one, at once."""
    llm = make(tiny, "chunked", block_size=2)
    seen: dict[str, int] = {}

    def press(seqs: list[Sequence]) -> None:
        if llm.engine.num_steps == 3:
            seen["stats"] = len(llm.engine.step_stats)
            for _ in range(presses):
                signal.raise_signal(signal.SIGINT)

    llm.engine.fault_hook = press
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    assert len(llm.engine.step_stats) == seen["stats"] + (1 if presses == 1 else 0)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is restored
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.skipif(not hasattr(signal, "raise_signal"), reason="needs signals")
def test_an_ignored_ctrl_c_stays_ignored(tiny: Path) -> None:
    """Where Ctrl-C is ignored (a background job) or handled by someone else, a step neither defers nor raises
    it, and the handler it found is the one it leaves."""
    llm = make(tiny, "chunked", block_size=2)
    llm.engine.fault_hook = lambda seqs: signal.raise_signal(signal.SIGINT)  # type: ignore[misc]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        outputs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)  # every step "pressed": nothing happens
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_interrupting_a_notebook_cell_leaves_the_engine_usable_for_the_next(tiny: Path) -> None:
    """The real thing: a Jupyter kernel runs a long generate, the ■ button interrupts it, the next cell works."""
    manager = pytest.importorskip("jupyter_client.manager")
    km, kc = manager.start_new_kernel(kernel_name="python3")

    def reply_to(msg_id: str, timeout: float = 300) -> dict:  # type: ignore[type-arg]
        while True:  # skip replies to earlier requests (e.g. the kernel_info of start-up)
            reply = kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]

    def run(code: str) -> dict:  # type: ignore[type-arg]
        return reply_to(kc.execute(code))

    try:
        setup = run(f"from labkit import LLM, SamplingParams\n"
                    f"llm = LLM({str(tiny)!r}, engine='chunked', dtype='float64', max_num_seqs=2, block_size=4)\n"
                    f"p = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)\n"
                    f"want = llm.generate(['Once upon a time'], p, use_tqdm=False)[0].outputs[0].token_ids")
        assert setup["status"] == "ok", setup
        msg_id = kc.execute("llm.generate(['Once upon a time'] * 12, p, use_tqdm=False)")
        while True:  # wait until the cell runs, then let it get well into the generation
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
                break
        time.sleep(1.0)
        km.interrupt_kernel()
        reply = reply_to(msg_id, timeout=120)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        after = run("bm = llm.engine.block_manager\n"
                    "assert not llm.engine.has_unfinished_requests()\n"
                    "assert bm.num_free_blocks == bm.num_blocks, bm.num_used_blocks\n"
                    "bm.check_invariants([])\n"
                    "assert llm.generate(['Once upon a time'], p, use_tqdm=False)[0].outputs[0].token_ids == want")
        assert after["status"] == "ok", after
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.parametrize("engine", ALL)
def test_abort_frees_memory_and_spares_the_others(tiny: Path, reference: Reference, engine: str) -> None:
    llm = make(tiny, engine, **({"block_size": 2} if engine in PAGED else {}))
    params = greedy(8)
    want = reference(PROMPTS[:4], [params] * 4)
    seqs = [llm.add_request(p, params)[0] for p in PROMPTS[:4]]
    for _ in range(3):
        llm.step()
    running, waiting = seqs[0], seqs[3]  # the first has started; the last has not (small batches)
    assert running.output_token_ids and not waiting.output_token_ids
    for seq in (running, waiting):
        assert llm.engine.abort_request(seq.seq_id) is seq
        assert seq.finish_reason.value == "abort" and not seq.block_table
        assert llm.engine.abort_request(seq.seq_id) is None  # twice: nothing left to abort
    assert llm.engine.abort_request(10**9) is None
    while llm.engine.has_unfinished_requests():
        llm.step()
    assert [s.output_token_ids for s in seqs[1:3]] == [w[0] for w in want[1:3]]
    assert running.output_token_ids == want[0][0][: len(running.output_token_ids)]
    assert_memory_returned([llm])


@pytest.mark.parametrize("engine", ALL)
def test_a_disconnected_stream_frees_its_memory(tiny: Path, engine: str) -> None:
    import gc

    llm = make(tiny, engine, **({"block_size": 2} if engine in PAGED else {}))
    for leave in ("close", "drop"):
        stream = llm.stream(PROMPTS[2], greedy(40))
        next(stream), next(stream)
        assert llm.engine.has_unfinished_requests()
        if engine in PAGED:
            assert llm.engine.block_manager.num_used_blocks > 0  # type: ignore[attr-defined]
        if leave == "close":
            stream.close()  # what a client disconnect or a `break` does
        else:
            del stream
            gc.collect()
        assert not llm.engine.has_unfinished_requests(), leave
        assert_memory_returned([llm])


# ---- 4. invariant checks ----


def test_the_suite_runs_paged_engines_in_debug_mode(tiny: Path) -> None:
    assert os.environ.get("LABKIT_DEBUG_CHECKS") == "1"
    assert all(make(tiny, e).engine.config.debug_checks for e in PAGED)  # type: ignore[attr-defined]
    assert not make(tiny, "chunked", debug_checks=False).engine.config.debug_checks  # type: ignore[attr-defined]


def test_debug_mode_catches_broken_books_and_is_not_swallowed(tiny: Path) -> None:
    llm = make(tiny, "chunked", block_size=2)
    llm.add_request(PROMPTS[0], greedy(6))
    llm.step()
    bm = llm.engine.block_manager  # type: ignore[attr-defined]
    block = bm.blocks[bm.free_block_ids[0]]
    block.ref_count += 1  # a leak: taken by nobody
    with pytest.raises(AssertionError, match=rf"block {block.block_id}: ref_count 1, free=True"):
        llm.step()  # an engine bug must surface as itself, never as a failed request
    block.ref_count -= 1
    llm.engine.abort_all()


def test_the_memory_check_catches_a_leaked_block(tiny: Path) -> None:
    llm = make(tiny, "paged", block_size=2)
    llm.generate(PROMPTS[0], greedy(3), use_tqdm=False)
    bm = llm.engine.block_manager  # type: ignore[attr-defined]
    leaked = bm._take_free_block()
    with pytest.raises(AssertionError, match="still holds 1 of"):
        assert_memory_returned([llm])
    bm._release(leaked)
    assert_memory_returned([llm])


# ---- 6. security defaults ----


def evil_folder(tmp_path: Path, source: Path) -> Path:
    """A checkpoint folder that would run code (and leave marker files) if anything executed its contents."""
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    marker = tmp_path / "pwned"
    (folder / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    for name, cls in (("evil_model", "AutoModelForCausalLM"), ("evil_tok", "AutoTokenizer")):
        (folder / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('{name}')\n")
        config_name = "config.json" if cls.startswith("AutoModel") else "tokenizer_config.json"
        config = json.loads((folder / config_name).read_text())
        config["auto_map"] = {cls: f"{name}.Evil" if cls.startswith("AutoModel") else [f"{name}.Evil", None]}
        (folder / config_name).write_text(json.dumps(config))
    return folder


def test_remote_code_and_pickles_never_run(tmp_path: Path, tiny: Path) -> None:
    folder = evil_folder(tmp_path, tiny)
    marker = tmp_path / "pwned"
    llm = LLM(str(folder), engine="chunked")  # labkit's own model code, weights from safetensors only
    assert len(llm.generate(PROMPTS[0], greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"only pickle checkpoint files \(pytorch_model.bin\).*safetensors"):
        LLM(str(folder), engine="naive")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evil"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="evil"):
        LLM(str(folder), engine="naive")
    assert not marker.exists()


def test_errors_and_failures_never_echo_the_prompt(tiny: Path, caplog: pytest.LogCaptureFixture,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """Prompts may hold secrets: no log line, progress bar or error message repeats them."""
    secret = "my password is hunter2-SECRET"
    llm = make(tiny, "chunked", max_model_len=64)
    caplog.set_level("DEBUG")
    messages = []
    for prompt, params in ((secret * 20, greedy(2)), (secret, greedy(60))):
        with pytest.raises(ValueError) as info:
            llm.generate(prompt, params)
        messages.append(str(info.value))
    llm.engine.fault_hook = Fault(at=2, error=RuntimeError("boom"))
    with pytest.raises(RequestFailedError) as failed:
        llm.generate([secret, "Hello"], greedy(4))
    messages.append(str(failed.value))
    out, err = capfd.readouterr()
    for text in [*messages, out, err, caplog.text]:
        assert "hunter2" not in text
