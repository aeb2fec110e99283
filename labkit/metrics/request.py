"""Per-request latency metrics, defined as vLLM's benchmark defines them.

TTFT = arrival -> first token; ITL = each gap between consecutive tokens; TPOT = (E2E - TTFT) /
(output tokens - 1); E2E = arrival -> last token. Introduced in notebook 01
(``01_anatomy_of_a_request``), where the learner computes them from timestamps (Task 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Latencies:
    """The four latency numbers of one request, in seconds. Notebook 01."""

    ttft: float
    itl: list[float]
    tpot: float
    e2e: float


def compute_latencies(arrival_time: float, token_times: list[float]) -> Latencies:
    """Derive TTFT, ITL, TPOT and E2E from the arrival time and each output token's time.

    A request with a single output token has no gaps: ITL is empty and TPOT is 0.
    """
    if not token_times:
        raise ValueError("a request with no output tokens has no latencies")
    ttft = token_times[0] - arrival_time
    e2e = token_times[-1] - arrival_time
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    tpot = (e2e - ttft) / (len(token_times) - 1) if len(token_times) > 1 else 0.0
    return Latencies(ttft=ttft, itl=itl, tpot=tpot, e2e=e2e)


@dataclass
class RequestMetrics:
    """Timestamps of one request (``time.perf_counter`` seconds) and what follows from them. Notebook 01."""

    arrival_time: float
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def queue_time(self) -> float | None:
        """Arrival -> first time the engine worked on it."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    def latencies(self) -> Latencies:
        return compute_latencies(self.arrival_time, self.token_times)

    @property
    def ttft(self) -> float:
        return self.latencies().ttft

    @property
    def itl(self) -> list[float]:
        return self.latencies().itl

    @property
    def tpot(self) -> float:
        return self.latencies().tpot

    @property
    def e2e(self) -> float:
        return self.latencies().e2e
