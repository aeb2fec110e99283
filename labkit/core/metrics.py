"""Per-request latency metrics, defined as vLLM's benchmark defines them.

TTFT = arrival -> first token; ITL = each gap between consecutive tokens; TPOT = (E2E - TTFT) /
(output tokens - 1); E2E = arrival -> last token. Introduced in notebook 01
(``01_anatomy_of_a_request``), where the learner computes them from timestamps (Task 1).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Latencies:
    """The four latency numbers of one request, in seconds. Notebook 01."""

    ttft: float
    itl: list[float]
    tpot: float
    e2e: float


def inter_token_latencies(token_times: Sequence[float]) -> list[float]:
    """ITL: every gap between consecutive tokens (empty for fewer than two)."""
    return [b - a for a, b in itertools.pairwise(token_times)]


def time_per_output_token(ttft: float, e2e: float, num_output_tokens: int) -> float:
    """TPOT = (E2E - TTFT) / (output tokens - 1): the mean pace after the first token; 0 for fewer than two.

    The one definition of TPOT in labkit: the engine's request metrics, the run summaries and the load generator
    all call it. The load generator passes the server's token count, which can exceed its chunk count (a server
    may stream several tokens in one chunk), so the count is an argument rather than ``len(token_times)``.
    A single-token request has no pace to measure; 0 is what vLLM's goodput counts for it.
    """
    return (e2e - ttft) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0


def compute_latencies(arrival_time: float, token_times: list[float]) -> Latencies:
    """Derive TTFT, ITL, TPOT and E2E from the arrival time and each output token's time.

    A request with a single output token has no gaps: ITL is empty and TPOT is 0.
    """
    if not token_times:
        raise ValueError("a request with no output tokens has no latencies")
    ttft = token_times[0] - arrival_time
    e2e = token_times[-1] - arrival_time
    return Latencies(ttft=ttft, itl=inter_token_latencies(token_times),
                     tpot=time_per_output_token(ttft, e2e, len(token_times)), e2e=e2e)


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
