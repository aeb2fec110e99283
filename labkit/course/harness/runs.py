"""Describe a workload, run the real engine with the learner's part in it one step at a time, and keep what happened.

A ``Setup`` is a workload (``Request``s: a prompt, how it samples and stops, ``n``, the engine step it arrives at) and
the engine options it runs under. ``run_setup`` builds ``LLM(model, engine=..., <options>, <the learner's part>)``
(or drives an ``LLM`` the learner built: notebook 10's capstone) and steps it to the end, not through
``LLM.generate``, so that whatever goes wrong ends the run with a record instead of a traceback or a hang: a step that
raises (``StepFailedError``: the learner's part, or a ``Mistake`` a watching subclass caught), KV books that stop
balancing (``debug_checks``), a scheduler that admits nobody, a run that never ends (``max_steps``). Every step records
what each sequence computed, who was preempted and the KV blocks in use; the run keeps every sequence's tokens, finish
and stop reasons, and the engine's totals. ``reference_run`` is the same setup with labkit's own parts;
``labkit.course.harness.compare`` compares the two, and transformers. Notebooks 02, 03, 05, 06, 07, 08 and 10.
"""

from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from labkit.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from labkit.core.engine.base import Engine
    from labkit.core.engine.step import StepStats
    from labkit.core.kv.block_manager import BlockManager
    from labkit.core.llm import LLM
    from labkit.core.sequence import Sequence

PAGED_ENGINES = ("paged", "continuous", "chunked")  # engines with a block manager: their books are checked every step


class Mistake(Exception):
    """Raised by a checker's watching subclass when the learner's part broke a rule; the message says which and where.
    The step fails with it, and the run's report shows it as it is. Notebooks 02, 03 and 05."""


@dataclass(frozen=True)
class TextOfLength:
    """A prompt of exactly ``num_tokens`` tokens of in-domain text (BOS first), drawn with ``seed``: made with the run's
    own tokenizer, so a workload can be written down before any model is loaded. Notebooks 07-08."""

    num_tokens: int
    seed: int


@dataclass(frozen=True)
class Request:
    """One request of a workload: its prompt (text, token ids or ``TextOfLength``), how it samples and stops, ``n``
    parallel samples (sequences ``name.0``, ``name.1``, ...), and the engine step it arrives at. Notebooks 02-10."""

    name: str
    prompt: str | tuple[int, ...] | TextOfLength
    max_tokens: int | None = 10
    n: int = 1
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = True  # outputs of a known length, whatever the model predicts
    arrival_step: int = 0  # added to the engine just before this engine step

    @property
    def seq_names(self) -> list[str]:
        """The names of its sequences, in the order ``LLM.add_request`` returns them."""
        return [self.name] if self.n == 1 else [f"{self.name}.{j}" for j in range(self.n)]

    def params(self) -> SamplingParams:
        return SamplingParams(n=self.n, max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, seed=self.seed, stop=list(self.stop),
                              stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos)

    def describe(self, seq_name: str | None = None) -> str:
        """'R1 ("The dog ran to the park...", temperature 0.8, seed 2, max_tokens 10)' for a text prompt; just the name
        for token ids (unreadable: the workload's name says what they exercise)."""
        name = seq_name or self.name
        if not isinstance(self.prompt, str):
            return name
        defaults = Request(self.name, self.prompt)
        prompt = self.prompt if len(self.prompt) <= 28 else self.prompt[:25] + "..."
        knobs = [f"{k} {getattr(self, k)!r}" for k in ("temperature", "top_k", "top_p", "seed", "stop",
                                                         "stop_token_ids", "ignore_eos", "n")
                 if getattr(self, k) != getattr(defaults, k)]
        knobs = (["greedy"] if self.temperature == 0 else []) + knobs + [f"max_tokens {self.max_tokens}"]
        return f"{name} ({prompt!r}, {', '.join(knobs)})"


