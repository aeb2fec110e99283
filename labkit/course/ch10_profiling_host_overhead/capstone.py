"""Checker for the capstone of notebook 10 (``10_profiling_host_overhead``): your engine, all parts together.

The task is ``my_engine(parts, model, **options)``: build engine ``chunked`` with every pluggable part of ``parts``
(``labkit.course.ch10_profiling_host_overhead.parts.EngineParts``: your scheduler rules from notebooks 07-08, your block
manager and attention backend from notebook 06, labkit's wherever yours is not done). The checker builds it on a
workload made to exercise every part at once: prompts that share a cached prefix, a long prompt prefilled in chunks
beside decodes, and a pool small enough that requests are preempted and recomputed; it runs with the per-token input
preparation (``prepare_inputs="loop"``, which calls the block manager's ``slot``) and the engine's per-step
checks of the KV books, step by step through the harness (``labkit.course.harness``). The engine must run the given
parts, produce transformers' greedy tokens for every request, keep every step within the token budget, leave no block
in use, and run, preempt and hit the prefix cache at every step as labkit's own ``chunked``. A failure names the
request, the step or the part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.course.ch10_profiling_host_overhead.parts import PART_OPTIONS, EngineParts
from labkit.course.harness.compare import RUN_FAILURES, expect_run
from labkit.course.harness.runs import Request, Run, Setup, prompt, run_setup
from labkit.course.harness.runs import reference_run as labkit_run

if TYPE_CHECKING:
    from labkit.core.llm import LLM

BuildEngine = Callable[..., "LLM"]

# Blocks of 4 in a pool of 16, a 16-token budget, 4 slots: R0-R2 share a 12-token system prompt (R1 and R2 find it
# in the prefix cache), R3's 40-token prompt is prefilled in chunks beside decodes, R4 and R5 arrive later; the pool
# runs dry as they decode, so requests are preempted and recomputed.
SYSTEM_PROMPT_LEN = 12
# (system prompt shared?, own prompt tokens, output tokens, arrival step)
CAPSTONE_REQUESTS: tuple[tuple[bool, int, int, int], ...] = (
    (True, 6, 12, 0), (True, 9, 10, 1), (True, 5, 14, 2), (False, 40, 8, 2), (False, 7, 12, 4), (False, 13, 9, 6))
# What a difference most likely means, added to the harness's message: the checks of the parts' own notebooks name
# the rule, this one only sees the engine.
HINTS = {
    "transformers": ": K/V written or read in the wrong place (the block manager's slots or block tables, or the "
                    "attention backend)",
    "steps": ": a scheduler or block-manager part decides differently from labkit's (its notebook's check names the "
             "rule)",
}


CAPSTONE_HINTS = Hints(
    concept="Every part you built is a class the engine accepts through an option with vLLM's name. Which engine "
            "runs all of them at once, and how do the parts reach it?",
    rule="Build the chunked engine with the model, pass each part under its option name, and pass on the other "
         "options unchanged; return the engine you built. A part at fault is named: go back to its notebook, or "
         "leave it out (labkit's is then used).",
    code="return LLM(model, engine=\"chunked\", scheduler_cls=parts.scheduler_cls, block_manager_cls="
         "parts.block_manager_cls, attention_backend=parts.attention_backend, **options)",
    by_failure={
        **RUN_FAILURES,
        "return-value": "my_engine returns the LLM it built",
        "parts-not-run": "the engine must be chunked and must run exactly the parts it was given",
        "options-dropped": "every option the caller passes (max_num_seqs, the budget, the pool, ...) reaches the "
                           "engine unchanged, next to the parts",
    },
)


def build_engine(parts: EngineParts, model: str, **options: Any) -> LLM:
    """Engine ``chunked`` running every pluggable part of ``parts``: the capstone's engine. Notebook 10."""
    from labkit import LLM  # late import: labkit.core.llm imports the engines

    return LLM(model, engine="chunked", scheduler_cls=parts.scheduler_cls, block_manager_cls=parts.block_manager_cls,
               attention_backend=parts.attention_backend, **options)


