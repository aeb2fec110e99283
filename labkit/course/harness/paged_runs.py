"""Run a paged engine with a learner's part in it, one step at a time, and record what happened.

Notebook 06's Build tasks are a ``BlockManager`` subclass (``LLM(..., block_manager_cls=...)``) and a
``PagedAttentionBackend`` subclass (``LLM(..., attention_backend=...)``). Their checkers run a small workload
through the real engine with the learner's class and again with labkit's own, in debug mode (the block
manager's books are checked after every step), and compare the two runs. The run is driven step by step,
not through ``LLM.generate``, so that a part that raises, or books that stop balancing, end the run with the
step and what it ran, instead of a traceback. Notebook 06.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from labkit.core.sequence import Sequence
from labkit.course import Check, where_in_learner_code


@dataclass(frozen=True)
class RunRequest:
    """One request of a workload: its prompt (token ids), how it samples, and the step it arrives at. Notebook 06."""

    label: str
    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1  # parallel samples: sequences label.0, label.1, ...
    temperature: float = 0.0
    seed: int | None = None
    arrival_step: int = 0  # added to the engine just before this engine step


@dataclass(frozen=True)
class RunSetup:
    """A workload and the engine options it runs under. Notebook 06."""

    name: str  # what the workload exercises, for messages ("shared prefixes")
    engine: str
    requests: tuple[RunRequest, ...]
    block_size: int = 4
    num_gpu_blocks: int = 64
    max_num_seqs: int = 4
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = False
    max_steps: int = 200  # a part that never lets the workload finish is stopped here

    def describe(self) -> str:
        caching = ", prefix caching on" if self.enable_prefix_caching else ""
        budget = f", max_num_batched_tokens {self.max_num_batched_tokens}" if self.max_num_batched_tokens else ""
        return (f"engine {self.engine!r} on {self.name} (block_size {self.block_size}, {self.num_gpu_blocks} "
                f"blocks{caching}{budget})")


@dataclass
class StepRecord:
    """One engine step: what each sequence computed and the KV blocks in use afterwards. Notebook 06."""

    step: int
    scheduled: list[str]  # the sequences the step was about to run (after scheduling, before the forward pass)
    ran: dict[str, int]  # sequence label -> new tokens it computed this step
    used_blocks: int


@dataclass
class RunRecord:
    """A finished (or stopped) run. Notebook 06."""

    setup: RunSetup
    steps: list[StepRecord] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)  # sequence label -> output token ids
    num_cached_tokens: dict[str, int] = field(default_factory=dict)  # sequence label -> prompt tokens from the cache
    num_preemptions: int = 0
    num_copies: int = 0
    num_hit_tokens: int = 0
    blocks_in_use_after: int = 0  # KV blocks still held once every request finished (a leak if not 0)
    shared_write: str | None = None  # the first time a step was about to write K/V into a block others hold
    error: BaseException | None = None  # what a step raised (the learner's part, or the engine because of it)
    error_step: int | None = None
    books_error: str | None = None  # the engine's per-step check of the block manager's books failed
    stalled: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is None and self.books_error is None and self.stalled is None

    def ran_in(self, step: int) -> str:
        """'R0: 18 tokens, S.1: 1 token' for the sequences that step computed (or was about to run)."""
        record = next((s for s in self.steps if s.step == step), None)
        if record is None:
            return "nothing"
        if record.ran:
            return ", ".join(f"{name}: {n} token{'s' * (n != 1)}" for name, n in record.ran.items())
        return ", ".join(record.scheduled) or "nothing yet: it failed while scheduling"


def first_shared_write(bm: Any, batch: list[Sequence], names: dict[int, str], step: int) -> str | None:
    """A sequence about to write K/V into a block that another sequence also holds, if any (engines without
    chunking compute every token a sequence has not computed yet)."""
    for seq in batch:
        for position in range(seq.num_computed_tokens, seq.num_tokens):
            i = position // bm.block_size
            block_id = seq.block_table[i] if i < len(seq.block_table) else None
            if block_id is not None and bm.blocks[block_id].ref_count > 1:
                return (f"engine step {step}: {names[id(seq)]} was about to write the K/V of its token {position} "
                        f"into block {block_id}, which {bm.blocks[block_id].ref_count} sequences hold: a shared "
                        "block must be copied before anyone writes into it (copy-on-write)")
    return None


def raised_in_check_invariants(exc: BaseException) -> bool:
    return any(f.name == "check_invariants" for f in traceback.extract_tb(exc.__traceback__))


def run_engine(setup: RunSetup, part: dict[str, Any], model: str = "labkit-tiny") -> RunRecord:
    """Run ``setup``'s workload with the engine options ``part`` (``{"block_manager_cls": C}`` or
    ``{"attention_backend": C}``), in debug mode, one step at a time."""
    from labkit import LLM, SamplingParams  # late import: labkit.core.llm imports the engines
    from labkit.core.engine.base import StepFailedError

    budget = {"max_num_batched_tokens": setup.max_num_batched_tokens} if setup.max_num_batched_tokens else {}
    llm = LLM(model, engine=setup.engine, device="cpu", block_size=setup.block_size,
              num_gpu_blocks=setup.num_gpu_blocks, max_num_seqs=setup.max_num_seqs,
              enable_prefix_caching=setup.enable_prefix_caching, debug_checks=True, **budget, **part)
    engine: Any = llm.engine
    seqs: dict[str, Sequence] = {}
    names: dict[int, str] = {}
    scheduled: dict[str, tuple[int, int]] = {}  # label -> (tokens computed, tokens to compute) at the forward pass

    def before_forward(batch: list[Sequence]) -> None:  # the engine calls it after scheduling a step
        scheduled.update({names[id(s)]: (s.num_computed_tokens, s.num_tokens - s.num_computed_tokens) for s in batch})
        if record.shared_write is None:
            record.shared_write = first_shared_write(engine.block_manager, batch, names, len(record.steps))

    engine.fault_hook = before_forward
    record = RunRecord(setup)
    try:
        for step in range(setup.max_steps + 1):
            for r in setup.requests:
                if r.arrival_step == step:
                    params = SamplingParams(n=r.n, max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed,
                                            ignore_eos=True)
                    group = llm.add_request(list(r.prompt), params)
                    for j, seq in enumerate(group):
                        seqs[r.label if r.n == 1 else f"{r.label}.{j}"] = seq
                        names[id(seq)] = r.label if r.n == 1 else f"{r.label}.{j}"
            arriving = any(r.arrival_step > step for r in setup.requests)
            if not engine.has_unfinished_requests() and not arriving:
                break
            if step == setup.max_steps:
                left = ", ".join(name for name, s in seqs.items() if not s.is_finished)
                record.stalled = f"after {setup.max_steps} engine steps {left} had still not finished"
                break
            scheduled.clear()
            try:
                engine.step()
            except StepFailedError as exc:
                record.error, record.error_step = exc.cause, step
                break
            except Exception as exc:  # the per-step check of the books, or a failure while failing the step
                if isinstance(exc, AssertionError) and raised_in_check_invariants(exc):
                    record.books_error = str(exc)
                else:
                    record.error = exc
                record.error_step = step
                break
            finally:
                # A sequence that finished has given its blocks back (and its count): it computed all it had left.
                ran = {name: left if seqs[name].is_finished else seqs[name].num_computed_tokens - done
                       for name, (done, left) in scheduled.items()}
                ran = {name: n for name, n in ran.items() if n > 0}
                used = engine.block_manager.num_used_blocks
                record.steps.append(StepRecord(step, list(scheduled), ran, used))
        record.tokens = {name: list(s.output_token_ids) for name, s in seqs.items()}
        record.num_cached_tokens = {name: s.num_cached_tokens for name, s in seqs.items()}
        bm = engine.block_manager
        record.num_preemptions = engine.num_preemptions
        record.num_copies, record.num_hit_tokens = bm.num_copies, bm.num_hit_tokens
        record.blocks_in_use_after = bm.num_used_blocks
    finally:
        release(engine)
    return record


def release(engine: Any) -> None:
    """Whatever happened, the discarded engine gives its KV memory back: a part that lost track of blocks gets
    its books started afresh (what the run did wrong is in its record already)."""
    from labkit.core.kv.block_manager import BlockManager

    bm = engine.block_manager
    try:
        engine.abort_all()
        bm.check_invariants([])
        balanced = bm.num_used_blocks == 0
    except Exception:
        balanced = False
    if not balanced:
        BlockManager.__init__(bm, bm.num_blocks, bm.block_size, bm.enable_prefix_caching)


@functools.lru_cache(maxsize=16)
def reference_run(setup: RunSetup, model: str = "labkit-tiny") -> RunRecord:
    """The same workload with labkit's own parts (computed once per setup)."""
    record = run_engine(setup, {}, model)
    assert record.finished, f"labkit's own parts did not finish {setup.describe()}: {record}"
    return record


