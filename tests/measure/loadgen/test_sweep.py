"""The frontier sweep: settings, medians under SLOs from stored records, the Pareto front, the recommendation, and one
small live run through real (in-process) servers."""

from __future__ import annotations

import pytest

from labkit import LLM
from labkit.measure.loadgen.datasets import RandomDataset
from labkit.measure.loadgen.metrics import RequestRecord, calculate_metrics
from labkit.measure.loadgen.runner import BenchResult, ServeBenchConfig
from labkit.measure.loadgen.sweep import (
    BatchLimits,
    FrontierPoint,
    frontier_points,
    grid,
    pareto_front,
    recommend,
    run_frontier,
)
from labkit.serving import ServerThread


def result(ttfts: list[float], itl: float, tokens: int = 10, duration: float = 2.0) -> BenchResult:
    records = [RequestRecord(success=True, prompt_len=8, output_tokens=tokens, ttft=t, itl=[itl] * (tokens - 1),
                             latency=t + itl * (tokens - 1)) for t in ttfts]
    return BenchResult({}, records, duration, calculate_metrics(records, duration))


def point(seqs: int, tput: float, itl: float, goodput: float = 0.0) -> FrontierPoint:
    return FrontierPoint(BatchLimits(seqs, 64), tput, 10.0, itl, goodput, 1)


def test_grid_keeps_settings_that_can_give_every_sequence_a_token() -> None:
    assert grid([2, 8], [4, 16]) == [BatchLimits(2, 4), BatchLimits(2, 16), BatchLimits(8, 16)]
    with pytest.raises(ValueError, match="max_num_batched_tokens >= max_num_seqs"):
        grid([32], [8])
    with pytest.raises(ValueError, match="max_num_seqs"):
        BatchLimits(0, 8)
    assert BatchLimits(4, 32).server_options() == {"max_num_seqs": 4, "max_num_batched_tokens": 32}


def test_points_are_medians_and_goodput_follows_the_slos() -> None:
    fast, slow = BatchLimits(2, 16), BatchLimits(8, 64)
    results = {fast: [result([0.01, 0.02], 0.005), result([0.01, 0.03], 0.007), result([0.01], 0.006)],
               slow: [result([0.2, 0.3], 0.02)]}
    loose = {p.limits: p for p in frontier_points(results, {"ttft": 1000})}
    assert loose[fast].num_rounds == 3 and loose[fast].p99_itl_ms == pytest.approx(6.0)
    assert loose[slow].goodput == pytest.approx(2 / 2.0)  # both requests within 1 s, over 2 s
    strict = {p.limits: p for p in frontier_points(results, {"ttft": 100})}
    assert strict[slow].goodput == 0.0 and strict[fast].goodput > 0  # the same records, other SLOs


def test_pareto_front_and_recommendation() -> None:
    a, b, c, d = point(1, 100, 5), point(2, 200, 8), point(4, 150, 9), point(8, 300, 20)
    assert pareto_front([a, b, c, d]) == [a, b, d]  # c is beaten by b on both
    assert recommend([point(1, 100, 5, goodput=2), point(2, 300, 8, goodput=3), point(4, 400, 30, goodput=3)]
                     ).limits.max_num_seqs == 2  # equal goodput: the lower p99 ITL
    with pytest.raises(ValueError):
        recommend([])


class _ThreadServer:
    """ServerThread with the launch / wait_until_ready / stop shape of a ServerProcess."""

    def __init__(self, limits: BatchLimits) -> None:
        self.inner = ServerThread(LLM("labkit-tiny", engine="chunked", max_model_len=64, **limits.server_options()),
                                  served_model_name="labkit-tiny")
        self.base_url = ""

    def launch(self) -> None:
        self.base_url = self.inner.start().base_url

    def wait_until_ready(self) -> None:
        pass

    def stop(self) -> None:
        self.inner.stop()


def test_run_frontier_sends_the_same_load_to_every_setting() -> None:
    settings = [BatchLimits(1, 16), BatchLimits(4, 16)]
    seen: list[tuple[BatchLimits, int]] = []
    config = ServeBenchConfig(base_url="http://replaced", dataset=RandomDataset(input_len=8, output_len=4),
                              num_prompts=4, ignore_eos=True, disable_tqdm=True)
    results = run_frontier(settings, _ThreadServer, config, num_rounds=2, progress=lambda s, k: seen.append((s, k)))
    assert seen == [(settings[0], 0), (settings[1], 0), (settings[1], 1), (settings[0], 1)]  # rotating order
    for runs in results.values():
        assert len(runs) == 2 and all(r.metrics.completed == 4 and r.metrics.total_output == 16 for r in runs)
    points = frontier_points(results, {"ttft": 60_000})
    assert all(p.goodput > 0 for p in points) and recommend(points) in points
    with pytest.raises(ValueError, match="num_rounds"):
        run_frontier(settings, _ThreadServer, config, num_rounds=0)
