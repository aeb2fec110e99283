"""Utilisation readings: the CPU's busy time (exact with fake clocks, sane with real ones) and NVML, mocked."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import pytest
import torch

from labkit.measure.utilisation import CpuBusyMeter, NvmlBusySampler, busy_meter, measure_busy


class FakeClock:
    def __init__(self, *values: float) -> None:
        self.values = iter(values)

    def __call__(self) -> float:
        return next(self.values)


def test_cpu_busy_is_cpu_time_over_wall_time_and_threads() -> None:
    with CpuBusyMeter(num_threads=2, clock=FakeClock(10.0, 12.0), cpu_clock=FakeClock(5.0, 8.0)) as meter:
        pass
    assert meter.reading.wall_s == 2.0
    assert meter.reading.busy_fraction == pytest.approx(3.0 / (2.0 * 2))
    assert "2 thread" in meter.reading.source
    # more CPU time than wall x threads (another thread of ours) is capped at 100 %
    with CpuBusyMeter(num_threads=1, clock=FakeClock(0.0, 1.0), cpu_clock=FakeClock(0.0, 1.5)) as meter:
        pass
    assert meter.reading.busy_fraction == 1.0


def test_cpu_busy_on_real_clocks() -> None:
    with CpuBusyMeter(num_threads=1) as meter:
        total = sum(i * i for i in range(300_000))  # pure Python: one thread kept busy
    assert total > 0
    assert 0.0 < meter.reading.busy_fraction <= 1.0
    with CpuBusyMeter(num_threads=1) as idle:
        threading.Event().wait(0.05)  # blocked: no CPU time
    assert idle.reading.busy_fraction < meter.reading.busy_fraction
    with pytest.raises(RuntimeError, match="context manager"):
        _ = CpuBusyMeter().reading


@dataclass
class _Rates:
    gpu: int
    memory: int = 0


class FakeNvml:
    """pynvml's functions the sampler uses, returning utilisation values from a script."""

    def __init__(self, values: list[int]) -> None:
        self.values = itertools.cycle(values)
        self.returned: list[int] = []
        self.calls: list[str] = []
        self.initialised = False

    def nvmlInit(self) -> None:
        self.calls.append("init")
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")
        self.initialised = False

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.calls.append(f"handle {index}")
        return f"gpu{index}"

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> _Rates:
        assert self.initialised and handle.startswith("gpu")
        value = next(self.values)
        self.returned.append(value)
        return _Rates(value)


def test_nvml_sampler_averages_the_drivers_readings() -> None:
    nvml = FakeNvml([100, 100, 40, 0])
    with NvmlBusySampler(device_index=1, interval_s=0.001, nvml=nvml) as sampler:
        threading.Event().wait(0.02)
    reading = sampler.reading
    assert nvml.calls[:2] == ["init", "handle 1"] and nvml.calls[-1] == "shutdown" and not nvml.initialised
    assert reading.num_samples == len(nvml.returned) >= 2  # one at each end at least
    assert reading.busy_fraction == pytest.approx(sum(nvml.returned) / len(nvml.returned) / 100)
    assert reading.source == "NVML utilization.gpu"


def test_nvml_busy_but_constant() -> None:
    nvml = FakeNvml([97])
    with NvmlBusySampler(interval_s=0.001, nvml=nvml) as sampler:
        pass
    assert sampler.reading.busy_fraction == pytest.approx(0.97)
    assert "97% busy" in str(sampler.reading)


def test_nvml_failure_shuts_down_and_names_the_problem() -> None:
    class NoDevice(FakeNvml):
        def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
            raise RuntimeError(f"NVML: no device {index}")

    nvml = NoDevice([0])
    with pytest.raises(RuntimeError, match="no device 3"):
        with NvmlBusySampler(device_index=3, nvml=nvml):
            pass
    assert nvml.calls == ["init", "shutdown"]
    with pytest.raises(ValueError, match="interval_s"):
        NvmlBusySampler(interval_s=0, nvml=nvml)


def test_busy_meter_picks_nvml_on_cuda_and_cpu_time_elsewhere() -> None:
    assert isinstance(busy_meter("cpu"), CpuBusyMeter)
    meter = busy_meter(torch.device("cuda", 2), nvml=FakeNvml([50]))
    assert isinstance(meter, NvmlBusySampler) and meter.device_index == 2
    result, reading = measure_busy(lambda: 41 + 1, "cpu")
    assert result == 42 and reading.source.startswith("process CPU time")


def test_missing_bindings_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    with pytest.raises(ImportError, match="nvidia-ml-py"):
        NvmlBusySampler(0)
