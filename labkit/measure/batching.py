"""Static batching, counted: which token positions a padded batch computes, and which were useful.

The ``kvcache`` engine runs requests in *static* batches: the first ``max_num_seqs`` waiting requests
(first come, first served) form a batch, prompts are left-padded to the longest, and the batch decodes
until its longest output is done; rows that finish early keep their slot and are still computed.

A request with ``p`` prompt tokens and ``o`` output tokens needs ``p + o - 1`` token positions run
through the model: every prompt token (prefill), then every output token but the last (each is fed
back in the next decode step; the last one is sampled and never fed). A static batch of ``B`` rows
computes ``B x (max p + max o - 1)`` positions. The difference is waste of two kinds:

- padding: ``max p - p`` positions per row, in the prefill step;
- idle (finished) slots: ``max o - o`` positions per row, one per decode step after the row finished.

Everything here is arithmetic on lengths, so it can be checked against the engine's ``StepStats``
(``num_computed_tokens``, ``num_padding_tokens``, ``num_idle_slots``). Introduced in notebook 05
(``05_static_batching``); notebook 07 compares continuous batching against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from labkit.core.engine.step import StepStats


@dataclass(frozen=True)
class TokenCounts:
    """Token positions a batch (or a whole run) computed, split by what they were for. Notebook 05."""

    useful: int  # prompt tokens and fed-back output tokens of requests still running
    padding: int  # left padding, computed only to square up the prefill
    idle: int  # rows already finished, computed anyway until their batch ends

    @property
    def computed(self) -> int:
        """Every position run through the model."""
        return self.useful + self.padding + self.idle

    @property
    def useful_fraction(self) -> float:
        """Share of the computed positions that served a live request (1.0 = no waste)."""
        return self.useful / self.computed if self.computed else 1.0

    def __add__(self, other: TokenCounts) -> TokenCounts:
        return TokenCounts(self.useful + other.useful, self.padding + other.padding, self.idle + other.idle)

    @classmethod
    def from_step(cls, stats: StepStats) -> TokenCounts:
        """What one engine step reported. An idle row computes one position per (decode) step."""
        wasted = stats.num_padding_tokens + stats.num_idle_slots
        return cls(useful=stats.num_computed_tokens - wasted, padding=stats.num_padding_tokens,
                   idle=stats.num_idle_slots)

    @classmethod
    def from_steps(cls, steps: Iterable[StepStats]) -> TokenCounts:
        """Sum over a run's steps, e.g. ``llm.engine.step_stats``: the measured counterpart of
        ``static_batching_waste``."""
        total = cls(0, 0, 0)
        for s in steps:
            total = total + cls.from_step(s)
        return total


def _check_lengths(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> None:
    if len(prompt_lens) != len(output_lens):
        raise ValueError(f"got {len(prompt_lens)} prompt lengths and {len(output_lens)} output lengths; "
                         "give one of each per request")
    for name, lens in (("prompt", prompt_lens), ("output", output_lens)):
        bad = [n for n in lens if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1]
        if bad:
            raise ValueError(f"{name} lengths must be ints >= 1, got {bad[0]!r}")


def static_batch_waste(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> TokenCounts:
    """Useful, padding and idle positions of ONE static batch (one row per request). Notebook 05."""
    _check_lengths(prompt_lens, output_lens)
    if not prompt_lens:
        return TokenCounts(0, 0, 0)
    max_p, max_o = max(prompt_lens), max(output_lens)
    return TokenCounts(
        useful=sum(p + o - 1 for p, o in zip(prompt_lens, output_lens)),
        padding=sum(max_p - p for p in prompt_lens),
        idle=sum(max_o - o for o in output_lens),
    )


def static_batch_tokens(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> tuple[int, int]:
    """(computed, useful) token positions of ONE static batch. Task 1 of notebook 05 mirrors it.

    computed = B x (max prompt + max output - 1): every row runs the padded prefill and every decode
    step of the batch. useful = sum of (prompt + output - 1): what each request needs on its own.
    """
    counts = static_batch_waste(prompt_lens, output_lens)
    return counts.computed, counts.useful


def static_batches(num_requests: int, max_num_seqs: int) -> list[range]:
    """Request indices of each static batch, in the ``kvcache`` engine's order (FCFS chunks)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return [range(i, min(i + max_num_seqs, num_requests)) for i in range(0, num_requests, max_num_seqs)]


