"""A learner's trial: a naive but plausible first attempt at a Build task, written from the task text alone, gets a
first failure that names its actual bug, a hint in words for that failure, and never the reference code."""

from __future__ import annotations

from labkit import BlockManager, Scheduler
from labkit.core.sequence import SequenceStatus
from labkit.course.ch06_paged_attention.block_manager import HINTS as BLOCK_MANAGER_HINTS
from labkit.course.ch06_paged_attention.block_manager import check_block_manager
from labkit.course.ch07_continuous_batching import PREEMPTION_HINTS, check_preemption


class FirstTryBlockManager(BlockManager):
    """Blocks appended as the tokens grow, cached prefixes taken, references given back last first: but a block
    shared with a forked sample is written in place (no copy-on-write)."""

    def allocate(self, seq, num_new_tokens, cached_blocks=None):  # type: ignore[no-untyped-def]
        if cached_blocks:
            for block_id in cached_blocks:
                self._share(block_id)
            seq.block_table = list(cached_blocks)
            seq.num_computed_tokens = seq.num_cached_tokens = len(cached_blocks) * self.block_size
        while len(seq.block_table) < self.blocks_needed(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._take_free_block())
        return []

    def free(self, seq):  # type: ignore[no-untyped-def]
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def lookup_prefix(self, seq):  # type: ignore[no-untyped-def]
        return BlockManager.lookup_prefix(self, seq)


class FirstTryPreemption(Scheduler):
    """Preempts while the pool is short, stops when there is room: but it evicts the oldest running request (the
    first in the list), and puts the victim at the back of the queue."""

    def reserve(self, seq, n, out):  # type: ignore[no-untyped-def]
        bm = self.block_manager
        while not bm.can_allocate(seq, n):
            victim = self.running[0]
            if victim in out.seqs or id(victim) in self.in_flight:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        out.add(seq, n, bm.allocate(seq, n))
        return True

    def preempt(self, seq):  # type: ignore[no-untyped-def]
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)


def test_a_first_block_manager_without_copy_on_write_is_told_so() -> None:
    result = check_block_manager(FirstTryBlockManager)
    message = result.message()
    assert result.status == "failed", message
    first = result.failures[0]
    assert "writes token" in first and "it must first get a private copy" in first, first
    assert BLOCK_MANAGER_HINTS.by_failure["no-copy-on-write"] in message  # the hint for this failure, in words
    assert BLOCK_MANAGER_HINTS.by_failure["free-order"] not in message  # not the hints of other failures
    assert BLOCK_MANAGER_HINTS.code not in message and BLOCK_MANAGER_HINTS.rule not in message
    assert "ref_count > 1" not in message and "_take_free_block" not in message  # no reference code
    assert "show_hint('06.block_manager', 2)" in message


def test_a_first_preemption_that_evicts_the_oldest_is_told_so() -> None:
    result = check_preemption(FirstTryPreemption)
    message = result.message()
    assert result.status == "failed" and len(result.failures) == 1, message
    first = result.failures[0]
    assert "your reserve preempted R0 (the oldest)" in first and "preempt the newest running request" in first, first
    assert PREEMPTION_HINTS.by_failure["victim-not-newest"] in message
    assert PREEMPTION_HINTS.by_failure["queue-tail"] not in message  # the second bug shows once the first is fixed
    assert PREEMPTION_HINTS.code not in message and "self.running[-1]" not in message
    assert "appendleft" not in message
    assert "show_hint('07.preempt', 2)" in message
