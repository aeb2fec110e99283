"""Faults, for every engine: a step that fails (an injected fault, an error inside the model's forward pass
with K/V partly written, or a scheduler bug) fails only the requests in that step, with a prefix of their
tokens and the error; every other request completes untouched, no KV memory leaks, and the same engine keeps
serving with unchanged outputs. Also how the failure surfaces through ``step`` (``StepFailedError``) and
``stream`` (``RequestFailedError``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_memory_returned

from labkit import RequestOutput
from labkit.core.engine.base import StepFailedError
from labkit.core.llm import RequestFailedError
from labkit.core.sequence import Sequence

from .reliability_common import ALL, PAGED, PROMPTS, Fault, Reference, greedy, make, tokens


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
