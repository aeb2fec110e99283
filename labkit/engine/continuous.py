"""Engines ``continuous`` and ``chunked``: iteration-level scheduling over the paged pool.

``continuous`` admits new requests at every step and prefills each prompt whole when admitted
(notebook 07, ``07_continuous_batching``). ``chunked`` also splits prefills into chunks under a
per-step token budget, after scheduling every running decode, so a long prompt never stalls the
decodes beside it (notebook 08, ``08_chunked_prefill``). ``chunked`` is ``LLM``'s default engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.engine.async_scheduling import AsyncSchedulingMixin
from labkit.engine.base import StageClock
from labkit.engine.paged import PagedConfig, PagedEngineBase
from labkit.engine.sched.scheduler import Scheduler
from labkit.sequence import Sequence


@dataclass
class ContinuousConfig(PagedConfig):
    """Options of ``continuous``/``chunked``. ``max_num_batched_tokens=None``: max_model_len when
    prompts are prefilled whole, 512 when chunked."""

    max_num_batched_tokens: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        n = self.max_num_batched_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"max_num_batched_tokens must be an int >= 1, got {n!r}")


class ContinuousEngine(AsyncSchedulingMixin, PagedEngineBase):
    """Continuous batching: requests join and leave at every step. Notebook 07.

    With ``async_scheduling=True`` the next step is planned while the device runs this one (notebook 10).
    """

    name = "continuous"
    config_class = ContinuousConfig
    config: ContinuousConfig
    enable_chunked_prefill = False

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        budget = self.config.max_num_batched_tokens
        if budget is None:
            assert self.config.max_model_len is not None
            budget = 512 if self.enable_chunked_prefill else self.config.max_model_len
        self.max_num_batched_tokens = budget
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, budget, self.enable_chunked_prefill)

    def validate(self, seq: Sequence) -> None:
        super().validate(seq)
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

    # The queues live in the scheduler; the base class's ``waiting`` stays empty.
    def add_request(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def unfinished_sequences(self) -> list[Sequence]:
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    def running_sequences(self) -> list[Sequence]:
        return list(self.scheduler.running)

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)

    def _fail_step(self, exc: BaseException) -> list[Sequence]:
        self._drain_in_flight()  # its blocks may be about to be freed: let the device finish with them first
        failed = super()._fail_step(exc)
        for seq in failed:
            seq.num_pending_tokens = 0
        return failed

    def _step(self) -> list[Sequence]:
        if self.config.async_scheduling:
            return self._step_async()
        clock = StageClock(self.device)
        with clock.stage("schedule"):
            batch = self.scheduler.schedule(clock.start)
        if not batch.seqs:
            return []
        self.num_preemptions = self.scheduler.num_preemptions
        return self._run(batch, clock, num_slots=len(batch.seqs))


class ChunkedEngine(ContinuousEngine):
    """Continuous batching with chunked prefill under a token budget. Notebook 08; LLM's default."""

    name = "chunked"
    enable_chunked_prefill = True