@functools.lru_cache(maxsize=4)
def tokenizer_of(model: str) -> Any:
    from labkit.core.model.source import resolve_model_source
    from labkit.core.text.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_source(model).tokenizer_path)


def prompt(model: str, num_tokens: int, seed: int) -> tuple[int, ...]:
    """``num_tokens`` ids of in-domain text (BOS first): readable prompts, so greedy output is readable too."""
    from labkit.course.workloads import prompt_ids_of_length

    return tuple(prompt_ids_of_length(tokenizer_of(model), num_tokens, seed=seed))


def stop_on_error(check: Any, record: RunRecord, part: str, model: str = "labkit-tiny") -> bool:
    """Report a run that did not finish (True: nothing else to compare). A stub's NotImplementedError is raised
    again, so that the checker reports "not started"."""
    where = record.setup.describe()
    if record.error is not None:
        if isinstance(record.error, NotImplementedError):
            raise record.error
        check.expect(False, f"{where}: engine step {record.error_step} (running {record.ran_in(record.error_step)}) "
                     f"raised {type(record.error).__name__}{where_in_learner_code(record.error)}: {record.error}")
        return True
    if record.books_error is not None:
        ran = record.ran_in(record.error_step)
        check.expect(False, f"{where}: after engine step {record.error_step} (it ran {ran}) the block manager's "
                     f"books did not balance: {record.books_error}")
        return True
    if record.stalled is not None:
        check.expect(False, f"{where}: {record.stalled} (with labkit's {part} it takes "
                     f"{len(reference_run(record.setup, model).steps)})")
        return True
    return False


