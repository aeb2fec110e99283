"""What every engine shares: its config, per-step statistics and the add/step/abort interface.

``LLM`` drives any engine the same way (vLLM's shape): ``add_request`` queues a ``Sequence``,
``step`` runs one forward pass and returns the sequences that got a token. Introduced in
notebook 01 (``01_anatomy_of_a_request``).

Faults are contained per step: if anything inside a step raises, only the sequences of that step
fail (finish reason "error"), their KV memory is returned, and ``step`` raises ``StepFailedError``
naming them; the engine stays consistent and keeps serving everything else. A Ctrl-C (the
notebook's ■ button) that arrives during a step is held until the step ends, so it never lands
half-way through the block manager's books; pressing it a second time interrupts at once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from labkit.device import synchronize
from labkit.model import CausalLM
from labkit.sequence import Sequence

FaultHook = Callable[[list[Sequence]], None]


_profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def profiler_range(name: str) -> AbstractContextManager[object]:
    """A named range in torch.profiler traces (notebook 10). With no profiler recording, nothing at all: an idle
    ``record_function`` still costs ~15 µs, several times per step, which is host overhead on a small model."""
    return torch.profiler.record_function(name) if _profiler_enabled() else nullcontext()


def debug_checks_default() -> bool:
    """``LABKIT_DEBUG_CHECKS=1`` turns the per-step invariant checks on by default (the test suite does)."""
    return os.environ.get("LABKIT_DEBUG_CHECKS", "") not in ("", "0")


class StepFailedError(RuntimeError):
    """An engine step raised. Its sequences (``failed``) are finished with reason "error" and hold no
    memory any more; every other request is untouched and the engine keeps serving. Notebook 07."""

    def __init__(self, step: int, failed: list[Sequence], cause: BaseException) -> None:
        ids = ", ".join(str(s.seq_id) for s in failed) or "none"
        super().__init__(f"engine step {step} failed with {type(cause).__name__}: {cause}; "
                         f"failed its {len(failed)} sequence(s) (ids {ids}), the engine keeps serving the rest")
        self.step = step
        self.failed = failed
        self.cause = cause


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) until the block ends, then raise KeyboardInterrupt; a second Ctrl-C raises at once.

    Only in the main thread, and only over Python's default handler (as in a notebook cell); two signal
    calls per step, a few microseconds.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if pending:  # pressed twice: the user wants out now (e.g. a step that never ends)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    if previous is not signal.default_int_handler:  # Ctrl-C is handled (or ignored) by someone else: leave it so
        signal.signal(signal.SIGINT, previous)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if pending:
            raise KeyboardInterrupt  # now that the step is over (this also wins over a StepFailedError)


@dataclass
class EngineConfig:
    """Options every engine accepts (vLLM's names). Engines subclass it to add their own."""

    max_model_len: int | None = None  # None: the model's max_position_embeddings


@dataclass
class StepStats:
    """What one engine step did and where its time went. Notebook 01; plotted again in 05, 07 and 10."""

    step: int
    start: float
    end: float
    num_seqs: int
    num_computed_tokens: int  # token positions run through the model (including recomputed ones)
    num_new_tokens: int  # tokens sampled: the useful output of the step
    stage_times: dict[str, float] = field(default_factory=dict)
    num_padding_tokens: int = 0  # positions computed only to square up a padded batch
    num_idle_slots: int = 0  # batch rows already finished but still computed
    is_prefill: bool = True  # whether any prompt tokens were processed this step
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens among num_computed_tokens
    kv_blocks_used: int | None = None  # paged engines: blocks held during the step (before finished ones free)
    num_preemptions: int = 0  # paged engines: preemptions so far

    @property
    def duration(self) -> float:
        return self.end - self.start


class StageClock:
    """Times the stages of one step; each stage is also a named profiler range (``labkit::<stage>``).

    ``with clock.stage("forward"): ...`` times the block, synchronising the device at its end so that
    queued kernels count in the stage that launched them. The ranges let ``torch.profiler`` traces show
    schedule / prepare / forward / sample / detokenize for every step (notebook 10).
    """

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.device = device
        self.sync = sync
        self.times: dict[str, float] = {}
        self.start = self.last = time.perf_counter()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        with profiler_range(f"labkit::{name}"):
            yield
            if self.sync:
                synchronize(self.device)
        # Counted from the previous stage's end, so the stages of a step add up to the whole step.
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.last
        self.last = now


class Engine(ABC):
    """Base class of every engine in ``ENGINES``. Introduced in notebook 01 (``01_anatomy_of_a_request``).

    ``fault_hook`` is a test hook: when set, every step calls it with the sequences it is about to
    run, after scheduling and before the forward pass; raise from it to inject a fault.
    """

    name: ClassVar[str]
    config_class: ClassVar[type[EngineConfig]] = EngineConfig

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.device = model.device
        self.step_stats: list[StepStats] = []
        self.fault_hook: FaultHook | None = None
        self.num_steps = 0  # steps started, failed ones included
        self._scheduled: list[Sequence] | None = None  # the running step's sequences, once scheduled

    def validate(self, seq: Sequence) -> None:
        """Raise if this engine could never serve ``seq`` (called for every request before any is added)."""

    @abstractmethod
    def add_request(self, seq: Sequence) -> None: ...

    def step(self) -> list[Sequence]:
        """Run one iteration; return every sequence that received a token (finished ones included).

        Raises ``StepFailedError`` if the step failed (its sequences are finished with reason "error"),
        and re-raises a KeyboardInterrupt after aborting the sequences of the interrupted step.
        """
        self.num_steps += 1
        self._scheduled = None
        with deferred_interrupt(), profiler_range("labkit::step"):
            try:
                done = self._step()
            except BaseException as exc:
                failed = self._fail_step(exc)
                self.check_invariants()
                if isinstance(exc, Exception):
                    raise StepFailedError(self.num_steps - 1, failed, exc) from exc
                raise  # KeyboardInterrupt, SystemExit: the step's sequences were aborted
            finally:
                self._scheduled = None
            self.check_invariants()
        return done

    def _before_forward(self, seqs: list[Sequence]) -> None:
        """Engines call this once a step's sequences are chosen: they are the ones a fault fails."""
        self._scheduled = list(seqs)
        if self.fault_hook is not None:
            self.fault_hook(list(seqs))

    def _fail_step(self, exc: BaseException) -> list[Sequence]:
        """Take the failed step's sequences out of the engine (memory returned) and finish them."""
        affected = self._scheduled if self._scheduled is not None else self.running_sequences()
        now = time.perf_counter()
        failed = []
        for seq in affected:
            was_finished = seq.is_finished
            if not was_finished:
                if isinstance(exc, Exception):
                    seq.fail(exc, self.num_steps - 1, now)
                else:
                    seq.abort(now)
                failed.append(seq)
            self._drop(seq)  # also for one that finished this step before the fault: its memory goes back
        return failed

    @abstractmethod
    def _step(self) -> list[Sequence]: ...

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def unfinished_sequences(self) -> list[Sequence]:
        """Every sequence in the engine that has not finished: running ones first, then waiting ones."""

    @abstractmethod
    def running_sequences(self) -> list[Sequence]:
        """Sequences that hold engine state (a cache row or KV blocks): the ones a fault during scheduling fails."""

    @abstractmethod
    def _drop(self, seq: Sequence) -> None:
        """Take a (just finished) sequence out of every queue and return its memory; safe to repeat."""

    def unfinished_seq_ids(self) -> list[int]:
        return [s.seq_id for s in self.unfinished_sequences()]

    def abort_request(self, seq_id: int) -> Sequence | None:
        """Drop a request wherever it is and free its memory; returns it (finished, reason "abort") if it was there."""
        for seq in self.unfinished_sequences():
            if seq.seq_id == seq_id:
                seq.abort(time.perf_counter())
                self._drop(seq)
                return seq
        return None

    def abort_all(self) -> list[Sequence]:
        return [s for s in (self.abort_request(i) for i in self.unfinished_seq_ids()) if s is not None]

    def check_invariants(self) -> None:
        """Debug mode (``debug_checks``): raise AssertionError if the engine's books do not balance."""