@functools.lru_cache(maxsize=2)
def capstone_setup(model: str = "labkit-tiny") -> Setup:
    """The capstone's workload (``CAPSTONE_REQUESTS``) and the options its engine is built with, in debug mode with the
    per-token input preparation (which calls the block manager's ``slot``). Notebook 10."""
    system = prompt(model, SYSTEM_PROMPT_LEN, seed=1)
    requests = []
    for i, (shared, n, max_tokens, arrival) in enumerate(CAPSTONE_REQUESTS):
        # Shared: the system prompt, then n tokens of the request's own text (without its BOS).
        own = prompt(model, n + 1, seed=10 + i)[1:] if shared else prompt(model, n, seed=10 + i)
        requests.append(Request(f"R{i}", system + own if shared else own, max_tokens, arrival_step=arrival))
    return Setup("the capstone's workload", tuple(requests), "chunked", max_num_seqs=4, max_num_batched_tokens=16,
                 block_size=4, num_gpu_blocks=16, enable_prefix_caching=True, prepare_inputs="loop", max_steps=300)


def reference_run(model: str = "labkit-tiny") -> Run:
    """The capstone workload through labkit's own ``chunked`` (computed once); it preempts and hits the cache."""
    run = labkit_run(capstone_setup(model), model)
    assert run.num_preemptions and run.num_hit_tokens, f"labkit's capstone run neither preempts nor hits: {run}"
    return run


def parts_problem(llm: LLM, parts: EngineParts) -> str | None:
    """Does the engine run the parts it was given?"""
    if llm.engine_name != "chunked":
        return (f"your engine is {llm.engine_name!r}; the capstone runs engine 'chunked' (every part at once: "
                "chunked prefill beside decodes, preemption, prefix caching)")
    engine = llm.engine
    running = {"scheduler_cls": type(engine.scheduler), "block_manager_cls": type(engine.block_manager),  # type: ignore[attr-defined]
               "attention_backend": engine.runner.attention_backend}  # type: ignore[attr-defined]
    for option in PART_OPTIONS:
        want = getattr(parts, option)
        if running[option] is not want:
            return (f"your engine runs {running[option].__name__} as its {option}, not {want.__name__} from parts: "
                    f"pass {option}=parts.{option} to LLM")
    return None


def options_problem(llm: LLM, options: dict[str, Any]) -> str | None:
    """Did the engine get the options the caller passed (those its config records)?"""
    config = llm.engine.config  # type: ignore[attr-defined]
    for name, want in options.items():
        got = getattr(config, name, want)
        if got != want:
            return (f"your engine was built with {name}={got!r}, not the {name}={want!r} the caller passed: pass the "
                    "other options on to LLM unchanged (**options)")
    return None


def check_capstone(build: BuildEngine, parts: EngineParts | None = None, model: str = "labkit-tiny") -> CheckResult:
    """The capstone: ``build(parts, model, **options)`` is engine ``chunked`` with ``parts``, and it is right."""
    parts_ = parts if parts is not None else EngineParts()

    def body(check: Check) -> None:
        if not callable(build):
            raise TypeError(f"expected a function my_engine(parts, model, **options), got {build!r}")
        setup = capstone_setup(model)
        llm = build(parts_, model, **setup.options())  # first: a stub raises at once, before any run
        if not hasattr(llm, "engine") or not hasattr(llm, "add_request"):
            check.expect(False, f"my_engine returned {llm!r}: it must return the LLM it built", because="return-value")
            return
        reference_run(model)  # labkit's run first (cached): the workload still preempts and hits the prefix cache
        try:
            problem = parts_problem(llm, parts_)
            dropped = options_problem(llm, setup.options()) if problem is None else None
            run = run_setup(setup, model, llm=llm) if problem is None and dropped is None else None
        finally:
            llm.close()
        if dropped:
            check.expect(False, dropped, because="options-dropped")
            return
        if problem or run is None:
            check.expect(False, problem or "", because="parts-not-run")
            return
        expect_run(check, run, model, "engine's parts", "labkit's chunked", hints=HINTS)

    return run_checker("Task 2 (your engine)", "", body, task_id="10.capstone")
