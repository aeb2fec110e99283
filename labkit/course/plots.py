"""The workbook's shared plots: the roofline, batch slots and tokens; the colours every plot uses
(``labkit.measure.colors``).

Introduced in notebook 00 (``00_setup_and_hardware``: ``plot_roofline``; one request's plots of notebook 01 and
notebook 07's Gantt chart are in ``request_plots``). Notebook 03 adds ``plot_kv_memory``, notebook 06
``plain_count_ticks``. Notebook 04 places measured engine steps on the roofline with
``plot_roofline(roof, points=...)``. Notebook 05 (``05_static_batching``) adds
``plot_slot_occupancy`` and ``plot_token_breakdown``, which notebook 07 reuses. Every function draws on
``ax`` (a new figure if None) and returns it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.axis import Axis
from matplotlib.colors import ListedColormap
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter, FixedLocator, FuncFormatter, NullFormatter

from labkit.measure.batching import SlotOccupancy, TokenCounts
from labkit.measure.hardware import DeviceRoof

RooflinePoint = tuple[str, float, float]  # (label, arithmetic intensity FLOP/byte, achieved FLOP/s)


def _eng(value: float, unit: str) -> str:
    """1.5e11, "FLOP/s" -> "150 GFLOP/s": SI prefixes keep CPU and GPU numbers readable alike."""
    return EngFormatter(unit=unit, places=1)(value)


def _intensity(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def plain_count_ticks(axis: Axis, values: Sequence[float] | None = None) -> None:
    """Label a log-scaled axis with plain counts (1, 2, 4, ..., 2,048) instead of powers (2⁰ ... 2¹¹), at ``values``
    when given (matplotlib's own ticks otherwise). Notebook 06 (``06_paged_attention``)."""
    if values is not None:
        axis.set_major_locator(FixedLocator(list(values)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def new_ax(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is None:
        _, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax


def plot_roofline(roof: DeviceRoof, points: Sequence[RooflinePoint] | None = None, ax: Axes | None = None) -> Axes:
    """Log-log roofline of ``roof``: attainable FLOP/s against arithmetic intensity (FLOP/byte).

    ``points``: optional (label, intensity, achieved FLOP/s) markers, e.g. measured engine steps (notebook 04).
    """
    ax = new_ax(ax, (8, 5))
    points = list(points or [])
    peak, bw, ridge = roof.matmul_flops, roof.memory_bandwidth, roof.ridge_point
    # Span two decades either side of the ridge point, widened to include every point.
    xs_wanted = [ridge / 100, ridge * 100] + [p[1] for p in points if p[1] > 0]
    x = np.logspace(np.log10(min(xs_wanted)) - 0.3, np.log10(max(xs_wanted)) + 0.3, 400)
    ax.loglog(x, np.minimum(peak, x * bw), color="black", lw=2.5,
              label="attainable = min(compute, intensity × bandwidth)")
    ax.loglog(x, x * bw, color="tab:blue", ls="--", lw=1,
              label=f"memory roof: {_eng(bw, 'B/s')} × intensity")
    ax.axhline(peak, color="tab:orange", ls="--", lw=1,
               label=f"compute roof: {_eng(peak, 'FLOP/s')} ({roof.dtype} matmul)")
    ax.scatter([ridge], [peak], s=60, color="black", zorder=5)
    ax.annotate(f"ridge point\n{_intensity(ridge)} FLOP/byte", (ridge, peak), xytext=(0, -42),
                textcoords="offset points", ha="center", va="top", fontsize=9,
                arrowprops={"arrowstyle": "->", "color": "gray"})
    ax.axvspan(x[0], ridge, color="tab:blue", alpha=0.06)
    ax.axvspan(ridge, x[-1], color="tab:orange", alpha=0.06)
    achieved = [p[2] for p in points if p[2] > 0]
    ymin = min([float(np.minimum(peak, x[0] * bw))] + achieved) / 2
    ymax = max([peak] + achieved) * 3
    ax.text(x[1], peak * 1.8, "bandwidth-bound", color="tab:blue", fontsize=9, va="center")
    ax.text(x[-2], peak * 1.8, "compute-bound", color="tab:orange", fontsize=9, va="center", ha="right")
    markers = "osD^vP*X"
    for i, (label, intensity, flops) in enumerate(points):
        ax.scatter([intensity], [flops], s=70, marker=markers[i % len(markers)], zorder=6,
                   label=f"{label}: {_intensity(intensity)} FLOP/byte, {_eng(flops, 'FLOP/s')}")
    ax.set_xlim(x[0], x[-1])
    ax.set_ylim(ymin, ymax)
    ax.yaxis.set_major_formatter(EngFormatter(unit="FLOP/s"))
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("attainable throughput (FLOP/s)")
    ax.set_title(f"Roofline of {roof.device_name} ({roof.device}, {roof.dtype}, {roof.num_threads} threads)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return ax


# ---- static batching (notebook 05; reused by 07) ----

# Slot states of an occupancy timeline, and their colours: blue is useful work, warm colours are waste.
SLOT_COLORS: dict[str, str] = {
    "empty": "#ffffff",
    "useful: prompt (prefill)": "#08519c",
    "useful: decode": "#6baed6",
    "padding": "#fd8d3c",
    "finished, still computed": "#d62728",
}
WASTE_COLORS: dict[str, str] = {"useful": "#3182bd", "padding": "#fd8d3c", "idle": "#d62728"}


def plot_slot_occupancy(occupancy: SlotOccupancy, ax: Axes | None = None, step_times: Sequence[float] | None = None,
                        title: str | None = None, sub_rows: int = 8) -> Axes:
    """Slot-occupancy timeline: x = engine step (or time), y = batch slot, colour = what the slot computed.

    A prefill cell is split vertically in proportion to its useful and padding positions; a decode
    cell is useful or finished-but-still-computed. ``step_times``: each step's duration in seconds, to
    draw steps as wide as they took (x in ms) instead of one unit each.
    """
    ax = new_ax(ax, (10, 3.5))
    names = list(SLOT_COLORS)
    code = {name: i for i, name in enumerate(names)}
    steps, slots, k = occupancy.num_steps, occupancy.num_slots, sub_rows
    grid = np.zeros((slots * k, steps), dtype=float)  # (slot sub-rows, steps): a category per sub-cell
    positions = occupancy.useful + occupancy.padding  # (steps, slots)
    frac = np.divide(occupancy.useful, positions, out=np.zeros(positions.shape), where=positions > 0)
    filled = np.rint(frac * k).astype(int)  # sub-rows drawn as useful, from the bottom of the slot
    filled[(occupancy.useful > 0) & (filled == 0)] = 1  # never hide useful work entirely
    for slot in range(slots):
        for j in range(k):
            row = slot * k + j
            useful_here = j < filled[:, slot]
            useful_code = np.where(occupancy.prefill, code["useful: prompt (prefill)"], code["useful: decode"])
            cell = np.full(steps, code["empty"])
            cell = np.where(positions[:, slot] > 0, np.where(useful_here, useful_code, code["padding"]), cell)
            cell = np.where(occupancy.idle[:, slot], code["finished, still computed"], cell)
            grid[row] = cell
    if step_times is None:
        x_edges = np.arange(steps + 1) - 0.5
        ax.set_xlabel("engine step (one forward pass each)")
    else:
        if len(step_times) != steps:
            raise ValueError(f"got {len(step_times)} step times for {steps} steps")
        x_edges = np.concatenate([[0.0], np.cumsum(step_times)]) * 1e3
        ax.set_xlabel("time since the first step started (ms)")
    y_edges = np.arange(slots * k + 1) / k - 0.5
    cmap = ListedColormap([SLOT_COLORS[n] for n in names])
    ax.pcolormesh(x_edges, y_edges, grid, cmap=cmap, vmin=-0.5, vmax=len(names) - 0.5, shading="flat")
    for start in occupancy.batch_starts[1:]:
        ax.axvline(x_edges[start], color="black", lw=0.8)
    for boundary in range(1, slots):
        ax.axhline(boundary - 0.5, color="white", lw=0.5)
    ax.set_ylabel("batch slot (row)")
    ax.set_yticks(range(slots) if slots <= 16 else np.linspace(0, slots - 1, 9).round().astype(int))
    ax.set_xlim(x_edges[0], x_edges[-1])
    ax.set_ylim(-0.5, slots - 0.5)
    totals = occupancy.totals()
    ax.set_title(title or f"Slot occupancy: {totals.useful_fraction:.0%} of {totals.computed:,} computed token "
                          f"positions useful ({len(occupancy.batch_starts)} static batches of up to {slots})")
    shown = [n for n in names if n != "empty" or (grid == code["empty"]).any()]
    handles = [Patch(facecolor=SLOT_COLORS[n], edgecolor="gray", label=n if n != "empty" else "empty slot")
               for n in shown]
    handles.append(Line2D([], [], color="black", lw=0.8, label="a new static batch starts"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return ax


def plot_token_breakdown(counts: Mapping[str, TokenCounts], ax: Axes | None = None, xlabel: str = "run",
                         title: str | None = None) -> Axes:
    """Stacked bars per run: useful, padding and idle (finished-slot) token positions computed."""
    ax = new_ax(ax, (8, 4))
    labels = list(counts)
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    parts = {"useful": "useful", "padding": "padding (prefill)", "idle": "finished slots, still computed"}
    for field_name, label in parts.items():
        values = np.array([getattr(c, field_name) for c in counts.values()], dtype=float)
        ax.bar(x, values, bottom=bottom, color=WASTE_COLORS[field_name], label=label)
        bottom += values
    for xi, c in zip(x, counts.values()):
        ax.annotate(f"{c.useful_fraction:.0%} useful", (xi, c.computed), xytext=(0, 3), textcoords="offset points",
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("token positions computed")
    ax.set_ylim(top=max(bottom.max(), 1) * 1.25)  # headroom for the labels and the legend
    ax.set_title(title or "Useful vs wasted token positions")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    return ax


def plot_kv_memory(weights: float, kv_cache: float, kv_cache_mha: float, title: str, ax: Axes | None = None) -> Axes:
    """Notebook 03's KV-memory calculator: the weights, the KV cache as built (GQA) and without GQA, in bytes.

    Robust for every input the widget allows: the axes, tick labels and x label are always drawn, in one unit chosen
    from the largest bar (B ... TiB), with room for each bar's label; a zero or sub-pixel bar still gets its label.
    """
    from labkit.measure.units import human_bytes

    ax = new_ax(ax, (9, 2.8))
    values = np.array([weights, kv_cache, kv_cache_mha], dtype=float)
    if not np.isfinite(values).all() or (values < 0).any():
        raise ValueError(f"byte counts must be finite and non-negative, got {values.tolist()}")
    largest = max(values.max(), 1.0)
    scale, unit = next((s, u) for s, u in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))
                       if largest >= s)
    names = ["weights", "KV cache (GQA, as built)", "KV cache without GQA"]
    y = np.arange(len(names))
    bars = ax.barh(y, values / scale, color=["tab:gray", "tab:blue", "tab:orange"])
    ax.bar_label(bars, [human_bytes(v) for v in values], padding=4)
    ax.set_yticks(y, names)
    ax.set_xlim(0, largest / scale * 1.35)  # room on the right for the largest bar's label
    ax.set_ylim(len(names) - 0.5, -0.5)  # first bar on top
    ax.set_xlabel(f"memory ({unit})")
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_axis_on()
    for spine in ax.spines.values():
        spine.set_visible(True)
    return ax