def static_batching_waste(prompt_lens: Sequence[int], output_lens: Sequence[int], max_num_seqs: int
                          ) -> TokenCounts:
    """Useful, padding and idle positions of a whole workload run in static batches. Notebook 05."""
    _check_lengths(prompt_lens, output_lens)
    total = TokenCounts(0, 0, 0)
    for batch in static_batches(len(prompt_lens), max_num_seqs):
        total = total + static_batch_waste([prompt_lens[i] for i in batch], [output_lens[i] for i in batch])
    return total


@dataclass
class SlotOccupancy:
    """What every batch slot did at every engine step: the grid behind a slot-occupancy timeline.

    Arrays are (num_steps, num_slots). A cell with no positions and not idle is an empty slot (no
    request in it). Notebook 05 draws it with ``labkit.course.plots.plot_slot_occupancy``; any engine that
    can say, per step and slot, how many positions were useful, padding or idle can fill one.
    """

    useful: np.ndarray  # (steps, slots) int: positions that served a live request
    padding: np.ndarray  # (steps, slots) int: padding positions
    idle: np.ndarray  # (steps, slots) bool: the slot's request had finished but the row was computed
    prefill: np.ndarray  # (steps,) bool: whether the step processed prompt tokens
    batch_starts: list[int]  # step index where each static batch starts

    @property
    def num_steps(self) -> int:
        return int(self.useful.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.useful.shape[1])

    def step_counts(self) -> list[TokenCounts]:
        """Per step totals, comparable with ``TokenCounts.from_step`` of the engine's StepStats."""
        return [TokenCounts(int(u.sum()), int(p.sum()), int(i.sum()))
                for u, p, i in zip(self.useful, self.padding, self.idle)]

    def totals(self) -> TokenCounts:
        return TokenCounts(int(self.useful.sum()), int(self.padding.sum()), int(self.idle.sum()))


def static_batch_occupancy(prompt_lens: Sequence[int], output_lens: Sequence[int], max_num_seqs: int
                           ) -> SlotOccupancy:
    """The slot-by-step schedule of the ``kvcache`` engine on this workload (FCFS static batches).

    Each batch takes one prefill step (row r: p_r useful positions, max p - p_r padding), then
    max o - 1 decode steps; in decode step k (1-based) row r is useful while k < o_r, idle after.
    """
    _check_lengths(prompt_lens, output_lens)
    batches = static_batches(len(prompt_lens), max_num_seqs)
    num_slots = max((len(b) for b in batches), default=0)
    num_steps = sum(max(output_lens[i] for i in b) for b in batches)  # 1 prefill + (max o - 1) decodes
    useful = np.zeros((num_steps, num_slots), dtype=np.int64)
    padding = np.zeros((num_steps, num_slots), dtype=np.int64)
    idle = np.zeros((num_steps, num_slots), dtype=bool)
    prefill = np.zeros(num_steps, dtype=bool)
    starts = []
    step = 0
    for batch in batches:
        p = np.array([prompt_lens[i] for i in batch])
        o = np.array([output_lens[i] for i in batch])
        rows = len(batch)
        starts.append(step)
        prefill[step] = True
        useful[step, :rows] = p
        padding[step, :rows] = p.max() - p
        for k in range(1, int(o.max())):  # decode steps of this batch
            live = k < o
            useful[step + k, :rows] = live
            idle[step + k, :rows] = ~live
        step += int(o.max())
    return SlotOccupancy(useful=useful, padding=padding, idle=idle, prefill=prefill, batch_starts=starts)
