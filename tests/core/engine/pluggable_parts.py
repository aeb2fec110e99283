"""Subclasses of labkit's parts that count their calls, importable by path (the server's --scheduler-cls)."""

from __future__ import annotations

from labkit import BlockManager, Scheduler, StaticScheduler
from labkit.core.attention import TorchAttentionBackend
from labkit.core.sched.output import SchedulerOutput
from labkit.core.sequence import Sequence


class CountingScheduler(Scheduler):
    instances: list[CountingScheduler] = []

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.num_schedule_calls = 0
        CountingScheduler.instances.append(self)

    def schedule(self, now: float) -> SchedulerOutput:
        self.num_schedule_calls += 1
        return super().schedule(now)


class CountingStaticScheduler(StaticScheduler):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.num_schedule_calls = 0

    def schedule(self, now: float) -> SchedulerOutput:
        self.num_schedule_calls += 1
        return super().schedule(now)


class CountingBlockManager(BlockManager):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.num_allocate_calls = 0
        self.num_free_calls = 0

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None
                 ) -> list[tuple[int, int]]:
        self.num_allocate_calls += 1
        return super().allocate(seq, num_new_tokens, cached_blocks)

    def free(self, seq: Sequence) -> None:
        self.num_free_calls += 1
        super().free(seq)


class CountingAttention(TorchAttentionBackend):
    num_steps = 0  # class-level: one backend object is built per step

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        CountingAttention.num_steps += 1
