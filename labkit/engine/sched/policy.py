"""The scheduler's two rules as small pure functions: whom to admit, and how to fill the token budget.

``labkit.engine.sched.scheduler.Scheduler.schedule`` decides every step which sequences run and how many
tokens each computes. Inside it are two rules, written out here on plain numbers so they can be read,
tested and re-implemented in isolation (tests/test_scheduling_policy.py checks that the real scheduler
does exactly what these functions say):

* ``admit_fcfs``: admission without chunking (engine ``continuous``). Waiting requests are taken
  first come, first served while there is a free slot (``max_num_seqs``), room in the step's token
  budget for the *whole* prompt, and enough free KV blocks. The first request that does not fit stops
  admission: nobody behind it may jump the queue (head-of-line blocking keeps FCFS fair).
  Introduced in notebook 07 (``07_continuous_batching``).
* ``fill_token_budget``: the budget-filling policy with chunked prefill (engine ``chunked``,
  Sarathi-Serve, vLLM's default). Every running decode gets its one token first, then running sequences
  part-way through their prompt get the next chunk, then waiting prompts are admitted FCFS; each
  prefill takes ``min(remaining tokens, budget left)``, so a long prompt is split over several steps and
  never holds up the decodes. Introduced in notebook 08 (``08_chunked_prefill``).

Both assume the step has not preempted anyone (the real scheduler admits nobody in a step that had to
preempt) and, for ``fill_token_budget``, that KV blocks are plentiful. ``scheduler_state`` reads their
inputs off a live ``Scheduler`` and ``planned_tokens`` applies the right rule, so a notebook can put the
rule's plan next to what the engine then does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from labkit.engine.sched.scheduler import Scheduler


def admit_fcfs(waiting: Sequence[tuple[int, int]], num_free_slots: int, token_budget: int,
               num_free_blocks: int) -> list[int]:
    """Which waiting requests this step admits (their indices), prompts prefilled whole. Notebook 07.

    Args:
        waiting: for each waiting request, in queue order, ``(num_tokens, num_blocks)``: the tokens it
            must compute to join (its prompt) and the KV blocks those tokens need.
        num_free_slots: ``max_num_seqs`` minus the sequences already running.
        token_budget: what is left of ``max_num_batched_tokens`` after this step's decodes.
        num_free_blocks: free KV blocks after this step's decodes took theirs.

    Returns the indices admitted, always a prefix ``[0, 1, ..., k-1]`` of the queue: FCFS stops at the
    first request that lacks a slot, budget or blocks.
    """
    admitted: list[int] = []
    for i, (num_tokens, num_blocks) in enumerate(waiting):
        if num_free_slots == 0 or num_tokens > token_budget or num_blocks > num_free_blocks:
            break  # head-of-line blocking: later (maybe smaller) requests wait their turn
        admitted.append(i)
        num_free_slots -= 1
        token_budget -= num_tokens
        num_free_blocks -= num_blocks
    return admitted


class TokenPlan(NamedTuple):
    """Tokens each sequence computes this step (0: not scheduled), in the order they were given. Notebook 08."""

    decodes: list[int]  # one entry per running decode: 1 or 0
    partials: list[int]  # one per running sequence part-way through its prompt
    waiting: list[int]  # one per waiting request: 0 if not admitted this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.decodes) + sum(self.partials) + sum(self.waiting)


def fill_token_budget(num_decodes: int, partial_prefills: Sequence[int], waiting: Sequence[int], token_budget: int,
                      num_free_slots: int) -> TokenPlan:
    """Split one step's token budget: decodes first, then partial prefills, then admissions, FCFS. Notebook 08.

    Args:
        num_decodes: running sequences that each need exactly one token (their next output; a prompt
            with one token left counts here too, as the scheduler counts it).
        partial_prefills: for each running sequence part-way through its prompt, in admission order,
            the prompt tokens it still has to compute.
        waiting: for each waiting request, in queue order, its prompt tokens still to compute.
        token_budget: ``max_num_batched_tokens``.
        num_free_slots: ``max_num_seqs`` minus the sequences already running (decodes and partials).

    Returns a ``TokenPlan``: how many tokens each one computes this step. A waiting request is admitted
    only while slots and budget remain, and the last one admitted may get just a first chunk.
    """
    budget = token_budget
    decodes = []
    for _ in range(num_decodes):
        take = 1 if budget >= 1 else 0
        decodes.append(take)
        budget -= take
    partials = []
    for remaining in partial_prefills:
        take = min(remaining, budget)
        partials.append(take)
        budget -= take
    admitted = []
    for prompt_tokens in waiting:
        take = min(prompt_tokens, budget) if num_free_slots > 0 else 0
        if take == 0:
            break  # FCFS: nobody behind a request that cannot start may start
        admitted.append(take)
        budget -= take
        num_free_slots -= 1
    admitted += [0] * (len(waiting) - len(admitted))
    return TokenPlan(decodes, partials, admitted)


# ---- reading the rules' inputs off a live scheduler ----

@dataclass(frozen=True)
class SchedulerState:
    """What the rules look at, read off a ``Scheduler`` just before its next step (ids are seq_ids). Notebook 08."""

    decodes: list[int]  # running sequences with one token to compute, in running order
    partials: list[tuple[int, int]]  # (seq_id, prompt tokens left) of running sequences mid-prefill
    waiting: list[tuple[int, int]]  # (seq_id, tokens to compute to join), in queue order
    max_num_batched_tokens: int
    num_free_slots: int
    num_free_blocks: int  # after every decode has taken the block it needs
    block_size: int
    enable_chunked_prefill: bool


def scheduler_state(scheduler: Scheduler) -> SchedulerState:
    """Snapshot the inputs of ``fill_token_budget`` / ``admit_fcfs`` (no prefix caching, no forks)."""
    bm = scheduler.block_manager
    decodes, partials = [], []
    blocks_for_decodes = 0
    for seq in scheduler.running:
        left = seq.num_tokens - seq.num_computed_tokens
        if left == 1:
            decodes.append(seq.seq_id)
            blocks_for_decodes += bm.blocks_needed(seq.num_computed_tokens + 1) - len(seq.block_table)
        else:
            partials.append((seq.seq_id, left))
    return SchedulerState(
        decodes=decodes, partials=partials,
        waiting=[(s.seq_id, s.num_tokens - s.num_computed_tokens) for s in scheduler.waiting],
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        num_free_slots=scheduler.max_num_seqs - len(scheduler.running),
        num_free_blocks=bm.num_free_blocks - blocks_for_decodes, block_size=bm.block_size,
        enable_chunked_prefill=scheduler.enable_chunked_prefill,
    )


def planned_tokens(state: SchedulerState) -> dict[int, int]:
    """seq_id -> tokens the rules give it this step (0: not scheduled): what the scheduler should do."""
    if state.enable_chunked_prefill:
        plan = fill_token_budget(len(state.decodes), [n for _, n in state.partials], [n for _, n in state.waiting],
                                 state.max_num_batched_tokens, state.num_free_slots)
        ids = state.decodes + [i for i, _ in state.partials] + [i for i, _ in state.waiting]
        return dict(zip(ids, plan.decodes + plan.partials + plan.waiting))
    budget = state.max_num_batched_tokens - len(state.decodes)
    needs = [(n, -(-n // state.block_size)) for _, n in state.waiting]
    admitted = set(admit_fcfs(needs, state.num_free_slots, budget, state.num_free_blocks))
    tokens = {i: 1 for i in state.decodes}
    tokens.update({i: n if k in admitted else 0 for k, (i, n) in enumerate(state.waiting)})
    return tokens
