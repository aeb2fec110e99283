"""What the server exposes on ``/metrics``: Prometheus histograms, gauges and counters, vLLM's names.

A load generator measures latency from outside; the server's own metrics say what happened inside
while it ran: how many requests were running or queued, how full the KV pool was, how often the
scheduler preempted, how much of the prompts the prefix cache served. Prometheus (and Grafana on top)
scrapes ``/metrics`` every few seconds; histograms let it compute percentiles over any window.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` becomes ``labkit:time_to_first_token_seconds``)
so dashboards carry over. Each server gets its own ``CollectorRegistry``: no global state, so tests
can run several servers in one process. TTFT and ITL are observed by the definitions of
``labkit.core.metrics``; percentiles are left to Prometheus (``histogram_quantile`` over the buckets), so
``Percentiles`` has no place here. Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from labkit.core.metrics import inter_token_latencies

# Seconds. vLLM's buckets, with finer ones at the bottom: a tiny model on a CPU answers in milliseconds.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 20.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0)


@dataclass(frozen=True)
class EngineState:
    """A snapshot of the engine between two steps. Notebook 09.

    Counters (preemptions, prefix-cache tokens) are totals since the engine started.
    """

    num_running: int
    num_waiting: int
    kv_blocks_used: int | None  # None: the engine has no paged pool
    kv_blocks_total: int | None
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    unfinished_request_ids: tuple[int, ...] = ()

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


class ServerMetrics:
    """The server's Prometheus metrics, in a registry of its own. Notebook 09."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r, label = self.registry, {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"labkit:{name}", doc, list(label), registry=r).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"labkit:{name}", doc, list(label), registry=r).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"labkit:{name}", doc, list(label), buckets=buckets, registry=r).labels(**label)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token, per request.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between consecutive tokens of a request.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token, per finished request.",
                             E2E_BUCKETS)
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests queued, not yet admitted (or preempted).")
        self.kv_used = gauge("kv_blocks_used", "KV-cache blocks held by requests.")
        self.kv_total = gauge("kv_blocks_total", "KV-cache blocks in the pool.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of the KV pool in use (1 = full).")
        self.preemptions = counter("num_preemptions", "Requests preempted (their KV freed, recomputed later).")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries so far.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._success = Counter("labkit:request_success", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._label = label
        self._last: EngineState | None = None

    def observe_tokens(self, arrival_time: float, token_times: list[float], num_new: int) -> None:
        """Record the newest ``num_new`` tokens of a request (TTFT for its first, ITL for each later one)."""
        first_new = len(token_times) - num_new
        if num_new > 0 and first_new == 0:
            self.ttft.observe(token_times[0] - arrival_time)
        # Only the gaps that end at a new token: the slice starts one token earlier to include the first of them.
        for gap in inter_token_latencies(token_times[max(first_new - 1, 0):]):
            self.itl.observe(gap)
        self.generation_tokens.inc(num_new)

    def request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def request_finished(self, reason: str, e2e: float | None) -> None:
        self._success.labels(finished_reason=reason, **self._label).inc()
        if e2e is not None:
            self.e2e.observe(e2e)

    def update(self, state: EngineState) -> None:
        """Set the gauges from a snapshot; advance the counters by what changed since the last one."""
        self.running.set(state.num_running)
        self.waiting.set(state.num_waiting)
        if state.kv_blocks_total:
            self.kv_used.set(state.kv_blocks_used or 0)
            self.kv_total.set(state.kv_blocks_total)
            self.kv_usage.set((state.kv_blocks_used or 0) / state.kv_blocks_total)
        last = self._last
        self.preemptions.inc(max(0, state.num_preemptions - (last.num_preemptions if last else 0)))
        self.prefix_queries.inc(max(0, state.prefix_cache_queried_tokens -
                                    (last.prefix_cache_queried_tokens if last else 0)))
        self.prefix_hits.inc(max(0, state.prefix_cache_hit_tokens - (last.prefix_cache_hit_tokens if last else 0)))
        self.prefix_hit_rate.set(state.prefix_cache_hit_rate)
        self._last = state

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric in this registry."""
        return generate_latest(self.registry)
