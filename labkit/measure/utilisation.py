"""Utilisation as the usual tools report it: how *busy* the device was, which is not how much useful work it did.

* On a CUDA GPU, ``nvidia-smi``'s ``utilization.gpu`` (NVML's ``nvmlDeviceGetUtilizationRates(...).gpu``): the
  percentage of time, over the driver's last sample period, during which *at least one kernel* was running. One small
  kernel at a time, using a sliver of the chip, reads 100 %.
* On a CPU, a process's CPU time over wall time (``top``'s %CPU), here divided by the threads torch uses, so 100 %
  means every core torch may use was running this process. A Python loop that only prepares the next step reads as
  busy as a matrix multiply.

Neither says how close the work came to the hardware's limits: that is MBU and MFU (``labkit.measure.roofline``).
Notebook 04 puts the two side by side for the same runs: a device can be near 100 % busy while moving a small
fraction of the bytes it could (host-bound steps, the padding and finished slots of static batches).

NVML comes from the ``nvidia-ml-py`` package (``import pynvml``), imported only when a CUDA device is measured;
tests pass a stand-in module instead. Introduced in notebook 04 (``04_prefill_vs_decode``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch


@dataclass(frozen=True)
class BusyReading:
    """How busy a device was over one measured stretch of time. Notebook 04."""

    source: str  # what was read: "process CPU time" or "NVML utilization.gpu"
    wall_s: float
    busy_fraction: float  # 0..1
    num_samples: int = 0  # NVML readings averaged (0 for the CPU figure, which is exact)

    def __str__(self) -> str:
        return f"{self.busy_fraction:.0%} busy over {self.wall_s:.2f} s ({self.source})"


class CpuBusyMeter:
    """``with CpuBusyMeter() as m: ...`` then ``m.reading``: this process's CPU time over (wall time x threads).

    ``process_time`` counts every thread of the process (torch's intra-op threads too). ``num_threads``: the cores the
    work may use (default ``torch.get_num_threads()``); the clocks can be replaced in tests. Notebook 04.
    """

    source = "process CPU time"

    def __init__(self, num_threads: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.process_time) -> None:
        self.num_threads = num_threads or torch.get_num_threads()
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        self._clock, self._cpu_clock = clock, cpu_clock
        self._start: tuple[float, float] | None = None
        self._reading: BusyReading | None = None

    def __enter__(self) -> CpuBusyMeter:
        self._start = (self._clock(), self._cpu_clock())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self._start is not None, "__exit__ without __enter__"
        wall = self._clock() - self._start[0]
        cpu = self._cpu_clock() - self._start[1]
        busy = min(1.0, cpu / (wall * self.num_threads)) if wall > 0 else 0.0
        self._reading = BusyReading(f"{self.source}, {self.num_threads} thread(s)", wall, busy)

    @property
    def reading(self) -> BusyReading:
        if self._reading is None:
            raise RuntimeError("no reading yet: use the meter as a context manager around the work")
        return self._reading


def import_nvml() -> Any:
    """The ``pynvml`` module of ``nvidia-ml-py``, or an ImportError saying what to install."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ImportError("reading GPU utilisation needs NVML's Python bindings: pip install nvidia-ml-py") from exc
    return pynvml


class NvmlBusySampler:
    """``with NvmlBusySampler(0) as s: ...`` then ``s.reading``: NVML's ``utilization.gpu``, averaged over samples
    taken every ``interval_s`` by a background thread (and once at each end). Notebook 04.

    The driver itself averages over a window of 1/6 s to 1 s depending on the card, so stretches shorter than that
    read partly what ran before them. ``nvml``: a module with pynvml's functions (tests pass a stand-in).
    """

    source = "NVML utilization.gpu"

    def __init__(self, device_index: int = 0, interval_s: float = 0.05, nvml: Any | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.device_index = device_index
        self.interval_s = interval_s
        self.nvml = nvml if nvml is not None else import_nvml()
        self._clock = clock
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handle: Any = None
        self._reading: BusyReading | None = None
        self._start = 0.0

    def _sample(self) -> None:
        self.samples.append(float(self.nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> NvmlBusySampler:
        self.nvml.nvmlInit()
        try:
            self._handle = self.nvml.nvmlDeviceGetHandleByIndex(self.device_index)
            self._sample()
        except BaseException:
            self.nvml.nvmlShutdown()
            raise
        self._start = self._clock()
        self._thread = threading.Thread(target=self._run, name="labkit-nvml", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        wall = self._clock() - self._start
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self._sample()
        finally:
            self.nvml.nvmlShutdown()
        busy = sum(self.samples) / len(self.samples) / 100.0
        self._reading = BusyReading(self.source, wall, min(1.0, busy), len(self.samples))

    @property
    def reading(self) -> BusyReading:
        if self._reading is None:
            raise RuntimeError("no reading yet: use the sampler as a context manager around the work")
        return self._reading


def busy_meter(device: str | torch.device, nvml: Any | None = None) -> CpuBusyMeter | NvmlBusySampler:
    """The utilisation figure people watch for ``device``: NVML's on CUDA, the process's CPU time elsewhere (MPS has
    no public counter, so it reads the host process as well). Notebook 04."""
    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else (torch.cuda.current_device() if nvml is None else 0)
        return NvmlBusySampler(index, nvml=nvml)
    return CpuBusyMeter()


def measure_busy(fn: Callable[[], Any], device: str | torch.device, nvml: Any | None = None
                 ) -> tuple[Any, BusyReading]:
    """Run ``fn()`` under ``busy_meter(device)``; its result and the reading. Notebook 04."""
    meter = busy_meter(device, nvml)
    with meter:
        result = fn()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)  # the reading ends when the device's work does
    return result, meter.reading
