"""Checkers for notebook 08 (``08_chunked_prefill``).

Task 1 is a ``Scheduler`` subclass that overrides ``Scheduler.schedule_running``: the first half of the
``chunked`` engine's budget-filling policy (Sarathi-Serve, vLLM's default). Every running decode gets its one
token first, then each running sequence part-way through its prompt gets its next chunk,
``min(tokens left, budget left)``; the method returns the budget left, which admissions then fill. The
checker runs engine ``chunked`` with the learner's class (``LLM(..., scheduler_cls=...)``) on short requests
that are decoding when a long prompt arrives, through the harness (``labkit.course.harness``), and reads every
step's plan (``labkit.course.harness.scheduler_records``): no decode is stalled while the prompt is chunked, no step
exceeds the budget, every partial prefill takes what the budget allows, and the budget returned is what is left.
Then the run must match labkit's own scheduler and transformers: the same greedy tokens, the same batch at every
step, and no KV block left in use.
"""

from __future__ import annotations

from labkit.core.sched.scheduler import Scheduler
from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.course.harness.compare import RUN_FAILURES, expect_run
from labkit.course.harness.runs import Setup, requests_of_lengths
from labkit.course.harness.scheduler_records import StepPlan, require_scheduler, run_trial, show

# Three short requests decoding when a 100-token prompt arrives (step 3), and one more short one behind it
# (step 4): with a 32-token budget the long prompt is split over four steps while the decodes go on.
BUDGET_TRIAL = Setup(
    "3 decodes, then a long prompt",
    requests_of_lengths((8, 14, 0), (10, 14, 0), (6, 14, 0), (100, 3, 3), (12, 4, 4)),
    engine="chunked", max_num_seqs=5, max_num_batched_tokens=32, block_size=8, num_gpu_blocks=64,
)


# Three requests decoding in a pool too small for all of them to grow: a decode's reserve preempts the newest, which
# later in the same loop must be skipped (it is waiting again), and a reserve that gives up takes no budget.
PREEMPTION_TRIAL = Setup(
    "3 decodes outgrowing the pool",
    requests_of_lengths((7, 12, 0), (6, 14, 0), (5, 16, 0), (9, 6, 2)),
    engine="chunked", max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_gpu_blocks=9,
)
BUDGET_TRIALS = (BUDGET_TRIAL, PREEMPTION_TRIAL)

HINTS = Hints(
    concept="A step has a token budget. A decode needs 1 token to produce its next output; a prompt being chunked "
            "can take many. If the budget is short, which of the two should wait, and what does each choice cost "
            "the users already reading output? And when reserve says no, what did this request take from the step?",
    rule="Serve the running decodes first, one token each, oldest first; then give each running request part-way "
         "through its prompt the largest chunk the budget still allows. A request takes budget only if reserve "
         "found it room (returned True); a request an earlier reserve preempted is no longer running, so it is "
         "skipped. Return the budget left: admissions fill it next.",
    code="for seq in decodes (num_uncomputed_tokens == 1): if seq still in self.running and budget >= 1 and "
         "self.reserve(seq, 1, out): budget -= 1. Then for seq in partial prefills (num_uncomputed_tokens > 1): skip "
         "it unless still running and budget > 0; n = min(seq.num_uncomputed_tokens, budget); if self.reserve(seq, "
         "n, out): budget -= n. return budget.",
    by_failure={
        **RUN_FAILURES,
        "return-value": "schedule_running returns one int: the budget it did not use",
        "over-budget": "no chunk may be bigger than the budget that is left when it is scheduled",
        "decode-stall": "a decode left without its token stalls a user who is already reading output; a prompt "
                        "chunk can wait one step more cheaply",
        "decode-one-token": "a decode computes exactly one token per step: its next output",
        "chunk-too-big": "a chunk is never bigger than what is left of the prompt",
        "chunk-too-small": "a partial prefill takes all the budget it can use: the rest of its prompt or the budget "
                           "left, whichever is smaller",
        "budget-left": "the budget you return is the budget you were given minus the tokens actually scheduled",
        "preempted-not-skipped": "reserve may preempt another running request to make room; that request is waiting "
                                 "again, so later in the same loop it must be skipped (is it still in self.running?)",
        "budget-on-false": "when reserve returns False the request was not scheduled, so it used none of the budget",
    },
)


