"""Judge a run of the harness: did it finish, and does it match labkit's own part and transformers' greedy tokens?

``problems(run, ref, ...)`` lists every way a run with the learner's part goes wrong, most fundamental first, each a
``Problem`` whose sentence names the workload, then the step or the request and what was expected: a run that did not
finish (a step raised, a ``Mistake``, unbalanced books, a stall), a write into a shared block, a step over the engine's
limits, a KV block left in use, sampled requests drawn greedily, tokens that differ from transformers' greedy
continuation or from labkit's part (seeded sampling included), finish and stop reasons, what each step ran and the KV
blocks it used, the number of steps, preemptions, copies and prefix-cache hits. ``check_setups`` runs workloads with
the learner's part and reports the first (or, for notebook 06, every) problem of the first one that goes wrong.
Notebooks 02, 03, 05, 06, 07, 08 and 10.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

from labkit.course import Check, where_in_learner_code
from labkit.course.harness.runs import Mistake, Run, Setup, reference_run, run_setup
from labkit.course.oracle import first_difference, transformers_greedy

T = TypeVar("T")


class Problem(NamedTuple):
    """One thing wrong with a run: its kind ("stopped", "shared write", "limits", "leak", "sampling", "transformers",
    "reference", "steps", "blocks", "num steps", "preemptions", "copies", "prefix cache", "prefix stats") and the
    sentence that says so. Notebooks 02-10."""

    kind: str
    text: str


def require_subclass(cls: object, base: type[T], example: str, name: str = "") -> type[T]:
    """The learner's class, or a clear error if it is not a subclass of ``base`` (``name``: how to call it)."""
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"expected a subclass of {name or f'{base.__module__}.{base.__name__}'} ({example}), "
                        f"got {cls!r}")
    return cls


def stopped(run: Run, ref: Run, part: str, reference: str) -> str | None:
    """Why ``run`` did not finish, in one sentence, or None. A stub's NotImplementedError is raised again, so the
    checker reports the task as not started."""
    where = run.setup.describe()
    record = run.step_record(run.error_step)
    if run.error is not None:
        if isinstance(run.error, NotImplementedError):
            raise run.error
        doing = (f"running {', '.join(record.scheduled)}" if record is not None and record.scheduled
                 else "while scheduling, before anything ran")
        head = f"{where}: engine step {run.error_step} ({doing})"
        if isinstance(run.error, Mistake):
            return f"{head}: {run.error}"
        return (f"{head}: your {part} raised {type(run.error).__name__}{where_in_learner_code(run.error)}: "
                f"{run.error}")
    if run.books_error is not None:
        ran = record.describe() if record is not None else "nothing"
        return (f"{where}: after engine step {run.error_step} (it ran {ran}) the block manager's books did not "
                f"balance: {run.books_error}")
    if run.stalled is not None:
        return f"{where}: {run.stalled} (with {reference} the run takes {len(ref.steps)} engine steps)"
    return None


def beyond_limits(run: Run) -> Iterator[str]:
    """The first step (the engine's own record of it) that ran more sequences or tokens than the setup allows."""
    setup = run.setup
    for stats in run.step_stats:
        if ((setup.max_num_seqs and stats.num_seqs > setup.max_num_seqs)
                or (setup.max_num_batched_tokens and stats.num_computed_tokens > setup.max_num_batched_tokens)):
            yield (f"a step ran {stats.num_seqs} sequences and {stats.num_computed_tokens} tokens (StepStats); "
                   f"max_num_seqs is {setup.max_num_seqs} and max_num_batched_tokens {setup.max_num_batched_tokens}")
            return


def drew_greedily(run: Run, ref: Run, model: str) -> bool:
    """Whether every sampled sequence drew exactly its greedy continuation, where labkit's part did not."""
    sampled = [n for n in run.outcomes if run.setup.request_of(n).temperature > 0]
    if not sampled or all(run.outcomes[n].token_ids == ref.outcomes[n].token_ids for n in sampled):
        return False
    for n in sampled:
        got = run.outcomes[n].token_ids
        (greedy,) = transformers_greedy(model, [run.outcomes[n].prompt_token_ids], max(len(got), 1))
        if got != greedy[: len(got)]:
            return False
    return True


