"""Async scheduling: the host schedules and prepares step N+1 while the device still runs step N.

In a synchronous engine the device waits while the host schedules, builds the next step's inputs
and processes the last step's tokens (notebook 10 measures that gap). vLLM's async scheduling
overlaps them: step N is launched, and *before its tokens are known* the scheduler already plans
step N+1, counting each sampling sequence's token as pending (``Sequence.num_pending_tokens``).
Step N+1's inputs are prepared with a hole where that token goes; once step N's tokens arrive
they are appended (stop rules apply as always), written into the hole, and step N+1 is launched.

Rules that keep outputs identical to the synchronous engine:

- a sequence whose pending token is its last (max_tokens, context full) is not scheduled again;
- one that stops on the pending token (EOS, stop string) or is aborted is taken out of step N+1
  before it launches, and the step is prepared again without it;
- a sequence in the launched step is never preempted (its blocks are being written): the scheduler's
  ``in_flight`` names them;
- blocks enter the prefix cache only once their token ids are known.

Here the device's part of a step (``ModelRunner.execute``) runs on one worker thread: on a GPU that
thread launches kernels while the host's Python goes on. On a CPU both threads share the cores and
Python's GIL: ``docs/benchmarks/host_overhead.md`` measured async scheduling taking 1.19x (batch 1) and 1.06x
(batch 32) the synchronous wall time per decode step there. Its payoff needs a device that runs on its own.
It is a subclass of ``EngineCore`` that
overrides ``step`` alone; ``LLM(..., async_scheduling=True)`` builds it. Introduced in notebook 10
(``10_profiling_host_overhead``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from labkit.core.engine.config import PagedConfig
from labkit.core.engine.engine_core import EngineCore
from labkit.core.engine.model_runner import StepInputs
from labkit.core.engine.step import StageClock
from labkit.core.model import CausalLM
from labkit.core.sched.output import ModelRunnerOutput, SchedulerOutput
from labkit.core.sequence import Sequence


@dataclass
class InFlightStep:
    """A launched step whose tokens the host has not seen yet. Notebook 10."""

    out: SchedulerOutput
    inputs: StepInputs
    future: Future[list[int]]
    worker_clock: StageClock  # forward and sample, timed on the worker thread
    start: float  # when the call that scheduled it began
    host_times: dict[str, float]  # its schedule and prepare stages
    num_prefill_tokens: int
    kv_blocks_used: int


class AsyncEngineCore(EngineCore):
    """The engine loop that plans step N+1 while the device runs step N (``async_scheduling=True``). Notebook 10."""

    def __init__(self, model: CausalLM, config: PagedConfig) -> None:
        super().__init__(model, config)
        self._in_flight: InFlightStep | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def async_scheduling(self) -> bool:
        return True

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[Sequence]:
        """Schedule and prepare step N+1, take step N's tokens (``update_from_output``), then launch step N+1."""
        with self.step_context():
            clock = StageClock(self.device, sync=False)  # never wait for the device here
            prev = self._in_flight
            with clock.stage("schedule"):
                self.scheduler.in_flight = {id(s) for s in prev.out.seqs} if prev is not None else set()
                out = self.scheduler.schedule(clock.start)
            inputs = None
            if out.seqs:
                with clock.stage("prepare"):
                    inputs = self.runner.prepare_step(out)
            host_times = dict(clock.times)
            if not out.seqs and prev is None:
                self.check_progress()
            done = self._resolve(prev, clock) if prev is not None else []
            if out.seqs:
                if any(s.is_finished for s in out.seqs):  # stopped on its pending token, or aborted meanwhile
                    out = out.without_finished()
                    inputs = self.runner.prepare_step(out) if out.seqs else None
                if inputs is not None:
                    self._launch(out, inputs, clock.start, host_times)
            return done

    def _launch(self, out: SchedulerOutput, inputs: StepInputs, start: float, host_times: dict[str, float]) -> None:
        """Count the step's tokens as computed and its samples as pending (so the next step can be planned before
        the device finishes), then run it on the worker thread."""
        self._before_forward(out.seqs)  # the sequences a fault now fails
        self.runner.fill_pending(inputs)
        num_prefill = out.num_prefill_tokens
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += n
        for seq in inputs.samplers:
            seq.num_pending_tokens = 1
        out.computed_at_launch = True  # update_from_output must not count them again
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="labkit-device")
        worker_clock = StageClock(self.device)
        future = self._executor.submit(self.runner.execute, inputs, worker_clock)
        self._in_flight = InFlightStep(out, inputs, future, worker_clock, start, host_times, num_prefill,
                                       self.block_manager.num_used_blocks)

    def _resolve(self, step: InFlightStep, clock: StageClock) -> list[Sequence]:
        """Wait for a launched step's tokens and hand them to their sequences."""
        self._in_flight = None
        self._scheduled = list(step.out.seqs)  # a fault now fails these
        with clock.stage("wait"):
            tokens = step.future.result()  # re-raises what the worker raised
        with clock.stage("detokenize"):
            output = ModelRunnerOutput(list(step.inputs.samplers), [[t] for t in tokens])
            done = self.scheduler.update_from_output(step.out, output, clock.last)
        times = {**step.host_times, **step.worker_clock.times, "wait": clock.times.get("wait", 0.0),
                 "detokenize": clock.times.get("detokenize", 0.0)}
        self.record_step(step.start, time.perf_counter(), times, num_seqs=len(step.out),
                         num_computed_tokens=step.out.num_batched_tokens, num_new_tokens=len(done),
                         num_prefill_tokens=step.num_prefill_tokens, kv_blocks_used=step.kv_blocks_used)
        return done

    def close(self) -> None:
        """Let a launched step finish (its blocks are being written), stop the worker thread, then release the rest."""
        self._drain_in_flight()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        super().close()

    def _fail_step(self, exc: BaseException) -> tuple[list[Sequence], list[Sequence]]:
        self._drain_in_flight()  # its blocks may be about to be freed: let the device finish with them first
        failed, finished = super()._fail_step(exc)
        for seq in failed:
            seq.num_pending_tokens = 0
        return failed, finished

    def _drain_in_flight(self) -> None:
        """Wait for a launched step and drop its tokens (its sequences are failing or aborted)."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        try:
            step.future.result()
        except Exception:  # noqa: BLE001  its sequences are being failed already
            pass
        for seq in step.inputs.samplers:
            seq.num_pending_tokens = 0
