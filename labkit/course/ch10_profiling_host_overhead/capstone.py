"""Checker for the capstone of notebook 10 (``10_profiling_host_overhead``): your engine, all parts together.

The task is ``my_engine(parts, model, **options)``: build engine ``chunked`` with every pluggable part of ``parts``
(``labkit.course.ch10_profiling_host_overhead.parts.EngineParts``: your scheduler rules from notebooks 07-08, your block
manager and attention backend from notebook 06, labkit's wherever yours is not done). The checker builds it on a
workload made to exercise every part at once: prompts that share a cached prefix, a long prompt prefilled in chunks
beside decodes, and a pool small enough that requests are preempted and recomputed; it runs with the per-token input
preparation (``prepare_inputs="loop"``, which calls the block manager's ``slot``) and the engine's per-step
checks of the KV books. The engine must run the given parts, produce transformers' greedy tokens for every
request, keep every step within the token budget, leave no block in use, and preempt, hit the prefix cache and
take as many steps as labkit's own ``chunked``. A failure names the request, the step or the part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from labkit.course import Check, CheckResult, run_checker
from labkit.course.ch10_profiling_host_overhead.parts import PART_OPTIONS, EngineParts
from labkit.course.harness.scheduling import reclaim_lost_blocks
from labkit.course.harness.trial_checks import where_in_learner_code
from labkit.course.oracle import first_difference, transformers_greedy

if TYPE_CHECKING:
    from labkit.core.llm import LLM
    from labkit.core.sequence import Sequence

BuildEngine = Callable[..., "LLM"]

# Blocks of 4 in a pool of 16, a 16-token budget, 4 slots: R0-R2 share a 12-token system prompt (R1 and R2 find it
# in the prefix cache), R3's 40-token prompt is prefilled in chunks beside decodes, R4 and R5 arrive later; the pool
# runs dry as they decode, so requests are preempted and recomputed.
CAPSTONE_OPTIONS: dict[str, Any] = dict(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=16,
                                        block_size=4, num_gpu_blocks=16, enable_prefix_caching=True,
                                        prepare_inputs="loop", debug_checks=True)
SYSTEM_PROMPT_LEN = 12
# (system prompt shared?, own prompt tokens, output tokens, arrival step)
CAPSTONE_REQUESTS: tuple[tuple[bool, int, int, int], ...] = (
    (True, 6, 12, 0), (True, 9, 10, 1), (True, 5, 14, 2), (False, 40, 8, 2), (False, 7, 12, 4), (False, 13, 9, 6))
MAX_STEPS = 300


def build_engine(parts: EngineParts, model: str, **options: Any) -> LLM:
    """Engine ``chunked`` running every pluggable part of ``parts``: the capstone's engine. Notebook 10."""
    from labkit import LLM  # late import: labkit.core.llm imports the engines

    return LLM(model, engine="chunked", scheduler_cls=parts.scheduler_cls, block_manager_cls=parts.block_manager_cls,
               attention_backend=parts.attention_backend, **options)


@dataclass
class CapstoneRun:
    """One run of the capstone workload: what came out, and what went wrong if anything did. Notebook 10."""

    prompts: list[list[int]]
    outputs: list[list[int]] = field(default_factory=list)
    steps: list[str] = field(default_factory=list)  # per step: what each request computed, who was preempted
    num_preemptions: int = 0
    num_hit_tokens: int = 0  # prompt tokens found in the prefix cache
    num_steps: int = 0
    max_step_tokens: int = 0
    blocks_in_use_after: int = 0
    error: str | None = None


def capstone_prompts(llm: LLM) -> list[list[int]]:
    from labkit.course.workloads import prompt_ids_of_length

    system = prompt_ids_of_length(llm.tokenizer, SYSTEM_PROMPT_LEN, seed=1)
    prompts = []
    for i, (shared, n, _, _) in enumerate(CAPSTONE_REQUESTS):
        if shared:  # the system prompt, then n tokens of the request's own text (without its BOS)
            prompts.append(system + prompt_ids_of_length(llm.tokenizer, n + 1, seed=10 + i)[1:])
        else:
            prompts.append(prompt_ids_of_length(llm.tokenizer, n, seed=10 + i))
    return prompts


def step_text(seqs: list[Sequence], before: list[tuple[int, int]]) -> str:
    """What one step did, from the requests' counters: "R0: 1, R3: 13 (request: new tokens); R2 preempted"."""
    ran, preempted = [], []
    for i, (seq, (computed, times)) in enumerate(zip(seqs, before)):
        # A request that finished returned its blocks (and its count): it had computed all but its last token.
        now = seq.num_tokens - 1 if seq.is_finished else seq.num_computed_tokens
        if seq.num_preemptions > times:
            preempted.append(f"R{i}")
        elif now > computed:
            ran.append(f"R{i}: {now - computed}")
    return (", ".join(ran) or "nothing") + " (request: new tokens)" + (
        f"; {', '.join(preempted)} preempted" if preempted else "")


