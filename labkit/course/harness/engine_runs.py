"""Run engine ``naive`` or ``kvcache`` with a learner's part in it, step by step, and compare what it produced.

The Build tasks of notebooks 02, 03 and 05 are subclasses of labkit's classes: an engine (``LLM(...,
engine=MyEngine)``) or a KV cache (``LLM(..., engine="kvcache", kv_cache_cls=MyCache)``). Their checkers run a few
requests of the bundled model through the real engine with the learner's class and compare every request's tokens,
finish reason and stop reason with transformers' greedy continuation and with labkit's own part. The checkers wrap
the learner's class in a watching subclass that compares each call with labkit's and raises ``Mistake`` at the first
one that breaks a rule, so the message names the request, the step and what was expected. The run is driven one
step at a time, so a part that raises or never lets a request finish ends the run with a message, not a traceback.
Notebooks 02, 03 and 05.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

from labkit.core.sampling_params import SamplingParams
from labkit.course import Check, where_in_learner_code
from labkit.course.oracle import first_difference, transformers_greedy


class Mistake(Exception):
    """Raised by a checker's watching subclass: the learner's part broke a rule; the message says which and where.
    Notebooks 02, 03 and 05."""


@dataclass(frozen=True)
class Request:
    """One request of a check run: a prompt, how it samples and stops, and the name messages call it by.
    Notebooks 02, 03 and 05."""

    name: str
    prompt: str
    max_tokens: int | None = 10
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = True

    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, stop=list(self.stop),
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)

    def describe(self) -> str:
        """'R1 ("The dog ran to the park...", temperature 0.8, seed 2, max_tokens 10)'."""
        defaults = Request(self.name, self.prompt)
        prompt = self.prompt if len(self.prompt) <= 28 else self.prompt[:25] + "..."
        knobs = [f"{k} {getattr(self, k)!r}" for k in ("temperature", "top_k", "top_p", "seed", "stop",
                                                         "stop_token_ids", "ignore_eos")
                 if getattr(self, k) != getattr(defaults, k)]
        knobs = (["greedy"] if self.temperature == 0 else []) + knobs + [f"max_tokens {self.max_tokens}"]
        return f"{self.name} ({prompt!r}, {', '.join(knobs)})"


@dataclass(frozen=True)
class Setup:
    """Requests run together through one engine, and what messages call the run ("3 requests in static batches").
    Notebooks 02, 03 and 05."""

    name: str
    requests: tuple[Request, ...]
    max_steps: int = 120  # a part that never lets the requests finish is stopped here


@dataclass
class Outcome:
    """What one request produced. Notebooks 02, 03 and 05."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    text: str


@dataclass
class Run:
    """A finished (or stopped) run: each request's outcome, or why the run ended early. Notebooks 02, 03 and 05."""

    setup: Setup
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    error: BaseException | None = None  # what a step raised (the learner's part, or a Mistake it made)
    error_step: int | None = None
    running: list[str] = field(default_factory=list)  # the requests of the step that raised
    stalled: str | None = None
    eos_token_ids: frozenset[int] = frozenset()


def make_llm(engine: Any, model: str, **options: Any) -> Any:
    """An ``LLM`` on the CPU in float32 (exactly reproducible) with engine ``engine`` and its options."""
    from labkit import LLM  # late import: labkit.core.llm imports the engines

    return LLM(model, engine=engine, device="cpu", dtype="float32", **options)


def run_setup(llm: Any, setup: Setup) -> Run:
    """Add ``setup``'s requests to ``llm``'s engine and step it until they are all done (or something broke)."""
    from labkit.core.engine.base import StepFailedError

    engine = llm.engine
    seqs = {r.name: llm.add_request(r.prompt, r.params())[0] for r in setup.requests}
    names = {id(s): name for name, s in seqs.items()}
    running: list[str] = []
    engine.fault_hook = lambda batch: running.__setitem__(slice(None), [names.get(id(s), "?") for s in batch])
    run = Run(setup, eos_token_ids=frozenset(llm.eos_token_ids))
    try:
        for step in range(setup.max_steps + 1):
            if not engine.has_unfinished_requests():
                break
            if step == setup.max_steps:
                left = ", ".join(name for name, s in seqs.items() if not s.is_finished)
                run.stalled = (f"after {setup.max_steps} engine steps {left} had still not finished (labkit's engine "
                               "needs far fewer): a request that should have stopped went on")
                break
            try:
                engine.step()
            except StepFailedError as exc:
                run.error, run.error_step, run.running = exc.cause, step, list(running)
                break
    finally:
        engine.fault_hook = None
        engine.abort_all()  # whatever happened, the engine is left empty for the next setup
    run.outcomes = {name: Outcome(list(s.prompt_token_ids), list(s.output_token_ids),
                                  s.finish_reason.value if s.finish_reason is not None else None,
                                  s.stop_reason, s.text) for name, s in seqs.items()}
    return run


