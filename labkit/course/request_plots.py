"""Where requests' time goes: one request's per-token latencies, stage breakdown and timeline; many requests' Gantt.

Introduced in notebook 01 (``01_anatomy_of_a_request``); ``plot_gantt`` in notebook 07 (``07_continuous_batching``),
reused in 08. Every function draws on ``ax`` (a new figure if None) and returns it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.axes import Axes

from labkit.course.plots import new_ax
from labkit.measure.colors import PHASE_COLORS, STAGE_COLORS
from labkit.measure.profiling.request_trace import RequestTrace

if TYPE_CHECKING:
    from labkit.measure.summary import GanttRow


def plot_token_latencies(traces: RequestTrace | Mapping[str, RequestTrace], ax: Axes | None = None,
                         show_work: bool = True) -> Axes:
    """Step time (ms) of the step that produced each output token, prefill token marked.

    Several traces (a mapping label -> trace) draw one line each, e.g. two engines side by side.
    ``show_work`` adds each step's computed token positions on a second axis (one trace only).
    """
    ax = new_ax(ax, (8, 4))
    named = {"request": traces} if isinstance(traces, RequestTrace) else dict(traces)
    for label, trace in named.items():
        steps = [s for s in trace.steps if s.token_id is not None]
        ms = [s.duration * 1e3 for s in steps]
        idx = np.arange(len(ms))
        name = f"{label}: decode steps" if len(named) > 1 else "decode step"
        line = ax.plot(idx, ms, marker=".", lw=1, label=name)[0]
        first = [i for i, s in enumerate(steps) if s.phase == "prefill"]
        ax.scatter(first, [ms[i] for i in first], s=90, marker="*", zorder=5,
                   color=PHASE_COLORS["prefill"] if len(named) == 1 else line.get_color(),
                   label=f"{label}: prefill (first token)" if len(named) > 1 else "prefill (first token)")
    ax.set_xlabel("output token index")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("Time of the engine step that produced each token")
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if show_work and len(named) == 1:
        trace = next(iter(named.values()))
        steps = [s for s in trace.steps if s.token_id is not None]
        ax2 = ax.twinx()
        work = ax2.plot(np.arange(len(steps)), [s.num_computed_tokens for s in steps], color="gray", ls=":",
                        label="token positions computed (right axis)")
        ax2.set_ylabel("token positions computed per step")
        ax2.set_ylim(bottom=0)
        handles += work
        labels += [work[0].get_label()]
    ax.legend(handles, labels, loc="upper left", fontsize=8)
    return ax


def plot_stage_breakdown(trace: RequestTrace, ax: Axes | None = None) -> Axes:
    """Stacked bars: each stage's milliseconds, for tokenize and for every engine step."""
    ax = new_ax(ax, (9, 4))
    stages = [s for s in STAGE_COLORS if s != "tokenize"]
    stages += sorted({k for st in trace.steps for k in st.stage_times} - set(stages))  # any engine-specific stage
    x = np.arange(len(trace.steps) + 1)  # bar 0 is tokenize
    bottom = np.zeros(len(x))
    tok = np.zeros(len(x))
    tok[0] = trace.tokenize_time * 1e3
    ax.bar(x, tok, color=STAGE_COLORS["tokenize"], label="tokenize")
    for stage in stages:
        ms = np.array([0.0] + [st.stage_times.get(stage, 0.0) * 1e3 for st in trace.steps])
        ax.bar(x, ms, bottom=bottom, color=STAGE_COLORS.get(stage), label=stage)
        bottom += ms
    labels = ["tok"] + ["P" if st.phase == "prefill" else str(st.index) for st in trace.steps]
    every = max(1, len(labels) // 16)
    ax.set_xticks(x[::every], labels[::every])
    ax.set_xlabel("stage (tok = tokenize, P = prefill step, then decode step number)")
    ax.set_ylabel("time (ms)")
    ax.set_title("Where the time goes in each stage of one request")
    ax.set_ylim(top=max(bottom.max(), tok[0]) * 1.25)  # headroom for the legend
    ax.legend(fontsize=8, ncols=len(stages) + 1, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    return ax


def plot_request_timeline(trace: RequestTrace, stream_times: Sequence[float] | None = None,
                          ax: Axes | None = None) -> Axes:
    """One request on a time axis (ms since submission): stages as coloured spans, tokens as ticks.

    ``stream_times``: seconds since submission at which stream deltas arrived (optional third row).
    """
    ax = new_ax(ax, (10, 3))
    rows: list[tuple[str, float]] = [("engine", 2.0), ("tokens", 1.0)] + ([("stream", 0.0)] if stream_times else [])
    spans: dict[str, list[tuple[float, float]]] = {"tokenize": [(0.0, trace.tokenize_time * 1e3)]}
    for step in trace.steps:
        t = step.start
        for stage, seconds in step.stage_times.items():
            spans.setdefault(stage, []).append((t * 1e3, seconds * 1e3))
            t += seconds
    for stage, bars in spans.items():
        ax.broken_barh(bars, (1.7, 0.6), color=STAGE_COLORS.get(stage, "gray"), label=stage)
    m = trace.metrics
    if m is not None and m.token_times:
        tok_ms = [(t - trace.submit_time) * 1e3 for t in m.token_times]
        ax.vlines(tok_ms, 0.7, 1.3, color="black", lw=1)
        arrival = (m.arrival_time - trace.submit_time) * 1e3
        ax.axvline(arrival, color="gray", ls=":", lw=1)
        ax.annotate("", xy=(tok_ms[0], 2.6), xytext=(arrival, 2.6),
                    arrowprops={"arrowstyle": "<->", "color": PHASE_COLORS["prefill"]})
        ax.text(arrival, 2.7, f"TTFT {tok_ms[0] - arrival:.1f} ms", ha="left", va="bottom",
                color=PHASE_COLORS["prefill"], fontsize=9)
    if stream_times:
        ax.vlines([t * 1e3 for t in stream_times], -0.3, 0.3, color="tab:purple", lw=1)
    ax.set_yticks([y for _, y in rows], [name for name, _ in rows])
    ax.set_ylim(-0.6 if stream_times else 0.4, 3.2)
    ax.set_xlabel("time since the request was submitted (ms)")
    ax.set_title("One request on a timeline: stages (top), token timestamps (middle)"
                 + (", stream deltas (bottom)" if stream_times else ""))
    ax.legend(fontsize=8, ncols=len(spans), loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    return ax


# ---- notebook 07 (07_continuous_batching), reused in 08: many requests over time ----

GANTT_COLORS: dict[str, str] = {
    "waiting (queued)": "#d9d9d9",
    "prefill (until the first token)": PHASE_COLORS["prefill"],
    "decode": PHASE_COLORS["decode"],
    "idle slot (finished, batch still running)": "#fdae6b",
}
PREFILL = "prefill (until the first token)"
# A prefill often lasts one step of hundreds: drawn to scale it is a bar under a pixel wide. It is drawn at least
# this share of the x axis wide, over the start of its decode.
MIN_VISIBLE_WIDTH = 0.006


def gantt_spans(rows: Sequence[GanttRow], unit: str = "step", min_visible: float = MIN_VISIBLE_WIDTH
                ) -> dict[str, list[tuple[int, float, float]]]:
    """Each phase's bars as (row, start, width): the rows in the given order, in steps or ms since the first
    arrival. A prefill bar narrower than ``min_visible`` of the chart's extent is widened to it (never narrowed)."""
    if unit not in ("step", "time"):
        raise ValueError(f"unit must be 'step' or 'time', got {unit!r}")
    if unit == "step" and any(r.first_scheduled_step is None for r in rows):
        raise ValueError("these Gantt rows have no step indices; pass step_stats to gantt_rows or use unit='time'")
    spans: dict[str, list[tuple[int, float, float]]] = {name: [] for name in GANTT_COLORS}
    all_edges = []
    for y, r in enumerate(rows):
        if unit == "step":  # a step index covers [i, i + 1): a token produced in step i ends its bar at i + 1
            assert r.first_token_step is not None and r.finish_step is not None and r.slot_release_step is not None
            edges = [r.arrival_step, r.first_scheduled_step, r.first_token_step + 1, r.finish_step + 1,
                     r.slot_release_step + 1]
        else:
            edges = [t * 1e3 for t in (r.arrival, r.first_scheduled, r.first_token, r.finish, r.slot_release)]
        all_edges.append(edges)
        for name, (a, b) in zip(GANTT_COLORS, zip(edges, edges[1:])):
            if b > a:
                spans[name].append((y, float(a), float(b - a)))
    extent = max((max(e) for e in all_edges), default=0.0)
    floor = min_visible * extent
    spans[PREFILL] = [(y, a, max(w, floor)) for y, a, w in spans[PREFILL]]
    return spans


def plot_gantt(rows: Sequence[GanttRow], ax: Axes | None = None, unit: str = "step", title: str | None = None,
               max_rows: int = 64, min_visible: float = MIN_VISIBLE_WIDTH) -> Axes:
    """Gantt chart, one row per request (``labkit.measure.summary.gantt_rows``), first arrival at the top.

    Each row shows the request waiting in the queue, its prefill (first scheduled -> first token), its
    decode, and, under static batching, its slot held idle after it finished until its batch ended
    (hatched). ``unit``: "step" (engine steps; rows need step indices) or "time" (ms since the first
    arrival). At most ``max_rows`` requests are drawn (the first to arrive). A prefill is drawn at least
    ``min_visible`` of the x axis wide (over the start of its decode), so a one-step prefill stays visible.
    """
    shown = sorted(rows, key=lambda r: (r.arrival, r.index))[:max_rows]
    spans = gantt_spans(shown, unit, min_visible)  # bad input raises before a figure is made
    ax = new_ax(ax, (10, 0.5 + 0.22 * len(shown)))
    for name in GANTT_COLORS:  # the prefill after waiting, before the decode it may overlap: drawn on top
        hatch = "////" if name.startswith("idle") else None
        for k, (y, a, w) in enumerate(spans[name]):
            ax.broken_barh([(a, w)], (y - 0.4, 0.8), facecolors=GANTT_COLORS[name],
                           edgecolor="white" if hatch else None, hatch=hatch, lw=0,
                           zorder=3 if name == PREFILL else 2, label=name if k == 0 else None)
    ax.set_ylim(len(shown) - 0.5, -0.5)  # first arrival on top
    ax.set_yticks(range(len(shown)) if len(shown) <= 32 else range(0, len(shown), 4))
    ax.set_ylabel("request (by arrival)")
    ax.set_xlabel("engine step" if unit == "step" else "time since the first arrival (ms)")
    ax.set_xlim(left=0)
    ax.grid(True, axis="x", alpha=0.3)
    if title is not None:
        ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return ax
