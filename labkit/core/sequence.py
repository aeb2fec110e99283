"""A request as the engine sees it: token ids, status, sampling state, timings.

Introduced in notebook 01 (``01_anatomy_of_a_request``). The request is plain data: it knows its tokens and derived
counts, never an engine rule. The scheduler decides when it stops (``labkit.core.sched.stop``, applied by
``Scheduler.update_from_output``) and when a parallel sample may share its parent's blocks (``Scheduler.can_fork``),
so requests stop alike whatever the scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from labkit.core.metrics import RequestMetrics
from labkit.core.sampling_params import SamplingParams
from labkit.core.text.detokenizer import IncrementalDetokenizer


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context (max_model_len) is used up
    ABORT = "abort"  # the caller dropped it (abort_request, a closed stream, an interrupted cell)
    ERROR = "error"  # the engine step that ran it raised; ``Sequence.error`` says what happened


@dataclass
class Sequence:
    """One sequence being generated. Notebook 01."""

    seq_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    metrics: RequestMetrics
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    # Paged engines (notebook 06 on): where this sequence's K/V live and how much of it is computed.
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache (no prefill needed)
    num_preemptions: int = 0
    # Async scheduling (notebook 10): tokens a launched step is sampling that the host has not seen yet (0 or 1).
    num_pending_tokens: int = 0
    # Speculative decoding (notebook 13): this step's proposed tokens, verified after the known ones.
    spec_token_ids: list[int] = field(default_factory=list)
    parent: Sequence | None = None  # parallel sampling (n > 1): the sample whose prompt K/V this one shares
    error: str | None = None  # why it failed (finish_reason ERROR)
    error_cause: BaseException | None = field(default=None, repr=False)  # the exception, for tracebacks

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V are still to compute, counting one still being sampled (async scheduling)."""
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens

    @property
    def pending_token_is_last(self) -> bool:
        """Async scheduling: the token being sampled now is this sequence's last (max_tokens or the context
        is used up), so it needs no further step."""
        if not self.num_pending_tokens:
            return False
        max_tokens = self.params.max_tokens
        return ((max_tokens is not None and self.num_output_tokens + self.num_pending_tokens >= max_tokens)
                or self.num_tokens + self.num_pending_tokens >= self.max_model_len)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text

    def record_token(self, token_id: int, now: float) -> None:
        """Append a sampled token (its time, its text, any stop string it completes) without deciding to stop."""
        self.output_token_ids.append(token_id)
        self.metrics.token_times.append(now)
        self.detokenizer.append(token_id)