@functools.lru_cache(maxsize=32)
def reference_run(engine: str, setup: Setup, model: str, options: tuple[tuple[str, Any], ...] = ()) -> Run:
    """``setup`` through labkit's own engine ``engine`` (computed once per setup and options)."""
    run = run_setup(make_llm(engine, model, **dict(options)), setup)
    assert run.error is None and run.stalled is None, f"labkit's own engine failed {setup.name}: {run}"
    return run


def stopped_early(check: Check, run: Run, part: str) -> bool:
    """Report a run that did not finish; True when there is nothing else to compare. A stub's NotImplementedError
    is raised again, so the checker reports the task as not started."""
    if run.error is not None:
        if isinstance(run.error, NotImplementedError):
            raise run.error
        where = f"{run.setup.name}, engine step {run.error_step} (running {', '.join(run.running) or 'nothing'})"
        if isinstance(run.error, Mistake):
            check.expect(False, f"{where}: {run.error}")
        else:
            check.expect(False, f"{where}: your {part} raised {type(run.error).__name__}: {run.error}"
                         f"{where_in_learner_code(run.error)}")
        return True
    if run.stalled is not None:
        check.expect(False, f"{run.setup.name}: {run.stalled}")
        return True
    return False


def compare_with_transformers(check: Check, run: Run, model: str) -> bool:
    """Greedy requests must continue their prompts as transformers' ``generate`` does. False (and a failure naming
    the first request and token that differ) if one does not."""
    greedy = [r for r in run.setup.requests if r.temperature == 0]
    # Up to the first end-of-sequence token: transformers' reference is generated with EOS suppressed.
    got = [list(itertools.takewhile(lambda t: t not in run.eos_token_ids, run.outcomes[r.name].token_ids))
           for r in greedy]
    longest = max(len(g) for g in got) if got else 0
    want = transformers_greedy(model, [run.outcomes[r.name].prompt_token_ids for r in greedy], max(longest, 1))
    want = [w[: len(g)] for w, g in zip(want, got)]  # each stopped where its own rule said (checked elsewhere)
    problem = first_difference(got, want, [r.describe() for r in greedy])
    check.expect(problem is None, f"{run.setup.name}, against transformers' greedy continuation: {problem}")
    return problem is None


def compare_with_reference(check: Check, run: Run, reference: Run) -> bool:
    """Every request's tokens, finish reason and stop reason must be those of labkit's own part."""
    for r in run.setup.requests:
        got, want = run.outcomes[r.name], reference.outcomes[r.name]
        problem = first_difference([got.token_ids], [want.token_ids], [r.describe()])
        if problem is not None:
            seeded = " (the same seed)" if r.temperature > 0 else ""
            check.expect(False, f"{run.setup.name}, against labkit's own engine{seeded}: {problem}")
            return False
        if (got.finish_reason, got.stop_reason) != (want.finish_reason, want.stop_reason):
            check.expect(False, f"{run.setup.name}: {r.describe()} finished with finish_reason {got.finish_reason!r}, "
                         f"stop_reason {got.stop_reason!r}; expected {want.finish_reason!r}, {want.stop_reason!r}")
            return False
    return True


def require_subclass(cls: object, base: type, example: str) -> type:
    """The learner's class, or a clear error if it is not a subclass of ``base``."""
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"expected a subclass of {base.__module__}.{base.__name__} ({example}), got {cls!r}")
    return cls


def check_runs(check: Check, llm: Any, setups: tuple[Setup, ...], part: str, model: str, engine: str,
               options: tuple[tuple[str, Any], ...] = ()) -> None:
    """Run ``setups`` in order (smallest first) through ``llm``, whose engine has the learner's part, and stop at the
    first that fails: greedy tokens against transformers', every outcome against labkit's own ``engine``."""
    for setup in setups:
        run = run_setup(llm, setup)
        if (stopped_early(check, run, part) or not compare_with_transformers(check, run, model)
                or not compare_with_reference(check, run, reference_run(engine, setup, model, options))):
            return


# Engine kvcache's runs: one request alone (no padding), then static batches of 3 whose prompts and outputs differ
# in length (padding, finished rows still computed, a second batch with a fresh cache), then seeded sampling.
KV_MAX_NUM_SEQS = 3
KV_ALONE = Setup("1 greedy request alone", (Request("R0", "The dog ran to the park. He saw", max_tokens=8),))
KV_BATCHES = Setup("4 greedy requests in static batches of 3", (
    Request("R0", "Lily was happy.", max_tokens=6),
    Request("R1", "The dog ran to the park. He saw", max_tokens=4),
    Request("R2", "One day, Tom found a red ball under the big tree. He", max_tokens=8),
    Request("R3", "Once upon a time, there was a little fox named Lily.", max_tokens=5),
))
KV_SAMPLED = Setup("3 sampled requests (seeded) in one static batch", (
    Request("S0", "Lily was happy.", max_tokens=8, temperature=0.8, seed=1),
    Request("S1", "The dog ran to the park. He saw", max_tokens=6, temperature=1.3, top_k=20, seed=2),
    Request("S2", "One day, Tom found a red ball under the big tree. He", max_tokens=8, temperature=0.7, top_p=0.8,
            seed=3),
))
