"""The capstone of notebook 10: the learner's parts are found in saved notebooks, checked again and combined; the
capstone checker passes labkit's parts and correct learner parts, and fails a planted bug in one part (or an engine
that ignores the parts) with a message naming the request, the step or the part; the race's helpers interleave and
report ratios from one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from labkit import LLM, BlockManager, Scheduler
from labkit.core.attention import TorchAttentionBackend
from labkit.course import use_or_reference
from labkit.course.ch10_profiling_host_overhead.capstone import (
    CAPSTONE_REQUESTS,
    build_engine,
    check_capstone,
    reference_run,
)
from labkit.course.ch10_profiling_host_overhead.capstone_bench import Rounds, interleaved_rounds, transformers_contender
from labkit.course.ch10_profiling_host_overhead.parts import EngineParts, combine, combine_parts, learner_parts
from labkit.course.oracle import transformers_greedy

# ---- learner parts: right ones, and one planted bug per part ----


class Admits(Scheduler):
    """A right schedule_waiting (labkit's rule, through super)."""

    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        super().schedule_waiting(out, budget, now)


class Fills(Scheduler):
    """A right schedule_running, written out."""

    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_token_is_last]:
            if seq in self.running and budget >= 1 and self.reserve(seq, 1, out):
                budget -= 1
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if seq in self.running and budget > 0:
                n = min(seq.num_uncomputed_tokens, budget)
                if self.reserve(seq, n, out):
                    budget -= n
        return budget


class ChunkNotCapped(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_token_is_last]:
            if seq in self.running and self.reserve(seq, 1, out):
                budget -= 1
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if seq in self.running and budget > 0 and self.reserve(seq, seq.num_uncomputed_tokens, out):
                budget -= seq.num_uncomputed_tokens  # the whole rest of the prompt, whatever the budget
        return max(budget, 0)


class Slots(BlockManager):
    def slot(self, seq, position):  # type: ignore[no-untyped-def]
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size


