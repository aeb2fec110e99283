"""trace_request follows one request step by step and its timeline adds up (notebook 01)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from labkit import LLM, SamplingParams
from labkit.measure.profiling.request_trace import time_stream, trace_request

PROMPT = "Once upon a time, there was a little fox named Ben. Ben loved to"


@pytest.fixture(scope="module")
def llm(bundled_path: Path) -> LLM:
    return LLM(bundled_path, engine="naive", device="cpu")


def test_trace_matches_generate_and_counts_steps(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ref = llm.generate(PROMPT, params, use_tqdm=False)[0]
    trace = trace_request(llm, PROMPT, params)

    assert trace.output_token_ids == ref.outputs[0].token_ids
    assert trace.text == ref.outputs[0].text == "".join(s.text_delta for s in trace.steps)
    assert trace.prompt_token_ids == ref.prompt_token_ids
    assert trace.finish_reason == "length"
    # The naive engine produces one token per step: steps = output tokens, one prefill then decodes.
    assert len(trace.steps) == trace.num_output_tokens == 6
    assert [s.phase for s in trace.steps] == ["prefill"] + ["decode"] * 5
    assert [s.token_id for s in trace.steps] == trace.output_token_ids
    # The first step computes the whole prompt; the naive engine then recomputes one more each step.
    n = trace.num_prompt_tokens
    assert [s.num_computed_tokens for s in trace.steps] == [n + i for i in range(6)]


def test_stage_times_add_up_and_steps_are_ordered(llm: LLM) -> None:
    trace = trace_request(llm, PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert trace.tokenize_time > 0
    prev_end = trace.tokenize_time - 1e-9
    for step in trace.steps:
        assert set(step.stage_times) == {"schedule", "prepare", "forward", "sample", "detokenize"}
        assert math.isclose(sum(step.stage_times.values()), step.duration, rel_tol=1e-6, abs_tol=1e-6)
        assert step.start >= prev_end and step.end > step.start
        prev_end = step.end
    totals = trace.stage_totals()
    assert math.isclose(sum(totals.values()), trace.tokenize_time + sum(s.duration for s in trace.steps),
                        rel_tol=1e-6)
    # The engine's token timestamps fall inside the step that produced each token.
    m = trace.metrics
    assert m is not None and len(m.token_times) == len(trace.steps)
    for t, step in zip(m.token_times, trace.steps):
        assert step.start <= t - trace.submit_time <= step.end
    assert len(trace.token_step_durations) == 4
    # TTFT (from the engine's arrival stamp, after tokenizing) covers the prefill step up to its sampled token.
    first = trace.steps[0]
    assert m.ttft >= first.duration - first.stage_times["detokenize"] - 1e-9


def test_trace_refuses_a_busy_engine_and_leaves_none_behind(llm: LLM) -> None:
    params = SamplingParams(max_tokens=3, temperature=0.0)
    (seq,), = llm.input_processor.make_sequences([PROMPT], [params])
    llm.engine.add_request(seq)
    try:
        with pytest.raises(ValueError, match="unfinished"):
            trace_request(llm, PROMPT, params)
    finally:
        llm.engine.abort_all()
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="n=2"):
        trace_request(llm, PROMPT, SamplingParams(max_tokens=3, n=2))
    assert not llm.engine.has_unfinished_requests()


def test_time_stream_text_and_gaps(llm: LLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ref = llm.generate(PROMPT, params, use_tqdm=False)[0]
    stream = time_stream(llm, PROMPT, params)
    assert stream.text == ref.outputs[0].text
    assert 1 <= len(stream.deltas) <= 8
    assert stream.times == sorted(stream.times) and stream.time_to_first_delta > 0
    assert len(stream.gaps) == len(stream.deltas) - 1
    assert not llm.engine.has_unfinished_requests()


def test_plots_of_a_trace_and_a_roof_draw_labelled_axes(llm: LLM) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from labkit.course.plots import plot_roofline
    from labkit.course.request_plots import plot_request_timeline, plot_stage_breakdown, plot_token_latencies
    from labkit.measure.hardware import DeviceRoof

    trace = trace_request(llm, PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    roof = DeviceRoof("cpu", "test CPU", "float32", 10e9, 8e9, 10e9, 100e9, 512, 1 << 26, 2)
    axes = [
        plot_token_latencies(trace), plot_token_latencies({"a": trace, "b": trace}), plot_stage_breakdown(trace),
        plot_request_timeline(trace, stream_times=[s.end for s in trace.steps]),
        plot_roofline(roof, points=[("decode", 0.5, 5e9)]),
    ]
    for ax in axes:
        assert ax.get_title() and ax.get_xlabel()
    # The roofline's black curve is min(peak, intensity x bandwidth): bandwidth-bound left of the ridge (10).
    x, y = axes[-1].get_lines()[0].get_data()
    assert abs(float(np.interp(1.0, x, y)) - 10e9) / 10e9 < 0.02
    assert abs(float(y[-1]) - 100e9) < 1.0
    plt.close("all")
