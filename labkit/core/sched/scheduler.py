"""The iteration-level scheduler: which sequences run this step, and how many tokens each computes.

Every step (Orca's idea) the scheduler looks again: running sequences keep going, finished ones have
left, and waiting ones are admitted FCFS while there is a free slot (``max_num_seqs``), token budget
(``max_num_batched_tokens``) and KV blocks. When a running sequence needs a block and none is free,
the most recently admitted sequence is preempted by recompute: its blocks are freed and it goes
back to the head of the waiting queue.

Without chunking (engine ``continuous``) a prompt is prefilled whole in the step that admits it.
With chunking (engine ``chunked``) every running decode is scheduled first, then prefill chunks fill
whatever budget is left, splitting long prompts across steps: Sarathi-Serve's policy (and vLLM V0's
with chunked prefill; vLLM V1 walks its running queue, then its waiting queue, under the same budget).

Each rule is a method, so a subclass passed as ``LLM(..., scheduler_cls=MyScheduler)`` replaces one rule
and the engine runs it: ``schedule_running`` (decodes first, then partial prefills), ``schedule_waiting``
(FCFS admission), ``num_tokens_to_schedule`` (whole prompt or chunk), ``select_victim`` (whom to preempt).
Introduced in notebook 07 (``07_continuous_batching``); chunking in notebook 08 (``08_chunked_prefill``).
"""

from __future__ import annotations

from collections import deque

from labkit.core.kv.block_manager import BlockManager
from labkit.core.sched.output import ModelRunnerOutput, SchedulerOutput
from labkit.core.sched.stop import append_token
from labkit.core.sequence import Sequence, SequenceStatus


