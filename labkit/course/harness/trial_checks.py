"""What every scheduler trial must show, after the rule's own checks: it ran to the end within the engine's
limits, left no KV block behind, and matched labkit's scheduler (and, where asked, transformers' greedy tokens).

Shared by the scheduler checkers of notebooks 07 and 08 (``labkit.course.ch07_continuous_batching``, ``ch08``); a
failure is one sentence naming the step or the request, never a traceback. Notebooks 07-08.
"""

from __future__ import annotations

import traceback
from pathlib import Path

from labkit.core.sched.scheduler import Scheduler
from labkit.course import Check
from labkit.course.harness.scheduling import Trial, reference_trial
from labkit.course.oracle import first_difference, transformers_greedy

LABKIT_DIR = Path(__file__).resolve().parents[2]


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


def oracle_problem(trial: Trial, model: str) -> str | None:
    """The first request whose greedy tokens differ from transformers' on the same prompt, or None."""
    for name, got in trial.output_tokens.items():
        (want,) = transformers_greedy(model, [trial.prompts[name]], len(got) or 1)
        diff = first_difference([got], [want], [name])
        if diff:
            again = trial.preempted.get(name, 0)
            why = f" ({name} was preempted {again} time(s) and recomputed)" if again else ""
            return f"{diff} in transformers' greedy continuation of the same prompt{why}"
    return None


def check_run(check: Check, trial: Trial, rule: str, model: str = "labkit-tiny", oracle: bool = False) -> None:
    """Run-level checks, in order, stopping at the first failure: no error, books balanced, not stalled, limits
    kept, no leak, the tokens (labkit's scheduler's; with ``oracle``, transformers' too), the preemption count,
    every step's batch and the number of steps."""
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
    if trial.blocks_in_use_after:
        check.expect(False, f"{trial.blocks_in_use_after} KV block(s) were still in use after every request "
                     "finished: a leak")
        return
    reference = reference_trial(setup, model)
    for name, want in reference.output_tokens.items():
        got = trial.output_tokens.get(name)
        if got != want:
            check.expect(False, f"{name}'s greedy tokens differ from those under labkit's scheduler "
                         f"(got {got}, expected {want})")
            return
    problem = oracle_problem(trial, model) if oracle else None
    if problem:
        check.expect(False, problem)
        return
    if trial.num_preemptions != reference.num_preemptions:
        check.expect(False, f"your scheduler preempted {trial.num_preemptions} time(s) in all ({setup.describe()}); "
                     f"labkit's preempted {reference.num_preemptions} time(s)")
        return
    for plan, want in zip(trial.plans, reference.plans):
        if plan.tokens != want.tokens:
            check.expect(False, f"engine step {plan.step} ran {show(plan.tokens)} (request: new tokens); labkit's "
                         f"scheduler ran {show(want.tokens)}")
            return
    check.expect(len(trial.plans) == len(reference.plans),
                 f"the run took {len(trial.plans)} engine steps; labkit's scheduler took {len(reference.plans)}")
