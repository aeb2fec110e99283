"""Async scheduling keeps step N's sampled tokens on the device (notebook 10): step N+1 is launched, its input ids
filled from step N's device tensor, before the host waits for step N's tokens.

The order is checked with a stand-in for a GPU: the sampled tokens are a tensor subclass that reports a CUDA device
(so ``SamplerOutput.copy_to_host`` takes its CUDA branch: pinned buffer, non-blocking copy, an event) and logs every
operation that would make the host wait for the device (``tolist``, ``item``, ``int`` and the like); the event logs
when the host waits on it. The device's part of each step runs at launch (an inline executor through the engine's
``make_executor`` seam), so the log's order is the launch order, with no timing involved.

Also: stops on a token already placed in the next step (EOS, a stop token, a stop string) give the synchronous
engine's completions, the extra step's token is discarded, and every KV block comes back.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import hf_greedy

import labkit.core.engine.model_runner as model_runner
import labkit.core.sampler as sampler
from labkit import LLM, SamplingParams
from labkit.core.sampler import SamplerOutput, sample, sample_tokens

PROMPTS = ["Once upon a time", "The little fox ran to the", "One day, Lily went to the park with her mom",
           "There once was a kind seal", "A big red"]


class InlineExecutor(Executor):
    """Runs each step's device part when it is launched: the log then shows the launch order."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001  handed to whoever waits, as a worker thread would
            future.set_exception(exc)
        return future


LOG: list[tuple[str, int]] = []
STEP = {"n": -1}  # the step whose forward pass ran last
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__index__,
              torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.to,
              torch.Tensor.__repr__, torch.Tensor.__format__}


class FakeCudaTokens(torch.Tensor):
    """Sampled tokens that say they live on a CUDA device. Anything derived from them is one too; reading their
    values on the host (which on a GPU waits for the device) is logged as "sync-read"."""

    step: int

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def,override]
        if getattr(func, "__self__", None) is torch.Tensor.device:  # the ``.device`` property
            return torch.device("cuda")
        if func in HOST_READS:
            LOG.append(("sync-read", STEP["n"]))
        if func is torch.Tensor.copy_ and isinstance(args[1], FakeCudaTokens):  # device -> host copy issued
            LOG.append(("copy" if (kwargs or {}).get("non_blocking") else "blocking-copy", STEP["n"]))
        return super().__torch_function__(func, types, args, kwargs)


