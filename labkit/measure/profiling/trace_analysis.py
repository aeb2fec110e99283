"""Read a profiler trace without a web UI: where each step's time went, and when the device sat idle.

The input is the Chrome trace JSON that ``torch.profiler`` writes (``profile_engine`` in
``labkit.measure.profiling.profiler``): a list of events with a name, a category, a start ``ts`` and a
duration ``dur``, both in microseconds. Three kinds of event matter here:

* ``labkit::step`` ranges, one per engine step, and inside each the stage ranges ``labkit::schedule``,
  ``labkit::prepare``, ``labkit::forward``, ``labkit::sample``, ``labkit::detokenize`` (the engine's
  ``StageClock``; they tile the step). Between steps the profiler driver adds ``labkit::stream``
  (handing each request its new text) and, once, ``labkit::tokenize``.
* **Device work.** On CUDA: the GPU's kernels, memcpys and memsets (categories ``kernel``,
  ``gpu_memcpy``, ``gpu_memset``). On a CPU there is no separate device, so we *define* device work as
  the ``aten::`` operators that run inside the ``labkit::forward`` ranges: the model's arithmetic, which
  on a GPU would be kernels. Everything else (Python scheduling, input preparation, sampling and
  detokenisation bookkeeping, streaming, and the Python *between* the forward's operators) is **host
  overhead**: time in which the device has nothing to do.
* Device intervals overlap and nest (``aten::linear`` contains ``aten::addmm``), so busy time is the
  length of their *union*, never the sum of their durations.

The accounting adds up exactly, by construction: for each step, device busy + device idle = the step's
duration; over the whole run, from the first step's start to the last step's end,
``busy + idle_between_kernels + idle_step_edges + idle_between_steps = span``.

Introduced in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

STEP = "labkit::step"
STEP_STAGES = ("schedule", "prepare", "forward", "sample", "detokenize")  # inside every step, in order
DRIVER_STAGES = ("tokenize", "stream")  # outside the steps: the loop that drives the engine
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # what the GPU ran (kineto's categories)

Event = Mapping[str, Any]
Interval = tuple[float, float]  # (start, end) in microseconds


def interval_of(event: Event) -> Interval:
    """An event's (start, end) in microseconds."""
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals (overlapping or nested ones become one)."""
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def busy_time(intervals: Iterable[Interval], start: float, end: float) -> float:
    """Length of the union of ``intervals`` inside the window [start, end]."""
    total = 0.0
    for a, b in merge_intervals(intervals):
        total += max(0.0, min(b, end) - max(a, start))
    return total


def idle_fraction(events: Iterable[Event], start: float, end: float) -> float:
    """Share of the window [start, end] (µs) in which none of ``events`` (device work) was running.

    Events may overlap, nest, come in any order and stick out of the window; the answer is in [0, 1].
    Notebook 10's exercise.
    """
    if not end > start:
        raise ValueError(f"the window must have end > start, got start={start}, end={end}")
    return 1.0 - busy_time((interval_of(e) for e in events), start, end) / (end - start)


@dataclass
class StepBreakdown:
    """Where one engine step's time went, from the trace. Times in microseconds. Notebook 10."""

    index: int
    start: float
    end: float
    stages: dict[str, float]  # stage name -> time inside its labkit::<stage> range(s)
    device_busy: float  # union of device work inside the step
    idle_between_kernels: float  # device idle between the step's first and last piece of device work
    num_device_intervals: int  # separate stretches of device work in the step (after merging overlaps)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def untracked(self) -> float:
        """Step time outside every stage range (the few µs between one range's end and the next's start)."""
        return self.duration - sum(self.stages.values())

    @property
    def host_overhead(self) -> float:
        """Step time in which the device had nothing to do: the host was busy (or waiting) instead."""
        return self.duration - self.device_busy

    @property
    def idle_step_edges(self) -> float:
        """Device idle before the step's first device work and after its last (schedule, prepare, sample...)."""
        return self.host_overhead - self.idle_between_kernels

    @property
    def host_share(self) -> float:
        return self.host_overhead / self.duration if self.duration > 0 else 0.0