def run_capstone(llm: LLM) -> CapstoneRun:
    """Step the capstone workload through ``llm`` (arrivals at their steps), catching what a faulty part raises."""
    from labkit import SamplingParams
    from labkit.core.engine.base import StepFailedError

    engine = llm.engine
    run = CapstoneRun(capstone_prompts(llm))
    seqs: list[Sequence] = []
    try:
        for step in range(MAX_STEPS + 1):
            for prompt, (_, _, max_tokens, arrival) in zip(run.prompts, CAPSTONE_REQUESTS):
                if arrival == step:
                    seqs += llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True))
            if not engine.has_unfinished_requests() and step > max(r[3] for r in CAPSTONE_REQUESTS):
                break
            if step == MAX_STEPS:
                run.error = f"after {MAX_STEPS} engine steps some requests had still not finished"
                break
            before = [(s.num_computed_tokens, s.num_preemptions) for s in seqs]
            try:
                engine.step()
                run.steps.append(step_text(seqs, before))
            except StepFailedError as exc:
                run.error = (f"engine step {step}: {type(exc.cause).__name__} raised"
                             f"{where_in_learner_code(exc.cause)}: {exc.cause}")
                break
            except AssertionError as exc:  # the engine's per-step check of the KV books
                run.error = f"after engine step {step} the engine's KV books did not balance: {exc}"
                break
        bm = engine.block_manager  # type: ignore[attr-defined]
        run.outputs = [list(s.output_token_ids) for s in seqs]
        run.num_preemptions, run.num_hit_tokens = engine.num_preemptions, bm.num_hit_tokens
        run.num_steps = len(engine.step_stats)
        run.max_step_tokens = max((st.num_computed_tokens for st in engine.step_stats), default=0)
        run.blocks_in_use_after = bm.num_used_blocks
    finally:
        engine.abort_all()
        reclaim_lost_blocks(engine.block_manager)  # type: ignore[attr-defined]
    return run


@functools.lru_cache(maxsize=2)
def reference_run(model: str = "labkit-tiny") -> CapstoneRun:
    """The capstone workload through labkit's own ``chunked`` (computed once)."""
    from labkit import LLM

    with LLM(model, engine="chunked", **CAPSTONE_OPTIONS) as llm:
        run = run_capstone(llm)
    assert run.error is None and run.num_preemptions and run.num_hit_tokens, f"labkit's capstone run: {run}"
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


def run_problem(run: CapstoneRun, want: CapstoneRun, model: str) -> str | None:
    """The first thing wrong with a capstone run, in order: an error, the budget, a leak, a token, then every
    step's batch and preemptions, the number of steps and the prefix-cache hits of labkit's chunked; or None."""
    if run.error:
        return run.error
    budget = CAPSTONE_OPTIONS["max_num_batched_tokens"]
    if run.max_step_tokens > budget:
        return f"a step computed {run.max_step_tokens} tokens; the budget (max_num_batched_tokens) is {budget}"
    if run.blocks_in_use_after:
        return f"{run.blocks_in_use_after} KV block(s) were still in use after every request finished: a leak"
    oracle = [transformers_greedy(model, [p], r[2])[0] for p, r in zip(run.prompts, CAPSTONE_REQUESTS)]
    diff = first_difference(run.outputs, oracle, [f"R{i}" for i in range(len(run.prompts))])
    if diff:
        return (f"{diff} in transformers' greedy continuation of the same prompt: K/V written or read in the wrong "
                "place (the block manager's slots or block tables, or the attention backend)")
    for step, (got, expected) in enumerate(zip(run.steps, want.steps)):
        if got != expected:
            return (f"engine step {step} ran {got}; labkit's chunked ran {expected}: a scheduler or block-manager "
                    "part decides differently from labkit's (its notebook's check names the rule)")
    if run.num_steps != want.num_steps:
        return f"your engine took {run.num_steps} steps, labkit's chunked {want.num_steps}"
    if run.num_hit_tokens != want.num_hit_tokens:
        return (f"{run.num_hit_tokens} prompt tokens came from the prefix cache, {want.num_hit_tokens} with labkit's "
                "parts")
    return None


def check_capstone(build: BuildEngine, parts: EngineParts | None = None, model: str = "labkit-tiny") -> CheckResult:
    """The capstone: ``build(parts, model, **options)`` is engine ``chunked`` with ``parts``, and it is right."""
    parts_ = parts if parts is not None else EngineParts()

    def body(check: Check) -> None:
        if not callable(build):
            raise TypeError(f"expected a function my_engine(parts, model, **options), got {build!r}")
        llm = build(parts_, model, **CAPSTONE_OPTIONS)  # first: a stub raises at once, before any run
        if not hasattr(llm, "engine") or not hasattr(llm, "add_request"):
            check.expect(False, f"my_engine returned {llm!r}: it must return the LLM it built")
            return
        want = reference_run(model)
        try:
            problem = parts_problem(llm, parts_)
            run = run_capstone(llm) if problem is None else None
        finally:
            llm.close()
        if problem or run is None:
            check.expect(False, problem or "")
            return
        problem = run_problem(run, want, model)
        if problem:
            check.expect(False, problem)

    return run_checker(
        "Task 2 (your engine)",
        "return LLM(model, engine=\"chunked\", scheduler_cls=parts.scheduler_cls, block_manager_cls="
        "parts.block_manager_cls, attention_backend=parts.attention_backend, **options); if a part is at fault, the "
        "message names it: go back to its notebook, or leave it out (labkit's part is then used).",
        body,
    )
