"""Notebook 06's Build task "the block manager": its checker passes labkit's BlockManager and a learner's own
solution, fails the mistakes learners make (by hand, and inside the engine), reports an untouched stub, and the
learner's class is the one the engine runs."""

from __future__ import annotations

import pytest

from labkit import LLM, BlockManager, SamplingParams
from labkit.course import use_or_reference
from labkit.course.ch06_paged_attention.block_manager import HINTS, check_block_manager, workloads
from labkit.course.harness.runs import reference_run


class LearnersBlockManager(BlockManager):
    """A solution written the way the notebook's hints lead to it (not labkit's code)."""

    def allocate(self, seq, num_new_tokens, cached_blocks=None):  # type: ignore[no-untyped-def]
        self.take_cached_prefix(seq, cached_blocks)
        copies = []
        i = seq.num_computed_tokens // self.block_size  # the block this step writes into first
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            src, dst = seq.block_table[i], self._take_free_block()
            self._release(src)
            seq.block_table[i] = dst
            copies.append((src, dst))
            self.num_copies += 1
        self.grow_table(seq, num_new_tokens)
        return copies

    def take_cached_prefix(self, seq, cached_blocks):  # type: ignore[no-untyped-def]
        """A prefix hit: the sequence shares the cached blocks, and their tokens count as computed and cached."""
        if cached_blocks:
            for block_id in cached_blocks:
                self._share(block_id)
            seq.block_table = list(cached_blocks)
            seq.num_computed_tokens = seq.num_cached_tokens = len(cached_blocks) * self.block_size

    def grow_table(self, seq, num_new_tokens):  # type: ignore[no-untyped-def]
        """A new block whenever the last one is full, until the table holds the new tokens too."""
        while len(seq.block_table) * self.block_size < seq.num_computed_tokens + num_new_tokens:
            seq.block_table.append(self._take_free_block())

    def free(self, seq):  # type: ignore[no-untyped-def]
        for block_id in seq.block_table[::-1]:
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def lookup_prefix(self, seq):  # type: ignore[no-untyped-def]
        if not self.enable_prefix_caching or seq.block_table:
            return []
        prompt = seq.prompt_token_ids
        hits = []
        for h in self.block_hashes(prompt[: len(prompt) - 1]):  # never the last token: it gives the logits
            if h not in self.hash_to_block_id:
                break
            hits.append(self.hash_to_block_id[h])
        return hits


# ---- mistakes learners make ----

class ForgetsTheDecrement(LearnersBlockManager):
    def free(self, seq):  # type: ignore[no-untyped-def]
        for block_id in seq.block_table[::-1]:
            if self.blocks[block_id].ref_count == 1:  # a shared block is skipped: its count never goes down
                self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0


class NoCopyOnWrite(LearnersBlockManager):
    def allocate(self, seq, num_new_tokens, cached_blocks=None):  # type: ignore[no-untyped-def]
        self.take_cached_prefix(seq, cached_blocks)
        self.grow_table(seq, num_new_tokens)  # BUG: a shared block is written into as it is, never copied
        return []


class OneBlockTooMany(LearnersBlockManager):
    """Off by one in the number of blocks needed: an extra block whenever the tokens fill the last one exactly."""

    def allocate(self, seq, num_new_tokens, cached_blocks=None):  # type: ignore[no-untyped-def]
        copies = super().allocate(seq, num_new_tokens, cached_blocks)
        if (seq.num_computed_tokens + num_new_tokens) % self.block_size == 0:
            seq.block_table.append(self._take_free_block())
        return copies


class OneBlockTooFew(LearnersBlockManager):
    def allocate(self, seq, num_new_tokens, cached_blocks=None):  # type: ignore[no-untyped-def]
        copies = super().allocate(seq, num_new_tokens, cached_blocks)
        needed = (seq.num_computed_tokens + num_new_tokens) // self.block_size  # floor: the partial block is lost
        while len(seq.block_table) > max(needed, 1) and self.blocks[seq.block_table[-1]].ref_count == 1:
            self._release(seq.block_table.pop())
        return copies


class FreesFirstToLast(LearnersBlockManager):
    def free(self, seq):  # type: ignore[no-untyped-def]
        for block_id in seq.block_table:
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0


