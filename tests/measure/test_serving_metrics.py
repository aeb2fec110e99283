"""Run-level serving metrics and Gantt data, checked on hand-computed timelines."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.core.engine.step import StepStats  # noqa: E402
from labkit.core.metrics import RequestMetrics  # noqa: E402
from labkit.core.outputs import CompletionOutput, RequestOutput  # noqa: E402
from labkit.course.request_plots import plot_gantt  # noqa: E402
from labkit.measure.stats import Percentiles  # noqa: E402
from labkit.measure.summary import gantt_rows, run_duration, run_workload, summarize  # noqa: E402


def output(arrival: float, scheduled: float, token_times: list[float], num_prompt: int) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled, token_times=list(token_times),
                             finished_time=token_times[-1])
    completion = CompletionOutput(index=0, text="", token_ids=list(range(len(token_times))), finish_reason="length")
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1] * num_prompt, outputs=[completion],
                         finished=True, metrics=metrics)


# Three requests, times in seconds (offset by 100 to show that only differences matter):
#   A arrives 0.0, scheduled 0.5, tokens at 1.0 1.5 2.0; 10 prompt tokens
#   B arrives 0.5, scheduled 0.5, tokens at 2.0 3.0;     20 prompt tokens
#   C arrives 1.0, scheduled 3.5, token  at 4.0;         5 prompt tokens
T = 100.0
RUN = [output(T + 0.0, T + 0.5, [T + 1.0, T + 1.5, T + 2.0], 10), output(T + 0.5, T + 0.5, [T + 2.0, T + 3.0], 20),
       output(T + 1.0, T + 3.5, [T + 4.0], 5)]
STEPS = [StepStats(step=i, start=T + a, end=T + b, num_seqs=1, num_computed_tokens=1, num_new_tokens=1)
         for i, (a, b) in enumerate([(0.5, 1.0), (1.0, 1.5), (1.5, 2.0), (2.0, 3.0), (3.5, 4.0)])]


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def test_percentiles_by_hand() -> None:
    p = Percentiles.of([1.0, 1.5, 3.0])
    # numpy's linear interpolation: p90 sits 0.8 of the way from 1.5 to 3.0 (rank 1.8 of 0..2)
    assert (p.count, p.median) == (3, 1.5)
    assert close(p.mean, 5.5 / 3) and close(p.p90, 2.7) and close(p.p99, 2.97)
    assert p.ms()["p90"] == pytest.approx(2700.0)
    empty = Percentiles.of([])  # no values: every statistic 0, count 0 (vLLM's rule, one rule everywhere)
    assert empty.count == 0 and empty.p99 == 0.0 and empty.mean == 0.0


def test_summary_by_hand() -> None:
    s = summarize(RUN, num_preemptions=2)
    assert close(run_duration(RUN), 4.0) and close(s.duration, 4.0)  # first arrival 0.0 -> last token 4.0
    assert (s.num_requests, s.num_prompt_tokens, s.num_output_tokens, s.num_preemptions) == (3, 35, 6, 2)
    assert close(s.request_throughput, 0.75) and close(s.output_throughput, 1.5)
    assert close(s.total_token_throughput, 41 / 4)
    # TTFT per request: 1.0, 1.5, 3.0
    assert close(s.ttft.mean, 5.5 / 3) and close(s.ttft.median, 1.5) and close(s.ttft.p99, 2.97)
    # ITL pools every gap: A's 0.5, 0.5 and B's 1.0
    assert s.itl.count == 3 and close(s.itl.mean, 2 / 3) and close(s.itl.median, 0.5) and close(s.itl.p90, 0.9)
    # TPOT: A (2.0 - 1.0) / 2 = 0.5, B (2.5 - 1.5) / 1 = 1.0; C has one token and is left out (vLLM)
    assert s.tpot.count == 2 and close(s.tpot.mean, 0.75) and close(s.tpot.p99, 0.995)
    # E2E: 2.0, 2.5, 3.0
    assert close(s.e2e.mean, 2.5) and close(s.e2e.p90, 2.9)
    row = s.as_row("x")
    assert row["run"] == "x" and close(row["ttft median (ms)"], 1500.0) and row["preemptions"] == 2


def test_summary_with_a_given_duration_and_errors() -> None:
    assert close(summarize(RUN, duration=2.0).output_throughput, 3.0)
    with pytest.raises(ValueError, match="at least one"):
        summarize([])


def test_gantt_rows_by_hand() -> None:
    a, b, c = gantt_rows(RUN, STEPS)
    assert (a.arrival, a.first_scheduled, a.first_token, a.finish, a.slot_release) == (0.0, 0.5, 1.0, 2.0, 2.0)
    assert close(b.arrival, 0.5) and close(b.queue_time, 0.0) and close(c.queue_time, 2.5)
    assert (a.num_prompt_tokens, a.num_output_tokens, c.index) == (10, 3, 2)
    # steps: [0.5,1.0] [1.0,1.5] [1.5,2.0] [2.0,3.0] [3.5,4.0]; an event belongs to the step that ends at or after it
    assert (a.arrival_step, a.first_scheduled_step, a.first_token_step, a.finish_step) == (0, 0, 0, 2)
    assert (b.first_token_step, b.finish_step, c.arrival_step, c.first_scheduled_step, c.finish_step) == (2, 3, 1, 4, 4)
    assert a.idle_slot_time == 0.0  # continuous batching: the slot is free when the request finishes


def test_gantt_rows_static_batches_hold_slots() -> None:
    a, b, c = gantt_rows(RUN, STEPS, static_batches=True)
    # A and B were scheduled in the same step: one batch, both slots held until B's last token at 3.0
    assert close(a.slot_release, 3.0) and close(a.idle_slot_time, 1.0) and a.slot_release_step == 3
    assert close(b.idle_slot_time, 0.0) and close(c.slot_release, 4.0)
    assert gantt_rows(RUN)[0].first_scheduled_step is None  # no steps given: times only


def test_plot_gantt_draws_every_phase() -> None:
    ax = plot_gantt(gantt_rows(RUN, STEPS, static_batches=True))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["waiting (queued)", "prefill (until the first token)", "decode",
                      "idle slot (finished, batch still running)"]
    assert ax.get_ylim() == (2.5, -0.5)
    plot_gantt(gantt_rows(RUN), unit="time")
    with pytest.raises(ValueError, match="no step indices"):
        plot_gantt(gantt_rows(RUN), unit="step")
    plt.close("all")


def test_run_workload_keeps_this_runs_steps_and_preemptions(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="continuous", device="cpu", block_size=4, num_gpu_blocks=12, max_num_seqs=3)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13], [1, 20, 21, 22, 23, 24, 25, 26], [1, 30, 31, 32, 33, 34]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # an earlier run: not counted below
    before, preempted_before = len(llm.engine.step_stats), llm.engine.num_preemptions
    run = run_workload(llm, prompts, params)
    assert run.engine == "continuous" and not run.static_batches and run.max_num_seqs == 3
    assert run.step_stats == llm.engine.step_stats[before:]
    # 3 requests x (up to 17 tokens = 5 blocks of 4) do not fit 12 blocks: someone is preempted
    assert run.num_preemptions == llm.engine.num_preemptions - preempted_before >= 1
    s = run.summary()
    assert s.num_output_tokens == 24 and s.num_preemptions == run.num_preemptions and s.output_throughput > 0
    rows = run.gantt()
    assert len(rows) == 3 and all(r.first_scheduled_step is not None for r in rows)
    assert max(r.finish_step for r in rows) == len(run.step_stats) - 1  # type: ignore[type-var]


def test_run_workload_of_an_engine_that_never_preempts(bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="naive", device="cpu")
    run = run_workload(llm, [[1, 5, 6, 7], [1, 8, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert (run.engine, run.max_num_seqs, run.num_preemptions) == ("naive", 1, 0)  # one request at a time
    assert run.summary().tpot.count == 2 and run.summary().num_output_tokens == 6