class SlotOffByOne(BlockManager):
    def slot(self, seq, position):  # type: ignore[no-untyped-def]
        return seq.block_table[position // self.block_size] * self.block_size + (position + 1) % self.block_size


class ForgetsToRelease(BlockManager):
    def free(self, seq):  # type: ignore[no-untyped-def]
        seq.block_table = []  # the blocks are never given back to the pool
        seq.num_computed_tokens = 0


class Attention(TorchAttentionBackend):
    def attend(self, layer_idx, q, k, v):  # type: ignore[no-untyped-def]
        return super().attend(layer_idx, q, k, v)


def ignores_the_parts(parts, model, **options):  # type: ignore[no-untyped-def]
    return LLM(model, engine="chunked", **options)


def builds_continuous(parts, model, **options):  # type: ignore[no-untyped-def]
    return LLM(model, engine="continuous", **parts.options(), **options)


def drops_the_options(parts, model, **options):  # type: ignore[no-untyped-def]
    return LLM(model, engine="chunked", **parts.options())  # the caller's budget, pool and slots never arrive


# ---- the capstone checker ----


def test_capstone_workload_exercises_every_part() -> None:
    run = reference_run()
    assert run.finished and run.num_preemptions >= 2 and run.num_hit_tokens > 0
    steps = [s.describe() for s in run.steps]  # "R0: 1, R3: 13 (request: new tokens); R2 preempted"
    assert any("; " in s for s in steps), "some step preempted"
    long_prompt = next(i for i, r in enumerate(CAPSTONE_REQUESTS) if r[1] > 16)
    chunked = [s for s in steps if f"R{long_prompt}: " in s and s.count(": ") > 2]
    assert chunked, "the long prompt is prefilled in chunks beside decodes"


@pytest.mark.parametrize("parts", [EngineParts(), combine_parts(Admits, Fills, Slots, Attention)],
                         ids=["labkit's parts", "right learner parts"])
def test_capstone_checker_passes_right_parts(parts: EngineParts) -> None:
    result = check_capstone(build_engine, parts)
    assert result.passed, result.message()


@pytest.mark.parametrize("build,parts,message", [
    (build_engine, combine_parts(Admits, SlotOffByOne),
     "R2: output token 8 is 269, expected 1526 (the tokens before it agree) in transformers' greedy continuation of "
     "the same prompt: K/V written or read in the wrong place"),
    (build_engine, combine_parts(ChunkNotCapped, Slots),
     "engine step 3 ran R0: 1, R1: 1, R2: 1 (request: new tokens); R3 preempted; labkit's chunked ran R0: 1, R1: 1, "
     "R2: 1, R3: 13"),
    (build_engine, combine_parts(ForgetsToRelease), "the block manager's books did not balance"),
    (ignores_the_parts, combine_parts(Fills),
     "your engine runs Scheduler as its scheduler_cls, not Fills from parts: pass scheduler_cls=parts.scheduler_cls"),
    (builds_continuous, EngineParts(), "your engine is 'continuous'; the capstone runs engine 'chunked'"),
    (drops_the_options, EngineParts(), "your engine was built with max_num_seqs=16, not the max_num_seqs=4 the caller "
                                       "passed"),
], ids=["slot off by one", "chunk not capped", "free forgets the pool", "parts ignored", "wrong engine",
        "options dropped"])
def test_capstone_checker_fails_a_planted_bug(build, parts: EngineParts, message: str) -> None:  # type: ignore[no-untyped-def]
    result = check_capstone(build, parts)
    assert result.status == "failed" and len(result.failures) == 1, result.message()
    assert message in result.failures[0], result.failures[0]


def test_capstone_stub_falls_back_to_build_engine(capsys: pytest.CaptureFixture[str]) -> None:
    def my_engine(parts, model, **options):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    result = check_capstone(my_engine)
    assert result.status == "not started"
    assert use_or_reference(result, my_engine, build_engine) is build_engine
    assert "labkit.course.ch10_profiling_host_overhead.capstone.build_engine" in capsys.readouterr().out


# ---- combining parts ----


def test_combine_takes_each_method_from_the_part_that_overrides_it() -> None:
    assert combine(Scheduler, [], "YourScheduler") is Scheduler
    assert combine(Scheduler, [Scheduler, Fills], "YourScheduler") is Fills
    mixed = combine(Scheduler, [Admits, Fills], "YourScheduler")
    assert mixed.__name__ == "YourScheduler" and issubclass(mixed, Admits) and issubclass(mixed, Fills)
    assert mixed.schedule_running is Fills.schedule_running and mixed.schedule_waiting is Admits.schedule_waiting

    class Later(Admits):  # a later task that subclassed an earlier one: the earlier one is inside it already
        def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
            return Fills.schedule_running(self, out, budget)

    assert combine(Scheduler, [Admits, Later], "YourScheduler") is Later
    parts = combine_parts(Admits, Fills, Slots, Attention)
    assert parts.block_manager_cls is Slots and parts.attention_backend is Attention
    assert "schedule_running (Fills)" in parts.describe() and not parts.is_labkits()


# ---- reading the learner's parts from saved notebooks ----


def write_notebook(path: Path, cells: list[tuple[str, str]]) -> Path:
    nb = {"cells": [{"cell_type": kind, "metadata": {}, "source": text,
                     **({"outputs": [], "execution_count": None} if kind == "code" else {})} for kind, text in cells],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    path.write_text(json.dumps(nb))
    return path


IMPORTS = "from labkit import LLM, Scheduler\nfrom labkit.course import use_or_reference\nx = LLM('nope')  # not run"
FILLS = ("class MyScheduler(Scheduler):\n    def schedule_running(self, out, budget):\n"
         "        return fill(self, out, budget)")
HELPER = '''def fill(self, out, budget):
    for seq in [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_token_is_last]:
        if seq in self.running and budget >= 1 and self.reserve(seq, 1, out):
            budget -= 1
    for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
        if seq in self.running and budget > 0:
            n = min(seq.num_uncomputed_tokens, budget)
            if self.reserve(seq, n, out):
                budget -= n
    return budget'''
CHECK = ("from labkit.course.ch08_chunked_prefill import check_schedule_running\n\n"
         "MyScheduler = use_or_reference(check_schedule_running(MyScheduler), MyScheduler, Scheduler)")


def test_learner_parts_reads_checks_and_combines_saved_notebooks(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    done = write_notebook(tmp_path / "08_chunked_prefill.ipynb", [
        ("code", IMPORTS), ("markdown", "### Task 1: the budget-filling rule\n\nIt replaces ..."),
        ("code", "class MyScheduler(Scheduler):\n    def schedule_running(self, out, budget):\n"
                 "        raise NotImplementedError"),
        ("code", FILLS.replace("class MyScheduler(Scheduler):", "class MyScheduler(Scheduler):  # my answer")),
        ("code", CHECK), ("code", "%time 1 + 1\n" + HELPER),  # a helper defined further down, after a magic
    ])
    parts = learner_parts(notebooks=[done])
    out = capsys.readouterr().out
    (part,) = parts.found
    assert part.used and part.task == "08 Task 1 (the budget-filling rule)" and part.name == "MyScheduler"
    assert parts.scheduler_cls is part.cls and parts.block_manager_cls is BlockManager
    assert "yours for schedule_running (MyScheduler)" in out and "labkit's BlockManager" in out

    stub = write_notebook(tmp_path / "stub.ipynb", [
        ("code", IMPORTS), ("markdown", "### Task 1 — the budget-filling rule"),
        ("code", "class MyScheduler(Scheduler):\n    def schedule_running(self, out, budget):\n"
                 "        raise NotImplementedError"), ("code", CHECK)])
    wrong = write_notebook(tmp_path / "wrong.ipynb", [
        ("code", IMPORTS), ("markdown", "### Task 1 — the budget-filling rule"),
        ("code", "class MyScheduler(Scheduler):\n    def schedule_running(self, out, budget):\n        return budget"),
        ("code", CHECK)])
    for path, status in ((stub, "labkit's: not started"), (wrong, "labkit's: its check failed")):
        parts = learner_parts(notebooks=[path], verbose=False)
        assert parts.is_labkits() and parts.found[0].status().startswith(status), parts.describe()


def test_learner_parts_of_the_committed_notebooks_are_labkits() -> None:
    parts = learner_parts(verbose=False)  # the workbook's own notebooks hold the stubs
    assert parts.found and parts.is_labkits()
    assert {p.option for p in parts.found} == {"scheduler_cls", "block_manager_cls", "attention_backend"}


# ---- the race ----


def test_interleaved_rounds_rotate_and_report_ratios_of_the_same_rounds() -> None:
    order: list[str] = []
    contenders = {name: (lambda name=name: order.append(name) or [[1]]) for name in ("a", "b", "c")}
    rounds = interleaved_rounds(contenders, output_tokens=10, num_rounds=3, progress=False)  # type: ignore[arg-type]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    fixed = Rounds(10, {"a": [1.0, 2.0], "b": [2.0, 2.0]})
    assert fixed.tokens_per_s("a") == [10.0, 5.0] and fixed.ratios("a", "b") == [2.0, 1.0]
    assert "a / b: 1.50x (rounds: 1.00-2.00)" in fixed.table()
    assert set(rounds.seconds) == {"a", "b", "c"} and all(len(s) == 3 for s in rounds.seconds.values())


def test_transformers_contender_runs_padded_batches_of_the_greedy_continuation() -> None:
    prompts = [[1, 5, 6, 7, 8], [1, 9], [1, 20, 21]]
    lens = [4, 2, 3]
    got = transformers_contender("labkit-tiny", prompts, lens, batch_size=2)()
    assert [len(g) for g in got] == lens
    want = [transformers_greedy("labkit-tiny", [p], n)[0] for p, n in zip(prompts, lens)]
    assert sum(g == w for g, w in zip(got, want)) >= 2  # left padding may part ways after a near-tie, rarely
