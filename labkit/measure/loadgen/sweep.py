"""The latency-throughput frontier: the same load against servers with different batch limits.

``max_num_seqs`` (sequences per step) and ``max_num_batched_tokens`` (tokens per step) are the knobs every
operator tunes. Bigger batches raise throughput, and also each step's time, which every running request waits for
(ITL), and how long a prompt waits for room (TTFT). ``run_frontier`` starts one server per setting, sends each the
same load, round after round (the order rotating, so a slow moment hits different settings), and keeps every
``BenchResult``; ``frontier_points`` turns them into (throughput, p99 TTFT, p99 ITL, goodput) under any SLOs, from the
stored records, so changing an SLO needs no new run; ``pareto_front`` keeps the settings no other beats on both
throughput and latency; ``recommend`` picks the one with the most goodput. Introduced in notebook 09
(``09_serving_and_metrics``, the frontier).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from labkit.measure.loadgen.runner import BenchResult, ServeBenchConfig, benchmark_serving


@dataclass(frozen=True, order=True)
class BatchLimits:
    """One setting of the two knobs. Notebook 09."""

    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def label(self) -> str:
        return f"{self.max_num_seqs} seqs, {self.max_num_batched_tokens} tok"

    def server_options(self) -> dict[str, int]:
        return {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens}


def grid(max_num_seqs: Sequence[int], max_num_batched_tokens: Sequence[int]) -> list[BatchLimits]:
    """Every pair, except those where a step's token budget could not give each sequence one token."""
    pairs = [BatchLimits(s, t) for s in max_num_seqs for t in max_num_batched_tokens if t >= s]
    if not pairs:
        raise ValueError(f"no setting has max_num_batched_tokens >= max_num_seqs: {list(max_num_seqs)} x "
                         f"{list(max_num_batched_tokens)}")
    return pairs


@dataclass(frozen=True)
class FrontierPoint:
    """One setting's figures: medians over its rounds. Notebook 09."""

    limits: BatchLimits
    output_throughput: float  # tokens/s
    p99_ttft_ms: float
    p99_itl_ms: float
    goodput: float  # requests/s meeting every SLO
    num_rounds: int


def frontier_points(results: Mapping[BatchLimits, Sequence[BenchResult]], slos: Mapping[str, float]
                    ) -> list[FrontierPoint]:
    """Each setting's medians over its rounds; goodput under ``slos`` (ms, e.g. {"ttft": 500, "tpot": 50})."""
    points = []
    for limits, runs in results.items():
        ms = [r.with_slos(dict(slos)) for r in runs]
        points.append(FrontierPoint(
            limits, statistics.median(m.output_throughput for m in ms),
            statistics.median(1e3 * m.ttft.p99 for m in ms), statistics.median(1e3 * m.itl.p99 for m in ms),
            statistics.median(m.request_goodput or 0.0 for m in ms), len(ms)))
    return points


def pareto_front(points: Sequence[FrontierPoint], latency: str = "p99_itl_ms") -> list[FrontierPoint]:
    """The points no other point beats on both throughput (higher) and ``latency`` (lower), by throughput."""
    def beaten(p: FrontierPoint) -> bool:
        return any(q.output_throughput >= p.output_throughput and getattr(q, latency) <= getattr(p, latency)
                   and (q.output_throughput > p.output_throughput or getattr(q, latency) < getattr(p, latency))
                   for q in points)
    return sorted((p for p in points if not beaten(p)), key=lambda p: p.output_throughput)


def recommend(points: Sequence[FrontierPoint]) -> FrontierPoint:
    """The most goodput; among equals, the lower p99 ITL, then the higher throughput."""
    if not points:
        raise ValueError("no points to choose from")
    return max(points, key=lambda p: (p.goodput, -p.p99_itl_ms, p.output_throughput))


class Server(Protocol):
    """What ``run_frontier`` needs of a server (``labkit.serving.ServerProcess`` has it). Notebook 09."""

    base_url: str

    def launch(self) -> Any: ...  # start, without waiting

    def wait_until_ready(self) -> Any: ...

    def stop(self) -> None: ...


def run_frontier(settings: Sequence[BatchLimits], make_server: Callable[[BatchLimits], Server],
                 config: ServeBenchConfig, num_rounds: int, progress: Callable[[BatchLimits, int], None] | None = None
                 ) -> dict[BatchLimits, list[BenchResult]]:
    """A server per setting (``make_server(limits)``, e.g. a ``ServerProcess`` with those options), all launched at
    once; each gets the same load (``config``; its ``base_url`` is replaced) in ``num_rounds`` rotating rounds; then
    all are stopped. Each round uses a fresh seed, the same for every setting. Notebook 09."""
    if num_rounds < 1:
        raise ValueError(f"num_rounds must be >= 1, got {num_rounds}")
    results: dict[BatchLimits, list[BenchResult]] = {s: [] for s in settings}
    started = {s: make_server(s) for s in settings}
    try:
        for server in started.values():
            server.launch()
        for server in started.values():
            server.wait_until_ready()
        for k in range(num_rounds):
            order = list(settings)[k % len(settings):] + list(settings)[: k % len(settings)]
            for limits in order:
                run_config = ServeBenchConfig(**{**config.__dict__, "base_url": started[limits].base_url,
                                                 "seed": config.seed + k, "label": f"{limits.label} round {k + 1}"})
                results[limits].append(benchmark_serving(run_config))
                if progress is not None:
                    progress(limits, k)
    finally:
        for server in started.values():
            server.stop()
    return results