def requests_of_lengths(*shapes: tuple[int, int, int]) -> tuple[Request, ...]:
    """Greedy requests R0, R1, ... from (prompt tokens, output tokens, arrival step): prompts of in-domain text of
    exactly that length (request i's drawn with seed i). Notebooks 07-08."""
    return tuple(Request(f"R{i}", TextOfLength(p, seed=i), o, arrival_step=a) for i, (p, o, a) in enumerate(shapes))


@dataclass(frozen=True)
class Setup:
    """A workload and the engine options it runs under (None: the engine's default). Notebooks 02-10."""

    name: str  # what the workload exercises, for messages ("shared prefixes and n=3 sampling")
    requests: tuple[Request, ...]
    engine: str = "naive"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool = False
    async_scheduling: bool = False  # plan step N+1 while step N runs (notebook 10): sequences in flight
    max_model_len: int | None = None
    prepare_inputs: str | None = None  # "loop": the per-token input preparation, which calls the block manager's slot
    max_steps: int = 200  # a part that never lets the workload finish is stopped here

    def options(self) -> dict[str, Any]:
        """``LLM``'s keyword arguments, the engine's name aside: on the CPU in float32 (exactly reproducible), and in
        debug mode where there is a block manager (its books are checked after every step)."""
        options: dict[str, Any] = dict(device="cpu", dtype="float32")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_gpu_blocks", "max_model_len",
                     "prepare_inputs"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        for name in ("enable_prefix_caching", "async_scheduling"):
            if getattr(self, name):
                options[name] = True
        if self.engine in PAGED_ENGINES:
            options["debug_checks"] = True
        return options

    def describe(self) -> str:
        """"engine 'paged' on shared prefixes (max_num_seqs 4, 64 blocks of 4, prefix caching on)"."""
        knobs = [f"max_num_seqs {self.max_num_seqs}"] if self.max_num_seqs else []
        if self.max_num_batched_tokens:
            knobs.append(f"max_num_batched_tokens {self.max_num_batched_tokens}")
        if self.num_gpu_blocks and self.block_size:
            knobs.append(f"{self.num_gpu_blocks} blocks of {self.block_size}")
        elif self.block_size or self.num_gpu_blocks:
            knobs.append(f"block_size {self.block_size}" if self.block_size else f"{self.num_gpu_blocks} blocks")
        knobs += [what for on, what in ((self.enable_prefix_caching, "prefix caching on"),
                                        (self.async_scheduling, "async scheduling")) if on]
        if self.max_model_len:
            knobs.append(f"max_model_len {self.max_model_len}")
        if self.prepare_inputs:
            knobs.append(f"prepare_inputs {self.prepare_inputs!r}")
        return f"engine {self.engine!r} on {self.name}" + (f" ({', '.join(knobs)})" if knobs else "")

    def request_of(self, seq_name: str) -> Request:
        """The request a sequence ("S.1") belongs to."""
        return next(r for r in self.requests if seq_name in r.seq_names)


@dataclass
class StepRecord:
    """One engine step: what it scheduled, what each sequence computed, who was preempted, the KV blocks in use after
    it. Notebooks 06-10."""

    step: int
    scheduled: list[str]  # the sequences it was about to run (after scheduling, before the forward pass)
    ran: dict[str, int]  # sequence -> new tokens it computed (engines with a block manager count them)
    preempted: list[str]
    used_blocks: int | None  # None: an engine without a block manager

    def describe(self) -> str:
        """'R0: 1, R3: 13 (request: new tokens); R2 preempted'."""
        if self.ran:
            text = ", ".join(f"{name}: {n}" for name, n in self.ran.items()) + " (request: new tokens)"
        else:  # an engine that does not count computed tokens, or a step that failed while scheduling
            text = ", ".join(self.scheduled) or "nothing"
        return text + (f"; {', '.join(self.preempted)} preempted" if self.preempted else "")


