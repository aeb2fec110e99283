"""Run a scheduler class inside the real engine, step by step, and record what each of its rules did.

The scheduler tasks of notebooks 07 and 08 are ``Scheduler`` subclasses that override one rule
(``schedule_waiting``, ``schedule_running``). Their checkers run the engine with the learner's class
(``LLM(..., scheduler_cls=...)``) on a small workload, wrapped in a recording subclass that notes, for every
step, the queues before planning, what each rule was given and what it scheduled. The same workload runs
with labkit's own ``Scheduler``; the checkers then compare the two runs (tokens, every step's batch) and
read the records for the rule's invariants, so a failure names the step, the request and what was expected.

The run is driven step by step (not through ``LLM.generate``) so that a rule that raises, or that stops
admitting anyone, ends the run with a message instead of a traceback or a hang. Notebooks 07-08.
"""

from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from labkit.cache.block_manager import BlockManager
from labkit.engine.sched.output import SchedulerOutput
from labkit.engine.sched.scheduler import Scheduler
from labkit.engine.step import StepStats
from labkit.exercises import Check
from labkit.sequence import Sequence

LABKIT_DIR = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TrialRequest:
    """One request of a trial workload: exact prompt length, greedy output length, and when it arrives."""

    prompt_len: int
    max_tokens: int
    arrival_step: int = 0  # added to the engine just before this engine step


