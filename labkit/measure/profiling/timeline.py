"""Draw one or two engine steps from a trace: the host's stages above, the device's work below, gaps marked.

Reading it: the top row is what the host (Python) was doing, stage by stage (``labkit::schedule``,
``prepare``, ``forward``, ``sample``, ``detokenize``, and ``stream`` between steps). The bottom row is
device work (CUDA kernels; on a CPU, the aten operators of the forward pass, see
``labkit.measure.profiling.trace_analysis``). Red shading on the device row marks the device idle *inside* the
forward (the host between two kernels); grey shading marks it idle while the host runs the other stages
of a step, and hatching marks it idle between steps.

Introduced in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch

from labkit.measure.colors import STAGE_COLORS
from labkit.measure.profiling.trace_analysis import TraceAnalysis, busy_time

COLORS = {**STAGE_COLORS, "stream": "#e377c2"}
GAP_COLORS = {"between kernels": "#d62728", "host stages": "#bbbbbb", "between steps": "#555555"}


def _gaps(busy: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """Idle stretches of [start, end] around the sorted, disjoint ``busy`` intervals."""
    gaps, t = [], start
    for a, b in busy:
        if a > t:
            gaps.append((t, min(a, end)))
        t = max(t, b)
    if t < end:
        gaps.append((t, end))
    return gaps


def plot_step_timeline(analysis: TraceAnalysis, steps: Sequence[int] | None = None, ax: Axes | None = None,
                       title: str | None = None) -> Axes:
    """Timeline of consecutive ``steps`` (indices into ``analysis.steps``; default the last two)."""
    if not analysis.steps:
        raise ValueError("the analysis has no steps to draw")
    n = len(analysis.steps)
    steps = list(steps) if steps is not None else list(range(max(0, n - 2), n))
    if not steps or any(not 0 <= i < n for i in steps):
        raise ValueError(f"steps must be indices in [0, {n}), got {steps}")
    chosen = [analysis.steps[i] for i in sorted(steps)]
    t0, t1 = chosen[0].start, chosen[-1].end
    ms = lambda t: (t - t0) / 1e3  # noqa: E731  (µs on the trace clock -> ms from the first step's start)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 2.8), layout="constrained")

    host_y, dev_y, h = 1.0, 0.0, 0.7
    for name, a, b in analysis.stage_ranges:
        if b > t0 and a < t1:
            ax.broken_barh([(ms(a), (b - a) / 1e3)], (host_y - h / 2, h), color=COLORS.get(name, "#17becf"))
    busy = [(max(a, t0), min(b, t1)) for a, b in analysis.device_intervals if b > t0 and a < t1]
    ax.broken_barh([(ms(a), (b - a) / 1e3) for a, b in busy], (dev_y - h / 2, h), color="black")

    for k, step in enumerate(chosen):  # idle stretches of each step, and between it and the next
        inside = [(a, b) for a, b in busy if a < step.end and b > step.start]
        first = inside[0][0] if inside else step.end
        last = inside[-1][1] if inside else step.end
        for a, b in _gaps(inside, step.start, step.end):
            kind = "between kernels" if first <= a and b <= last else "host stages"
            ax.axvspan(ms(a), ms(b), ymin=0.05, ymax=0.45, color=GAP_COLORS[kind], alpha=0.35, lw=0)
        if k + 1 < len(chosen):
            ax.axvspan(ms(step.end), ms(chosen[k + 1].start), color=GAP_COLORS["between steps"], alpha=0.25,
                       hatch="//", lw=0)
        ax.axvline(ms(step.start), color="black", lw=0.6, ls=":")
        ax.text(ms(step.start), host_y + h / 2 + 0.08, f" step {step.index}", fontsize=8, va="bottom")

    idle = 1.0 - busy_time(analysis.device_intervals, t0, t1) / (t1 - t0)
    ax.set_yticks([dev_y, host_y], ["device work", "host stages"])
    ax.set_ylim(-0.6, 1.75)
    ax.set_xlim(0, ms(t1))
    ax.set_xlabel("ms from the first step's start")
    ax.set_title(title or f"{len(chosen)} step(s): device idle {idle:.0%} of the time ({analysis.device_work})",
                 fontsize=10)
    handles = [Patch(color=COLORS[s], label=s) for s in ("schedule", "prepare", "forward", "sample", "detokenize",
                                                          "stream")]
    handles += [Patch(color="black", label="device busy")]
    handles += [Patch(color=c, alpha=0.4, label=f"idle: {k}") for k, c in GAP_COLORS.items()]
    ax.legend(handles=handles, fontsize=7, ncols=5, loc="upper center", bbox_to_anchor=(0.5, -0.28), frameon=False)
    return ax
