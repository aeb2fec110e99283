"""interleave: every contender once per round, the order rotated, warm-up untimed, metrics kept per round."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.measure import Rounds, default_rounds, interleave, plot_rounds  # noqa: E402


def test_rounds_rotate_the_order_and_exclude_warmup() -> None:
    calls: list[str] = []

    def contender(name: str, value: float):  # noqa: ANN202
        def run() -> dict[str, float]:
            calls.append(name)
            return {"tok/s": value + len(calls)}
        return run

    rounds = interleave({"a": contender("a", 100), "b": contender("b", 10), "c": contender("c", 1)}, num_rounds=3,
                        warmup=1, progress=False, check_load=False)
    assert calls == ["a", "b", "c",  # warm-up, untimed
                     "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert rounds.num_rounds == 3
    assert rounds.get("a", "tok/s") == [104, 109, 111]  # warm-up's value (101) not kept
    assert rounds.median("a", "tok/s") == 109
    assert rounds.spread("b", "tok/s") == (15, 22)
    assert len(rounds.get("c", "seconds")) == 3 and all(s >= 0 for s in rounds.get("c", "seconds"))
    assert rounds.ratios("a", "b", "tok/s") == pytest.approx([104 / 15, 109 / 17, 111 / 22])


def test_before_round_runs_before_each_round_but_not_before_the_warmup() -> None:
    calls: list[str] = []
    interleave({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, num_rounds=2, warmup=1,
               progress=False, check_load=False, before_round=lambda r: calls.append(f"round {r}"))
    assert calls == ["a", "b", "round 0", "a", "b", "round 1", "b", "a"]


def test_table_lists_every_round_and_the_median() -> None:
    r = Rounds()
    for a, b in [(3.0, 1.0), (5.0, 2.0), (4.0, 9.0)]:
        r.add("engine a", {"seconds": 1.0, "tok/s": a})
        r.add("engine b", {"seconds": 1.0, "tok/s": b})
    table = r.table("tok/s", unit="tok/s")
    assert "round 3" in table and "median" in table
    row_a = next(line for line in table.splitlines() if line.startswith("engine a"))
    assert row_a.split()[-4:] == ["3.0", "5.0", "4.0", "4.0"]


def test_clear_errors() -> None:
    r = Rounds()
    r.add("a", {"seconds": 1.0})
    with pytest.raises(KeyError, match="no contender 'b'; measured: a"):
        r.get("b", "seconds")
    with pytest.raises(KeyError, match="has no metric 'tok/s'; it has: seconds"):
        r.get("a", "tok/s")
    with pytest.raises(ValueError, match="num_rounds must be at least 1"):
        interleave({"a": lambda: None}, num_rounds=0, progress=False)
    with pytest.raises(ValueError, match="at least one contender"):
        interleave({}, num_rounds=1, progress=False)


def test_default_rounds() -> None:
    assert default_rounds(smoke=False) >= 3
    assert 1 <= default_rounds(smoke=True) < default_rounds(smoke=False)


def test_plot_shows_median_bars_with_the_rounds_range() -> None:
    r = Rounds()
    for a, b in [(3.0, 1.0), (5.0, 2.0), (4.0, 9.0)]:
        r.add("a", {"seconds": 1.0, "tok/s": a})
        r.add("b", {"seconds": 1.0, "tok/s": b})
    fig, ax = plt.subplots()
    plot_rounds(r, ax, "tok/s")
    heights = [p.get_height() for p in ax.patches]
    assert heights == [4.0, 2.0]
    dots = [line for line in ax.lines if line.get_marker() == "o"]
    assert sorted(y for line in dots for y in line.get_ydata()) == [1.0, 2.0, 3.0, 4.0, 5.0, 9.0]
    assert "median of 3 interleaved rounds" in ax.get_title(loc="right")
    plt.close(fig)