def against_transformers(run: Run, model: str) -> Iterator[str]:
    """The first greedy sequence whose tokens are not transformers' greedy continuation of its prompt."""
    for name, outcome in run.outcomes.items():
        r = run.setup.request_of(name)
        if r.temperature > 0:
            continue
        # Up to where it stopped (whether it stopped there is compared with labkit's part): transformers' continuation
        # is made with EOS neither stopping nor masked, so an end-of-sequence token is compared like any other.
        got = outcome.token_ids
        (want,) = transformers_greedy(model, [outcome.prompt_token_ids], max(len(got), r.max_tokens or 0, 1))
        diff = first_difference([got], [want[: len(got)]], [r.describe(name)])
        if diff is not None:
            again = (f"{name} was preempted {outcome.num_preemptions} time(s) and recomputed; "
                     if outcome.num_preemptions else "")
            yield f"{again}{diff} in transformers' greedy continuation of the same prompt"
            return


def against_reference(run: Run, ref: Run, reference: str) -> Iterator[str]:
    """The first sequence whose tokens, finish reason or stop reason are not those of labkit's part."""
    for name, want in ref.outcomes.items():
        got, r = run.outcomes[name], run.setup.request_of(name)
        diff = first_difference([got.token_ids], [want.token_ids], [r.describe(name)])
        if diff is not None:
            yield f"against {reference}{' (the same seed)' if r.temperature > 0 else ''}: {diff}"
            return
        if (got.finish_reason, got.stop_reason) != (want.finish_reason, want.stop_reason):
            yield (f"{r.describe(name)} finished with finish_reason {got.finish_reason!r}, stop_reason "
                   f"{got.stop_reason!r}; with {reference} {want.finish_reason!r}, {want.stop_reason!r}")
            return


def step_by_step(run: Run, ref: Run, reference: str) -> Iterator[Problem]:
    """The first step that ran something else than labkit's part did, and the first that used other KV blocks."""
    for got, want in zip(run.steps, ref.steps):
        if got.describe() != want.describe():
            yield Problem("steps", f"engine step {got.step} ran {got.describe()}; {reference} ran {want.describe()}")
            break
    for got, want in zip(run.steps, ref.steps):
        if got.used_blocks != want.used_blocks:
            yield Problem("blocks", f"after engine step {got.step} (it ran {got.describe()}) {got.used_blocks} KV "
                          f"blocks were in use; with {reference} {want.used_blocks}")
            break


def problems(run: Run, ref: Run, model: str, part: str, reference: str) -> list[Problem]:
    """Everything wrong with ``run`` (the learner's ``part``) against ``ref`` (labkit's, called ``reference`` in the
    messages) and transformers, most fundamental first: later problems often follow from the first."""
    why = stopped(run, ref, part, reference)
    if why is not None:
        return [Problem("stopped", why)]
    found: list[Problem] = []
    if run.shared_write is not None and ref.shared_write is None:
        found.append(Problem("shared write", run.shared_write))
    found += [Problem("limits", text) for text in beyond_limits(run)]
    if run.blocks_in_use_after:
        found.append(Problem("leak", f"{run.blocks_in_use_after} KV block(s) were still in use after every request "
                             "finished: a leak (every block a request held goes back to the pool)"))
    if drew_greedily(run, ref, model):
        found.append(Problem("sampling", f"every sampled request produced its greedy tokens; with {reference} they "
                             "did not. With temperature > 0 the next token is drawn from softmax(logits / "
                             "temperature), after top-k and top-p, with the request's generator (seq.params, "
                             "seq.generator)"))
    found += [Problem("transformers", text) for text in against_transformers(run, model)]
    found += [Problem("reference", text) for text in against_reference(run, ref, reference)]
    found += step_by_step(run, ref, reference)
    counts = (("num steps", "the run took {} engine steps", len(run.steps), len(ref.steps)),
              ("preemptions", "{} preemption(s)", run.num_preemptions, ref.num_preemptions),
              ("copies", "copy-on-write copied {} block(s)", run.num_copies, ref.num_copies))
    found += [Problem(kind, f"{text.format(got)}; with {reference} {want}") for kind, text, got, want in counts
              if got != want]
    for name, want_outcome in ref.outcomes.items():
        got_n, want_n = run.outcomes[name].num_cached_tokens, want_outcome.num_cached_tokens
        if got_n != want_n:
            found.append(Problem("prefix cache", f"{name} found {got_n} prompt tokens in the prefix cache; with "
                                 f"{reference} {want_n}"))
            break
    if (run.num_queried_tokens, run.num_hit_tokens) != (ref.num_queried_tokens, ref.num_hit_tokens):
        def rate(r: Run) -> str:
            return f"{r.num_hit_tokens / r.num_queried_tokens:.2f}" if r.num_queried_tokens else "0.00"
        found.append(Problem("prefix stats", f"the prefix cache's statistics counted {run.num_hit_tokens} hit of "
                             f"{run.num_queried_tokens} queried prompt tokens (block_manager.hit_rate {rate(run)}); "
                             f"with {reference} {ref.num_hit_tokens} of {ref.num_queried_tokens} ({rate(ref)}): every "
                             "admitted prompt is counted once in the hit-rate statistics"))
    where = run.setup.describe()
    return [Problem(p.kind, f"{where}: {p.text}") for p in found]


