"""The static scheduler of engine ``paged``: one batch at a time, over paged KV memory.

Same policy as ``kvcache`` (a batch of up to ``max_num_seqs`` runs until its last request finishes; freed
slots are not refilled), but memory is handed out block by block as sequences grow, and returned the
moment a sequence finishes. If the pool runs dry mid-batch, the most recently admitted row is preempted
(its blocks freed; it leaves the batch and waits for the next one). Swapping this scheduler for the
iteration-level ``Scheduler`` is all that separates engine ``paged`` from ``continuous``.
Introduced in notebook 06 (``06_paged_attention``); compared with ``Scheduler`` in notebook 07.
"""

from __future__ import annotations

from labkit.core.kv.block_manager import BlockManager
from labkit.core.sched.output import SchedulerOutput
from labkit.core.sched.scheduler import Scheduler
from labkit.core.sequence import Sequence, SequenceStatus


class StaticScheduler(Scheduler):
    """Static batches: admit FCFS only when the previous batch is done. Notebook 06."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool) -> None:
        super().__init__(block_manager, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill)
        self.batch: list[Sequence] = []  # the static batch: its slots stay taken until all are done

    def has_unfinished_requests(self) -> bool:
        return bool(self.batch) or bool(self.waiting)

    def unfinished_sequences(self) -> list[Sequence]:
        return [s for s in self.batch if not s.is_finished] + list(self.waiting)

    def finish_request(self, seq: Sequence) -> None:
        # Its slot in the static batch stays taken (finished) until the whole batch is done.
        super().finish_request(seq)
        if all(s.is_finished for s in self.batch):
            self.batch = []

    def preempt(self, seq: Sequence) -> None:
        self.batch.remove(seq)  # it leaves this batch and waits for the next one
        super().preempt(seq)

    def schedule(self, now: float) -> SchedulerOutput:
        """Rows of the static batch that compute this step (admitting a new batch when the last one is done)."""
        out = SchedulerOutput()
        if not self.batch:
            self.schedule_waiting(out, self.max_num_batched_tokens, now)
            out = SchedulerOutput()  # the rows are scheduled below, like every later step's
        bm = self.block_manager
        for seq in list(self.running):  # admission order: the newest rows are the first to give way
            if seq not in self.running:
                continue  # preempted a moment ago to make room for an older row
            if self.can_fork(seq) and seq.parent is not None:
                bm.fork(seq.parent, seq, seq.num_prompt_tokens - 1)
            elif self.waits_for_parent(seq):
                continue  # its parent's prompt is still being computed
            self.reserve(seq, seq.num_tokens - seq.num_computed_tokens, out)
        out.num_idle_slots = len(self.batch) - len(out.seqs)
        return out

    def schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Form a new static batch: FCFS while slots and blocks for the prompts last (blocks are taken here)."""
        bm = self.block_manager
        while self.waiting and len(self.batch) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.waits_for_parent(seq) and seq.parent in self.batch:
                # A parallel sample joins its parent's batch without blocks; it forks once the parent's
                # prompt is computed (see schedule).
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                seq.metrics.first_scheduled_time = now
                self.batch.append(seq)
                self.running.append(seq)
                continue
            cached = bm.lookup_prefix(seq)
            num_new = seq.num_tokens - len(cached) * bm.block_size
            if not bm.can_allocate(seq, num_new, cached):
                break
            self.waiting.popleft()
            bm.allocate(seq, num_new, cached)
            bm.record_prefix_query(seq)
            self.batch.append(seq)
            self.admit(seq, num_new, [], out, now)
