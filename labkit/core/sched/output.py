"""What the scheduler hands the model runner for one step (vLLM's ``SchedulerOutput``), and what comes back
(``ModelRunnerOutput``).

The scheduler decides *which* sequences run and *how many* new tokens each computes; the runner turns that into
tensors, runs the model and samples; the scheduler's ``update_from_output`` takes the sampled tokens back. Introduced
in notebook 06 (``06_paged_attention``); built by the schedulers of notebooks 07-08.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.core.sequence import Sequence


@dataclass
class SchedulerOutput:
    """One step's batch: the sequences, their new-token counts and the block copies to run first. Notebook 06."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence, tokens to compute this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies (src, dst)
    num_idle_slots: int = 0  # static batches: rows that hold a slot but compute nothing this step
    # Async scheduling (notebook 10): the step's tokens were counted as computed when it was launched.
    computed_at_launch: bool = False

    def add(self, seq: Sequence, num_new_tokens: int, copies: list[tuple[int, int]]) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.copies += copies

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for s, n in zip(self.seqs, self.num_new_tokens) if s.num_computed_tokens < s.num_prompt_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class ModelRunnerOutput:
    """What one step's forward pass produced (vLLM's ``ModelRunnerOutput``): the sequences that sampled, in batch
    order, and each one's new tokens (one; with speculative decoding the accepted proposals, then one). A prefill
    chunk that stops mid-prompt samples nothing. Notebook 06; speculative decoding in notebook 13."""

    seqs: list[Sequence] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
