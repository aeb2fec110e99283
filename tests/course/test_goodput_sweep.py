"""Notebook 09's sweep in rounds: SLOs from the median of the baseline rounds, and the goodput verdict's three outcomes,
its reasons, and the plot with every SLO set (E2EL included) and a labelled capacity line."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit.course.ch09_serving_and_metrics.goodput_sweep import baseline_slos, goodput_verdict, plot_sweep  # noqa: E402
from labkit.measure import (
    LoadReport,  # noqa: E402
    audit,  # noqa: E402
)
from labkit.measure.loadgen import BenchResult  # noqa: E402
from labkit.measure.loadgen.metrics import RequestRecord, calculate_metrics  # noqa: E402


def result(ttfts: list[float], duration: float, tpot: float = 0.01, tokens: int = 5) -> BenchResult:
    """A run whose requests have these TTFTs (s), each then ``tokens - 1`` gaps of ``tpot``."""
    records = [RequestRecord(success=True, prompt_len=8, output_tokens=tokens, ttft=t, itl=[tpot] * (tokens - 1),
                             latency=t + tpot * (tokens - 1)) for t in ttfts]
    return BenchResult(config={"request_rate": 1.0}, records=records, duration=duration,
                       metrics=calculate_metrics(records, duration))


SLOS = {"ttft": 100.0}  # ms
FACTORS = [0.25, 0.5, 1.0, 2.0]


def sweep(good_at_last: list[int], low_misses: int = 0) -> dict[float, list[BenchResult]]:
    """Four rates x two rounds of 10 requests in 1 s; below the knee every request meets the TTFT SLO except
    ``low_misses`` in round 2 of the lowest rate; at the highest rate ``good_at_last[k]`` do in round k."""
    fast, slow = 0.05, 0.5
    runs = {1.0: [result([fast] * 10, 1.0), result([fast] * (10 - low_misses) + [slow] * low_misses, 1.0)],
            2.0: [result([fast] * 10, 1.0)] * 2,
            4.0: [result([fast] * 8 + [slow] * 2, 1.0)] * 2}
    runs[8.0] = [result([fast] * g + [slow] * (10 - g), 1.0) for g in good_at_last]
    return runs


def test_slos_are_the_median_of_the_baseline_rounds_not_one_run() -> None:
    rounds = [result([0.01] * 5, 1.0, tpot=0.002), result([0.5] * 5, 1.0, tpot=0.2),
              result([0.012] * 5, 1.0, tpot=0.003)]
    slos = baseline_slos(rounds)
    assert slos == {"ttft": 48.0, "tpot": 6.0}  # 4 x 12 ms and 2 x 3 ms: the noisy round sets nothing
    with pytest.raises(ValueError, match="at least one run"):
        baseline_slos([])


def test_holds_when_goodput_equals_throughput_below_and_falls_past_the_knee() -> None:
    v = goodput_verdict(FACTORS, sweep([3, 4]), SLOS)
    assert v.outcome == "holds" and v.text.startswith("[holds]")
    assert "Likely reason" not in v.text
    assert "3.00, 4.00 per round" in v.text and "10.00, 10.00 at 1.00 req/s" in v.text  # the best median
    assert "at least 90% of the requests meet the SLOs: 100%-100% did" in v.text
    assert audit(v.text) == []  # both parts' marks agree with their printed rounds, and the summary with both


def test_a_noisy_low_rate_run_is_named_with_its_reason() -> None:
    load = LoadReport(cpu_count=2, others_cores=1.0, load_avg_1m=2.0, sample_s=0.5)
    v = goodput_verdict(FACTORS, sweep([3, 4], low_misses=3), SLOS, load=load)
    # one round below the bar, the other above it: the rounds disagree
    assert v.outcome == "too close to call" and v.text.startswith("[too close to call]")
    assert "at 1.00 req/s (round 2) only 70% of the requests met the SLOs" in v.text
    assert "noisy neighbour" in v.text and "under load" in v.text
    assert audit(v.text) == []


def test_goodput_that_does_not_fall_is_too_close_or_contradicted() -> None:
    close = goodput_verdict(FACTORS, sweep([3, 10]), SLOS)  # one round fell, the other did not
    assert close.outcome == "too close to call" and "few requests per run" in close.text
    # above the best lower rate in every round, and closely enough for the 5% t-test with two rounds
    rising = goodput_verdict(FACTORS, sweep([13, 13]), SLOS)
    assert rising.outcome == "contradicted"
    assert audit(close.text) == [] and audit(rising.text) == []
    assert audit(rising.text.replace("[does NOT hold here]", "[holds]", 1)) != []  # a summary its parts contradict


def test_the_goodput_function_given_is_the_one_used() -> None:
    def nobody_is_good(records, slos_ms, duration):  # noqa: ANN001, ANN202
        return 0.0

    v = goodput_verdict(FACTORS, sweep([3, 4]), SLOS, goodput_of=nobody_is_good)
    assert v.outcome == "contradicted" and "only 0% of the requests" in v.text


def test_bad_arguments_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="one factor per rate"):
        goodput_verdict([0.5], sweep([3, 4]), SLOS)


def test_plot_draws_every_slo_set_and_labels_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plt, "show", lambda: None)
    plot_sweep(sweep([3, 4]), {"ttft": 100.0, "tpot": 20.0, "e2el": 300.0}, capacity=4.0)
    fig = plt.gcf()
    ttft_ax, tpot_ax, e2el_ax, rate_ax = fig.axes[:4]
    labels = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in (ttft_ax, tpot_ax, e2el_ax, rate_ax)]
    assert "SLO 100 ms" in labels[0] and "SLO 20 ms" in labels[1] and "SLO 300 ms" in labels[2]
    assert all("capacity 4.00 req/s" in ls for ls in labels)
    plt.close(fig)
    plot_sweep(sweep([3, 4]), {"ttft": 100.0}, capacity=4.0)  # no E2EL SLO: none drawn
    assert not any(t.get_text().startswith("SLO") for t in plt.gcf().axes[2].get_legend().get_texts())
    plt.close("all")
