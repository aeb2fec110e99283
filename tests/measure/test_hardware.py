"""The hardware probe and the timing helper return sane, synchronised measurements."""

from __future__ import annotations

import math

import torch

from labkit.course.profile import pick_profile, smoke_mode
from labkit.measure.hardware import DeviceRoof, attainable_flops, probe
from labkit.measure.timing import time_call, time_fn


def test_probe_measures_positive_finite_roofs(tmp_path) -> None:
    roof = probe("cpu", "float32", smoke=True)
    for value in (roof.memory_bandwidth, roof.read_bandwidth, roof.copy_bandwidth, roof.matmul_flops):
        assert math.isfinite(value) and value > 0
    assert roof.memory_bandwidth == max(roof.read_bandwidth, roof.copy_bandwidth)
    assert roof.ridge_point == roof.matmul_flops / roof.memory_bandwidth
    assert roof.device == "cpu" and roof.dtype == "float32"
    # Saved and reloaded unchanged, for notebook 04.
    assert DeviceRoof.load(roof.save(tmp_path / "roof.json")) == roof


def test_roofline_is_the_minimum_of_its_two_roofs() -> None:
    assert attainable_flops(1.0, 1e12, 1e11) == 1e11
    assert attainable_flops(100.0, 1e12, 1e11) == 1e12


def test_time_call_returns_the_result_and_its_seconds() -> None:
    result, seconds = time_call(lambda: torch.ones(3).sum().item(), torch.device("cpu"))
    assert result == 3.0 and seconds >= 0


def test_time_fn_times_every_repeat() -> None:
    x = torch.randn(256, 256)
    times = time_fn(lambda: x @ x, torch.device("cpu"), repeats=4, warmup=1)
    assert len(times) == 4 and all(t > 0 for t in times)


def test_profiles(monkeypatch) -> None:
    monkeypatch.setenv("LABKIT_SMOKE", "1")
    assert smoke_mode() and pick_profile("cpu").smoke
    monkeypatch.setenv("LABKIT_SMOKE", "0")
    monkeypatch.setenv("CI", "true")
    assert not smoke_mode()
    cpu = pick_profile("cpu", smoke=False)
    assert cpu.device == "cpu" and cpu.dtype == "float32" and not cpu.smoke


def test_human_bytes() -> None:
    from labkit.measure.units import human_bytes

    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(3 * 1024**3) == "3.00 GiB"