class LookupSkipsMisses(LearnersBlockManager):
    def lookup_prefix(self, seq):  # type: ignore[no-untyped-def]
        if not self.enable_prefix_caching or seq.block_table:
            return []
        prompt = seq.prompt_token_ids
        return [self.hash_to_block_id[h] for h in self.block_hashes(prompt[: len(prompt) - 1])
                if h in self.hash_to_block_id]  # `continue` past a miss: a later block without its prefix


class LookupMatchesTheWholePrompt(LearnersBlockManager):
    def lookup_prefix(self, seq):  # type: ignore[no-untyped-def]
        if not self.enable_prefix_caching or seq.block_table:
            return []
        hits = []
        for h in self.block_hashes(seq.prompt_token_ids):  # the last token may be cached: nothing left to compute
            if h not in self.hash_to_block_id:
                break
            hits.append(self.hash_to_block_id[h])
        return hits


class CopyKeepsTheOriginal(LearnersBlockManager):
    """Copy-on-write that never lets go of the original: the shared block keeps one holder too many."""

    def allocate(self, seq, num_new_tokens, cached_blocks=None):  # type: ignore[no-untyped-def]
        self.take_cached_prefix(seq, cached_blocks)
        copies = []
        i = seq.num_computed_tokens // self.block_size
        if i < len(seq.block_table) and self.blocks[seq.block_table[i]].ref_count > 1:
            src, dst = seq.block_table[i], self._take_free_block()
            seq.block_table[i] = dst  # BUG: no self._release(src)
            copies.append((src, dst))
            self.num_copies += 1
        self.grow_table(seq, num_new_tokens)
        return copies


class CachedBlocksNotCounted(LearnersBlockManager):
    def take_cached_prefix(self, seq, cached_blocks):  # type: ignore[no-untyped-def]
        if cached_blocks:
            for block_id in cached_blocks:
                self._share(block_id)
            seq.block_table = list(cached_blocks)  # BUG: the cached tokens are not counted as computed and cached


class LookupIgnoresTheSwitch(LearnersBlockManager):
    def lookup_prefix(self, seq):  # type: ignore[no-untyped-def]
        if seq.block_table:  # BUG: looks up even with enable_prefix_caching=False
            return []
        prompt = seq.prompt_token_ids
        hits = []
        for h in self.block_hashes(prompt[: len(prompt) - 1]):
            if h not in self.hash_to_block_id:
                break
            hits.append(self.hash_to_block_id[h])
        return hits or [0]  # a fresh pool has no hashes: a guess at block 0 shows the lookup ran


class FreeKeepsTheTable(LearnersBlockManager):
    def free(self, seq):  # type: ignore[no-untyped-def]
        for block_id in seq.block_table[::-1]:
            self._release(block_id)
        seq.num_computed_tokens = 0  # BUG: block_table still lists the blocks it gave back


def in_the_engine(seq) -> bool:  # type: ignore[no-untyped-def]
    """The engine stamps a sequence when it schedules it; the checker's by-hand sequences are never scheduled."""
    return seq.metrics.first_scheduled_time is not None


class NoCopyOnWriteOnlyInTheEngine(LearnersBlockManager):
    def allocate(self, seq, num_new_tokens, cached_blocks=None):  # type: ignore[no-untyped-def]
        if in_the_engine(seq):
            return NoCopyOnWrite.allocate(self, seq, num_new_tokens, cached_blocks)
        return super().allocate(seq, num_new_tokens, cached_blocks)


class ForgetsTheDecrementOnlyInTheEngine(LearnersBlockManager):
    def free(self, seq):  # type: ignore[no-untyped-def]
        if in_the_engine(seq):
            return ForgetsTheDecrement.free(self, seq)
        return super().free(seq)


class KeepsComputedTokensOnlyInTheEngine(LearnersBlockManager):
    """Frees the blocks but forgets to reset num_computed_tokens: a preempted sequence skips its recompute."""

    def free(self, seq):  # type: ignore[no-untyped-def]
        computed = seq.num_computed_tokens
        super().free(seq)
        if in_the_engine(seq):
            seq.num_computed_tokens = computed


def test_the_workloads_exercise_every_path() -> None:
    shared, _, tight = (reference_run(s) for s in workloads())
    assert shared.num_copies > 0 and shared.num_hit_tokens > 0 and shared.num_preemptions == 0
    assert tight.num_preemptions > 0 and tight.num_copies > 0
    assert shared.outcomes["D"].num_cached_tokens == 8  # exactly 3 full cached blocks: the last one is recomputed


