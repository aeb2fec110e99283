"""Notebook 03's KV-memory calculator always draws a full chart (axes, bar names, unit), whatever the widget's inputs;
notebook 06's log axes read as plain counts, not powers of two."""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from labkit import PRESETS  # noqa: E402
from labkit.course.plots import plain_count_ticks, plot_kv_memory  # noqa: E402
from labkit.measure.roofline import kv_cache_bytes  # noqa: E402

NAMES = ["weights", "KV cache (GQA, as built)", "KV cache without GQA"]


def drawn(ax: plt.Axes) -> dict[str, object]:
    ax.figure.canvas.draw()
    return {"yticks": [t.get_text() for t in ax.get_yticklabels()],
            "xticks": [t.get_text() for t in ax.get_xticklabels() if t.get_text()],
            "xlabel": ax.get_xlabel(), "axis_on": ax.axison,
            "spines": all(s.get_visible() for s in ax.spines.values()),
            "bars": [p.get_width() for p in ax.patches], "labels": [t.get_text() for t in ax.texts],
            "xlim": ax.get_xlim()}


def calculator_inputs() -> list[tuple[str, int, int, int]]:
    """The widget's corners: every model, the shortest and longest context, batch 1 and 256, fp8 and float32."""
    return [(name, ctx, batch, nbytes) for name in PRESETS for ctx in (256, 131072) for batch in (1, 256)
            for nbytes in (1, 4)]


@pytest.mark.parametrize(("name", "context", "batch", "nbytes"), calculator_inputs())
def test_the_calculator_always_draws_axes_labels_and_three_bars(name: str, context: int, batch: int,
                                                                nbytes: int) -> None:
    config = PRESETS[name]
    mha = dataclasses.replace(config, num_key_value_heads=config.num_attention_heads)
    values = (config.num_params * nbytes, kv_cache_bytes(config, context * batch, nbytes),
              kv_cache_bytes(mha, context * batch, nbytes))
    fig, ax = plt.subplots()
    d = drawn(plot_kv_memory(*values, title=f"{name}", ax=ax))
    plt.close(fig)
    assert d["axis_on"] and d["spines"]
    assert d["yticks"] == NAMES
    assert d["xlabel"].startswith("memory (") and d["xticks"], d
    assert len(d["bars"]) == 3 and len(d["labels"]) == 3 and all(d["labels"])
    assert d["xlim"][0] == 0 and d["xlim"][1] > max(d["bars"])  # every bar, and room for its label


@pytest.mark.parametrize("values", [(0, 0, 0), (1, 0, 0), (5e12, 10, 10), (100, 100, 100)])
def test_the_calculator_survives_edge_values(values: tuple[float, float, float]) -> None:
    fig, ax = plt.subplots()
    d = drawn(plot_kv_memory(*values, title="edge", ax=ax))
    plt.close(fig)
    assert d["yticks"] == NAMES and d["xticks"] and d["xlabel"] and d["spines"]
    assert d["xlim"][1] > 0 and np.isfinite(d["xlim"][1])


def test_the_calculator_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="finite and non-negative"):
        plot_kv_memory(1.0, -1.0, 2.0, title="bad")
    plt.close("all")


def test_log_axes_read_as_plain_counts() -> None:
    fig, ax = plt.subplots()
    budgets = [2048 * k for k in (1, 2, 4, 8, 16, 32)]
    ax.plot(budgets, [1, 3, 9, 20, 70, 250])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    plain_count_ticks(ax.xaxis, budgets)
    plain_count_ticks(ax.yaxis)
    fig.canvas.draw()
    x = [t.get_text() for t in ax.get_xticklabels()]
    y = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    plt.close(fig)
    assert x == ["2,048", "4,096", "8,192", "16,384", "32,768", "65,536"]
    assert "1" in y and "256" in y and not any("^" in t or "$" in t for t in x + y), y
