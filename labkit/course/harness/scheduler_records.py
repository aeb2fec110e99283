"""What a learner's scheduler did at every step, recorded by a subclass that runs its rules unchanged.

The scheduler tasks of notebooks 07 and 08 are ``Scheduler`` subclasses that override one or two rules
(``schedule_waiting``; ``reserve`` and ``preempt``; ``schedule_running``). ``run_trial(cls, setup)`` runs a harness
setup (``labkit.course.harness.runs``) with ``recording(cls, plans, names)`` as the engine's ``scheduler_cls``: every
planning step is noted into ``plans``, the queues before planning, what ``schedule_running`` and ``schedule_waiting``
were given and scheduled, and every ``reserve`` and ``preempt`` call with the state around it (who ran, in what order,
what this step had already scheduled, the free blocks, the queue afterwards). The chapters' checkers read the records
for the rule's invariants, so a failure names the step, the request and what was expected, then compare the run with
labkit's scheduler (``labkit.course.harness.compare``). Notebooks 07-08.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple

from labkit.core.kv.block_manager import BlockManager
from labkit.core.sched.output import SchedulerOutput
from labkit.core.sched.scheduler import Scheduler
from labkit.core.sequence import Sequence, SequenceStatus
from labkit.course.harness.compare import require_subclass
from labkit.course.harness.runs import Run, Setup, run_setup


@dataclass
class RunningCall:
    """One call of ``schedule_running``: the budget it was given, what it scheduled, what it returned. Notebook 08."""

    budget: int
    tokens: dict[str, int] = field(default_factory=dict)
    returned: object = None
    error: BaseException | None = None  # what the call raised (then it returned nothing)


@dataclass
class WaitingCall:
    """One call of ``schedule_waiting``: the queue and the room it saw, whom it admitted, and whether the new
    head of the queue would still have fit (a slot, the budget left and its blocks: FCFS should have taken it).
    Notebook 07."""

    budget: int
    queue: list[tuple[str, int, int]]  # (request, tokens to compute to join, KV blocks those need), queue order
    free_slots: int
    free_blocks: int
    admitted: dict[str, int] = field(default_factory=dict)
    num_running_after: int = 0
    # (request, tokens to compute, tokens that fit, their KV blocks) of a head left waiting that fit: whole in engine
    # continuous, a chunk of it in chunked
    head_fit: tuple[str, int, int, int] | None = None
    budget_left: int = 0
    free_blocks_left: int = 0
    error: BaseException | None = None  # what the call raised


@dataclass
class PreemptCall:
    """One call of ``preempt(victim)``: the state it met and the state it left. Notebook 07."""

    victim: str
    running: list[str]  # running requests before, oldest first (admission order)
    scheduled: list[str]  # requests this step's batch already held
    in_flight: list[str]  # requests the launched step is still computing (async scheduling)
    blocks_held: int  # blocks in the victim's table before
    blocks_own: int  # of those, blocks nobody else holds (freeing the victim returns them to the pool)
    free_before: int
    free_after: int = 0
    table_after: int = 0  # blocks left in the victim's table
    status_after: SequenceStatus | None = None
    still_running: bool = False
    waiting_after: list[str] = field(default_factory=list)
    victim_count: int = 0  # change of victim.num_preemptions
    scheduler_count: int = 0  # change of the scheduler's num_preemptions
    room_after: bool | None = None  # whether the reserving request fits now (None: called outside reserve)
    error: BaseException | None = None


@dataclass
class ReserveCall:
    """One call of ``reserve(seq, n, out)``, with the preemptions it made. Notebook 07."""

    seq: str
    num_tokens: int
    running: list[str]  # before, oldest first
    scheduled: list[str]  # this step's batch before the call
    in_flight: list[str]
    free_blocks: int
    fit: bool  # the blocks were there before anyone was preempted
    seq_running: bool = True  # seq was running when reserve was called (False: an earlier reserve preempted it)
    preempts: list[PreemptCall] = field(default_factory=list)
    left_running: list[str] = field(default_factory=list)  # requests no longer running after the call
    added: dict[str, int] = field(default_factory=dict)  # what the call added to the step's batch
    returned: object = None
    error: BaseException | None = None


@dataclass
class StepPlan:
    """What the scheduler saw and did when planning one engine step. Notebooks 07-08."""

    step: int
    queue: list[str]  # waiting requests, queue order
    decoding: list[str]  # running requests with one token to compute: their next output
    prefilling: dict[str, int]  # running requests part-way through a prefill: tokens left
    tokens: dict[str, int] = field(default_factory=dict)  # what the step ran, request -> new tokens
    planned: bool = False  # schedule() returned (a rule that raised leaves it False)
    num_preemptions: int = 0
    num_running_after: int = 0
    running: RunningCall | None = None
    waiting: WaitingCall | None = None
    reserves: list[ReserveCall] = field(default_factory=list)


def require_scheduler(cls: object) -> type[Scheduler]:
    """The learner's class, or a clear error if it is not a Scheduler subclass."""
    return require_subclass(cls, Scheduler, "class MyScheduler(Scheduler): ...", "labkit.Scheduler")


def show(tokens: dict[str, int]) -> str:
    """'R0: 1, R3: 13' (request: new tokens), or 'nothing'."""
    return ", ".join(f"{name}: {n}" for name, n in tokens.items()) or "nothing"


def label_of(labels: dict[int, str], seq: Sequence) -> str:
    return labels.get(seq.seq_id, f"seq {seq.seq_id}")


