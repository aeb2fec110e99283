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
- a sequence in the launched step is never preempted (its blocks are being written);
- blocks enter the prefix cache only once their token ids are known.

Here the device's part of a step (``ModelRunner.execute``) runs on one worker thread: on a GPU that
thread launches kernels while the host's Python goes on; on a CPU the overlap is real too, but both
threads share two cores and Python's GIL, so the gain is small (notebook 10 measures it).
Introduced in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from labkit.engine.base import StageClock, StepStats
from labkit.engine.model_runner import ScheduledBatch, StepInputs
from labkit.sequence import Sequence


@dataclass
class InFlightStep:
    """A launched step whose tokens the host has not seen yet."""

    batch: ScheduledBatch
    inputs: StepInputs
    future: Future[list[int]]
    worker_clock: StageClock  # forward and sample, timed on the worker thread
    start: float  # when the call that scheduled it began
    host_times: dict[str, float]  # its schedule and prepare stages
    num_prefill_tokens: int
    kv_blocks_used: int


class AsyncSchedulingMixin:
    """The async step loop of ``continuous`` and ``chunked`` (``async_scheduling=True``). Notebook 10."""

    _in_flight: InFlightStep | None = None
    _executor: ThreadPoolExecutor | None = None

    def _step_async(self) -> list[Sequence]:
        clock = StageClock(self.device, sync=False)  # type: ignore[attr-defined]  # never wait for the device here
        prev = self._in_flight
        with clock.stage("schedule"):
            in_flight = {id(s) for s in prev.batch.seqs} if prev is not None else set()
            batch = self.scheduler.schedule(clock.start, in_flight)  # type: ignore[attr-defined]
        inputs = None
        if batch.seqs:
            with clock.stage("prepare"):
                inputs = self.runner.prepare_step(batch)  # type: ignore[attr-defined]
        host_times = dict(clock.times)
        done = self._resolve(prev, clock) if prev is not None else []
        if batch.seqs:
            if any(s.is_finished for s in batch.seqs):  # stopped on its pending token, or aborted meanwhile
                keep = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
                batch = ScheduledBatch([batch.seqs[i] for i in keep], [batch.num_new_tokens[i] for i in keep],
                                       batch.copies)
                inputs = self.runner.prepare_step(batch) if batch.seqs else None  # type: ignore[attr-defined]
            if inputs is not None:
                self._launch(batch, inputs, clock.start, host_times)
        self.num_preemptions = self.scheduler.num_preemptions  # type: ignore[attr-defined]
        return done

    def _launch(self, batch: ScheduledBatch, inputs: StepInputs, start: float, host_times: dict[str, float]) -> None:
        self._before_forward(batch.seqs)  # type: ignore[attr-defined]  # the sequences a fault now fails
        self.runner.fill_pending(inputs)  # type: ignore[attr-defined]
        num_prefill = batch.num_prefill_tokens
        self.runner.advance_launched(batch, inputs)  # type: ignore[attr-defined]
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="labkit-device")
        worker_clock = StageClock(self.device)  # type: ignore[attr-defined]
        future = self._executor.submit(self.runner.execute, inputs, worker_clock)  # type: ignore[attr-defined]
        self._in_flight = InFlightStep(batch, inputs, future, worker_clock, start, host_times, num_prefill,
                                       self.block_manager.num_used_blocks)  # type: ignore[attr-defined]

    def _resolve(self, step: InFlightStep, clock: StageClock) -> list[Sequence]:
        """Wait for a launched step's tokens and hand them to their sequences."""
        self._in_flight = None
        self._scheduled = list(step.batch.seqs)  # type: ignore[attr-defined]  # a fault now fails these
        with clock.stage("wait"):
            tokens = step.future.result()  # re-raises what the worker raised
        with clock.stage("detokenize"):
            for seq in step.inputs.samplers:
                seq.num_pending_tokens = 0
            done = []
            for seq, token in zip(step.inputs.samplers, tokens):
                if seq.is_finished:  # aborted while its step ran: the token is dropped
                    continue
                seq.append_token(token, clock.last)
                done.append(seq)
            for seq in step.batch.seqs:
                if not seq.is_finished:
                    self.block_manager.cache_full_blocks(seq)  # type: ignore[attr-defined]
            for seq in done:
                if seq.is_finished:
                    self._finish(seq)  # type: ignore[attr-defined]
        times = {**step.host_times, **step.worker_clock.times, "wait": clock.times.get("wait", 0.0),
                 "detokenize": clock.times.get("detokenize", 0.0)}
        self.step_stats.append(StepStats(  # type: ignore[attr-defined]
            step=len(self.step_stats), start=step.start, end=time.perf_counter(),  # type: ignore[attr-defined]
            num_seqs=len(step.batch.seqs), num_computed_tokens=step.batch.num_batched_tokens,
            num_new_tokens=len(done), stage_times=times, is_prefill=step.num_prefill_tokens > 0,
            num_prefill_tokens=step.num_prefill_tokens, kv_blocks_used=step.kv_blocks_used,
            num_preemptions=self.scheduler.num_preemptions,  # type: ignore[attr-defined]
        ))
        return done

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
