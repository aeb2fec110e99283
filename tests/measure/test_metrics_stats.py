"""The one statistics type (``labkit.measure.stats.Percentiles``) and the one definition of each latency.

``Percentiles`` is checked against numpy on known inputs, for its empty rule and its millisecond view; TPOT
(and ITL, E2E) is checked to be the same number wherever it is reported: the engine's request metrics, the run
summaries, the load generator (its records, statistics, JSON file and report) and the Prometheus exporter.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from labkit.core.metrics import RequestMetrics, compute_latencies, inter_token_latencies, time_per_output_token
from labkit.core.outputs import CompletionOutput, RequestOutput
from labkit.measure.loadgen import BenchResult
from labkit.measure.loadgen.metrics import RequestRecord, calculate_metrics
from labkit.measure.stats import Percentiles
from labkit.measure.summary import summarize
from labkit.serving.prometheus import ServerMetrics

# ---- Percentiles ----

SAMPLES = [
    [0.25],
    [1.0, 1.5, 3.0],
    [0.004, 0.001, 0.009, 0.002, 0.010, 0.003],  # unsorted on purpose
    list(np.random.default_rng(0).lognormal(-3.0, 1.0, size=257)),  # a latency-like heavy tail
]


@pytest.mark.parametrize("values", SAMPLES, ids=lambda v: f"{len(v)} values")
def test_percentiles_match_numpy(values: list[float]) -> None:
    p = Percentiles.of(values)
    a = np.asarray(values)
    assert p.count == len(values)
    assert p.mean == pytest.approx(np.mean(a), rel=1e-12) and p.std == pytest.approx(np.std(a), rel=1e-12)
    assert p.median == pytest.approx(np.percentile(a, 50), rel=1e-12)
    assert p.p90 == pytest.approx(np.percentile(a, 90), rel=1e-12)
    assert p.p99 == pytest.approx(np.percentile(a, 99), rel=1e-12)
    assert Percentiles.of(tuple(values)) == Percentiles.of(a) == p  # any sequence, the same numbers


def test_percentiles_by_hand() -> None:
    # [1, 2, 3, 4]: linear interpolation puts p90 at rank 2.7 of 0..3 (3.7) and p99 at rank 2.97 (3.97);
    # the population std (ddof 0, vLLM's) is sqrt(1.25), not the sample std sqrt(5/3)
    p = Percentiles.of([4.0, 1.0, 3.0, 2.0])
    assert (p.mean, p.median, p.count) == (2.5, 2.5, 4)
    assert p.p90 == pytest.approx(3.7) and p.p99 == pytest.approx(3.97) and p.std == pytest.approx(1.25 ** 0.5)
    assert p.median <= p.p90 <= p.p99


def test_empty_is_zero_with_count_zero() -> None:
    empty = Percentiles.of([])
    assert dataclasses.astuple(empty) == (0.0, 0.0, 0.0, 0.0, 0.0, 0)
    assert empty == Percentiles.of(np.array([]))  # equal, as NaN statistics would never be
    assert empty.ms() == dict.fromkeys(("mean", "median", "std", "p90", "p99"), 0.0)
    assert Percentiles.of([0.0, 0.0]).count == 2  # all zero is not empty: count tells them apart


def test_ms_converts_every_statistic_and_nothing_else() -> None:
    p = Percentiles.of([0.010, 0.020, 0.060])
    ms = p.ms()
    assert list(ms) == ["mean", "median", "std", "p90", "p99"]  # no count: it has no unit
    for name, value in ms.items():
        assert value == pytest.approx(getattr(p, name) * 1000.0)
    assert ms["median"] == pytest.approx(20.0) and ms["mean"] == pytest.approx(30.0)
    assert p.median == pytest.approx(0.020)  # the type itself stays in seconds


def test_percentiles_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Percentiles.of([1.0]).mean = 2.0  # type: ignore[misc]


# ---- one definition of TPOT, ITL and E2E ----

def test_time_per_output_token_by_hand() -> None:
    assert time_per_output_token(ttft=0.2, e2e=0.5, num_output_tokens=4) == pytest.approx(0.1)
    assert time_per_output_token(0.3, 0.3, 1) == 0.0  # one token: no pace to measure (vLLM counts 0)
    assert time_per_output_token(0.0, 0.0, 0) == 0.0  # a failed request has no tokens
    assert time_per_output_token(0.2, 0.2, 4) == 0.0  # four tokens in one chunk: no time between them
    assert inter_token_latencies([1.0, 1.5, 2.25]) == [0.5, 0.75] and inter_token_latencies([1.0]) == []


def test_request_metrics_use_the_definitions() -> None:
    m = RequestMetrics(arrival_time=10.0, token_times=[10.5, 10.75, 11.25, 11.5])
    lat = compute_latencies(m.arrival_time, m.token_times)
    assert lat.tpot == m.tpot == time_per_output_token(0.5, 1.5, 4) == pytest.approx(1 / 3)
    assert lat.itl == m.itl == inter_token_latencies(m.token_times) == [0.25, 0.5, 0.25]
    assert (lat.ttft, lat.e2e) == (0.5, 1.5)


def test_record_tpot_is_the_request_definition() -> None:
    for ttft, latency, n in ((0.1, 0.2, 3), (0.3, 0.3, 1), (0.2, 0.2, 4), (0.05, 1.05, 11)):
        record = RequestRecord(success=True, output_tokens=n, ttft=ttft, latency=latency)
        assert record.tpot == time_per_output_token(ttft, latency, n)


# Three requests, as the engine timed them (seconds): arrival, then each token's time.
TIMELINES = [(0.0, [0.5, 0.6, 0.8, 1.0]), (0.2, [0.9, 1.3]), (0.4, [1.1]), (0.3, [0.7, 0.9, 1.4, 1.5, 2.6])]


def engine_output(arrival: float, token_times: list[float]) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=arrival, first_scheduled_time=arrival, token_times=list(token_times),
                             finished_time=token_times[-1])
    completion = CompletionOutput(index=0, text="", token_ids=list(range(len(token_times))), finish_reason="length")
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], outputs=[completion], finished=True,
                         metrics=metrics)


def client_record(arrival: float, token_times: list[float]) -> RequestRecord:
    """What the load generator records for the same request: one chunk per token, sent at ``arrival``."""
    lat = compute_latencies(arrival, token_times)
    return RequestRecord(success=True, prompt_len=2, output_tokens=len(token_times), ttft=lat.ttft, itl=lat.itl,
                         latency=lat.e2e, start_time=arrival)


def test_summaries_and_load_generator_report_the_same_statistics() -> None:
    summary = summarize([engine_output(a, t) for a, t in TIMELINES])
    bench = calculate_metrics([client_record(a, t) for a, t in TIMELINES], duration=summary.duration)
    # TPOT by hand: (1.0 - 0.5) / 3, (1.1 - 0.7) / 1, none for the single token, (2.3 - 0.4) / 4
    expected_tpot = Percentiles.of([0.5 / 3, 0.4, 1.9 / 4])
    assert summary.tpot.count == bench.tpot.count == 3
    for name in ("mean", "median", "std", "p90", "p99"):
        assert getattr(summary.tpot, name) == pytest.approx(getattr(expected_tpot, name), rel=1e-12), name
    assert summary.tpot == bench.tpot  # the very same numbers, not merely close
    assert (summary.ttft, summary.itl, summary.e2e) == (bench.ttft, bench.itl, bench.e2el)
    assert summary.output_throughput == pytest.approx(bench.output_throughput)


def test_the_load_generator_writes_and_shows_milliseconds() -> None:
    records = [client_record(a, t) for a, t in TIMELINES]
    metrics = calculate_metrics(records, duration=2.0)
    data = metrics.to_dict()
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat, ms in getattr(metrics, name).ms().items():
            assert data[f"{stat}_{name}_ms"] == ms  # vLLM's keys, in ms
    assert data["mean_tpot_ms"] == pytest.approx(1000 * (0.5 / 3 + 0.4 + 1.9 / 4) / 3)
    report = BenchResult(config={}, records=records, duration=2.0, metrics=metrics).report()
    line = next(r for r in report.splitlines() if r.startswith("Median TTFT (ms):"))
    assert float(line.split()[-1]) == pytest.approx(metrics.ttft.median * 1000, abs=0.005)


def test_prometheus_observes_the_same_ttft_and_gaps() -> None:
    arrival, times = TIMELINES[3]
    exporter = ServerMetrics("m")
    seen = 0
    for num_new in (1, 0, 2, 2):  # tokens arrive a few at a time, sometimes none in a step
        seen += num_new
        exporter.observe_tokens(arrival, times[:seen], num_new)

    def sample(name: str) -> float | None:
        return exporter.registry.get_sample_value(f"labkit:{name}", {"model_name": "m"})

    lat = compute_latencies(arrival, times)
    assert sample("time_to_first_token_seconds_count") == 1
    assert sample("time_to_first_token_seconds_sum") == pytest.approx(lat.ttft)
    assert sample("inter_token_latency_seconds_count") == len(lat.itl) == 4
    assert sample("inter_token_latency_seconds_sum") == pytest.approx(sum(lat.itl))
    assert sample("generation_tokens_total") == len(times)