def blocks_to_join(bm: BlockManager, seq: Sequence) -> tuple[int, int, list[int]]:
    """(tokens to compute, new KV blocks they need, cached prefix blocks) for a waiting sequence to join whole."""
    cached = bm.lookup_prefix(seq)
    num_new = seq.num_tokens - len(cached) * bm.block_size
    return num_new, bm.blocks_needed(len(cached) * bm.block_size + num_new) - len(cached), cached


def recording(cls: type[Scheduler], plans: list[StepPlan], labels: dict[int, str]) -> type[Scheduler]:
    """``cls`` with every planning step recorded into ``plans`` (its behaviour unchanged)."""

    def names(seqs: object) -> list[str]:
        return [label_of(labels, s) for s in seqs]  # type: ignore[attr-defined]

    class Recording(cls):  # type: ignore[valid-type, misc]
        _reserving: tuple[Sequence, int, SchedulerOutput] | None = None  # the reserve call now running

        def schedule(self, now: float) -> SchedulerOutput:
            plan = StepPlan(
                step=len(plans), queue=names(self.waiting),
                decoding=names(s for s in self.running if s.num_uncomputed_tokens == 1),
                prefilling={label_of(labels, s): s.num_uncomputed_tokens
                            for s in self.running if s.num_uncomputed_tokens > 1})
            plans.append(plan)  # before planning: a rule that raises still leaves its record
            preemptions = self.num_preemptions
            out = super().schedule(now)
            plan.tokens, plan.planned = dict(zip(names(out.seqs), out.num_new_tokens)), True
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
                call.tokens = dict(zip(names(out.seqs[first:]), out.num_new_tokens[first:]))
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
                call.admitted = dict(zip(names(out.seqs[first:]), out.num_new_tokens[first:]))
            call.num_running_after = len(self.running)
            call.budget_left = budget - sum(call.admitted.values())
            call.free_blocks_left = bm.num_free_blocks
            if self.waiting:
                head = self.waiting[0]
                num_new, _, cached = blocks_to_join(bm, head)
                n = Scheduler.num_tokens_to_schedule(self, num_new, call.budget_left)  # labkit's: whole, or a chunk
                if (not self.can_fork(head) and not self.waits_for_parent(head)
                        and len(self.running) < self.max_num_seqs and n > 0 and bm.can_allocate(head, n, cached)):
                    blocks = bm.blocks_needed(len(cached) * bm.block_size + n) - len(cached)
                    call.head_fit = (label_of(labels, head), num_new, n, blocks)

        def reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
            bm = self.block_manager
            call = ReserveCall(seq=label_of(labels, seq), num_tokens=n, running=names(self.running),
                               scheduled=names(out.seqs), in_flight=names(s for s in self.running
                                                                          if id(s) in self.in_flight),
                               free_blocks=bm.num_free_blocks, fit=bm.can_allocate(seq, n),
                               seq_running=seq in self.running)
            plans[-1].reserves.append(call)
            running, first = list(self.running), len(out.seqs)
            self._reserving = (seq, n, out)
            try:
                call.returned = super().reserve(seq, n, out)
            except BaseException as exc:
                call.error = exc
                raise
            finally:
                self._reserving = None
                call.added = dict(zip(names(out.seqs[first:]), out.num_new_tokens[first:]))
                call.left_running = names(s for s in running if s not in self.running)
            return call.returned  # type: ignore[no-any-return]

        def preempt(self, seq: Sequence) -> None:
            bm, context = self.block_manager, self._reserving
            call = PreemptCall(
                victim=label_of(labels, seq), running=names(self.running),
                scheduled=names(context[2].seqs) if context else [],
                in_flight=names(s for s in self.running if id(s) in self.in_flight),
                blocks_held=len(seq.block_table),
                blocks_own=sum(bm.blocks[b].ref_count == 1 for b in seq.block_table), free_before=bm.num_free_blocks)
            counts = (seq.num_preemptions, self.num_preemptions)
            if context is not None:  # (a preemption outside reserve is seen only through its effects)
                plans[-1].reserves[-1].preempts.append(call)
            try:
                super().preempt(seq)
            except BaseException as exc:
                call.error = exc
                raise
            finally:
                call.free_after, call.table_after = bm.num_free_blocks, len(seq.block_table)
                call.status_after, call.still_running = seq.status, seq in self.running
                call.waiting_after = names(self.waiting)
                call.victim_count = seq.num_preemptions - counts[0]
                call.scheduler_count = self.num_preemptions - counts[1]
                if context is not None and context[0] is not seq and context[0] in self.running:
                    call.room_after = bm.can_allocate(context[0], context[1])

    Recording.__name__ = Recording.__qualname__ = cls.__name__  # messages name the learner's class
    return Recording


class Trial(NamedTuple):
    """A run with a recorded scheduler: the harness's record of the run, and the scheduler's of every step.
    Notebooks 07-08."""

    run: Run
    plans: list[StepPlan]


def run_trial(scheduler_cls: type[Scheduler], setup: Setup, model: str = "labkit-tiny") -> Trial:
    """Run ``setup`` with ``scheduler_cls`` as the engine's scheduler, recording what its rules did at every step."""
    plans: list[StepPlan] = []
    names: dict[int, str] = {}  # filled by the harness as requests arrive: the records name what they see
    run = run_setup(setup, model, names=names, scheduler_cls=recording(scheduler_cls, plans, names))
    return Trial(run, plans)


@functools.lru_cache(maxsize=8)
def reference_trial(setup: Setup, model: str = "labkit-tiny") -> Trial:
    """The same setup with labkit's own ``Scheduler``, recorded (computed once per setup)."""
    trial = run_trial(Scheduler, setup, model)
    assert trial.run.finished, f"labkit's scheduler did not finish its own trial: {trial.run}"
    return trial