@dataclass
class Outcome:
    """What one sequence produced. Notebooks 02-10."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None
    text: str
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    num_preemptions: int


@dataclass
class Run:
    """A finished (or stopped) run: every step, every sequence's outcome, the engine's totals, or why it stopped.
    Notebooks 02-10."""

    setup: Setup
    steps: list[StepRecord] = field(default_factory=list)
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # sequence name -> what it produced
    step_stats: list[StepStats] = field(default_factory=list)  # the engine's own record of this run's steps
    num_preemptions: int = 0
    num_copies: int = 0  # copy-on-write copies
    num_hit_tokens: int = 0  # prompt tokens found in the prefix cache
    num_queried_tokens: int = 0  # prompt tokens counted as prefix-cache queries (the hit rate's denominator)
    blocks_in_use_after: int = 0  # KV blocks still held once every request finished (a leak if not 0)
    shared_write: str | None = None  # the first time a step was about to write K/V into a block others hold
    error: BaseException | None = None  # what a step raised (the learner's part, a Mistake, or the engine)
    error_step: int | None = None
    books_error: str | None = None  # the engine's per-step check of the KV books failed
    stalled: str | None = None  # why the run stopped without finishing

    @property
    def finished(self) -> bool:
        return self.error is None and self.books_error is None and self.stalled is None

    def step_record(self, step: int | None) -> StepRecord | None:
        """The record of engine step ``step``, if the run got there."""
        return next((s for s in self.steps if s.step == step), None)


def raised_in(exc: BaseException, function: str) -> bool:
    """Whether ``function`` is on ``exc``'s traceback (which engine check raised it)."""
    return any(f.name == function for f in traceback.extract_tb(exc.__traceback__))


def first_shared_write(bm: BlockManager, batch: list[Sequence], names: dict[int, str], step: int) -> str | None:
    """A sequence about to write K/V into a block that another sequence also holds, if any: the block manager should
    have given it a copy first (copy-on-write). Every token it has not computed yet counts (a bound for chunks)."""
    for seq in batch:
        for position in range(seq.num_computed_tokens, seq.num_tokens):
            i = position // bm.block_size
            block_id = seq.block_table[i] if i < len(seq.block_table) else None
            if block_id is not None and bm.blocks[block_id].ref_count > 1:
                return (f"engine step {step}: {names.get(seq.seq_id, '?')} was about to write the K/V of its token "
                        f"{position} into block {block_id}, which {bm.blocks[block_id].ref_count} sequences hold: a "
                        "shared block must be copied before anyone writes into it (copy-on-write)")
    return None


def stall_message(step: int, waiting: list[str], bm: BlockManager | None) -> str:
    """Why a run cannot go on: requests wait, none runs, and the scheduler admitted nobody."""
    pool = f" ({bm.num_free_blocks} of {bm.num_blocks} KV blocks free)" if bm is not None else ""
    return (f"engine step {step}: nothing was scheduled although {', '.join(waiting)} waited and no request was "
            f"running{pool}: the run could not go on")


def make_llm(setup: Setup, model: str, **part: Any) -> LLM:
    """``LLM(model, engine=setup.engine, <setup's options>, <part>)``: ``part`` is the learner's (``engine=MyEngine``,
    ``kv_cache_cls=``, ``block_manager_cls=``, ``attention_backend=``, ``scheduler_cls=``), or nothing (labkit's)."""
    from labkit import LLM  # late import: labkit.core.llm imports the engines

    return LLM(model, **{"engine": setup.engine, **setup.options(), **part})


def resolve_prompt(prompt: str | tuple[int, ...] | TextOfLength, tokenizer: PreTrainedTokenizerBase) -> str | list[int]:
    """What ``LLM.add_request`` takes: the text, or the token ids (a ``TextOfLength`` drawn with ``tokenizer``)."""
    if isinstance(prompt, TextOfLength):
        from labkit.measure.workloads import prompt_ids_of_length

        return prompt_ids_of_length(tokenizer, prompt.num_tokens, seed=prompt.seed)
    return prompt if isinstance(prompt, str) else list(prompt)


