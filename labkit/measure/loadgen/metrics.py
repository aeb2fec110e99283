"""Serving-benchmark metrics, computed exactly as vLLM's ``vllm bench serve`` computes them.

Everything is measured by the client, per request, from the moment it sends the request:

* **TTFT**: send -> the first streamed chunk that carries a choice;
* **ITL**: every gap between consecutive such chunks (one chunk per token on labkit's server; a
  server that bundles tokens into one chunk shows fewer, longer gaps), pooled over all requests;
* **E2EL**: send -> the last chunk with a choice (``latency``);
* **TPOT**: ``(E2EL - TTFT) / (output tokens - 1)``, per request with more than one output token;
  output tokens come from the server's usage record (``labkit.core.metrics.time_per_output_token``,
  the same definition the engine's own metrics use);
* mean, median, standard deviation, p90 and p99 of each as a ``Percentiles`` (``labkit.measure.stats``:
  seconds, 0 when a list is empty, as vLLM reports it); milliseconds only in the JSON file and the report;
* **throughput** over the benchmark's duration (first send -> last response): completed requests/s,
  output tokens/s, prompt + output tokens/s; failed requests count in none of them;
* **goodput**: completed requests that meet *every* given SLO, per second. SLOs are in milliseconds,
  ``{"ttft": 500, "tpot": 50, "e2el": 2000}`` (any subset); a request meets one when its value is
  <= the limit, and a single-token request's TPOT counts as 0 (vLLM's rule).

Introduced in notebook 09 (``09_serving_and_metrics``), whose Task 1 rebuilds ``request_goodput``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit.core.metrics import time_per_output_token
from labkit.measure.stats import Percentiles

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What the client saw of one request (vLLM's ``RequestFuncOutput``); times in seconds. Notebook 09."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0  # the server's usage.completion_tokens (else the number of chunks)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    generated_text: str = ""
    error: str = ""

    @property
    def e2el(self) -> float:
        return self.latency

    @property
    def tpot(self) -> float:
        """(E2EL - TTFT) / (output tokens - 1); 0 for a single-token request."""
        return time_per_output_token(self.ttft, self.latency, self.output_tokens)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class BenchMetrics:
    """One benchmark run's numbers, by ``vllm bench serve``'s definitions. Notebook 09."""

    completed: int
    failed: int
    duration: float  # seconds
    total_input: int
    total_output: int
    request_throughput: float  # completed requests / s
    request_goodput: float | None  # requests meeting every SLO / s; None without SLOs
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    ttft: Percentiles  # seconds, like every Percentiles; to_dict writes them in ms
    tpot: Percentiles
    itl: Percentiles
    e2el: Percentiles
    slos: dict[str, float] = field(default_factory=dict)  # ms

    def to_dict(self) -> dict[str, Any]:
        """vLLM's result-file keys and units: ``mean_ttft_ms``, ``p99_itl_ms`` (ms), ``request_goodput``, ..."""
        out: dict[str, Any] = {
            "duration": self.duration, "completed": self.completed, "failed": self.failed,
            "total_input_tokens": self.total_input, "total_output_tokens": self.total_output,
            "request_throughput": self.request_throughput, "request_goodput": self.request_goodput,
            "output_throughput": self.output_throughput, "total_token_throughput": self.total_token_throughput,
            "goodput_slos_ms": dict(self.slos),
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats: Percentiles = getattr(self, name)
            for stat, ms in stats.ms().items():  # vLLM's file is in ms: the one place these become ms
                out[f"{stat}_{name}_ms"] = ms
        return out


def parse_goodput(specs: str | Iterable[str] | Mapping[str, float] | None) -> dict[str, float]:
    """SLOs in ms from ``"ttft:500 tpot:50"`` (or a list of such pairs, or a dict), with clear errors."""
    if specs is None:
        return {}
    if isinstance(specs, Mapping):
        pairs = [(str(k), v) for k, v in specs.items()]
    else:
        items = specs.split() if isinstance(specs, str) else [s for spec in specs for s in str(spec).split()]
        pairs = []
        for item in items:
            key, sep, value = item.partition(":")
            if not sep:
                raise ValueError(f"goodput SLO {item!r} must look like KEY:MILLISECONDS, e.g. ttft:500")
            pairs.append((key, value))
    slos: dict[str, float] = {}
    for key, value in pairs:
        if key not in SLO_METRICS:
            raise ValueError(f"goodput SLO {key!r} is not one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ValueError(f"goodput SLO {key}:{value} needs a number of milliseconds") from None
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"goodput SLO {key}:{value} must be a finite number of milliseconds >= 0")
        slos[key] = ms
    return slos


def meets_slos(record: RequestRecord, slos_ms: Mapping[str, float]) -> bool:
    """True if a completed request's TTFT, TPOT and E2EL are each <= its SLO (only the SLOs given)."""
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.latency}
    return record.success and all(values[k] <= ms / 1000.0 for k, ms in slos_ms.items())


def count_good_requests(records: Sequence[RequestRecord], slos_ms: Mapping[str, float]) -> int:
    return sum(meets_slos(r, slos_ms) for r in records)


def request_goodput(records: Sequence[RequestRecord], slos_ms: Mapping[str, float], duration: float) -> float:
    """Requests meeting every SLO, per second of the benchmark. Notebook 09 (Task 1)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    return count_good_requests(records, slos_ms) / duration


def calculate_metrics(records: Sequence[RequestRecord], duration: float,
                      slos_ms: Mapping[str, float] | None = None) -> BenchMetrics:
    """Every metric of a run from its per-request records and its duration (seconds). Notebook 09."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    done = [r for r in records if r.success]
    slos = dict(slos_ms or {})
    total_output = sum(r.output_tokens for r in done)
    total_input = sum(r.prompt_len for r in done)
    return BenchMetrics(
        completed=len(done), failed=len(records) - len(done), duration=duration, total_input=total_input,
        total_output=total_output, request_throughput=len(done) / duration,
        request_goodput=request_goodput(done, slos, duration) if slos else None,
        output_throughput=total_output / duration, total_token_throughput=(total_input + total_output) / duration,
        ttft=Percentiles.of([r.ttft for r in done]),
        tpot=Percentiles.of([r.tpot for r in done if r.output_tokens > 1]),  # vLLM leaves single tokens out
        itl=Percentiles.of([gap for r in done for gap in r.itl]),
        e2el=Percentiles.of([r.latency for r in done]), slos=slos,
    )
