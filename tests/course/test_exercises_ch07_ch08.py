"""The scheduler checkers of notebooks 07 and 08 pass labkit's Scheduler, fail planted bugs typical of learners
with a message naming the step and the request, report unstarted stubs, and run the learner's class in the engine."""

from __future__ import annotations

import pytest

from labkit import Scheduler
from labkit.core.sched.output import SchedulerOutput
from labkit.course import use_or_reference
from labkit.course.ch07_continuous_batching import ADMISSION_TRIAL, PREFIX_TRIAL, check_schedule_waiting
from labkit.course.ch08_chunked_prefill import BUDGET_TRIAL, PREEMPTION_TRIAL, check_schedule_running
from labkit.course.harness.scheduler_records import reference_trial, run_trial

# ---- notebook 07: the admission rule (schedule_waiting) ----


def admit(self: Scheduler, out: SchedulerOutput, budget: int, now: float, *, fcfs: bool = True, slots: bool = True,
          spend: bool = True, blocks: bool = True, once: bool = False, chunks: bool = True,
          record: bool = True) -> None:
    """A learner's admission loop; each keyword turns one part of the rule off (a planted bug)."""
    bm = self.block_manager
    i = 0
    while i < len(self.waiting) and (not slots or len(self.running) < self.max_num_seqs) and budget > 0:
        seq = self.waiting[i]
        cached = bm.lookup_prefix(seq)
        num_new = seq.num_tokens - len(cached) * bm.block_size
        # chunks=False: whole prompts only, the continuous engine's rule written out (no chunk in engine chunked)
        n = self.num_tokens_to_schedule(num_new, budget) if chunks else (num_new if num_new <= budget else 0)
        if n == 0 or (blocks and not bm.can_allocate(seq, n, cached)):
            if fcfs:
                break
            i += 1  # skip it: a later, smaller request jumps the queue
            continue
        del self.waiting[i]
        copies = bm.allocate(seq, n, cached)
        if record:
            bm.record_prefix_query(seq)
        self.admit(seq, n, copies, out, now)
        if spend:
            budget -= n
        if once:
            break