class Driver:
    """Steps one engine through a setup, recording every step (the engine calls ``before_forward`` once a step's
    sequences are chosen). Notebooks 02-10."""

    def __init__(self, llm: LLM, setup: Setup, names: dict[int, str]) -> None:
        self.llm, self.engine, self.setup, self.names = llm, llm.engine, setup, names
        self.seqs: dict[str, Sequence] = {}
        self.run = Run(setup)
        self.at_forward: dict[str, tuple[int, int]] = {}  # sequence -> (tokens computed, tokens left) when it ran

    def before_forward(self, batch: list[Sequence]) -> None:
        """The engine's ``fault_hook``: the step's sequences, after scheduling and before the forward pass."""
        names = [self.names.get(s.seq_id, "?") for s in batch]
        self.at_forward = {name: (s.num_computed_tokens, s.num_tokens - s.num_computed_tokens)
                           for name, s in zip(names, batch)}
        bm = self.engine.block_manager
        if bm is not None and self.run.shared_write is None:
            self.run.shared_write = first_shared_write(bm, batch, self.names, len(self.run.steps))

    def add_arrivals(self, step: int) -> None:
        """Add the requests that arrive just before engine step ``step``, naming their sequences."""
        for r in self.setup.requests:
            if r.arrival_step == step:
                group = self.llm.add_request(resolve_prompt(r.prompt, self.llm.tokenizer), r.params())
                for name, seq in zip(r.seq_names, group):
                    self.seqs[name], self.names[seq.seq_id] = seq, name

    def step(self, step: int) -> bool:
        """One engine step; False when the run ends here (it failed, or the books stopped balancing)."""
        from labkit.core.engine.base import StepFailedError

        run, engine = self.run, self.engine
        before = {name: s.num_preemptions for name, s in self.seqs.items()}
        num_stats = len(engine.step_stats)
        self.at_forward = {}
        try:
            engine.step()
        except StepFailedError as exc:
            if not self.at_forward and raised_in(exc.cause, "check_progress"):  # the engine saw nobody admitted
                waiting = [self.names.get(s.seq_id, "?") for s in exc.failed]
                run.stalled = stall_message(step, waiting, engine.block_manager)
            else:
                run.error, run.error_step = exc.cause, step
            return False
        except Exception as exc:  # the per-step check of the books, or a part that raised while the step was failed
            if isinstance(exc, AssertionError) and raised_in(exc, "check_invariants"):
                run.books_error = str(exc)
            else:
                run.error = exc
            run.error_step = step
            return False
        finally:
            self.record(step, before)
        waiting = [self.names.get(s.seq_id, "?") for s in engine.unfinished_sequences()
                   if s not in engine.running_sequences()]
        if not self.at_forward and len(engine.step_stats) == num_stats and waiting and not engine.running_sequences():
            run.stalled = stall_message(step, waiting, engine.block_manager)
            return False
        return True

    def record(self, step: int, preemptions_before: dict[str, int]) -> None:
        """The step's record, also for a step that failed (then ``ran`` is what it was about to compute)."""
        bm = self.engine.block_manager
        ran: dict[str, int] = {}
        if bm is not None:  # engines with a block manager count each sequence's computed tokens
            for name, (done, left) in self.at_forward.items():
                seq = self.seqs[name]
                # A sequence that finished has given its blocks back (and its count): it computed all it had left.
                n = left if seq.is_finished else seq.num_computed_tokens - done
                if n > 0:
                    ran[name] = n
        preempted = [name for name, n in preemptions_before.items() if self.seqs[name].num_preemptions > n]
        used = bm.num_used_blocks if bm is not None else None
        self.run.steps.append(StepRecord(step, list(self.at_forward), ran, preempted, used))

    def drive(self) -> Run:
        """Step to the end, to a failure, or to ``max_steps``; then take the outcomes and the totals."""
        run, engine, setup = self.run, self.engine, self.setup
        bm = engine.block_manager
        # The engine may have run before (an LLM the learner built): count only this run's share of its totals.
        first_stats, preemptions = len(engine.step_stats), engine.num_preemptions
        copies, hits = (bm.num_copies, bm.num_hit_tokens) if bm is not None else (0, 0)
        queried = bm.num_queried_tokens if bm is not None else 0
        for step in range(setup.max_steps + 1):
            self.add_arrivals(step)
            arriving = any(r.arrival_step > step for r in setup.requests)
            if not engine.has_unfinished_requests() and not arriving:
                break
            if step == setup.max_steps:
                left = ", ".join(name for name, s in self.seqs.items() if not s.is_finished)
                run.stalled = f"after {setup.max_steps} engine steps {left} had still not finished"
                break
            if not self.step(step):
                break
        run.outcomes = {name: Outcome(list(s.prompt_token_ids), list(s.output_token_ids),
                                      s.finish_reason.value if s.finish_reason is not None else None, s.stop_reason,
                                      s.text, s.num_cached_tokens, s.num_preemptions) for name, s in self.seqs.items()}
        run.step_stats = list(engine.step_stats[first_stats:])
        run.num_preemptions = engine.num_preemptions - preemptions
        if bm is not None:
            run.num_copies, run.num_hit_tokens = bm.num_copies - copies, bm.num_hit_tokens - hits
            run.num_queried_tokens = bm.num_queried_tokens - queried
            run.blocks_in_use_after = bm.num_used_blocks
        return run


