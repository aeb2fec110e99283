"""What every engine shares: the add / step / abort interface, the request loop, and per-step fault containment.

``LLM`` drives any engine the same way (vLLM's shape): ``add_request`` queues a ``Sequence``, ``step`` runs one
iteration and returns the sequences that got a token, and ``run`` is the one add -> step loop every front end
shares (``LLM.generate`` and ``LLM.stream``, ``AsyncLLM``'s engine thread, the request trace, the profiler):

* ``run`` queues each request at its arrival time (replaying traffic: metrics count from arrival);
* a failed step (``StepFailedError``) fails only its own sequences: they come back from ``run`` finished with reason
  "error", and the others carry on;
* leaving ``run`` early (an exception, a KeyboardInterrupt, closing it) aborts its unfinished requests, so their KV
  memory goes back at once and the engine is ready for the next call.

Faults are contained per step (``step_context``): if anything inside a step raises, only the sequences of that step
fail (finish reason "error"), their KV memory is returned, and ``step`` raises ``StepFailedError`` naming them; the
engine stays consistent and keeps serving everything else. A Ctrl-C (the notebook's ■ button) that arrives during a
step is held until the step ends, so it never lands half-way through the block manager's books; pressing it a second
time interrupts at once. Introduced in notebook 01 (``01_anatomy_of_a_request``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import ClassVar

from labkit.core.engine.config import EngineConfig
from labkit.core.engine.interrupts import deferred_interrupt
from labkit.core.engine.step import StepStats, profiler_range
from labkit.core.kv.block_manager import BlockManager
from labkit.core.model import CausalLM
from labkit.core.sched.stop import abort, fail
from labkit.core.sequence import Sequence

FaultHook = Callable[[list[Sequence]], None]


class StepFailedError(RuntimeError):
    """An engine step raised. Its sequences (``failed``) are finished with reason "error" and hold no
    memory any more; every other request is untouched and the engine keeps serving. ``finished``: sequences of
    that step that had already finished normally before the fault (their output is complete). Notebook 07."""

    def __init__(self, step: int, failed: list[Sequence], cause: BaseException,
                 finished: list[Sequence] | None = None) -> None:
        ids = ", ".join(str(s.seq_id) for s in failed) or "none"
        super().__init__(f"engine step {step} failed with {type(cause).__name__}: {cause}; "
                         f"failed its {len(failed)} sequence(s) (ids {ids}), the engine keeps serving the rest")
        self.step = step
        self.failed = failed
        self.cause = cause
        self.finished = finished or []


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
        self.block_manager: BlockManager | None = None  # the paged engines' KV block manager
        self._scheduled: list[Sequence] | None = None  # the running step's sequences, once scheduled
        self._in_step = False  # inside step_context (a subclass's step may run its parent's inside its own)

    @property
    def max_num_seqs(self) -> int:
        """Requests that can run at once (batch slots)."""
        return 1

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far (only engines with a paged pool preempt)."""
        return 0

    @property
    def async_scheduling(self) -> bool:
        """Whether the next step is planned while the device runs this one (notebook 10)."""
        return False

    # ---- the queues: each engine keeps its own ----

    def validate(self, seq: Sequence) -> None:
        """Raise if this engine could never serve ``seq`` (called for every request before any is added)."""

    @abstractmethod
    def add_request(self, seq: Sequence) -> None: ...

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

    # ---- one step ----

    @abstractmethod
    def step(self) -> list[Sequence]:
        """Run one iteration inside ``step_context``; return every sequence that received a token (finished ones
        included). Raises ``StepFailedError`` if the step failed (its sequences are finished with reason "error"),
        and re-raises a KeyboardInterrupt after aborting the sequences of the interrupted step."""

    @contextmanager
    def step_context(self) -> Iterator[None]:
        """Around one step: a Ctrl-C is held until it ends, a profiler trace shows it as ``labkit::step``, and if it
        raises, only its sequences fail (``StepFailedError``). Entered again inside a step, it adds nothing."""
        if self._in_step:
            yield
            return
        self.num_steps += 1
        self._scheduled = None
        self._in_step = True
        with deferred_interrupt(), profiler_range("labkit::step"):
            try:
                yield
            except BaseException as exc:
                failed, finished = self._fail_step(exc)
                self.check_invariants()
                if isinstance(exc, Exception):
                    raise StepFailedError(self.num_steps - 1, failed, exc, finished) from exc
                raise  # KeyboardInterrupt, SystemExit: the step's sequences were aborted
            finally:
                self._scheduled = None
                self._in_step = False
            self.check_invariants()

    def _before_forward(self, seqs: list[Sequence]) -> None:
        """Engines call this once a step's sequences are chosen: they are the ones a fault fails."""
        self._scheduled = list(seqs)
        if self.fault_hook is not None:
            self.fault_hook(list(seqs))

    def _fail_step(self, exc: BaseException) -> tuple[list[Sequence], list[Sequence]]:
        """Take the failed step's sequences out of the engine (memory returned) and finish them. Returns the
        ones it failed, and the ones that had finished normally in this step before the fault."""
        affected = self._scheduled if self._scheduled is not None else self.running_sequences()
        now = time.perf_counter()
        failed, finished = [], []
        for seq in affected:
            if seq.is_finished:
                finished.append(seq)
            else:
                if isinstance(exc, Exception):
                    fail(seq, exc, self.num_steps - 1, now)
                else:
                    abort(seq, now)
                failed.append(seq)
            self._drop(seq)  # also for one that finished this step before the fault: its memory goes back
        return failed, finished

    def record_step(self, start: float, end: float, stage_times: dict[str, float], num_seqs: int,
                    num_computed_tokens: int, num_new_tokens: int, num_prefill_tokens: int,
                    num_padding_tokens: int = 0, num_idle_slots: int = 0, is_prefill: bool | None = None,
                    kv_blocks_used: int | None = None) -> StepStats:
        """Append this step's ``StepStats`` (every engine records its steps here, and only here).
        ``kv_blocks_used``: blocks held at the step's peak (default: now)."""
        bm = self.block_manager
        if kv_blocks_used is None and bm is not None:
            kv_blocks_used = bm.num_used_blocks
        stats = StepStats(
            step=len(self.step_stats), start=start, end=end, num_seqs=num_seqs,
            num_computed_tokens=num_computed_tokens, num_new_tokens=num_new_tokens, stage_times=stage_times,
            num_padding_tokens=num_padding_tokens, num_idle_slots=num_idle_slots,
            is_prefill=num_prefill_tokens > 0 if is_prefill is None else is_prefill,
            num_prefill_tokens=num_prefill_tokens, kv_blocks_used=kv_blocks_used,
            num_preemptions=self.num_preemptions,
        )
        self.step_stats.append(stats)
        return stats

    # ---- the request loop every front end shares ----

    def add_sequences(self, seqs: Iterable[Sequence]) -> None:
        """Queue sequences the input processor already built and validated."""
        for seq in seqs:
            self.add_request(seq)

    def run(self, groups: Seq[list[Sequence]], arrival_times: Seq[float] | None = None, start: float | None = None,
            before_step: Callable[[], None] | None = None) -> Iterator[list[Sequence]]:
        """Queue each group at ``start + arrival_times[i]`` and step until the engine is idle, yielding every step's
        sequences: the ones that got a token, or that a failed step finished (with reason "error").

        Close it when leaving early (``contextlib.closing``): its unfinished requests are aborted then, as they are
        when anything raises inside it. ``before_step`` runs before every engine step (the profiler marks steps).
        """
        start = time.perf_counter() if start is None else start
        offsets = [0.0] * len(groups) if arrival_times is None else list(arrival_times)
        pending = sorted(((t, i) for i, t in enumerate(offsets)), reverse=True)  # ties keep prompt order (FCFS)
        try:
            while pending or self.has_unfinished_requests():
                now = time.perf_counter()
                while pending and start + pending[-1][0] <= now:
                    offset, i = pending.pop()
                    for seq in groups[i]:
                        seq.metrics.arrival_time = start + offset
                    self.add_sequences(groups[i])
                if not self.has_unfinished_requests():
                    time.sleep(max(0.0, start + pending[-1][0] - time.perf_counter()))  # idle until the next arrival
                    continue
                if before_step is not None:
                    before_step()
                try:
                    yield self.step()
                except StepFailedError as exc:  # contained: its sequences are finished and out of the engine
                    yield exc.failed + exc.finished
        finally:
            # An interrupt, an error or a consumer that stopped early must not leave these requests in the engine.
            self.abort(seq for group in groups for seq in group)

    def unfinished_seq_ids(self) -> list[int]:
        return [s.seq_id for s in self.unfinished_sequences()]

    def abort_request(self, seq_id: int) -> Sequence | None:
        """Drop a request wherever it is and free its memory; returns it (finished, reason "abort") if it was there."""
        for seq in self.unfinished_sequences():
            if seq.seq_id == seq_id:
                abort(seq, time.perf_counter())
                self._drop(seq)
                return seq
        return None

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Abort every unfinished one of ``seqs`` (finished ones hold no engine state)."""
        for seq in seqs:
            if not seq.is_finished:
                self.abort_request(seq.seq_id)

    def abort_all(self) -> list[Sequence]:
        return [s for s in (self.abort_request(i) for i in self.unfinished_seq_ids()) if s is not None]

    def close(self) -> None:
        """Release what the engine holds on the device (a KV pool, CUDA graphs, worker threads); ``LLM.close`` calls
        it. Nothing to release here: engines that hold such things override it."""

    def check_invariants(self) -> None:
        """Debug mode (``debug_checks``): raise AssertionError if the engine's books do not balance."""
