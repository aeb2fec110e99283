"""One engine step, measured: its stages timed (``StageClock``) and what it did recorded (``StepStats``).

Each stage is also a named ``torch.profiler`` range (``labkit::<stage>``) when a profiler records, so a
trace shows schedule / prepare / forward / sample / detokenize for every step. Introduced in notebook 01
(``01_anatomy_of_a_request``); the ranges in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from labkit.core.device import synchronize

_profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


def profiler_range(name: str) -> AbstractContextManager[object]:
    """A named range in torch.profiler traces (notebook 10). With no profiler recording, nothing at all: an idle
    ``record_function`` still costs ~15 µs, several times per step, which is host overhead on a small model."""
    return torch.profiler.record_function(name) if _profiler_enabled() else nullcontext()


@dataclass
class StepStats:
    """What one engine step did and where its time went. Notebook 01; plotted again in 05, 07 and 10."""

    step: int
    start: float
    end: float
    num_seqs: int
    num_computed_tokens: int  # token positions run through the model (including recomputed ones)
    num_new_tokens: int  # tokens sampled: the useful output of the step
    stage_times: dict[str, float] = field(default_factory=dict)
    num_padding_tokens: int = 0  # positions computed only to square up a padded batch
    num_idle_slots: int = 0  # batch rows already finished but still computed
    is_prefill: bool = True  # whether any prompt tokens were processed this step
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens among num_computed_tokens
    kv_blocks_used: int | None = None  # paged engines: blocks held during the step (before finished ones free)
    num_preemptions: int = 0  # paged engines: preemptions so far

    @property
    def duration(self) -> float:
        return self.end - self.start


class StageClock:
    """Times the stages of one step; each stage is also a named profiler range (``labkit::<stage>``).

    ``with clock.stage("forward"): ...`` times the block so that queued device work counts in the stage that
    launched it. On CUDA that takes no synchronisation per stage: each stage's end records a CUDA event, and the first
    read of ``times`` or ``last`` waits once for the last event, then places every stage's end at the later of the
    host's end and the device's (from the events' elapsed times). Elsewhere (MPS) the device is synchronised at each
    stage's end; ``sync=False`` times the host alone. The ranges let ``torch.profiler`` traces show schedule /
    prepare / forward / sample / detokenize for every step (notebook 10).
    """

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.device = device
        self.sync = sync
        self.use_events = sync and device.type == "cuda"
        self._times: dict[str, float] = {}
        self.start = self._last = time.perf_counter()
        self._pending: list[tuple[str, float, torch.cuda.Event]] = []  # (stage, host end, its event): unresolved

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        event = None
        with profiler_range(f"labkit::{name}"):
            yield
            if self.use_events:
                event = torch.cuda.Event(enable_timing=True)
                event.record()  # on the current stream, behind everything the stage queued: no wait here
            elif self.sync:
                synchronize(self.device)
        now = time.perf_counter()
        if event is not None:
            self._pending.append((name, now, event))
            return
        # Counted from the previous stage's end, so the stages of a step add up to the whole step.
        self._resolve()
        self._times[name] = self._times.get(name, 0.0) + now - self._last
        self._last = now

    @property
    def times(self) -> dict[str, float]:
        """Seconds per stage so far (device work included)."""
        self._resolve()
        return self._times

    @property
    def last(self) -> float:
        """When the latest stage ended (``time.perf_counter``), its device work included."""
        self._resolve()
        return self._last

    def _resolve(self) -> None:
        """Wait once for the last pending event, then give each pending stage its end: the later of its host end and
        its device end. The device's ends come back from the last one by the events' elapsed times; the last one is
        now, if the device was still busy, else (it finished while the host looked) the host's end."""
        if not self._pending:
            return
        last_event = self._pending[-1][2]
        busy = not last_event.query()
        last_event.synchronize()
        device_last = time.perf_counter() if busy else self._pending[-1][1]
        for name, host_end, event in self._pending:
            end = max(self._last, host_end, device_last - event.elapsed_time(last_event) / 1e3)
            self._times[name] = self._times.get(name, 0.0) + end - self._last
            self._last = end
        self._pending.clear()
