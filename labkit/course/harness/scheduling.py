"""Run a scheduler class inside the real engine, step by step, and keep what each of its rules did.

The scheduler tasks of notebooks 07 and 08 are ``Scheduler`` subclasses that override one or two rules
(``schedule_waiting``, ``reserve`` and ``preempt``, ``schedule_running``). Their checkers run the engine with the
learner's class (``LLM(..., scheduler_cls=...)``) on a small workload, wrapped in a recording subclass
(``labkit.course.harness.trial_records``) that notes, for every step, the queues before planning, what each rule was
given and what it did. The same workload runs with labkit's own ``Scheduler``; the checkers then compare the two
runs (``labkit.course.harness.trial_checks``) and read the records for the rule's invariants, so a failure names the
step, the request and what was expected.

The run is driven step by step (not through ``LLM.generate``) so that a rule that raises, or that stops
admitting anyone, ends the run with a message instead of a traceback or a hang. Notebooks 07-08.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import SimpleNamespace

from labkit.core.engine.step import StepStats
from labkit.core.kv.block_manager import BlockManager
from labkit.core.sched.scheduler import Scheduler
from labkit.core.sequence import Sequence
from labkit.course.harness.trial_records import StepPlan, label_of, recording


@dataclass(frozen=True)
class TrialRequest:
    """One request of a trial workload: exact prompt length, greedy output length, when it arrives. Notebooks 07-08."""

    prompt_len: int
    max_tokens: int
    arrival_step: int = 0  # added to the engine just before this engine step


@dataclass(frozen=True)
class TrialSetup:
    """A workload and the engine options it runs under. Notebooks 07-08."""

    engine: str
    requests: tuple[TrialRequest, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_gpu_blocks: int
    async_scheduling: bool = False  # plan step N+1 while step N runs (notebook 10): in_flight sequences
    max_steps: int = 200  # a rule that never finishes the workload is stopped here

    def describe(self) -> str:
        mode = ", async scheduling" if self.async_scheduling else ""
        return (f"engine {self.engine}{mode}: {len(self.requests)} requests, max_num_seqs {self.max_num_seqs}, "
                f"budget {self.max_num_batched_tokens}, {self.num_gpu_blocks} blocks of {self.block_size}")


@dataclass
class Trial:
    """A finished (or stopped) trial run. Notebooks 07-08."""

    setup: TrialSetup
    plans: list[StepPlan]
    step_stats: list[StepStats]
    output_tokens: dict[str, list[int]]
    num_preemptions: int
    blocks_in_use_after: int  # KV blocks still held once every request finished (a leak if not 0)
    error: BaseException | None = None  # what the step raised (the learner's rule, or the engine because of it)
    error_step: int | None = None
    books_error: str | None = None  # the engine's per-step invariant check failed
    stalled: str | None = None  # why the run stopped without finishing
    prompts: dict[str, list[int]] = field(default_factory=dict)  # request -> prompt token ids
    preempted: dict[str, int] = field(default_factory=dict)  # request -> times it was preempted

    @property
    def finished(self) -> bool:
        return self.error is None and self.books_error is None and self.stalled is None


def stall_message(step: int, waiting: list[str]) -> str:
    return (f"step {step}: nothing was scheduled although {', '.join(waiting)} waited and no request was running "
            "(every slot and KV block was free): the run could not go on")


def run_trial(scheduler_cls: type[Scheduler], setup: TrialSetup, model: str = "labkit-tiny") -> Trial:
    """Run ``setup``'s workload through engine ``setup.engine`` with ``scheduler_cls``, one step at a time."""
    from labkit import LLM, SamplingParams  # late import: labkit.core.llm imports the engines
    from labkit.core.engine.base import StepFailedError
    from labkit.course.workloads import prompt_ids_of_length

    plans: list[StepPlan] = []
    labels: dict[int, str] = {}
    llm = LLM(model, engine=setup.engine, device="cpu", scheduler_cls=recording(scheduler_cls, plans, labels),
              max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
              block_size=setup.block_size, num_gpu_blocks=setup.num_gpu_blocks,
              async_scheduling=setup.async_scheduling, debug_checks=True)
    engine = llm.engine
    seqs: dict[str, Sequence] = {}
    trial = Trial(setup, plans, engine.step_stats, {}, 0, 0)
    try:
        for step in range(setup.max_steps + 1):
            for i, r in enumerate(setup.requests):
                if r.arrival_step == step:
                    prompt = prompt_ids_of_length(llm.tokenizer, r.prompt_len, seed=i)
                    (seq,) = llm.add_request(prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0,
                                                                     ignore_eos=True))
                    labels[seq.seq_id] = f"R{i}"
                    seqs[f"R{i}"] = seq
                    trial.prompts[f"R{i}"] = prompt
            arriving = any(r.arrival_step > step for r in setup.requests)
            if not engine.has_unfinished_requests() and not arriving:
                break
            if step == setup.max_steps:
                left = [name for name, s in seqs.items() if not s.is_finished]
                trial.stalled = (f"after {setup.max_steps} engine steps {', '.join(left)} had still not finished "
                                 f"(labkit's scheduler needs far fewer)")
                break
            num_stats = len(engine.step_stats)
            scheduler = engine.scheduler  # type: ignore[attr-defined]
            try:
                engine.step()
            except StepFailedError as exc:
                if plans and plans[-1].planned and not plans[-1].tokens and not scheduler.running:
                    trial.stalled = stall_message(step, [label_of(labels, s) for s in exc.failed])
                else:
                    trial.error, trial.error_step = exc.cause, step
                break
            except AssertionError as exc:  # the engine's own per-step check of the KV books
                trial.books_error, trial.error_step = str(exc), step
                break
            if len(engine.step_stats) == num_stats and scheduler.waiting and not scheduler.running:
                trial.stalled = stall_message(step, [label_of(labels, s) for s in scheduler.waiting])
                break
        trial.output_tokens = {name: list(s.output_token_ids) for name, s in seqs.items()}
        trial.num_preemptions = engine.num_preemptions
        trial.preempted = {name: s.num_preemptions for name, s in seqs.items() if s.num_preemptions}
        trial.blocks_in_use_after = engine.block_manager.num_used_blocks  # type: ignore[union-attr]
    finally:
        engine.abort_all()  # whatever happened, the engine gives its KV memory back,
        for seq in seqs.values():  # even blocks a faulty rule gave a request it then lost track of
            if seq.block_table:
                engine.block_manager.free(seq)  # type: ignore[union-attr]
        reclaim_lost_blocks(engine.block_manager)  # type: ignore[attr-defined]
    return trial


def reclaim_lost_blocks(bm: BlockManager) -> None:
    """Once no request is left, return the blocks a faulty part lost track of (taken, but in no block table), with
    labkit's own ``free``, so the engine's books balance again; the leak has been counted before."""
    lost = [b.block_id for b in bm.blocks for _ in range(b.ref_count)]
    if lost:
        BlockManager.free(bm, SimpleNamespace(block_table=lost, num_computed_tokens=0))  # type: ignore[arg-type]


@functools.lru_cache(maxsize=8)
def reference_trial(setup: TrialSetup, model: str = "labkit-tiny") -> Trial:
    """The same workload with labkit's own ``Scheduler`` (computed once per setup)."""
    trial = run_trial(Scheduler, setup, model)
    assert trial.finished, f"labkit's scheduler did not finish its own trial: {trial}"
    return trial


