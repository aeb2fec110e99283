"""Notebook 07's Gantt chart: a one-step prefill among hundreds of steps stays visible, and nothing else moves."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from labkit.course.request_plots import GANTT_COLORS, MIN_VISIBLE_WIDTH, PREFILL, gantt_spans, plot_gantt  # noqa: E402
from labkit.measure.summary import GanttRow  # noqa: E402


def row(index: int, scheduled: int, first_token: int, finish: int, release: int | None = None) -> GanttRow:
    release = finish if release is None else release
    return GanttRow(index=index, num_prompt_tokens=8, num_output_tokens=finish - first_token + 1, arrival=0.0,
                    first_scheduled=scheduled * 0.01, first_token=(first_token + 1) * 0.01,
                    finish=(finish + 1) * 0.01, slot_release=(release + 1) * 0.01, arrival_step=0,
                    first_scheduled_step=scheduled, first_token_step=first_token, finish_step=finish,
                    slot_release_step=release)


# one request prefilled in step 0 and decoding to step 499; one waiting until step 300, prefilled over 3 steps
ROWS = [row(0, 0, 0, 499), row(1, 300, 302, 399, release=499)]


def test_one_step_prefill_widened_to_the_visible_minimum() -> None:
    spans = gantt_spans(ROWS, "step")
    (y0, a0, w0), (y1, a1, w1) = spans[PREFILL]
    extent = 500  # the last edge: step 499 ends at 500
    assert (y0, a0) == (0, 0.0) and w0 == pytest.approx(MIN_VISIBLE_WIDTH * extent)  # 1 step -> 3 steps wide
    assert (y1, a1) == (1, 300.0) and w1 == pytest.approx(3.0)  # already wide enough: unchanged
    # the other phases keep their true extent
    assert spans["decode"] == [(0, 1.0, 499.0), (1, 303.0, 97.0)]
    assert spans["waiting (queued)"] == [(1, 0.0, 300.0)]
    assert spans["idle slot (finished, batch still running)"] == [(1, 400.0, 100.0)]


def test_min_visible_zero_draws_to_scale_and_time_axis_works() -> None:
    assert gantt_spans(ROWS, "step", min_visible=0.0)[PREFILL][0] == (0, 0.0, 1.0)
    ms = gantt_spans(ROWS, "time")
    assert ms[PREFILL][0][2] == pytest.approx(MIN_VISIBLE_WIDTH * 5000.0)  # 10 ms of 5000 ms -> 30 ms
    with pytest.raises(ValueError, match="unit must be"):
        gantt_spans(ROWS, "seconds")


def test_plot_draws_the_widened_prefill_on_top() -> None:
    ax = plot_gantt(ROWS)
    red = to_rgba(GANTT_COLORS[PREFILL])
    prefill = [c for c in ax.collections if tuple(c.get_facecolor()[0]) == red]
    others = [c for c in ax.collections if tuple(c.get_facecolor()[0]) != red]
    assert len(prefill) == 2 and min(c.get_zorder() for c in prefill) > max(c.get_zorder() for c in others)
    widths = sorted(c.get_paths()[0].get_extents().width for c in prefill)
    assert widths == pytest.approx([3.0, MIN_VISIBLE_WIDTH * 500])
    plt.close("all")