# The failure classes of a run's problems (``Problem.kind``), with a hint in words a task's ``Hints.by_failure`` can
# take over or replace (``{**RUN_FAILURES, "leak": "..."}``): a check tags each problem with its class.
RUN_FAILURES: dict[str, str] = {
    "stopped": "the run stopped at the step named above: the first step that breaks an invariant is where to look",
    "shared-write": "a block two requests share is written only after it is copied (copy-on-write)",
    "limits": "a step may never run more sequences than max_num_seqs, nor more tokens than max_num_batched_tokens",
    "leak": "every block a request holds goes back to the pool when it finishes or is preempted",
    "sampling": "with temperature > 0 the next token is drawn (with the request's generator), not taken greedily",
    "transformers": "the tokens must be exactly what the model computes: a wrong token means a wrong input to the "
                    "model (its position, its cache, or the logits you read)",
    "reference": "the tokens, finish reason and stop reason must be those of labkit's part on the same seed",
    "steps": "each engine step must run the same requests with the same number of tokens as labkit's part: compare "
             "the step named above with the rule",
    "blocks": "the number of KV blocks in use after each step must match labkit's part: allocate what the new tokens "
              "need, no more, and free what finished",
    "num-steps": "the run took a different number of steps: something was scheduled later or earlier than the rule "
                 "says",
    "preemptions": "preempt only while the pool is short, one request at a time",
    "copies": "copy a shared block only when it is written to, and only then",
    "prefix-cache": "the prefix cache must find exactly the full blocks a request shares with earlier ones",
    "prefix-stats": "the block manager's hit rate counts every admitted prompt once, cached part and all: the "
                    "admission is where a prompt meets the prefix cache",
}


def failure_class(kind: str) -> str:
    """The failure class of a problem kind ("num steps" -> "num-steps")."""
    return kind.replace(" ", "-")


def report(check: Check, found: Iterable[Problem], every: bool = False, hints: Mapping[str, str] | None = None) -> bool:
    """Each problem as a failure (only the first unless ``every``), tagged with its failure class when the task's
    hints know it, with the extra text ``hints`` gives its kind; True if none."""
    hints = hints or {}
    ok = True
    for p in found:
        key = failure_class(p.kind)
        check.expect(False, p.text + hints.get(p.kind, ""), because=key if check.knows(key) else "")
        ok = False
        if not every:
            break
    return ok


def expect_run(check: Check, run: Run, model: str, part: str, reference: str, every: bool = False,
               hints: Mapping[str, str] | None = None) -> bool:
    """Report ``run``'s problems against labkit's part on the same setup; True if it has none."""
    return report(check, problems(run, reference_run(run.setup, model), model, part, reference), every, hints)


def check_setups(check: Check, setups: Iterable[Setup], model: str, part: str, reference: str, every: bool = False,
                 **learner_part: Any) -> None:
    """Run ``setups`` in order (smallest first) with the learner's part (``LLM`` options, e.g. ``kv_cache_cls=C``) and
    stop at the first that goes wrong: later setups build on what it exercises."""
    for setup in setups:
        if not expect_run(check, run_setup(setup, model, **learner_part), model, part, reference, every):
            return
