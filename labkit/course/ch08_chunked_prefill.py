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
from labkit.course import Check, CheckResult, run_checker
from labkit.course.harness.compare import expect_run
from labkit.course.harness.runs import Setup, requests_of_lengths
from labkit.course.harness.scheduler_records import StepPlan, require_scheduler, run_trial, show

# Three short requests decoding when a 100-token prompt arrives (step 3), and one more short one behind it
# (step 4): with a 32-token budget the long prompt is split over four steps while the decodes go on.
BUDGET_TRIAL = Setup(
    "3 decodes, then a long prompt",
    requests_of_lengths((8, 14, 0), (10, 14, 0), (6, 14, 0), (100, 3, 3), (12, 4, 4)),
    engine="chunked", max_num_seqs=5, max_num_batched_tokens=32, block_size=8, num_gpu_blocks=64,
)


def budget_problem(plan: StepPlan) -> str | None:
    """What is wrong with one step's ``schedule_running`` call, or None."""
    call, step = plan.running, plan.step
    if call is None or call.error is not None:
        return None  # a call that raised is reported as such, with its line
    if isinstance(call.returned, bool) or not isinstance(call.returned, int):
        return (f"step {step}: your schedule_running returned {call.returned!r}; it must return the budget left "
                "(an int), which the admission of waiting requests then fills")
    used = sum(call.tokens.values())
    if used > call.budget:
        return (f"step {step}: your schedule_running scheduled {show(call.tokens)} (request: tokens) = {used} "
                f"tokens with a budget of {call.budget}: cap each chunk at the budget left, min(tokens left, budget)")
    if plan.num_preemptions == 0 and call.budget >= len(plan.decoding):
        prefills = {name: n for name, n in call.tokens.items() if name not in plan.decoding}
        for name in plan.decoding:
            got = call.tokens.get(name, 0)
            if got == 0:
                return (f"step {step}: {name} was decoding but got no token (a decode stall) while "
                        f"{show(prefills)} (request: prompt tokens) were scheduled: give every decode its 1 token "
                        "first, then fill what is left of the budget with prefill chunks")
            if got != 1:
                return f"step {step}: {name} is decoding and computes exactly 1 token per step, got {got}"
    for name, left in plan.prefilling.items():
        got = call.tokens.get(name, 0)
        if got > left:
            return f"step {step}: {name} had {left} prompt tokens left but was given {got}"
        if got < left and call.budget - used > 0 and plan.num_preemptions == 0:
            return (f"step {step}: {name} had {left} prompt tokens left and got {got} although "
                    f"{call.budget - used} tokens of the {call.budget}-token budget were still unused: give each "
                    "partial prefill min(tokens left, budget left)")
    if call.returned != call.budget - used:
        return (f"step {step}: you scheduled {used} tokens of the {call.budget}-token budget but returned "
                f"{call.returned}: return what is left ({call.budget - used}), so admissions cannot overfill the step")
    return None


def check_schedule_running(cls: type[Scheduler], model: str = "labkit-tiny") -> CheckResult:
    """Task 1: ``cls`` (a ``Scheduler`` subclass) fills the token budget as the ``chunked`` engine must."""

    def body(check: Check) -> None:
        trial = run_trial(require_scheduler(cls), BUDGET_TRIAL, model)
        for plan in trial.plans:
            problem = budget_problem(plan)
            if problem:
                check.expect(False, problem)
                return
        expect_run(check, trial.run, model, "schedule_running", "labkit's scheduler")

    return run_checker(
        "Task 1 (schedule_running)",
        "first every decode (num_uncomputed_tokens == 1): self.reserve(seq, 1, out) and budget -= 1 while budget "
        ">= 1; then each partial prefill: n = min(seq.num_uncomputed_tokens, budget), self.reserve(seq, n, out), "
        "budget -= n; return budget.",
        body,
    )
