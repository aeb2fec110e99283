"""The iteration-level scheduler: which sequences run this step, and how many tokens each computes.

Every step (Orca's idea) the scheduler looks again: running sequences keep going, finished ones have
left, and waiting ones are admitted FCFS while there is a free slot (``max_num_seqs``), token budget
(``max_num_batched_tokens``) and KV blocks. When a running sequence needs a block and none is free,
the most recently admitted sequence is preempted by recompute: its blocks are freed and it goes
back to the head of the waiting queue.

Without chunking (engine ``continuous``) a prompt is prefilled whole in the step that admits it.
With chunking (engine ``chunked``, Sarathi-Serve / vLLM's default) every running decode is scheduled
first, then prefill chunks fill whatever budget is left, splitting long prompts across steps.
Introduced in notebook 07 (``07_continuous_batching``); chunking in notebook 08 (``08_chunked_prefill``).
"""

from __future__ import annotations

from collections import deque

from labkit.cache.block_manager import BlockManager
from labkit.engine.model_runner import ScheduledBatch
from labkit.sequence import Sequence, SequenceStatus


class Scheduler:
    """Waiting and running queues, FCFS, with preemption by recompute. Notebooks 07-08."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves and returns its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch, in_flight: set[int]) -> bool:
        """Blocks for n more tokens of a running sequence, preempting newer ones if needed."""
        bm = self.block_manager
        while not bm.can_allocate(seq, n):
            victim = self.running[-1]
            # Never preempt what this step already scheduled, nor what a launched step is still computing.
            if victim in batch.seqs or id(victim) in in_flight:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        batch.copies += bm.allocate(seq, n)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
        return True

    def schedule(self, now: float, in_flight: set[int] | None = None) -> ScheduledBatch:
        """The next step's batch. ``in_flight``: ``id()`` of the sequences of a step still running on the device
        (async scheduling): they are scheduled as if their pending token were known, and never preempted."""
        in_flight = in_flight or set()
        batch = ScheduledBatch([], [])
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        # 1. Every running decode (one token each), oldest first.
        # (A sequence whose token being sampled is its last needs no further step.)
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_token_is_last]
        for seq in decodes:
            if seq in self.running and budget >= 1 and self._reserve(seq, 1, batch, in_flight):
                budget -= 1
        # 2. Running sequences part-way through a chunked prefill (or a recompute).
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if self._reserve(seq, n, batch, in_flight):
                budget -= n
        # 3. Admit waiting requests FCFS while slots, budget and blocks allow (not while preempting).
        bm = self.block_manager
        admitting = self.num_preemptions == preemptions_before  # memory is short: admit nobody this step
        while admitting and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.can_fork and bm.num_free_blocks >= 1:  # a parallel sample: share the parent's prompt
                self.waiting.popleft()
                bm.fork(seq.parent, seq, seq.num_prompt_tokens - 1)  # type: ignore[arg-type]
                self._admit(seq, 1, bm.allocate(seq, 1), batch, now)
                budget -= 1
                continue
            if seq.waits_for_parent and seq.parent in self.running:
                break  # its parent is being prefilled this step; share its blocks next step
            cached = bm.lookup_prefix(seq)
            n = seq.num_tokens - len(cached) * bm.block_size
            if self.enable_chunked_prefill:
                n = min(n, budget)
            elif n > budget:
                break  # a whole prompt must fit this step's budget
            if not bm.can_allocate(seq, n, cached):
                break
            self.waiting.popleft()
            copies = bm.allocate(seq, n, cached)
            bm.record_prefix_query(seq)
            self._admit(seq, n, copies, batch, now)
            budget -= n
        return batch

    def _admit(self, seq: Sequence, n: int, copies: list[tuple[int, int]], batch: ScheduledBatch, now: float) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = now
        self.running.append(seq)
        batch.copies += copies
        batch.seqs.append(seq)
        batch.num_new_tokens.append(n)
