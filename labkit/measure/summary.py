"""Serving metrics over a whole run: throughput, latency percentiles, preemptions, and Gantt data.

One request's latencies (``labkit.core.metrics``) say how *that* request fared; a scheduler is judged on the
whole workload. ``summarize`` turns a run's ``RequestOutput``s into the numbers vLLM's benchmark reports:

* throughput over the run's wall time (first arrival -> last token): requests/s, output tokens/s, and
  prompt + output tokens/s;
* TTFT, ITL, TPOT and E2E as ``Percentiles`` (``labkit.measure.stats``: mean, median, std, p90, p99, in
  seconds), where TTFT, TPOT and E2E have one value per request (TPOT only for requests with more than one
  output token) and ITL pools every gap between consecutive tokens of every request; each request's values
  come from ``labkit.core.metrics``, the definitions of notebook 01;
* preemptions (from the engine's counter: outputs do not carry them).

``run_workload`` runs prompts through an ``LLM`` and keeps what a summary and a Gantt chart need (the
outputs, the run's ``StepStats``, its preemptions); ``gantt_rows`` turns outputs into one row per request:
arrival, first scheduled, first token, finish, and how long it held its batch slot.

Introduced in notebook 07 (``07_continuous_batching``); used again in notebook 08 and by
``scripts/bench_engines.py``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass

from labkit.core.engine.step import StepStats
from labkit.core.llm import LLM
from labkit.core.outputs import RequestOutput
from labkit.core.sampling_params import SamplingParams
from labkit.measure.stats import Percentiles


@dataclass(frozen=True)
class ServingSummary:
    """What one run of a workload achieved, by vLLM's benchmark definitions. Notebook 07."""

    num_requests: int
    duration: float  # seconds: first arrival -> last token (or as given)
    num_prompt_tokens: int
    num_output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (prompt + output) tokens/s
    ttft: Percentiles
    itl: Percentiles
    tpot: Percentiles
    e2e: Percentiles
    num_preemptions: int = 0

    def as_row(self, label: str = "") -> dict[str, float | int | str]:
        """A flat dict (latencies in ms) for a table of runs side by side."""
        row: dict[str, float | int | str] = {"run": label} if label else {}
        row.update({"requests": self.num_requests, "duration_s": self.duration, "req/s": self.request_throughput,
                    "out tok/s": self.output_throughput, "preemptions": self.num_preemptions})
        for name in ("ttft", "itl", "tpot", "e2e"):
            for stat, value in getattr(self, name).ms().items():
                row[f"{name} {stat} (ms)"] = value
        return row


def run_duration(outputs: Sequence[RequestOutput]) -> float:
    """Wall time of a run from its outputs: the first arrival to the last token (0 if nothing came out)."""
    ends = [o.metrics.token_times[-1] for o in outputs if o.metrics.token_times]
    if not ends:
        return 0.0
    return max(ends) - min(o.metrics.arrival_time for o in outputs)


def summarize(outputs: Sequence[RequestOutput], duration: float | None = None, num_preemptions: int = 0
              ) -> ServingSummary:
    """Throughput and latency percentiles of a run. Notebook 07.

    ``duration`` defaults to ``run_duration(outputs)``. Every completion of a request counts (n > 1
    samples share the request's metrics, which follow the first sample, as in ``RequestOutput``).
    """
    if not outputs:
        raise ValueError("summarize needs at least one RequestOutput")
    duration = run_duration(outputs) if duration is None else duration
    ttfts, itls, tpots, e2es = [], [], [], []
    for out in outputs:
        m = out.metrics
        if not m.token_times:
            continue  # aborted before its first token: no latencies to count
        lat = m.latencies()
        ttfts.append(lat.ttft)
        e2es.append(lat.e2e)
        itls += lat.itl
        if len(m.token_times) > 1:  # vLLM leaves single-token requests out of TPOT
            tpots.append(lat.tpot)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)

    def per_s(count: int) -> float:
        return count / duration if duration > 0 else float("nan")

    return ServingSummary(
        num_requests=len(outputs), duration=duration, num_prompt_tokens=num_prompt, num_output_tokens=num_out,
        request_throughput=per_s(len(outputs)), output_throughput=per_s(num_out),
        total_token_throughput=per_s(num_prompt + num_out), ttft=Percentiles.of(ttfts), itl=Percentiles.of(itls),
        tpot=Percentiles.of(tpots), e2e=Percentiles.of(e2es), num_preemptions=num_preemptions,
    )


# ---- running a workload and keeping its record ----

STATIC_BATCH_ENGINES = frozenset({"kvcache", "paged"})  # a batch's slots stay taken until its last request ends