def run_setup(setup: Setup, model: str = "labkit-tiny", llm: LLM | None = None, names: dict[int, str] | None = None,
              **part: Any) -> Run:
    """Run ``setup`` one step at a time with the learner's ``part`` (see ``make_llm``), or through ``llm`` if given.
    ``names`` (sequence id -> name) is filled as requests arrive, for a watching part that names what it sees."""
    llm = llm if llm is not None else make_llm(setup, model, **part)
    driver = Driver(llm, setup, names if names is not None else {})
    engine = llm.engine
    hook = engine.fault_hook
    engine.fault_hook = driver.before_forward
    try:
        return driver.drive()
    finally:
        engine.fault_hook = hook
        release(engine)


def release(engine: Engine) -> None:
    """Whatever happened, the engine gives its KV memory back: a part that lost track of blocks gets its books started
    afresh (what the run did wrong is in its record already), so the engine can serve again or be closed."""
    from labkit.core.kv.block_manager import BlockManager

    engine.abort_all()
    bm = engine.block_manager
    if bm is None:
        return
    try:
        bm.check_invariants([])
        balanced = bm.num_used_blocks == 0
    except Exception:  # a learner's block manager whose books no longer balance, or that raises
        balanced = False
    if not balanced:
        BlockManager.__init__(bm, bm.num_blocks, bm.block_size, bm.enable_prefix_caching)


@functools.lru_cache(maxsize=32)
def reference_run(setup: Setup, model: str = "labkit-tiny") -> Run:
    """``setup`` with labkit's own parts (computed once per setup)."""
    run = run_setup(setup, model)
    assert run.finished, f"labkit's own parts did not finish {setup.describe()}: {run}"
    return run


@functools.lru_cache(maxsize=4)
def tokenizer_of(model: str) -> PreTrainedTokenizerBase:
    """``model``'s tokenizer, without loading its weights (prompts are made before any engine is built)."""
    from labkit.core.model.source import resolve_model_source
    from labkit.core.text.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_source(model).tokenizer_path)


def prompt(model: str, num_tokens: int, seed: int) -> tuple[int, ...]:
    """``num_tokens`` ids of in-domain text (BOS first): readable prompts, so greedy output is readable too."""
    from labkit.measure.workloads import prompt_ids_of_length

    return tuple(prompt_ids_of_length(tokenizer_of(model), num_tokens, seed=seed))
