"""Notebook 04's decode breakdown times each linear-layer and attention call with CUDA events on a GPU (a host clock
would time only the launches), checked with CUDA events mocked: the device's time per call is scripted, the host's
time does not enter, and the device is waited for once, not per call."""

from __future__ import annotations

import pytest
import torch

from labkit.measure.decode_roof import device_timing_calls


class Layer:
    def __call__(self, x: int) -> int:
        return x + 1


def test_calls_are_timed_by_cuda_events_with_one_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[object] = []
    clock = iter(range(100))  # each record() takes the next "device time" (ms)

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = -1

        def record(self) -> None:
            self.at = next(clock) * 3  # every call: 3 ms on the device, whatever the host took

        def elapsed_time(self, end: Event) -> float:
            return float(end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    into = [0.0]
    original = Layer.__call__
    with device_timing_calls(Layer, "__call__", into, torch.device("cuda")):
        assert [Layer()(i) for i in range(4)] == [1, 2, 3, 4]
        assert not waits
    assert Layer.__call__ is original and len(waits) == 1
    assert into[0] == pytest.approx(4 * 3e-3)


def test_off_cuda_the_host_clock_times_the_calls() -> None:
    into = [0.0]
    with device_timing_calls(Layer, "__call__", into, torch.device("cpu")):
        Layer()(1)
    assert into[0] > 0.0