@dataclass
class Run:
    """One workload through one engine: outputs, the steps it took, its preemptions. Notebook 07."""

    label: str
    engine: str  # the engine's name in ENGINES
    outputs: list[RequestOutput]
    step_stats: list[StepStats]
    num_preemptions: int
    wall_time: float  # seconds the generate call took (tokenization included)
    max_num_seqs: int  # the engine's batch slots (1 for the naive engine)

    def summary(self) -> ServingSummary:
        return summarize(self.outputs, num_preemptions=self.num_preemptions)

    @property
    def static_batches(self) -> bool:
        return self.engine in STATIC_BATCH_ENGINES

    def gantt(self) -> list[GanttRow]:
        """One row per request, with step indices, slots released as this engine releases them."""
        return gantt_rows(self.outputs, self.step_stats, static_batches=self.static_batches)


def run_workload(llm: LLM, prompts: Sequence[str | list[int]], params: SamplingParams | Sequence[SamplingParams],
                 arrival_times: Sequence[float] | None = None, label: str | None = None, use_tqdm: bool = False
                 ) -> Run:
    """``llm.generate`` the prompts and keep this run's step statistics and preemptions. Notebook 07."""
    engine = llm.engine
    first_step = len(engine.step_stats)
    preempted_before = engine.num_preemptions  # a running total since the engine started: keep this run's share
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm, arrival_times=arrival_times)
    wall = time.perf_counter() - start
    return Run(label=label or llm.engine_name, engine=llm.engine_name, outputs=outputs,
               step_stats=list(engine.step_stats[first_step:]),
               num_preemptions=engine.num_preemptions - preempted_before, wall_time=wall,
               max_num_seqs=engine.max_num_seqs)


# ---- Gantt data ----

@dataclass(frozen=True)
class GanttRow:
    """One request's life, in seconds since the run's first arrival (and in engine steps where known).

    ``slot_release`` is when its batch slot became free again: its finish under continuous batching,
    the end of its whole batch under static batching (the gap is an idle slot). Notebook 07.
    """

    index: int  # position in the outputs (prompt order)
    num_prompt_tokens: int
    num_output_tokens: int
    arrival: float
    first_scheduled: float
    first_token: float
    finish: float
    slot_release: float
    arrival_step: int | None = None  # the step indices are None when no step stats were given
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    slot_release_step: int | None = None

    @property
    def queue_time(self) -> float:
        return self.first_scheduled - self.arrival

    @property
    def idle_slot_time(self) -> float:
        return self.slot_release - self.finish


def _step_of(ends: list[float], t: float) -> int:
    """Index of the step during which time ``t`` happened (the first step ending at or after it)."""
    return min(bisect.bisect_left(ends, t), len(ends) - 1)


def gantt_rows(outputs: Sequence[RequestOutput], step_stats: Sequence[StepStats] | None = None,
               static_batches: bool = False) -> list[GanttRow]:
    """One ``GanttRow`` per finished request: arrival, first scheduled, first token, finish. Notebook 07.

    Times are seconds since the first arrival. With ``step_stats`` (the run's steps) each event also
    gets the index of the step it happened in (arrival: the first step starting after it). With
    ``static_batches``, requests first scheduled in the same step form a batch, and each holds its slot
    until the last of them finishes; otherwise a slot is released when its request finishes.
    """
    done = [(i, o) for i, o in enumerate(outputs) if o.metrics.token_times]
    if not done:
        return []
    t0 = min(o.metrics.arrival_time for _, o in done)
    batch_end: dict[float, float] = {}
    for _, o in done:
        m = o.metrics
        key = m.first_scheduled_time if m.first_scheduled_time is not None else m.token_times[0]
        batch_end[key] = max(batch_end.get(key, key), m.token_times[-1])
    ends = [s.end for s in step_stats] if step_stats else []
    starts = [s.start for s in step_stats] if step_stats else []
    rows = []
    for i, o in done:
        m = o.metrics
        scheduled = m.first_scheduled_time if m.first_scheduled_time is not None else m.token_times[0]
        finish = m.token_times[-1]
        release = batch_end[scheduled] if static_batches else finish
        steps: dict[str, int | None] = {}
        if ends:
            steps = {
                "arrival_step": min(bisect.bisect_left(starts, m.arrival_time), len(starts) - 1),
                "first_scheduled_step": _step_of(ends, scheduled),
                "first_token_step": _step_of(ends, m.token_times[0]),
                "finish_step": _step_of(ends, finish),
                "slot_release_step": _step_of(ends, release),
            }
        rows.append(GanttRow(
            index=i, num_prompt_tokens=len(o.prompt_token_ids), num_output_tokens=len(o.outputs[0].token_ids),
            arrival=m.arrival_time - t0, first_scheduled=scheduled - t0, first_token=m.token_times[0] - t0,
            finish=finish - t0, slot_release=release - t0, **steps,  # type: ignore[arg-type]
        ))
    return rows
