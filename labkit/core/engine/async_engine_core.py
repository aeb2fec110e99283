"""Async scheduling: the host schedules and prepares step N+1 while the device still runs step N.

In a synchronous engine the device waits while the host schedules, builds the next step's inputs
and processes the last step's tokens (notebook 10 measures that gap). vLLM's async scheduling
overlaps them: step N is launched, and *before its tokens are known* the scheduler already plans
step N+1, counting each sampling sequence's token as pending (``Sequence.num_pending_tokens``).
Step N+1's inputs are prepared with a hole where that token goes, and step N+1 is launched at once:
on the device, step N's sampled tokens (a device tensor, ``SamplerOutput``) are written into the
holes (``ModelRunner.fill_pending``), so no token goes through the host before the launch. Only
then does the host wait for step N's tokens (copied to pinned memory without blocking, on CUDA) and
hand them to their sequences (stop rules, detokenisation) while the device runs step N+1.

Rules that keep outputs identical to the synchronous engine:

- a sequence whose pending token is its last (max_tokens, context full) is not scheduled again;
- one that stops on the pending token (EOS, stop string) or is aborted has been launched in step N+1
  already: that step's token for it is discarded (``num_discarded_tokens`` counts them), as vLLM does,
  and its blocks go back when it finishes (the device is done writing them before any later step
  that reuses them runs: the steps run in launch order);
- a sequence in a launched step is never preempted (its blocks are being written): the scheduler's
  ``in_flight`` names them;
- blocks enter the prefix cache only once their token ids are known and their K/V written: a launched step's
  tokens count as computed only once the step before it has been handed over (``_count_launched``);
- a fault fails the faulty step's sequences alone: a step launched behind it keeps its tokens if it ran, and
  its other sequences are recomputed if it did not.

Here the device's part of a step (``ModelRunner.execute``) runs on one worker thread (the executor,
``make_executor``: tests swap in one that runs each step at launch): on a GPU that thread launches
kernels while the host's Python goes on. On a CPU both threads share the cores and Python's GIL:
``docs/benchmarks/host_overhead.md`` measured async scheduling taking 1.17x (batch 1) and 1.08x (batch
32) the synchronous wall time per decode step there. Its payoff needs a device that runs on its own. It is a
subclass of ``EngineCore`` that overrides ``step`` alone; ``LLM(..., async_scheduling=True)`` builds
it. Introduced in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass

from labkit.core.engine.config import PagedConfig
from labkit.core.engine.engine_core import EngineCore
from labkit.core.engine.model_runner import StepInputs
from labkit.core.engine.step import StageClock
from labkit.core.model import CausalLM
from labkit.core.sampler import SamplerOutput
from labkit.core.sched.output import ModelRunnerOutput, SchedulerOutput
from labkit.core.sequence import Sequence


@dataclass
class InFlightStep:
    """A launched step whose tokens the host has not seen yet. Notebook 10."""

    out: SchedulerOutput
    inputs: StepInputs
    samplers: list[Sequence]  # who samples, in the order of the step's sampled tokens
    future: Future[SamplerOutput]  # the sampled tokens, still on the device, with their host copy under way
    worker_clock: StageClock  # forward and sample, timed on the worker thread
    start: float  # when the call that scheduled it began
    host_times: dict[str, float]  # its schedule and prepare stages
    num_prefill_tokens: int
    kv_blocks_used: int


class AsyncEngineCore(EngineCore):
    """The engine loop that plans step N+1 while the device runs step N (``async_scheduling=True``). Notebook 10."""

    def __init__(self, model: CausalLM, config: PagedConfig) -> None:
        super().__init__(model, config)
        self._in_flight: InFlightStep | None = None  # the latest launched step, not yet resolved
        self._executor: Executor | None = None
        self._behind: InFlightStep | None = None  # while a step is resolved: the step launched behind it
        self._resolved_in_failed_step: list[Sequence] = []  # finished by the step resolved before a fault
        self.num_discarded_tokens = 0  # tokens sampled for a sequence that had stopped (or was aborted) meanwhile

    @property
    def async_scheduling(self) -> bool:
        return True

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or self._in_flight is not None

    def make_executor(self) -> Executor:
        """Where the device's part of each step runs: one worker thread, so steps run in launch order."""
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="labkit-device")

    def step(self) -> list[Sequence]:
        """Schedule and prepare step N+1, launch it (step N's tokens go into its inputs on the device), then wait for
        step N's tokens on the host and hand them over (``update_from_output``)."""
        with self.step_context():
            clock = StageClock(self.device, sync=False)  # never wait for the device here
            prev = self._in_flight
            with clock.stage("schedule"):
                self.scheduler.in_flight = {id(s) for s in prev.out.seqs} if prev is not None else set()
                out = self.scheduler.schedule(clock.start)
            if not out.seqs and prev is None:
                self.check_progress()
            if out.seqs:
                try:
                    with clock.stage("prepare"):
                        inputs = self.runner.prepare_step(out)
                    self._launch(out, inputs, prev, clock.start, dict(clock.times))
                except BaseException:
                    if prev is not None and self._in_flight is prev:  # not launched: step N's tokens still count
                        self._resolve_before_failing(prev, clock)
                    raise
            done = self._resolve(prev, clock) if prev is not None else []
            if self._in_flight is not None and self._in_flight is not prev:
                self._count_launched(self._in_flight)
            return done

    def _launch(self, out: SchedulerOutput, inputs: StepInputs, prev: InFlightStep | None, start: float,
                host_times: dict[str, float]) -> None:
        """Queue the step on the worker behind ``prev``, whose sampled tokens fill its holes on the device."""
        self._before_forward(out.seqs)  # the sequences a fault now fails
        num_prefill = out.num_prefill_tokens
        if self._executor is None:
            self._executor = self.make_executor()
        worker_clock = StageClock(self.device)
        prev_samplers = list(prev.samplers) if prev is not None else []
        prev_tokens = prev.future if prev is not None else None
        future = self._executor.submit(self._run_step, inputs, prev_samplers, prev_tokens, worker_clock)
        self._in_flight = InFlightStep(out, inputs, list(inputs.samplers), future, worker_clock, start, host_times,
                                       num_prefill, self.block_manager.num_used_blocks)

    def _count_launched(self, step: InFlightStep) -> None:
        """Count a launched step's tokens as computed and its samples as pending, so that the next step can be
        planned before the device finishes. Done once the step before it is handed over: until then a block
        that this step writes the last K/V of must not enter the prefix cache (it would, if counted as computed,
        and stay there with a hole should this step fail)."""
        for seq, n in zip(step.out.seqs, step.out.num_new_tokens):
            if not seq.is_finished:  # one that stopped on the step before: its blocks are back, its token dropped
                seq.num_computed_tokens += n
        for seq in step.samplers:
            seq.num_pending_tokens = 0 if seq.is_finished else 1
        step.out.computed_at_launch = True  # update_from_output must not count them again

    def _run_step(self, inputs: StepInputs, prev_samplers: list[Sequence],
                  prev_tokens: Future[SamplerOutput] | None, clock: StageClock) -> SamplerOutput:
        """On the worker: the previous step's tokens (already queued on the device: the worker runs steps in launch
        order) into this step's holes, device to device, then this step."""
        if inputs.pending_rows:
            assert prev_tokens is not None, "a pending token without a launched step to sample it"
            self.runner.fill_pending(inputs, prev_samplers, prev_tokens.result().token_ids)  # raises if it failed
        return self.runner.execute(inputs, clock)

    def _resolve_before_failing(self, step: InFlightStep, clock: StageClock) -> None:
        """The next step failed before its launch: hand step N's tokens over first (the sequences it finishes are
        reported with the failure). If that fails as well, its sequences fail too."""
        failing = self._scheduled
        try:
            done = self._resolve(step, clock)
        except BaseException:
            self._scheduled = None if failing is None else failing + [s for s in step.out.seqs if s not in failing]
            raise
        self._resolved_in_failed_step = [s for s in done if s.is_finished]
        self._scheduled = failing

    def _resolve(self, step: InFlightStep, clock: StageClock) -> list[Sequence]:
        """Wait for a launched step's tokens on the host and hand them to their sequences."""
        if self._in_flight is step:
            self._in_flight = None
        self._behind = self._in_flight  # launched behind it, if any: a fault now must settle that one too
        self._scheduled = list(step.out.seqs)  # a fault now fails these
        with clock.stage("wait"):
            tokens = step.future.result().tolist()  # re-raises what the worker raised; the one wait for the device
        with clock.stage("detokenize"):
            self.num_discarded_tokens += sum(s.is_finished for s in step.samplers)  # update_from_output drops them
            output = ModelRunnerOutput(list(step.samplers), [[t] for t in tokens])
            done = self.scheduler.update_from_output(step.out, output, clock.last)
        times = {**step.host_times, **step.worker_clock.times, "wait": clock.times.get("wait", 0.0),
                 "detokenize": clock.times.get("detokenize", 0.0)}
        self.record_step(step.start, time.perf_counter(), times, num_seqs=len(step.out),
                         num_computed_tokens=step.out.num_batched_tokens, num_new_tokens=len(done),
                         num_prefill_tokens=step.num_prefill_tokens, kv_blocks_used=step.kv_blocks_used)
        self._behind = None
        return done

    def close(self) -> None:
        """Let a launched step finish (its blocks are being written), stop the worker thread, then release the rest."""
        self._drain_in_flight()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        super().close()

    def _fail_step(self, exc: BaseException) -> tuple[list[Sequence], list[Sequence]]:
        """Fail the faulty step's sequences. A step launched behind it is waited for: if it ran, its tokens are
        handed over (the failed sequences' are dropped); if it failed too, its other sequences are preempted, to be
        recomputed (nothing of that step can be trusted)."""
        behind, self._behind = self._behind, None
        if behind is None:
            self._drain_in_flight()  # its blocks may be about to be freed: let the device finish with them first
        else:
            self._in_flight = None
            behind.future.exception()  # wait for the device to be done with its blocks
        failed, finished = super()._fail_step(exc)
        for seq in failed:
            seq.num_pending_tokens = 0
        finished += [s for s in self._resolved_in_failed_step if s not in finished]
        self._resolved_in_failed_step = []
        if behind is not None:
            finished += self._settle_behind(behind)
        return failed, finished

    def _settle_behind(self, step: InFlightStep) -> list[Sequence]:
        """A step launched behind a failed one: take its tokens if it ran, else recompute its surviving sequences.
        Returns those of its sequences that finished."""
        if step.future.exception() is None:
            try:
                self._count_launched(step)
                done = self._resolve(step, StageClock(self.device, sync=False))
                return [s for s in done if s.is_finished]
            except Exception:  # noqa: BLE001  handing its tokens over failed too: recompute instead, below
                pass
        for seq in step.samplers:
            seq.num_pending_tokens = 0
        for seq in reversed(step.out.seqs):  # newest first, so the oldest ends at the head of the queue
            if not seq.is_finished and seq in self.scheduler.running:
                self.scheduler.preempt(seq)
        return []

    def _drain_in_flight(self) -> None:
        """Wait for a launched step and drop its tokens (its sequences are failing or aborted)."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        step.future.exception()  # waits; what it raised is the failing step's business
        for seq in step.samplers:
            seq.num_pending_tokens = 0
