"""Notebook 07's preemption checker (Task 2: reserve and preempt) passes labkit's Scheduler and a learner's correct
rule, fails planted bugs typical of learners with a message naming the engine, the step, the request and who should
have been preempted, and reports an unstarted stub."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from labkit import Scheduler
from labkit.core.sched.output import SchedulerOutput
from labkit.core.sequence import Sequence, SequenceStatus
from labkit.course import use_or_reference
from labkit.course.ch07_continuous_batching import PREEMPTION_TRIALS, check_preemption
from labkit.course.harness.scheduler_records import reference_trial

Pick = Callable[[Scheduler, Sequence], Sequence]


def newest(self: Scheduler, seq: Sequence) -> Sequence:
    return self.running[-1]


def reserve(self: Scheduler, seq: Sequence, n: int, out: SchedulerOutput, *, pick: Pick = newest,
            guard: bool = True, stop_if_self: bool = True) -> bool:
    """A learner's reserve; each keyword turns one part of the rule off (a planted bug)."""
    bm = self.block_manager
    while not bm.can_allocate(seq, n):
        victim = pick(self, seq)
        if guard and (victim in out.seqs or id(victim) in self.in_flight):
            return False
        self.preempt(victim)
        if stop_if_self and victim is seq:
            return False
    out.add(seq, n, bm.allocate(seq, n))
    return True


def preempt(self: Scheduler, seq: Sequence, *, free: bool = True, head: bool = True, count: bool = True) -> None:
    """A learner's preempt; each keyword turns one part of it off (a planted bug)."""
    self.running.remove(seq)
    if free:
        self.block_manager.free(seq)
    else:
        seq.block_table = []  # forgets the pool: the blocks stay taken
    seq.status = SequenceStatus.WAITING
    if count:
        seq.num_preemptions += 1
        self.num_preemptions += 1
    if head:
        self.waiting.appendleft(seq)
    else:
        self.waiting.append(seq)


def learner(name: str, reserve_options: dict[str, object] | None = None,
            preempt_options: dict[str, object] | None = None) -> type[Scheduler]:
    r, p = reserve_options or {}, preempt_options or {}

    def reserve_(self, seq, n, out):  # type: ignore[no-untyped-def]
        return reserve(self, seq, n, out, **r)  # type: ignore[arg-type]

    def preempt_(self, seq):  # type: ignore[no-untyped-def]
        preempt(self, seq, **p)  # type: ignore[arg-type]

    return type(name, (Scheduler,), {"reserve": reserve_, "preempt": preempt_})


def newest_other(self: Scheduler, seq: Sequence) -> Sequence:
    """'Never preempt myself': the newest running request other than seq (which this step may have scheduled)."""
    others = [s for s in self.running if s is not seq]
    return others[-1] if others else seq


def test_ch07_preemption_trials_preempt_often_both_ways_and_protect() -> None:
    seen = {"self": 0, "other": 0, "protected": 0, "recomputed in chunks": 0}
    for setup in PREEMPTION_TRIALS:
        trial = reference_trial(setup)
        assert trial.run.num_preemptions >= 4, setup
        victims: set[str] = set()
        for plan in trial.plans:
            # a request preempted before, now running part-way through its recompute
            seen["recomputed in chunks"] += any(name in victims for name in plan.prefilling)
            for call in plan.reserves:
                for p in call.preempts:
                    seen["self" if p.victim == call.seq else "other"] += 1
                    victims.add(p.victim)
                if not call.fit and not call.preempts and call.returned is False:
                    seen["protected"] += 1  # the newest was in flight: reserve gave up
    assert all(seen.values()), seen


@pytest.mark.parametrize("cls", [Scheduler, learner("Preempts")], ids=lambda c: c.__name__)
def test_ch07_preemption_checker_passes_labkits_rule(cls: type[Scheduler]) -> None:
    result = check_preemption(cls)
    assert result.passed, result.message()


@pytest.mark.parametrize("bug,message", [
    (learner("PreemptsTheOldest", {"pick": lambda self, seq: self.running[0]}),
     "engine continuous, step 4: R0 needed KV blocks for its next token and the pool was short (0 free); your "
     "reserve preempted R0 (the oldest): preempt the newest running request, R3, instead"),
    (learner("ForgetsToFree", preempt_options={"free": False}),
     "engine continuous, step 4: your preempt(R3) did not give R3's 3 KV block(s) back to the pool"),
    (learner("AppendsAtTheTail", preempt_options={"head": False}),
     "after your preempt(R3), R3 is at place 3 of the waiting queue (R4, R5, R3): it goes back to the head"),
    (learner("PreemptsWhatThisStepScheduled", {"pick": newest_other, "guard": False}),
     "engine continuous, step 23: R4 needed KV blocks for its next token and the pool was short (0 free); your "
     "reserve preempted R3, but this step's batch already holds it (out.seqs)"),
    (learner("PreemptsTheLaunchedStep", {"guard": False}),
     "engine chunked (async scheduling), step 2: R1 needed KV blocks for its next token and the pool was short (0 "
     "free); your reserve preempted R2, but the launched step is still computing it"),
    (learner("NeverCounts", preempt_options={"count": False}),
     "count each preemption once in both"),
    (learner("GoesOnAfterGivingWay", {"stop_if_self": False}),
     "R4 gave way itself (it was the newest), but your reserve then returned True"),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_ch07_preemption_checker_fails_planted_bugs(bug: type[Scheduler], message: str) -> None:
    result = check_preemption(bug)
    assert result.status == "failed" and len(result.failures) == 1, result.message()
    assert message in result.failures[0], result.failures[0]


def test_ch07_preemption_checker_fails_a_reserve_that_gives_up_or_overshoots() -> None:
    class GivesUp(Scheduler):
        def reserve(self, seq, n, out):  # type: ignore[no-untyped-def]
            if not self.block_manager.can_allocate(seq, n):
                return False  # waits for memory instead of making room: nobody finishes, nobody frees
            return super().reserve(seq, n, out)

    class OneTooMany(Scheduler):
        def reserve(self, seq, n, out):  # type: ignore[no-untyped-def]
            short = not self.block_manager.can_allocate(seq, n)
            granted = super().reserve(seq, n, out)
            victim = self.running[-1]
            if granted and short and victim is not seq and victim not in out.seqs:
                self.preempt(victim)  # one more than needed
            return granted

    result = check_preemption(GivesUp)
    assert result.status == "failed" and "gave up without preempting anyone: the newest running request" in \
        result.failures[0], result.message()
    result = check_preemption(OneTooMany)
    assert result.status == "failed" and "yet your reserve also preempted" in result.failures[0], result.message()


def test_ch07_preemption_stub_falls_back_to_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    class Stub(Scheduler):
        def reserve(self, seq, n, out):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def preempt(self, seq):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    result = check_preemption(Stub)
    assert result.status == "not started"
    assert use_or_reference(result, Stub, Scheduler) is Scheduler
    assert "uses labkit's reference labkit.core.sched.scheduler.Scheduler" in capsys.readouterr().out
