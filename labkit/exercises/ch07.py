"""Checkers for notebook 07 (``07_continuous_batching``).

Task 1 is a ``Scheduler`` subclass that overrides ``Scheduler.schedule_waiting``: the admission rule of the
``continuous`` engine (first come, first served while a slot, the token budget and the KV blocks allow; the
first request that does not fit stops admission). The checker runs engine ``continuous`` with the learner's
class (``LLM(..., scheduler_cls=...)``) on a workload whose KV pool is small enough for preemption to happen,
and reads every step's admission (``labkit.exercises.scheduling``): admitted requests are a prefix of the
queue, no more than ``max_num_seqs`` run, admissions fit the budget and are whole prompts, and a request
left waiting did not fit. Then the run must match labkit's own scheduler: the same greedy tokens, the
same batch at every step, and no KV block left in use.
"""

from __future__ import annotations

from labkit.cache.block_manager import PoolExhausted
from labkit.engine.sched.scheduler import Scheduler
from labkit.exercises import Check, CheckResult, run_checker
from labkit.exercises.scheduling import (
    TrialRequest,
    TrialSetup,
    WaitingCall,
    check_run,
    require_scheduler,
    run_trial,
    show,
)

# Three slots, a 64-token budget and 12 blocks of 8 tokens: each limit stops admission at some step, a small
# request waits behind a big one, and the pool runs dry mid-generation (preemptions).
ADMISSION_TRIAL = TrialSetup(
    engine="continuous",
    requests=(TrialRequest(24, 12), TrialRequest(20, 8), TrialRequest(30, 10), TrialRequest(8, 6),
              TrialRequest(36, 4), TrialRequest(12, 10), TrialRequest(6, 3)),
    max_num_seqs=3, max_num_batched_tokens=64, block_size=8, num_gpu_blocks=12,
)


def admission_problem(step: int, call: WaitingCall, max_num_seqs: int) -> str | None:
    """What is wrong with one ``schedule_waiting`` call, or None."""
    queue = [name for name, _, _ in call.queue]
    admitted = list(call.admitted)
    if isinstance(call.error, PoolExhausted):
        name, num_new, blocks = next(entry for entry in call.queue if entry[0] not in call.admitted)
        return (f"step {step}: admitting {name} ({num_new} tokens, {blocks} KV blocks) ran the pool out of blocks "
                f"({call.free_blocks} were free before this step's admissions): ask "
                "bm.can_allocate(seq, num_new, cached) before allocating, and stop if it says no")
    if call.error is not None:
        return None  # any other error is reported as such, with its line
    if admitted != queue[: len(admitted)]:
        jumped = next(name for name in admitted if name not in queue[: len(admitted)])
        skipped = next(name for name in queue[: len(admitted)] if name not in admitted)
        return (f"step {step}: {jumped} was admitted while {skipped}, ahead of it in the queue {queue}, kept waiting: "
                "first come, first served stops at the first request that does not fit (break, not continue)")
    if call.num_running_after > max_num_seqs:
        return (f"step {step}: {call.num_running_after} requests were running after admission, more than "
                f"max_num_seqs = {max_num_seqs} ({call.free_slots} slot(s) were free and you admitted "
                f"{', '.join(admitted)}): admit only while len(self.running) < self.max_num_seqs")
    used = sum(call.admitted.values())
    if used > call.budget:
        return (f"step {step}: you admitted {show(call.admitted)} (request: tokens) = {used} tokens, but only "
                f"{call.budget} of the step's budget were left: each admission must fit what is left, and uses it up")
    for (name, num_new, _), n in zip(call.queue, call.admitted.values()):
        if n != num_new:
            return (f"step {step}: {name} was admitted with {n} of the {num_new} tokens it must compute: engine "
                    "continuous prefills a prompt whole (if it does not fit the budget, it waits)")
    if call.head_fit is not None:
        name, num_new, blocks = call.head_fit
        return (f"step {step}: {name} ({num_new} tokens, {blocks} KV blocks) was left waiting although it fit: "
                f"{max_num_seqs - call.num_running_after} slot(s), {call.budget_left} tokens of budget and "
                f"{call.free_blocks_left} free blocks were left. Admit while a slot, the budget and the blocks allow")
    return None


def check_schedule_waiting(cls: type[Scheduler], model: str = "labkit-tiny") -> CheckResult:
    """Task 1: ``cls`` (a ``Scheduler`` subclass) admits waiting requests as the ``continuous`` engine must."""

    def body(check: Check) -> None:
        trial = run_trial(require_scheduler(cls), ADMISSION_TRIAL, model)
        for plan in trial.plans:
            problem = plan.waiting and admission_problem(plan.step, plan.waiting, ADMISSION_TRIAL.max_num_seqs)
            if problem:
                check.expect(False, problem)
                return
        check_run(check, trial, "schedule_waiting")

    return run_checker(
        "Task 1 (schedule_waiting)",
        "loop while the queue is not empty and len(self.running) < self.max_num_seqs; take self.waiting[0]; if its "
        "tokens exceed the budget left or bm.can_allocate(seq, num_new, cached) is False, break (never skip it); "
        "else popleft, allocate, admit, and subtract its tokens from the budget.",
        body,
    )
