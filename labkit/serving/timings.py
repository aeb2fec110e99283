"""Where the server's own time goes: per request and per token, next to the engine step.

A streamed token's inter-token latency (ITL) is the engine step that produced it *plus* whatever the server does
around it. With ``--record-timings`` the server adds up, in seconds, how long each part took, and ``GET /timings``
returns the totals (a client subtracts two snapshots to get one run's share):

per request (worker thread)         ``parse`` (JSON, validation, limits), ``tokenize`` (text or chat template
                                    to ids), inside ``prepare`` (the whole of it)
per step (engine thread)            ``engine_step`` (the engine's ``step``: schedule, prepare inputs, forward,
                                    sample, detokenize, each also as ``engine:<stage>``), then ``collect`` (each
                                    request's new text and delta), ``metrics`` (Prometheus) and ``post`` (handing
                                    the deltas to the event loop, in ``wake_ups`` calls: counted, not timed)
per token (event loop)              ``wait`` (for the token to arrive), ``frame`` (the chunk's JSON and the SSE
                                    event), ``send`` (the web server writing it), inside ``stream`` (a request's
                                    whole stream); and ``hand_off``, from the token's sampling (inside the
                                    engine step) to the event loop picking it up

Parts nest as listed, so each whole is at least the sum of its parts (tested). Recording costs a few clock reads
per token. Introduced in notebook 09 (``09_serving_and_metrics``, server overhead).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from labkit.core.engine.step import StepStats
from labkit.serving.streams import TokenDelta

PER_REQUEST = ("prepare", "parse", "tokenize")
PER_STEP = ("engine_step", "collect", "metrics", "post")
PER_TOKEN = ("hand_off", "wait", "frame", "send")
# whole -> its parts (each whole is at least the sum of its parts)
NESTING: dict[str, tuple[str, ...]] = {"prepare": ("parse", "tokenize"), "stream": ("wait", "frame", "send")}


@dataclass
class ServerTimings:
    """Seconds and counts per part, added from the worker threads, the engine thread and the event loop. Notebook 09.
    """

    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, part: str, seconds: float, count: int = 1) -> None:
        with self._lock:
            self.seconds[part] = self.seconds.get(part, 0.0) + seconds
            self.counts[part] = self.counts.get(part, 0) + count

    @contextlib.contextmanager
    def time(self, part: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(part, time.perf_counter() - start)

    def record_step(self, step_stats: Sequence[StepStats], marks: Sequence[float], deltas: Sequence[object]) -> None:
        """One turn of the engine thread: ``marks`` = its start, the step's end, then the ends of collect, metrics
        and post; ``step_stats``: the engine's records of the step (its stages); ``deltas``: what it handed out.

        A running stream gets one token per step, so each ITL is one whole turn: the turn and its engine step are
        also added weighted by the step's tokens that end an ITL, every one but a request's first (whose wait is
        TTFT): ``turn_x_tokens`` and ``engine_step_x_tokens``, whose ratio of sums is the engine's share of the
        mean ITL as the server sees it."""
        for part, begin, end in zip(PER_STEP, marks, marks[1:]):
            self.add(part, end - begin)
        num_tokens = sum(len(d.token_ids) for d in deltas
                         if isinstance(d, TokenDelta) and d.num_output_tokens > len(d.token_ids))
        self.add("turn_x_tokens", (marks[-1] - marks[0]) * num_tokens, num_tokens)
        self.add("engine_step_x_tokens", (marks[1] - marks[0]) * num_tokens, num_tokens)
        for stats in step_stats:
            for stage, seconds in stats.stage_times.items():
                self.add(f"engine:{stage}", seconds)

    def snapshot(self) -> dict[str, Any]:
        """A JSON-ready copy: {"seconds": {part: s}, "counts": {part: n}}."""
        with self._lock:
            return {"seconds": dict(self.seconds), "counts": dict(self.counts)}


@dataclass(frozen=True)
class TimingBreakdown:
    """One run's server time (the difference of two ``/timings`` snapshots), per request and per token. Notebook 09.
    """

    seconds: Mapping[str, float]
    counts: Mapping[str, int]

    @classmethod
    def between(cls, before: Mapping[str, Any], after: Mapping[str, Any]) -> TimingBreakdown:
        parts = set(after["seconds"])
        return cls({p: after["seconds"][p] - before["seconds"].get(p, 0.0) for p in parts},
                   {p: after["counts"].get(p, 0) - before["counts"].get(p, 0) for p in parts})

    @property
    def num_requests(self) -> int:
        return self.counts.get("prepare", 0)

    @property
    def num_tokens(self) -> int:
        """Tokens streamed (an event carries several when a lagging stream's tokens were coalesced)."""
        return self.counts.get("streamed_tokens", 0)

    @property
    def num_events(self) -> int:
        """Server-sent events framed (one per token unless tokens were coalesced)."""
        return self.counts.get("frame", 0)

    @property
    def num_steps(self) -> int:
        return self.counts.get("engine_step", 0)

    @property
    def engine_share_of_turn(self) -> float:
        """The engine step's share of a streamed token's turn of the engine loop (token-weighted), server side."""
        turn = self.seconds.get("turn_x_tokens", 0.0)
        return self.seconds.get("engine_step_x_tokens", 0.0) / turn if turn else 0.0

    @property
    def mean_engine_step_per_token_ms(self) -> float:
        """The engine step a streamed token waited for, in ms, averaged over tokens (what an ITL contains)."""
        n = self.counts.get("engine_step_x_tokens", 0)
        return 1e3 * self.seconds.get("engine_step_x_tokens", 0.0) / n if n else 0.0

    def per_request_ms(self) -> dict[str, float]:
        n = max(1, self.num_requests)
        return {p: 1e3 * self.seconds.get(p, 0.0) / n for p in PER_REQUEST}

    def per_token_ms(self) -> dict[str, float]:
        """Each part's milliseconds per streamed token (step parts spread over the tokens their steps made)."""
        n = max(1, self.num_tokens)
        stages = sorted(p for p in self.seconds if p.startswith("engine:"))
        return {p: 1e3 * self.seconds.get(p, 0.0) / n for p in (*PER_STEP, *stages, *PER_TOKEN)}

    def engine_stages_ms(self) -> dict[str, float]:
        n = max(1, self.num_tokens)
        return {p.removeprefix("engine:"): 1e3 * s / n for p, s in sorted(self.seconds.items())
                if p.startswith("engine:")}

    def check_nesting(self, slack: float = 1e-6) -> None:
        """Raise AssertionError if a part took longer than the whole it is inside."""
        for whole, parts in {**NESTING, "engine_step": tuple(p for p in self.seconds if p.startswith("engine:"))
                             }.items():
            inside = sum(self.seconds.get(p, 0.0) for p in parts)
            assert inside <= self.seconds.get(whole, 0.0) + slack, (
                f"parts {parts} of {whole!r} sum to {inside:.6f} s > the whole {self.seconds.get(whole, 0.0):.6f} s")