def first_token_difference(got: dict[str, list[int]], want: dict[str, list[int]]) -> str | None:
    """'S.1: output token 3 is 17, expected 52' for the first sequence whose tokens differ, else None."""
    from labkit.course.oracle import first_difference

    names = list(want)
    return first_difference([got.get(n, []) for n in names], [want[n] for n in names], names)


def compare_tokens(check: Check, run: RunRecord, ref: RunRecord, model: str, reference: str) -> None:
    """A finished run's tokens against transformers' greedy tokens (its greedy requests) and against ``ref``, the
    run with labkit's parts, named ``reference`` in the message (every request: the same seeds draw alike)."""
    from labkit.course.oracle import transformers_greedy

    where = run.setup.describe()
    want = {r.label: transformers_greedy(model, [r.prompt], r.max_tokens)[0]
            for r in run.setup.requests if r.temperature == 0}
    diff = first_token_difference(run.tokens, want)
    check.expect(diff is None, f"{where}, against transformers' greedy tokens: {diff}")
    diff = first_token_difference(run.tokens, ref.tokens)
    check.expect(diff is None, f"{where}, against {reference}: {diff}")


def compare_in_engines(check: Check, part: dict[str, Any], part_name: str, setups: tuple[RunSetup, ...],
                       compare: Callable[[Check, RunRecord, RunRecord], None], model: str = "labkit-tiny") -> None:
    """Each workload with the learner's ``part`` and with labkit's, until one fails (the later ones build on it): a
    run that did not finish is reported (``part_name`` names labkit's part), a finished one is handed to
    ``compare(check, run, ref)``."""
    for setup in setups:
        run, ref = run_engine(setup, part, model), reference_run(setup, model)
        if not stop_on_error(check, run, part_name, model):
            compare(check, run, ref)
        if check.result.failures:
            return