class FakeEvent:
    """``torch.cuda.Event``: remembers the step it was recorded in, logs when the host waits on it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.step = -1

    def record(self) -> None:
        self.step = STEP["n"]

    def synchronize(self) -> None:
        LOG.append(("wait", self.step))


PINNED: list[int] = []  # the step of every pinned host buffer asked for


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    LOG.clear()
    PINNED.clear()
    STEP["n"] = -1
    real_sample = model_runner.sample_tokens

    def pinned_like(t: torch.Tensor) -> torch.Tensor:
        # the CPU build has no pinned allocator: note the request, allocate plainly. (Not a patch of torch.empty:
        # torch caches its factory functions the first time a ``with torch.device(...)`` runs, and a patched one
        # cached there leaves every later ``with torch.device("meta")`` allocating real memory.)
        PINNED.append(STEP["n"])
        return torch.empty(t.shape, dtype=t.dtype)

    def sample_on_fake_gpu(*args: Any, **kwargs: Any) -> SamplerOutput:
        return SamplerOutput(real_sample(*args, **kwargs).token_ids.as_subclass(FakeCudaTokens))

    monkeypatch.setattr(sampler, "pinned_like", pinned_like)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(model_runner, "sample_tokens", sample_on_fake_gpu)
    return LOG


def instrumented(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device part of every step at launch; each forward pass and each filling of holes logged."""
    runner = llm.engine.runner
    real_forward, real_fill = runner.forward, runner.fill_pending

    def forward(*args: Any, **kwargs: Any) -> Any:
        STEP["n"] += 1
        LOG.append(("forward", STEP["n"]))
        return real_forward(*args, **kwargs)

    def fill_pending(*args: Any, **kwargs: Any) -> None:
        LOG.append(("fill", STEP["n"] + 1))  # the holes of the step about to run
        real_fill(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "make_executor", InlineExecutor)
    monkeypatch.setattr(runner, "forward", forward)
    monkeypatch.setattr(runner, "fill_pending", fill_pending)


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def test_the_next_step_is_launched_before_the_host_waits_for_the_tokens(
        fake_gpu: list[tuple[str, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = [6, 3, 9]
    sync = LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32")
    want = [o.outputs[0].token_ids for o in sync.generate(PROMPTS[:3], [greedy(n) for n in lengths], use_tqdm=False)]
    LOG.clear()
    llm = LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32", async_scheduling=True)
    instrumented(llm, monkeypatch)
    outs = llm.generate(PROMPTS[:3], [greedy(n) for n in lengths], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    log = fake_gpu
    assert not [e for e in log if e[0] in ("sync-read", "blocking-copy")], log  # never a synchronous read
    at = {e: i for i, e in enumerate(log)}
    steps = [k for kind, k in log if kind == "forward"]
    assert steps == list(range(max(lengths)))  # one prefill step, then a decode step per token: none skipped
    fills = [k for kind, k in log if kind == "fill"]
    assert fills == steps[1:]  # every decode step takes the previous step's tokens on the device
    for k in fills:
        # Step k was launched (its holes filled from step k-1's device tensor, its forward pass run) before the
        # host waited for step k-1's tokens; the copy to the host had been issued before that launch.
        assert at[("copy", k - 1)] < at[("fill", k)] < at[("forward", k)] < at[("wait", k - 1)], log
    assert [k for kind, k in log if kind == "wait"] == steps  # every step's tokens reach the host, once, in order
    assert PINNED == [k for kind, k in log if kind == "copy"] == steps  # each copied into a pinned buffer


def test_stopping_on_a_token_already_placed_in_the_next_step(bundled_path: Path) -> None:
    """EOS-like stop tokens, stop strings and max_tokens, in one batch of different lengths: the same completions as
    the synchronous engine and transformers, the launched step's token for a stopped request discarded, every KV block
    back (block_size 2: the discarded step often takes a new block)."""
    free_run = LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32")
    requests = free_run.generate(PROMPTS, greedy(12), use_tqdm=False)
    free = [o.outputs[0] for o in requests]
    params = [
        greedy(12, stop_token_ids=[free[0].token_ids[3]]),  # stops on its 4th token (or earlier, if repeated)
        SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[free[1].token_ids[1]]),  # stop token id
        greedy(12, stop=[free[2].text[len(free[2].text) // 2:][:3]]),  # a stop string half-way
        greedy(5),  # max_tokens: its length is known, no step is wasted on it
        greedy(12, stop_token_ids=[free[4].token_ids[0]]),  # stops on its first token, sampled by the prefill
    ]
    runs, engines = {}, {}
    for mode in (False, True):
        llm = LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32", async_scheduling=mode,
                  block_size=2, max_num_batched_tokens=16, debug_checks=True)
        bm = llm.engine.block_manager
        start = bm.num_free_blocks
        runs[mode] = [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in o.outputs]
                      for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert bm.num_free_blocks == start and bm.num_used_blocks == 0
        engines[mode] = llm.engine
    assert runs[True] == runs[False]
    reasons = [out[0][1] for out in runs[True]]
    assert reasons == ["stop", "stop", "stop", "length", "stop"]
    engine = engines[True]
    assert engine.num_discarded_tokens == 4  # one launched step each for the four that stopped on a token
    computed = {mode: sum(s.num_computed_tokens for s in engines[mode].step_stats) for mode in (False, True)}
    assert computed[True] == computed[False] + engine.num_discarded_tokens
    for out, prompt in zip(runs[True], requests):
        tokens = out[0][0]
        assert tokens == hf_greedy(bundled_path, prompt.prompt_token_ids, len(tokens))


def test_sample_returns_the_host_list_of_sample_tokens() -> None:
    """The synchronous path is unchanged: ``sample`` is ``sample_tokens`` read on the host."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5, seed=1),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.9, seed=2)]

    def generators() -> list[torch.Generator | None]:
        return [None if p.greedy else torch.Generator().manual_seed(p.seed or 0) for p in params]

    out = sample_tokens(logits, params, generators())
    assert out.token_ids.shape == (4,) and out.token_ids.dtype == torch.long
    assert out.tolist() == sample(logits, params, generators())
    assert out.tolist()[0] == int(logits[0].argmax()) and out.tolist()[2] == int(logits[2].argmax())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_host_copy_on_cuda_is_pinned_and_waited_for_by_an_event() -> None:
    tokens = torch.arange(7, device="cuda")
    out = SamplerOutput(tokens).copy_to_host()
    assert out._host is not None and out._host.is_pinned() and out._ready is not None
    assert out.tolist() == list(range(7))