@dataclass(frozen=True)
class TrialSetup:
    """A workload and the engine options it runs under."""

    engine: str
    requests: tuple[TrialRequest, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_gpu_blocks: int
    max_steps: int = 200  # a rule that never finishes the workload is stopped here


@dataclass
class RunningCall:
    """One call of ``schedule_running``: the budget it was given, what it scheduled, what it returned."""

    budget: int
    tokens: dict[str, int] = field(default_factory=dict)
    returned: object = None
    error: BaseException | None = None  # what the call raised (then it returned nothing)


@dataclass
class WaitingCall:
    """One call of ``schedule_waiting``: the queue and the room it saw, whom it admitted, and whether the new
    head of the queue would still have fit (a slot, the budget left and its blocks: FCFS should have taken it)."""

    budget: int
    queue: list[tuple[str, int, int]]  # (request, tokens to compute to join, KV blocks those need), queue order
    free_slots: int
    free_blocks: int
    admitted: dict[str, int] = field(default_factory=dict)
    num_running_after: int = 0
    head_fit: tuple[str, int, int] | None = None  # (request, tokens, blocks) of a head left waiting that fit
    budget_left: int = 0
    free_blocks_left: int = 0
    error: BaseException | None = None  # what the call raised


@dataclass
class StepPlan:
    """What the scheduler saw and did when planning one engine step."""

    step: int
    queue: list[str]  # waiting requests, queue order
    decoding: list[str]  # running requests with one token to compute: their next output
    prefilling: dict[str, int]  # running requests part-way through a prefill: tokens left
    tokens: dict[str, int] = field(default_factory=dict)  # what the step ran, request -> new tokens
    num_preemptions: int = 0
    num_running_after: int = 0
    running: RunningCall | None = None
    waiting: WaitingCall | None = None


@dataclass
class Trial:
    """A finished (or stopped) trial run."""

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

    @property
    def finished(self) -> bool:
        return self.error is None and self.books_error is None and self.stalled is None


def label_of(labels: dict[int, str], seq: Sequence) -> str:
    return labels.get(seq.seq_id, f"seq {seq.seq_id}")


def blocks_to_join(bm: BlockManager, seq: Sequence) -> tuple[int, int, list[int]]:
    """(tokens to compute, new KV blocks they need, cached prefix blocks) for a waiting sequence to join whole."""
    cached = bm.lookup_prefix(seq)
    num_new = seq.num_tokens - len(cached) * bm.block_size
    return num_new, bm.blocks_needed(len(cached) * bm.block_size + num_new) - len(cached), cached


def recording(cls: type[Scheduler], plans: list[StepPlan], labels: dict[int, str]) -> type[Scheduler]:
    """``cls`` with every planning step recorded into ``plans`` (its behaviour unchanged)."""

    class Recording(cls):  # type: ignore[valid-type, misc]
        def schedule(self, now: float) -> SchedulerOutput:
            name = functools.partial(label_of, labels)
            plan = StepPlan(
                step=len(plans), queue=[name(s) for s in self.waiting],
                decoding=[name(s) for s in self.running if s.num_uncomputed_tokens == 1],
                prefilling={name(s): s.num_uncomputed_tokens for s in self.running if s.num_uncomputed_tokens > 1})
            plans.append(plan)  # before planning: a rule that raises still leaves its record
            preemptions = self.num_preemptions
            out = super().schedule(now)
            plan.tokens = {name(s): n for s, n in zip(out.seqs, out.num_new_tokens)}
            plan.num_preemptions = self.num_preemptions - preemptions
            plan.num_running_after = len(self.running)
            return out

        def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
            call = RunningCall(budget=budget)
            plans[-1].running = call
            first = len(out.seqs)
            try:
                left = super().schedule_running(out, budget)
            except BaseException as exc:
                call.error = exc
                raise
            finally:
                call.tokens = {label_of(labels, s): n for s, n in zip(out.seqs[first:], out.num_new_tokens[first:])}
            call.returned = left
            return left

        def schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
            bm = self.block_manager
            queue = []
            for s in self.waiting:
                num_new, blocks, _ = blocks_to_join(bm, s)
                queue.append((label_of(labels, s), num_new, blocks))
            call = WaitingCall(budget=budget, queue=queue, free_slots=self.max_num_seqs - len(self.running),
                               free_blocks=bm.num_free_blocks)
            plans[-1].waiting = call
            first = len(out.seqs)
            try:
                super().schedule_waiting(out, budget, now)
            except BaseException as exc:
                call.error = exc
                raise
            finally:
                call.admitted = {label_of(labels, s): n for s, n in zip(out.seqs[first:], out.num_new_tokens[first:])}
            call.num_running_after = len(self.running)
            call.budget_left = budget - sum(call.admitted.values())
            call.free_blocks_left = bm.num_free_blocks
            if self.waiting:
                head = self.waiting[0]
                num_new, blocks, cached = blocks_to_join(bm, head)
                if (not head.can_fork and not head.waits_for_parent and len(self.running) < self.max_num_seqs
                        and 0 < num_new <= call.budget_left and bm.can_allocate(head, num_new, cached)):
                    call.head_fit = (label_of(labels, head), num_new, blocks)

    Recording.__name__ = Recording.__qualname__ = cls.__name__  # messages name the learner's class
    return Recording


def run_trial(scheduler_cls: type[Scheduler], setup: TrialSetup, model: str = "labkit-tiny") -> Trial:
    """Run ``setup``'s workload through engine ``setup.engine`` with ``scheduler_cls``, one step at a time."""
    from labkit import LLM, SamplingParams  # late import: labkit.llm imports the engines
    from labkit.engine.base import StepFailedError
    from labkit.workbook.workloads import prompt_ids_of_length

    plans: list[StepPlan] = []
    labels: dict[int, str] = {}
    llm = LLM(model, engine=setup.engine, device="cpu", scheduler_cls=recording(scheduler_cls, plans, labels),
              max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens,
              block_size=setup.block_size, num_gpu_blocks=setup.num_gpu_blocks, debug_checks=True)
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
            arriving = any(r.arrival_step > step for r in setup.requests)
            if not engine.has_unfinished_requests() and not arriving:
                break
            if step == setup.max_steps:
                left = [name for name, s in seqs.items() if not s.is_finished]
                trial.stalled = (f"after {setup.max_steps} engine steps {', '.join(left)} had still not finished "
                                 f"(labkit's scheduler needs far fewer)")
                break
            num_stats = len(engine.step_stats)
            try:
                engine.step()
            except StepFailedError as exc:
                trial.error, trial.error_step = exc.cause, step
                break
            except AssertionError as exc:  # the engine's own per-step check of the KV books
                trial.books_error, trial.error_step = str(exc), step
                break
            scheduler = engine.scheduler  # type: ignore[attr-defined]
            if len(engine.step_stats) == num_stats and scheduler.waiting and not scheduler.running:
                queue = ", ".join(label_of(labels, s) for s in scheduler.waiting)
                trial.stalled = (f"step {step}: nothing was scheduled although {queue} waited and no request was "
                                 "running (every slot and KV block was free): the run could not go on")
                break
        trial.output_tokens = {name: list(s.output_token_ids) for name, s in seqs.items()}
        trial.num_preemptions = engine.num_preemptions
        trial.blocks_in_use_after = engine.block_manager.num_used_blocks  # type: ignore[union-attr]
    finally:
        engine.abort_all()  # whatever happened, the engine gives its KV memory back,
        for seq in seqs.values():  # even blocks a faulty rule gave a request it then lost track of
            if seq.block_table:
                engine.block_manager.free(seq)  # type: ignore[union-attr]
    return trial


@functools.lru_cache(maxsize=8)
def reference_trial(setup: TrialSetup, model: str = "labkit-tiny") -> Trial:
    """The same workload with labkit's own ``Scheduler`` (computed once per setup)."""
    trial = run_trial(Scheduler, setup, model)
    assert trial.finished, f"labkit's scheduler did not finish its own trial: {trial}"
    return trial


def require_scheduler(cls: object) -> type[Scheduler]:
    """The learner's class, or a clear error if it is not a Scheduler subclass."""
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise TypeError(f"expected a subclass of labkit.Scheduler (class MyScheduler(Scheduler): ...), got {cls!r}")
    return cls


def where_in_learner_code(exc: BaseException) -> str:
    """' (line N of your code)' for the innermost frame outside labkit, if any."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not Path(f.filename).resolve().is_relative_to(LABKIT_DIR)]
    return f" (line {frames[-1].lineno} of your code)" if frames else ""


def show(tokens: dict[str, int]) -> str:
    return ", ".join(f"{name}: {n}" for name, n in tokens.items()) or "nothing"


def check_run(check: Check, trial: Trial, rule: str) -> None:
    """What every scheduler trial must show, after the rule's own checks: it ran to the end, respected
    max_num_seqs and max_num_batched_tokens, left no KV block behind, and matched labkit's scheduler."""
    setup = trial.setup
    if trial.error is not None:
        if isinstance(trial.error, NotImplementedError):
            raise trial.error  # the stub: reported as "not started"
        check.expect(False, f"engine step {trial.error_step}: {type(trial.error).__name__} raised while your "
                     f"{rule} planned the step{where_in_learner_code(trial.error)}: {trial.error}")
        return
    if trial.books_error is not None:
        check.expect(False, f"after engine step {trial.error_step} the engine's KV books did not balance: "
                     f"{trial.books_error}")
        return
    if trial.stalled is not None:
        check.expect(False, trial.stalled)
        return
    for stats in trial.step_stats:
        if stats.num_seqs > setup.max_num_seqs or stats.num_computed_tokens > setup.max_num_batched_tokens:
            check.expect(False, f"a step ran {stats.num_seqs} sequences and {stats.num_computed_tokens} tokens "
                         f"(StepStats); max_num_seqs is {setup.max_num_seqs} and max_num_batched_tokens "
                         f"{setup.max_num_batched_tokens}")
            return
    check.expect(trial.blocks_in_use_after == 0, f"{trial.blocks_in_use_after} KV block(s) were still in use after "
                 "every request finished: a leak")
    reference = reference_trial(setup)
    for name, want in reference.output_tokens.items():
        got = trial.output_tokens.get(name)
        if got != want:
            check.expect(False, f"{name}'s greedy tokens differ from those under labkit's scheduler "
                         f"(got {got}, expected {want})")
            return
    for plan, want in zip(trial.plans, reference.plans):
        if plan.tokens != want.tokens:
            check.expect(False, f"engine step {plan.step} ran {show(plan.tokens)} (request: new tokens); labkit's "
                         f"scheduler ran {show(want.tokens)}")
            return
    check.expect(len(trial.plans) == len(reference.plans),
                 f"the run took {len(trial.plans)} engine steps; labkit's scheduler took {len(reference.plans)}")