class Scheduler:
    """Waiting and running queues, FCFS, with preemption by recompute. Notebooks 07-08.

    ``in_flight`` holds the ``id()`` of the sequences of a step still running on the device (async
    scheduling, notebook 10): they are scheduled as if their pending token were known, and never preempted.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.num_preemptions = 0
        self.in_flight: set[int] = set()
        self.num_lookahead_tokens = 0  # speculative decoding (notebook 13): slots for k proposals per decode

    # ---- queues ----

    def add_request(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or bool(self.running)

    def unfinished_sequences(self) -> list[Sequence]:
        """Running sequences first, then waiting ones."""
        return list(self.running) + list(self.waiting)

    def finish_request(self, seq: Sequence) -> None:
        """A finished, failed or aborted sequence leaves and returns its blocks; safe to repeat."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def validate(self, seq: Sequence) -> None:
        """Raise if this scheduler could never run ``seq`` (the engine has checked the pool already)."""
        if self.enable_chunked_prefill:
            return
        p = seq.params
        budget = p.max_tokens if p.max_tokens is not None else seq.max_model_len - seq.num_prompt_tokens
        # After a preemption the whole sequence so far (at most all but its last token) is recomputed in one step.
        if seq.num_prompt_tokens + budget - 1 > self.max_num_batched_tokens:
            raise ValueError(
                f"engine 'continuous' prefills whole sequences: {seq.num_prompt_tokens} prompt tokens + max_tokens "
                f"{budget} may need {seq.num_prompt_tokens + budget - 1} tokens in one step (a recompute after "
                f"preemption), more than max_num_batched_tokens {self.max_num_batched_tokens}; "
                "raise max_num_batched_tokens or use engine 'chunked'"
            )

    # ---- parallel sampling (n > 1): when a sample may share its parent's prompt blocks ----

    @staticmethod
    def can_fork(seq: Sequence) -> bool:
        """A parallel sample may share its parent's blocks once the parent's prompt K/V are computed
        (all but the last prompt token, which each sample computes itself to draw its own first token)."""
        p = seq.parent
        return (p is not None and not seq.block_table and bool(p.block_table)
                and p.num_computed_tokens >= seq.num_prompt_tokens - 1)

    @classmethod
    def waits_for_parent(cls, seq: Sequence) -> bool:
        """The parent is in the engine but has not computed its prompt yet: forking later saves its prefill."""
        p = seq.parent
        return p is not None and not seq.block_table and not p.is_finished and not cls.can_fork(seq)

    # ---- the policy ----

    def schedule(self, now: float) -> SchedulerOutput:
        """The next step's batch: running sequences first, then admissions (none in a step that preempted)."""
        out = SchedulerOutput()
        preemptions_before = self.num_preemptions
        budget = self.schedule_running(out, self.max_num_batched_tokens)
        if self.num_preemptions == preemptions_before:  # memory is short: admit nobody this step
            self.schedule_waiting(out, budget, now)
        return out

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Every running decode (one token each, oldest first), then running sequences part-way through a
        prefill (a chunk, or a recompute). Returns the budget left."""
        # A sequence whose token being sampled is its last needs no further step.
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1 and not s.pending_token_is_last]
        for i, seq in enumerate(decodes):
            # Lookahead for speculative decoding, leaving one token of budget for every decode after this one.
            n = 1 + self.num_lookahead(seq, budget - 1 - (len(decodes) - 1 - i))
            if seq in self.running and budget >= 1 and self.reserve(seq, n, out):
                budget -= n
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if seq not in self.running or budget == 0:
                continue  # preempted a moment ago to make room for an older one
            n = min(seq.num_uncomputed_tokens, budget)
            if self.reserve(seq, n, out):
                budget -= n
        return budget

    def num_lookahead(self, seq: Sequence, room: int) -> int:
        """Proposal slots for a decode (notebook 13): ``num_lookahead_tokens``, but never more than ``room`` in the
        budget, nor more than the request may still emit beyond this step's one token (max_tokens, max_model_len)."""
        if not self.num_lookahead_tokens:
            return 0
        left = seq.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return max(0, min(self.num_lookahead_tokens, room, left - 1))

    def schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Admit waiting requests FCFS while a slot, the budget and free blocks allow; the first that does not
        fit stops admission (head-of-line blocking keeps FCFS fair)."""
        bm = self.block_manager
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            # A parallel sample shares its parent's prompt blocks and computes only the prompt's last token.
            if self.can_fork(seq) and seq.parent is not None and bm.num_free_blocks >= 1:
                self.waiting.popleft()
                bm.fork(seq.parent, seq, seq.num_prompt_tokens - 1)
                self.admit(seq, 1, bm.allocate(seq, 1), out, now)
                budget -= 1
                continue
            if self.waits_for_parent(seq) and seq.parent in self.running:
                break  # its parent is being prefilled this step; share its blocks next step
            cached = bm.lookup_prefix(seq)
            n = self.num_tokens_to_schedule(seq.num_tokens - len(cached) * bm.block_size, budget)
            if n == 0 or not bm.can_allocate(seq, n, cached):
                break
            self.waiting.popleft()
            copies = bm.allocate(seq, n, cached)
            bm.record_prefix_query(seq)
            self.admit(seq, n, copies, out, now)
            budget -= n

    def num_tokens_to_schedule(self, num_uncomputed: int, budget: int) -> int:
        """Tokens a newly admitted prompt computes this step: a chunk of the budget when chunking, else the
        whole prompt or nothing (0: it does not fit this step's budget)."""
        if self.enable_chunked_prefill:
            return min(num_uncomputed, budget)
        return num_uncomputed if num_uncomputed <= budget else 0

    def admit(self, seq: Sequence, n: int, copies: list[tuple[int, int]], out: SchedulerOutput, now: float) -> None:
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = now
        self.running.append(seq)
        out.add(seq, n, copies)

    # ---- preemption ----

    def select_victim(self) -> Sequence:
        """Whom to preempt when blocks run out: the most recently admitted (it has done the least work)."""
        return self.running[-1]

    def reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Blocks for n more tokens of a running sequence, preempting others if needed; schedules it if granted."""
        bm = self.block_manager
        while not bm.can_allocate(seq, n):
            victim = self.select_victim()
            # Never preempt what this step already scheduled, nor what a launched step is still computing.
            if victim in out.seqs or id(victim) in self.in_flight:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        out.add(seq, n, bm.allocate(seq, n))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the sequence's K/V; it re-enters at the head of the queue."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- after the forward pass ----

    def update_from_output(self, out: SchedulerOutput, output: ModelRunnerOutput, now: float) -> list[Sequence]:
        """Take a step's sampled tokens back (vLLM's ``update_from_output``): every scheduled sequence moves on by the
        tokens it computed (rejected proposals excepted), each sampling sequence gets its tokens (the stop rule sees
        each one, so a stop mid-way drops the rest), and finished sequences leave and give their blocks back.
        Returns the sequences that received a token."""
        bm = self.block_manager
        sampled = {id(seq): tokens for seq, tokens in zip(output.seqs, output.sampled_token_ids)}
        if not out.computed_at_launch:  # async scheduling counted them when the step was launched
            for seq, n in zip(out.seqs, out.num_new_tokens):
                if seq.spec_token_ids:  # speculative decoding: rejected proposals do not count as computed
                    num_accepted = len(sampled.get(id(seq), [0])) - 1
                    seq.num_computed_tokens += n - (len(seq.spec_token_ids) - num_accepted)
                    seq.spec_token_ids = []
                    bm.trim(seq)  # blocks that held only rejected proposals go back to the pool
                else:
                    seq.num_computed_tokens += n
                bm.cache_full_blocks(seq)
        stepped = []
        for seq, tokens in zip(output.seqs, output.sampled_token_ids):
            seq.num_pending_tokens = 0
            if seq.is_finished:  # aborted while its (launched) step ran: the tokens are dropped
                tokens.clear()
                continue
            for i, token in enumerate(tokens):
                if append_token(seq, token, now):
                    del tokens[i + 1 :]  # the output keeps only the tokens the request received
                    break
            stepped.append(seq)
        for seq in out.seqs:
            if seq.is_finished:
                self.finish_request(seq)
            elif out.computed_at_launch:  # blocks enter the prefix cache once their token ids are known
                bm.cache_full_blocks(seq)
        return stepped