class Admits(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        admit(self, out, budget, now)


class JumpsTheQueue(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        admit(self, out, budget, now, fcfs=False)


class IgnoresMaxNumSeqs(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        admit(self, out, budget, now, slots=False)


class NeverSpendsTheBudget(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        admit(self, out, budget, now, spend=False)


class IgnoresKVBlocks(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        admit(self, out, budget, now, blocks=False)


class AdmitsOnePerStep(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        admit(self, out, budget, now, once=True)


class WholePromptsOnly(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        admit(self, out, budget, now, chunks=False)


class NoPrefixQuery(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        admit(self, out, budget, now, record=False)


class NeverAdmits(Scheduler):
    def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
        pass  # without the check's step limit and stall detection, generate() would spin forever


def test_ch07_trial_exercises_every_limit_and_preempts() -> None:
    trial = reference_trial(ADMISSION_TRIAL)
    assert trial.run.num_preemptions > 0
    calls = [p.waiting for p in trial.plans if p.waiting is not None and p.waiting.queue]
    head_blocked = [c for c in calls if len(c.admitted) < len(c.queue)]
    stopped_by = {"slots": any(c.num_running_after == ADMISSION_TRIAL.max_num_seqs for c in head_blocked),
                  "budget": any(c.queue[len(c.admitted)][1] > c.budget_left for c in head_blocked),
                  "blocks": any(c.queue[len(c.admitted)][2] > c.free_blocks_left and c.num_running_after <
                                ADMISSION_TRIAL.max_num_seqs for c in head_blocked)}
    assert all(stopped_by.values()), stopped_by


@pytest.mark.parametrize("cls", [Scheduler, Admits], ids=lambda c: c.__name__)
def test_ch07_checker_passes_labkits_rule(cls: type[Scheduler]) -> None:
    result = check_schedule_waiting(cls)
    assert result.passed, result.message()


@pytest.mark.parametrize("bug,message", [
    (JumpsTheQueue, "step 0: R3 was admitted while R2, ahead of it in the queue"),
    (IgnoresMaxNumSeqs, "step 1: 4 requests were running after admission, more than max_num_seqs = 3"),
    (NeverSpendsTheBudget, "but only 64 of the step's budget were left"),
    (IgnoresKVBlocks, "ran the pool out of blocks"),
    (AdmitsOnePerStep, "step 0: R1 (20 tokens, 3 KV blocks) was left waiting although it fit"),
    (NeverAdmits, "step 0: R0 (24 tokens, 3 KV blocks) was left waiting although it fit"),
    (WholePromptsOnly, "engine chunked, step 0: R1 (20 tokens to compute) was left waiting although a 8-token chunk "
                       "of it (1 KV blocks) fit"),
    (NoPrefixQuery, "the prefix cache's statistics counted 0 hit of 0 queried prompt tokens (block_manager.hit_rate "
                    "0.00); with labkit's scheduler 0 of 166"),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_ch07_checker_fails_planted_bugs(bug: type[Scheduler], message: str) -> None:
    result = check_schedule_waiting(bug)
    assert result.status == "failed" and len(result.failures) == 1, result.message()
    assert message in result.failures[0], result.failures[0]
    assert "bm.record_prefix_query(seq)" not in result.message()  # the code-level hint only when asked


def test_ch07_prefix_trial_hits_the_prefix_cache() -> None:
    run = reference_trial(PREFIX_TRIAL).run
    assert run.num_queried_tokens > run.num_hit_tokens > 0


def test_ch07_a_stalled_run_ends_with_a_message() -> None:
    trial = run_trial(NeverAdmits, ADMISSION_TRIAL)
    assert trial.run.stalled and "nothing was scheduled" in trial.run.stalled and "R0" in trial.run.stalled


# ---- notebook 08: the budget-filling rule (schedule_running) ----


def fill(self: Scheduler, out: SchedulerOutput, budget: int, *, decodes_first: bool = True, cap: bool = True,
         return_left: bool = True, skip: bool = True, only_if_reserved: bool = True) -> int:
    """A learner's schedule_running; each keyword turns one part of the rule off (a planted bug)."""
    given = budget
    decodes = [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_token_is_last]
    partials = [s for s in self.running if s.num_uncomputed_tokens > 1]

    def schedule_decodes(budget: int) -> int:
        for seq in decodes:
            if (seq in self.running or not skip) and budget >= 1:
                if self.reserve(seq, 1, out) or not only_if_reserved:
                    budget -= 1
        return budget

    def schedule_partials(budget: int) -> int:
        for seq in partials:
            if (seq in self.running or not skip) and budget > 0:
                n = min(seq.num_uncomputed_tokens, budget) if cap else seq.num_uncomputed_tokens
                if self.reserve(seq, n, out) or not only_if_reserved:
                    budget -= n
        return budget

    if decodes_first:
        budget = schedule_partials(schedule_decodes(budget))
    else:
        budget = schedule_decodes(schedule_partials(budget))
    return budget if return_left else given


class Fills(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        return fill(self, out, budget)


class PrefillBeforeDecodes(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        return fill(self, out, budget, decodes_first=False)


class ChunkNotCapped(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        return fill(self, out, budget, cap=False)


class ReturnsTheWholeBudget(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        return fill(self, out, budget, return_left=False)


class DecodesTwoTokens(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_token_is_last]:
            if seq in self.running and budget >= 2 and self.reserve(seq, 2, out):  # a decode computes one token
                budget -= 2
        return fill(self, out, budget, decodes_first=False)


class ChunkPastThePrompt(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_token_is_last]:
            if seq in self.running and budget >= 1 and self.reserve(seq, 1, out):
                budget -= 1
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            n = min(seq.num_uncomputed_tokens + 1, budget)  # one token past the end of the prompt
            if seq in self.running and n > 0 and self.reserve(seq, n, out):
                budget -= n
        return budget


class KeepsPreempted(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        return fill(self, out, budget, skip=False)


class SpendsOnRefusal(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        return fill(self, out, budget, only_if_reserved=False)


class ForgetsToReturn(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        fill(self, out, budget)


class FixedChunks(Scheduler):
    def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1]:
            if self.reserve(seq, 1, out):
                budget -= 1
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            n = min(seq.num_uncomputed_tokens, 16, budget)  # a fixed chunk size instead of what the budget allows
            if n and self.reserve(seq, n, out):
                budget -= n
        return budget


def test_ch08_trial_chunks_a_long_prompt_among_decodes() -> None:
    trial = reference_trial(BUDGET_TRIAL)
    chunked = [p for p in trial.plans if p.prefilling and p.decoding]
    assert len(chunked) >= 2 and all(all(p.tokens[d] == 1 for d in p.decoding) for p in chunked)
    assert max(s.num_computed_tokens for s in trial.run.step_stats) == BUDGET_TRIAL.max_num_batched_tokens


@pytest.mark.parametrize("cls", [Scheduler, Fills], ids=lambda c: c.__name__)
def test_ch08_checker_passes_labkits_rule(cls: type[Scheduler]) -> None:
    result = check_schedule_running(cls)
    assert result.passed, result.message()


@pytest.mark.parametrize("bug,message", [
    (PrefillBeforeDecodes, "step 4: R0 was decoding but got no token (a decode stall)"),
    (ChunkNotCapped, "tokens with a budget of 32: no chunk may exceed the budget left"),
    (ReturnsTheWholeBudget, "step 1: you scheduled 3 tokens of the 32-token budget but returned 32"),
    (ForgetsToReturn, "step 0: your schedule_running returned None"),
    (FixedChunks, "step 4: R3 had 71 prompt tokens left and got 16"),
    (DecodesTwoTokens, "step 1: you scheduled 3 tokens of the 32-token budget but returned 23"),  # 1 token each ran
    (ChunkPastThePrompt, "prompt tokens left but was given"),
    (KeepsPreempted, "which is no longer running (an earlier reserve in this step preempted it"),
    (SpendsOnRefusal, "yet your schedule_running took their tokens from the budget"),
], ids=lambda v: v.__name__ if isinstance(v, type) else "")
def test_ch08_checker_fails_planted_bugs(bug: type[Scheduler], message: str) -> None:
    result = check_schedule_running(bug)
    assert result.status == "failed" and len(result.failures) == 1, result.message()
    assert message in result.failures[0], result.failures[0]
    assert "show_hint('08.schedule_running', 2)" in result.message() and "self.reserve(" not in result.message()


def test_ch08_preemption_trial_preempts_within_the_decode_loop_and_refuses() -> None:
    trial = reference_trial(PREEMPTION_TRIAL)
    assert trial.run.num_preemptions > 0
    assert any(r.returned is False for p in trial.plans for r in p.reserves)


def test_ch08_a_decode_stall_with_no_chunk_scheduled_says_so() -> None:
    from labkit.course.ch08_chunked_prefill import budget_problem
    from labkit.course.harness.scheduler_records import RunningCall, StepPlan

    plan = StepPlan(step=2, queue=[], decoding=["R0", "R1"], prefilling={},
                    running=RunningCall(budget=8, tokens={"R1": 1}, returned=7))
    text, because = budget_problem(plan)  # type: ignore[misc]
    assert "no prompt chunk was scheduled either" in text and "nothing (request" not in text
    assert because == "decode-stall"


# ---- both ----


def test_unstarted_stubs_fall_back_to_the_reference(capsys: pytest.CaptureFixture[str]) -> None:
    class WaitingStub(Scheduler):
        def schedule_waiting(self, out, budget, now):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    class RunningStub(Scheduler):
        def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    for check, stub in ((check_schedule_waiting, WaitingStub), (check_schedule_running, RunningStub)):
        result = check(stub)
        assert result.status == "not started"
        assert use_or_reference(result, stub, Scheduler) is Scheduler
        assert "uses labkit's reference labkit.core.sched.scheduler.Scheduler" in capsys.readouterr().out


def test_a_crashing_rule_is_reported_with_its_line() -> None:
    class Crashes(Scheduler):
        def schedule_running(self, out, budget):  # type: ignore[no-untyped-def]
            return 1 // 0

    result = check_schedule_running(Crashes)
    assert result.status == "failed"
    assert ("engine step 0 (while scheduling, before anything ran): your schedule_running raised ZeroDivisionError"
            in result.failures[0])
    assert "line" in result.failures[0]


def test_a_function_instead_of_a_class_is_explained() -> None:
    result = check_schedule_waiting(lambda *args: None)  # type: ignore[arg-type]
    assert result.status == "failed" and "subclass of labkit.Scheduler" in result.failures[0]


def test_the_learners_class_is_the_one_the_engine_runs() -> None:
    trial = run_trial(Admits, ADMISSION_TRIAL)
    assert trial.run.finished and trial.run.blocks_in_use_after == 0
    assert len(trial.plans) == len(reference_trial(ADMISSION_TRIAL).plans)
