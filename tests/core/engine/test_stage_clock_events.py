"""``StageClock`` on CUDA records an event per stage instead of synchronising after each, and waits once when the times
are read: each stage still gets the device work it queued. Checked on the CPU with CUDA events mocked and a fake clock
(the device's timeline is scripted, so no test depends on wall-clock time)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import labkit.core.engine.step as step
from labkit.core.engine.step import StageClock


class Timeline:
    """The host's clock, and when the device finishes each event (scripted per record)."""

    def __init__(self, device_ends: list[float]) -> None:
        self.now = 0.0
        self.device_ends = list(device_ends)
        self.waits = 0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def timeline(monkeypatch: pytest.MonkeyPatch) -> Timeline:
    line = Timeline([])

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.done_at = 0.0

        def record(self) -> None:
            self.done_at = line.device_ends.pop(0)

        def query(self) -> bool:
            return self.done_at <= line.now

        def synchronize(self) -> None:
            line.waits += 1
            line.now = max(line.now, self.done_at)

        def elapsed_time(self, end: Event) -> float:
            return (end.done_at - self.done_at) * 1e3  # milliseconds, as CUDA's

    def no_sync(device: torch.device) -> None:
        raise AssertionError("a CUDA stage must not synchronise the device")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(step, "synchronize", no_sync)
    monkeypatch.setattr(step, "time", SimpleNamespace(perf_counter=line.perf_counter))
    return line


def run_stages(clock: StageClock, line: Timeline, host_ends: list[float]) -> None:
    for name, end in zip(("prepare", "forward", "sample"), host_ends):
        with clock.stage(name):
            line.now = end


def test_device_work_counts_in_the_stage_that_queued_it_with_one_wait(timeline: Timeline) -> None:
    timeline.device_ends = [1.5, 10.0, 10.5]  # the forward's kernels run long after the host launched them
    clock = StageClock(torch.device("cuda"))
    run_stages(clock, timeline, [1.0, 2.0, 3.0])
    assert timeline.waits == 0  # nothing waited for the device while the stages ran
    assert clock.times == pytest.approx({"prepare": 1.5, "forward": 8.5, "sample": 0.5})
    assert clock.last == pytest.approx(10.5) and timeline.waits == 1  # one wait, at the first read
    assert sum(clock.times.values()) == pytest.approx(clock.last - clock.start)  # the stages add up to the step


def test_a_device_that_kept_up_leaves_the_host_times(timeline: Timeline) -> None:
    timeline.device_ends = [0.5, 1.5, 2.5]  # each stage's work done before the host's next stage
    clock = StageClock(torch.device("cuda"))
    run_stages(clock, timeline, [1.0, 2.0, 3.0])
    assert clock.times == pytest.approx({"prepare": 1.0, "forward": 1.0, "sample": 1.0})
    with clock.stage("detokenize"):  # a later stage: the earlier ones were resolved, this one is timed on its own
        timeline.device_ends.append(3.0)
        timeline.now = 4.0
    assert clock.times["detokenize"] == pytest.approx(1.0) and clock.last == pytest.approx(4.0)


def test_off_cuda_or_unsynced_no_events(monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    monkeypatch.setattr(step, "synchronize", lambda device: synced.append(device.type))
    monkeypatch.setattr(torch.cuda, "Event", None)  # never touched off CUDA
    clock = StageClock(torch.device("mps"))
    with clock.stage("forward"):
        pass
    assert synced == ["mps"] and "forward" in clock.times
    unsynced = StageClock(torch.device("cuda"), sync=False)  # the async engine's host clock: never waits
    with unsynced.stage("schedule"):
        pass
    assert synced == ["mps"] and "schedule" in unsynced.times