def budget_problem(plan: StepPlan) -> tuple[str, str] | None:
    """What is wrong with one step's ``schedule_running`` call, and its failure class, or None."""
    call, step = plan.running, plan.step
    if call is None or call.error is not None:
        return None  # a call that raised is reported as such, with its line
    for reserve in plan.reserves:
        if not reserve.seq_running:
            return (f"step {step}: your schedule_running called reserve for {reserve.seq}, which is no longer "
                    f"running (an earlier reserve in this step preempted it, so it waits again): skip a request "
                    "that has left self.running", "preempted-not-skipped")
    if isinstance(call.returned, bool) or not isinstance(call.returned, int):
        return (f"step {step}: your schedule_running returned {call.returned!r}; it must return the budget left "
                "(an int), which the admission of waiting requests then fills", "return-value")
    used = sum(call.tokens.values())
    if used > call.budget:
        return (f"step {step}: your schedule_running scheduled {show(call.tokens)} (request: tokens) = {used} "
                f"tokens with a budget of {call.budget}: no chunk may exceed the budget left", "over-budget")
    if plan.num_preemptions == 0 and call.budget >= len(plan.decoding):
        prefills = {name: n for name, n in call.tokens.items() if name not in plan.decoding}
        others = (f"the prompt chunk(s) {show(prefills)} (request: prompt tokens) were scheduled" if prefills
                  else "no prompt chunk was scheduled either")
        for name in plan.decoding:
            got = call.tokens.get(name, 0)
            if got == 0:
                return (f"step {step}: {name} was decoding but got no token (a decode stall) while {others}, with "
                        f"a budget of {call.budget} for {len(plan.decoding)} decode(s)", "decode-stall")
            if got != 1:
                return (f"step {step}: {name} is decoding and computes exactly 1 token per step, got {got}",
                        "decode-one-token")
    for name, left in plan.prefilling.items():
        got = call.tokens.get(name, 0)
        if got > left:
            return f"step {step}: {name} had {left} prompt tokens left but was given {got}", "chunk-too-big"
        if got < left and call.budget - used > 0 and plan.num_preemptions == 0:
            return (f"step {step}: {name} had {left} prompt tokens left and got {got} although "
                    f"{call.budget - used} tokens of the {call.budget}-token budget were still unused",
                    "chunk-too-small")
    refused = {r.seq: r.num_tokens for r in plan.reserves if r.returned is False}
    if call.returned != call.budget - used:
        if refused and call.returned == call.budget - used - sum(refused.values()):
            return (f"step {step}: reserve returned False for {show(refused)} (request: tokens), yet your "
                    f"schedule_running took their tokens from the budget: it returned {call.returned} instead of "
                    f"{call.budget - used} ({used} tokens were scheduled)", "budget-on-false")
        return (f"step {step}: you scheduled {used} tokens of the {call.budget}-token budget but returned "
                f"{call.returned}: return what is left ({call.budget - used}), so admissions cannot overfill the step",
                "budget-left")
    return None


def check_schedule_running(cls: type[Scheduler], model: str = "labkit-tiny") -> CheckResult:
    """Task 1: ``cls`` (a ``Scheduler`` subclass) fills the token budget as the ``chunked`` engine must."""

    def body(check: Check) -> None:
        for setup in BUDGET_TRIALS:
            trial = run_trial(require_scheduler(cls), setup, model)
            for plan in trial.plans:
                problem = budget_problem(plan)
                if problem:
                    text, because = problem
                    check.expect(False, f"{setup.describe()}: {text}", because=because)
                    return
            if not expect_run(check, trial.run, model, "schedule_running", "labkit's scheduler"):
                return

    return run_checker("", "", body, task_id="08.schedule_running")
