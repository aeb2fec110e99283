"""The server's own share of each inter-token latency, measured under load through the real server.

A client streaming from the server sees inter-token latencies (ITL); the server's ``/timings``
(``--record-timings``, ``labkit.serving.timings``) says how much of each step was the engine's own step and how much
the server's work around it. ``measure_overhead`` runs one load against one server and puts the two together:

    non-engine time per ITL = client's mean ITL - the engine step each token waited for (token-weighted mean)

(each running stream gets one token per engine step, so its ITL is one turn of the engine loop plus whatever the
server and the transport add). The server alone also says which share of a token's turn of the engine loop was not
the engine step (``server_share_%``), free of the client's own noise. ``hand_off_contenders`` makes one contender
per server for ``labkit.measure.interleave``, so the per-token and per-step hand-offs are compared side by side,
round after round. Introduced in notebook 09
(``09_serving_and_metrics``, server overhead); ``scripts/bench_server_overhead.py`` is the command-line version.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import httpx

from labkit.measure.loadgen.datasets import RandomDataset
from labkit.measure.loadgen.runner import ServeBenchConfig, benchmark_serving
from labkit.serving.timings import PER_STEP, TimingBreakdown


@dataclass(frozen=True)
class OverheadRun:
    """One load's client-side ITL next to the server's breakdown of where the time went. Notebook 09."""

    mean_itl_ms: float  # per event: with coalesced streams an event may carry several tokens
    p99_itl_ms: float
    output_throughput: float  # tokens/s
    breakdown: TimingBreakdown
    mean_tpot_ms: float  # per output token, whatever the events carried

    @property
    def engine_step_ms(self) -> float:
        """The engine step (schedule, prepare, forward, sample, detokenize) a streamed token waited for, averaged
        over tokens, as the server timed it."""
        return self.breakdown.mean_engine_step_per_token_ms

    @property
    def server_step_ms(self) -> float:
        """The engine thread's own serving work per step: collecting deltas, metrics, handing them off."""
        return sum(1e3 * self.breakdown.seconds.get(p, 0.0) for p in PER_STEP[1:]) / max(1, self.breakdown.num_steps)

    @property
    def non_engine_ms(self) -> float:
        return self.mean_itl_ms - self.engine_step_ms

    @property
    def non_engine_share(self) -> float:
        return self.non_engine_ms / self.mean_itl_ms if self.mean_itl_ms else 0.0

    @property
    def non_engine_per_token_ms(self) -> float:
        """The client's time per output token (TPOT) minus the engine step each token waited for: the server's
        and the transport's share per token, comparable whether or not events carry several tokens."""
        return self.mean_tpot_ms - self.engine_step_ms

    def metrics(self) -> dict[str, float]:
        """The figures compared across rounds (``labkit.measure.Rounds``)."""
        b = self.breakdown
        steps = max(1, b.num_steps)
        return {"itl_ms": self.mean_itl_ms, "p99_itl_ms": self.p99_itl_ms, "tok/s": self.output_throughput,
                "engine_step_ms": self.engine_step_ms, "non_engine_ms": self.non_engine_ms,
                "non_engine_%": 100 * self.non_engine_share, "server_step_ms": self.server_step_ms,
                "tpot_ms": self.mean_tpot_ms, "non_engine_per_token_ms": self.non_engine_per_token_ms,
                "non_engine_per_token_%": 100 * self.non_engine_per_token_ms / self.mean_tpot_ms
                if self.mean_tpot_ms else 0.0,
                "events_per_token": b.num_events / max(1, b.num_tokens),
                "server_share_%": 100 * (1 - b.engine_share_of_turn),
                "post_ms": 1e3 * b.seconds.get("post", 0.0) / steps,
                "tokens_per_step": b.num_tokens / steps, "wake_ups_per_step": b.counts.get("wake_ups", 0) / steps,
                **{f"{p}_ms/tok": v for p, v in b.per_token_ms().items() if p in ("frame", "send", "hand_off")}}


def timings_snapshot(base_url: str) -> dict:  # type: ignore[type-arg]
    response = httpx.get(f"{base_url}/timings", timeout=30)
    if response.status_code == 404:
        raise RuntimeError(f"{base_url} records no timings: start it with --record-timings (record_timings=True)")
    response.raise_for_status()
    return response.json()


def measure_overhead(base_url: str, dataset: RandomDataset, num_prompts: int, max_concurrency: int, seed: int = 0
                     ) -> OverheadRun:
    """Send ``num_prompts`` requests, ``max_concurrency`` at a time, streaming; the client's ITL and the server's
    breakdown of the same run. Notebook 09."""
    config = ServeBenchConfig(base_url=base_url, dataset=dataset, num_prompts=num_prompts,
                              max_concurrency=max_concurrency, ignore_eos=True, disable_tqdm=True, seed=seed)
    before = timings_snapshot(base_url)
    result = benchmark_serving(config)
    after = timings_snapshot(base_url)
    m = result.metrics
    if m.failed:
        raise RuntimeError(f"{m.failed} of {m.failed + m.completed} requests failed")
    return OverheadRun(1e3 * m.itl.mean, 1e3 * m.itl.p99, m.output_throughput,
                       TimingBreakdown.between(before, after), 1e3 * m.tpot.mean)


def hand_off_contenders(base_urls: Mapping[str, str], dataset: RandomDataset, num_prompts: int,
                        max_concurrency: int, runs: dict[str, list[OverheadRun]] | None = None
                        ) -> dict[str, Callable[[], dict[str, float]]]:
    """One contender per server (label -> base URL) for ``labkit.measure.interleave``; each round sends fresh
    prompts (a new seed), the same to every server. ``runs`` collects every ``OverheadRun``. Notebook 09."""
    kept = runs if runs is not None else {}

    def contender(label: str, url: str) -> Callable[[], dict[str, float]]:
        def run() -> dict[str, float]:
            seed = len(kept.setdefault(label, []))
            kept[label].append(measure_overhead(url, dataset, num_prompts, max_concurrency, seed=seed))
            return kept[label][-1].metrics()
        return run

    return {label: contender(label, url) for label, url in base_urls.items()}