@dataclass
class TraceAnalysis:
    """Per-step breakdowns and the run's device idle time, from one trace. Times in µs. Notebook 10."""

    device_type: str  # "cuda" or "cpu"
    device_work: str  # in words: what counted as device work
    steps: list[StepBreakdown]
    stage_ranges: list[tuple[str, float, float]]  # (stage, start, end) of every labkit:: range except steps
    device_intervals: list[Interval]  # merged device work over the whole trace
    driver_stages: dict[str, float] = field(default_factory=dict)  # time in tokenize/stream (outside steps)

    @property
    def start(self) -> float:
        return self.steps[0].start if self.steps else 0.0

    @property
    def end(self) -> float:
        return self.steps[-1].end if self.steps else 0.0

    @property
    def span(self) -> float:
        """First step's start to last step's end."""
        return self.end - self.start

    @property
    def busy(self) -> float:
        """Device busy time within the span."""
        return busy_time(self.device_intervals, self.start, self.end)

    @property
    def idle_between_kernels(self) -> float:
        return sum(s.idle_between_kernels for s in self.steps)

    @property
    def idle_step_edges(self) -> float:
        return sum(s.idle_step_edges for s in self.steps)

    @property
    def idle_between_steps(self) -> float:
        """Device idle in the gaps between consecutive steps (the driver loop, streaming)."""
        in_steps = sum(s.device_busy for s in self.steps)
        return self.span - sum(s.duration for s in self.steps) - (self.busy - in_steps)

    @property
    def idle_fraction(self) -> float:
        """Share of the span in which the device was idle, in [0, 1]."""
        return 1.0 - self.busy / self.span if self.span > 0 else 0.0

    @property
    def host_overhead_per_step(self) -> float:
        """Mean host overhead (µs) per step: the device-idle time inside a step."""
        return sum(s.host_overhead for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def mean_step(self) -> float:
        return sum(s.duration for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def host_share(self) -> float:
        """Host overhead as a share of all step time."""
        total = sum(s.duration for s in self.steps)
        return sum(s.host_overhead for s in self.steps) / total if total > 0 else 0.0

    def stage_totals(self) -> dict[str, float]:
        """Stage -> total µs over all steps (plus the driver's stages between steps)."""
        totals = {name: sum(s.stages.get(name, 0.0) for s in self.steps) for name in STEP_STAGES}
        totals.update(self.driver_stages)
        return totals

    def idle_breakdown(self) -> dict[str, float]:
        """How the span splits: device busy and the three kinds of device idle (µs; they add up to the span)."""
        return {"device busy": self.busy, "idle between kernels": self.idle_between_kernels,
                "idle in host stages of a step": self.idle_step_edges,
                "idle between steps": self.idle_between_steps}


def _stage_name(name: str) -> str | None:
    if not name.startswith("labkit::") or name == STEP:
        return None
    return name.removeprefix("labkit::")


def device_events(events: Sequence[Event], device_type: str, device_stages: Sequence[str] = ("forward",)
                  ) -> list[Event]:
    """The events that count as device work (see the module docstring)."""
    if device_type == "cuda":
        return [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    windows = merge_intervals(interval_of(e) for e in events
                              if e.get("ph") == "X" and _stage_name(str(e.get("name", ""))) in device_stages)
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"
                  and str(e.get("name", "")).startswith("aten::")), key=lambda e: float(e["ts"]))
    inside, k = [], 0
    for op in ops:  # both sorted by start: one sweep
        start, end = interval_of(op)
        while k < len(windows) and windows[k][1] < start:
            k += 1
        if k < len(windows) and windows[k][0] <= start and end <= windows[k][1]:
            inside.append(op)
    return inside


def analyze_trace(events: Sequence[Event], device_type: str | None = None,
                  device_stages: Sequence[str] = ("forward",)) -> TraceAnalysis:
    """Per-step stage breakdown and device idle time of a trace's ``traceEvents``.

    ``device_type``: "cuda" or "cpu"; None guesses from the trace (any kernel event means CUDA).
    ``device_stages``: on a CPU, the stages whose aten operators count as device work.
    """
    if device_type is None:
        device_type = "cuda" if any(e.get("cat") in DEVICE_CATEGORIES for e in events) else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    ranges = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("labkit::")]
    steps = sorted(interval_of(e) for e in ranges if e["name"] == STEP)
    if not steps:
        raise ValueError("the trace has no labkit::step range; was an engine step run inside the profiler?")
    stage_ranges = sorted(((str(_stage_name(e["name"])), *interval_of(e)) for e in ranges if e["name"] != STEP),
                          key=lambda r: r[1])
    device = merge_intervals(interval_of(e) for e in device_events(events, device_type, device_stages))

    breakdowns: list[StepBreakdown] = []
    driver = {name: 0.0 for name in DRIVER_STAGES}
    k = d = 0
    for index, (start, end) in enumerate(steps):
        stages: dict[str, float] = {}
        while k < len(stage_ranges) and stage_ranges[k][1] < start:  # ranges before this step: the driver's
            name, a, b = stage_ranges[k]
            driver[name] = driver.get(name, 0.0) + b - a
            k += 1
        while k < len(stage_ranges) and stage_ranges[k][2] <= end + 1e-3:  # float µs: allow rounding
            name, a, b = stage_ranges[k]
            stages[name] = stages.get(name, 0.0) + b - a
            k += 1
        while d < len(device) and device[d][1] <= start:
            d += 1
        pieces = []  # this step's device work, clipped to the step
        j = d
        while j < len(device) and device[j][0] < end:
            pieces.append((max(device[j][0], start), min(device[j][1], end)))
            j += 1
        busy = sum(b - a for a, b in pieces)
        gaps = (pieces[-1][1] - pieces[0][0] - busy) if pieces else 0.0
        breakdowns.append(StepBreakdown(index, start, end, stages, busy, gaps, len(pieces)))
    for name, a, b in stage_ranges[k:]:
        driver[name] = driver.get(name, 0.0) + b - a
    return TraceAnalysis(
        device_type=device_type,
        device_work="CUDA kernels, memcpys and memsets" if device_type == "cuda"
        else f"aten operators inside labkit::{'/'.join(device_stages)}",
        steps=breakdowns, stage_ranges=stage_ranges, device_intervals=device, driver_stages=driver,
    )