@pytest.mark.parametrize("cls", [BlockManager, LearnersBlockManager], ids=lambda c: c.__name__)
def test_the_checker_passes_labkits_and_a_learners_solution(cls: type[BlockManager]) -> None:
    result = check_block_manager(cls)
    assert result.passed, result.message()


PLANTED = {
    ForgetsTheDecrement: "reference counts should be [1, 1, 1], got [2, 2, 2]",
    NoCopyOnWrite: "it must first get a private copy",
    OneBlockTooMany: "a new 4-token prompt in blocks of 4 needs 1 block(s)",
    OneBlockTooFew: "a new 5-token prompt in blocks of 4 needs 2 block(s)",
    FreesFirstToLast: "the pool's free list ends with [0, 1, 2] (yours); it should end with [2, 1, 0]",
    LookupSkipsMisses: "stop at the first miss",
    LookupMatchesTheWholePrompt: "exactly its first 8 tokens (2 full blocks) should find",
    NoCopyOnWriteOnlyInTheEngine: "a shared block must be copied before anyone writes into it",
    ForgetsTheDecrementOnlyInTheEngine: "the block manager's books did not balance: block",
    KeepsComputedTokensOnlyInTheEngine: "engine 'continuous' on a pool too small",
    CopyKeepsTheOriginal: "the original and the copy have one holder each (reference counts (1, 1), got (2, 1))",
    CachedBlocksNotCounted: "whose first 8 tokens are cached: block_table starts with [0, 1] and gets one new block",
    LookupIgnoresTheSwitch: "with enable_prefix_caching=False, lookup_prefix finds nothing",
    FreeKeepsTheTable: "after free(seq) the sequence holds nothing: block_table []",
}


@pytest.mark.parametrize("bug", list(PLANTED), ids=lambda c: c.__name__)
def test_the_checker_fails_planted_bugs_naming_the_case(bug: type[BlockManager]) -> None:
    result = check_block_manager(bug)
    assert result.status == "failed", bug.__name__
    assert PLANTED[bug] in result.failures[0], result.failures
    assert "Traceback" not in result.message()
    assert "show_hint('06.block_manager', 2) for more" in result.message()
    assert HINTS.code not in result.message() and "self._release(" not in result.message()  # code only when asked


def test_engine_failures_name_the_step_and_what_it_ran() -> None:
    failure = check_block_manager(ForgetsTheDecrementOnlyInTheEngine).failures[0]
    assert "after engine step" in failure and "(it ran " in failure and "ref_count" in failure
    failure = check_block_manager(NoCopyOnWriteOnlyInTheEngine).failures
    assert any("copy-on-write copied 0 block(s)" in f for f in failure)


def test_a_stub_is_not_started_and_falls_back(capsys: pytest.CaptureFixture[str]) -> None:
    class Stub(BlockManager):
        def allocate(self, seq, num_new_tokens, cached_blocks=None):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def free(self, seq):  # type: ignore[no-untyped-def]
            raise NotImplementedError

        def lookup_prefix(self, seq):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    result = check_block_manager(Stub)
    assert result.status == "not started"
    assert use_or_reference(result, Stub, BlockManager) is BlockManager
    assert "uses labkit's reference labkit.core.kv.block_manager.BlockManager" in capsys.readouterr().out


def test_only_free_left_to_write_is_not_started() -> None:
    class HalfDone(LearnersBlockManager):
        def free(self, seq):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    assert check_block_manager(HalfDone).status == "not started"


def test_the_learners_class_runs_inside_the_engine(bundled_path) -> None:  # type: ignore[no-untyped-def]
    calls: list[str] = []

    class Spy(LearnersBlockManager):
        def allocate(self, seq, num_new_tokens, cached_blocks=None):  # type: ignore[no-untyped-def]
            calls.append("allocate")
            return super().allocate(seq, num_new_tokens, cached_blocks)

        def free(self, seq):  # type: ignore[no-untyped-def]
            calls.append("free")
            super().free(seq)

    llm = LLM(str(bundled_path), engine="continuous", block_size=4, num_gpu_blocks=16, block_manager_cls=Spy)
    llm.generate([[1, 5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert type(llm.engine.block_manager) is Spy and "allocate" in calls and calls[-1] == "free"
