"""Profiling an engine run: named stage ranges in the trace, analysis that adds up, TensorBoard lists the run.

One profiled run of the bundled model on the ``chunked`` engine (CPU) feeds most tests; hand-made traces
with known answers check the analysis exactly, on the CPU definition of device work and on CUDA kernels.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.measure.profiling import EngineProfile, analyze_trace, profile_engine  # noqa: E402
from labkit.measure.profiling.tensorboard import TensorBoardServer  # noqa: E402
from labkit.measure.profiling.timeline import plot_step_timeline  # noqa: E402
from labkit.measure.profiling.trace_analysis import STEP_STAGES, busy_time, merge_intervals  # noqa: E402

PROMPTS = ["Once upon a time", "A little fox named Lily", "The sun was", "One day, Tom went to the park and"]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32", max_num_seqs=4)


@pytest.fixture(scope="module")
def prof(llm: LLM, tmp_path_factory: pytest.TempPathFactory) -> EngineProfile:
    return profile_engine(llm, PROMPTS, PARAMS, logdir=tmp_path_factory.mktemp("logs"), run_name="tiny chunked")


# ---- the trace of a real engine run ----

def test_trace_file_is_written_where_tensorboard_and_perfetto_look(prof: EngineProfile) -> None:
    assert prof.run_name == "tiny_chunked"  # made safe for a folder name
    assert prof.trace_path.parent == prof.logdir / prof.run_name
    assert prof.trace_path.name.endswith(".pt.trace.json")
    data = json.loads(prof.trace_path.read_text())  # plain Chrome trace JSON (Perfetto, chrome://tracing)
    assert data["traceEvents"] == prof.events


def test_named_stage_ranges_are_in_the_trace(prof: EngineProfile) -> None:
    names = prof.range_names()
    for stage in ("step", *STEP_STAGES, "tokenize", "stream"):
        assert f"labkit::{stage}" in names, stage
    analysis = prof.analyze()
    # one labkit::step per engine step the engine recorded, each with every stage inside it
    assert len(analysis.steps) == len(prof.step_stats) >= PARAMS.max_tokens
    for step in analysis.steps:
        assert set(step.stages) == set(STEP_STAGES), step.index
    # a stream range after every step
    streams = [r for r in analysis.stage_ranges if r[0] == "stream"]
    assert len(streams) == len(analysis.steps)


def test_profiling_does_not_change_the_tokens(prof: EngineProfile, llm: LLM) -> None:
    plain = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert prof.texts == [o.outputs[0].text for o in plain]
    assert all(prof.texts)


def test_stage_times_add_up_to_the_step(prof: EngineProfile) -> None:
    analysis = prof.analyze()
    total = sum(s.duration for s in analysis.steps)
    for step in analysis.steps:
        assert step.duration > 0
        assert step.untracked >= -1e-3, step.index  # stages lie inside their step
        assert all(t > 0 for t in step.stages.values())
    # the stage ranges tile the step: what falls between them is a small share
    assert sum(s.untracked for s in analysis.steps) <= 0.10 * total
    # the trace's step times agree with the engine's own clock (StepStats) for the same steps
    engine_total = sum(st.duration for st in prof.step_stats) * 1e6
    assert engine_total == pytest.approx(total, rel=0.05)


def test_host_and_device_accounting_adds_up(prof: EngineProfile) -> None:
    analysis = prof.analyze()
    assert analysis.device_type == "cpu" and "labkit::forward" in analysis.device_work
    assert 0.0 < analysis.idle_fraction < 1.0
    assert 0.0 < analysis.host_share < 1.0
    for step in analysis.steps:
        assert step.num_device_intervals > 0
        # on a CPU, device work is the forward's aten ops: it fits inside the forward stage
        assert 0 < step.device_busy <= step.stages["forward"] + 1e-3
        assert step.host_overhead == pytest.approx(step.duration - step.device_busy)
        assert step.idle_between_kernels >= 0 and step.idle_step_edges >= -1e-3
        # schedule, prepare, sample and detokenize leave the device idle: at least their time is host overhead
        others = sum(t for name, t in step.stages.items() if name != "forward")
        assert step.idle_step_edges >= others - 1e-3
    parts = analysis.idle_breakdown()
    assert sum(parts.values()) == pytest.approx(analysis.span, rel=1e-9)
    assert all(v >= -1e-3 for v in parts.values())
    assert analysis.idle_fraction == pytest.approx(1 - parts["device busy"] / analysis.span)
    assert analysis.driver_stages["stream"] > 0 and analysis.driver_stages["tokenize"] > 0


def test_timeline_draws_steps_and_gaps(prof: EngineProfile) -> None:
    analysis = prof.analyze()
    ax = plot_step_timeline(analysis, steps=[1, 2])
    assert "device idle" in ax.get_title()
    assert len(ax.collections) >= 2 and len(ax.patches) > 0  # stage and device bars; shaded gaps
    plt.close(ax.figure)
    with pytest.raises(ValueError, match="steps must be indices"):
        plot_step_timeline(analysis, steps=[len(analysis.steps)])


def test_tensorboard_plugin_lists_the_run(prof: EngineProfile) -> None:
    server = TensorBoardServer(prof.logdir)
    try:
        server.start()
        assert server.url is not None and server.url.startswith("http://127.0.0.1:")
        views = server.wait_for_run(prof.run_name)
        assert "Overview" in views and "Trace" in views
        workers = server.workers(prof.run_name)
        assert workers == ["chunked"]  # the profiler's worker name is the engine's
        spans = server.spans(prof.run_name, workers[0])
        overview = server.overview(prof.run_name, workers[0], spans[0])
        # the plugin breaks the run down by the profiler's step markers: one per engine step (+ the setup step)
        assert len(overview["steps"]["rows"]) == len(prof.step_stats) + 1
        assert {"title": "Device Type", "value": "CPU"} in overview["environments"]
    finally:
        pid, log = server.pid, server.log_path
        server.stop()
    assert server.pid is None and server.url is None and pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the server is gone
    assert log is not None and not log.exists()  # and so is its log file


def test_tensorboard_refuses_a_missing_logdir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a folder"):
        TensorBoardServer(tmp_path / "nope")


def test_a_second_run_gets_its_own_folder(llm: LLM, prof: EngineProfile) -> None:
    again = profile_engine(llm, PROMPTS[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                           logdir=prof.logdir, run_name="tiny chunked", warmup=False)
    assert again.run_name == "tiny_chunked_2" and again.trace_path.is_file()
    assert prof.trace_path.is_file()


def test_a_bad_prompt_leaves_nothing_in_the_engine(llm: LLM, tmp_path: Path) -> None:
    too_long = [5] * llm.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        profile_engine(llm, ["Once upon a time", too_long], PARAMS, logdir=tmp_path, warmup=False)
    assert not llm.engine.has_unfinished_requests()  # the good request queued before it was dropped too


# ---- hand-made traces with known answers ----

def _x(name: str, start: float, end: float, cat: str = "user_annotation") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start, "pid": 1, "tid": 1}


def _step(start: float, forward: tuple[float, float], end: float) -> list[dict]:
    """A step from start to end: schedule/prepare before the forward, sample/detokenize after it."""
    f0, f1 = forward
    mid_before, mid_after = (start + f0) / 2, (f1 + end) / 2
    return [_x("labkit::step", start, end), _x("labkit::schedule", start, mid_before),
            _x("labkit::prepare", mid_before, f0), _x("labkit::forward", f0, f1),
            _x("labkit::sample", f1, mid_after), _x("labkit::detokenize", mid_after, end)]


def test_cpu_analysis_on_a_known_trace() -> None:
    events = [_x("labkit::tokenize", 0, 5)]
    events += _step(10, (20, 60), 70)
    events += [_x("aten::linear", 22, 30, "cpu_op"), _x("aten::addmm", 23, 29, "cpu_op"),  # nested
               _x("aten::mul", 28, 35, "cpu_op"),  # overlaps the linear: busy 22-35
               _x("aten::softmax", 40, 50, "cpu_op"),  # busy 40-50; gap 35-40 between kernels
               _x("aten::argmax", 62, 64, "cpu_op")]  # in sample: host work by the CPU definition
    events += [_x("labkit::stream", 70, 75)]
    events += _step(80, (85, 95), 100)
    events += [_x("aten::linear", 85, 95, "cpu_op"), _x("aten::empty", 81, 82, "cpu_op")]  # empty is in prepare
    a = analyze_trace(events, "cpu")
    s0, s1 = a.steps
    assert s0.stages == {"schedule": 5, "prepare": 5, "forward": 40, "sample": 5, "detokenize": 5}
    assert s0.untracked == 0
    assert s0.device_busy == 23 and s0.idle_between_kernels == 5 and s0.num_device_intervals == 2
    assert s0.host_overhead == 60 - 23 and s0.idle_step_edges == 60 - 23 - 5
    assert s1.device_busy == 10 and s1.idle_between_kernels == 0
    assert a.span == 90 and a.busy == 33
    assert a.idle_between_steps == 10
    assert a.idle_fraction == pytest.approx(1 - 33 / 90)
    assert a.driver_stages == {"tokenize": 5, "stream": 5}
    assert sum(a.idle_breakdown().values()) == pytest.approx(90)
    # treating the sample stage as device work too picks up the argmax
    assert analyze_trace(events, "cpu", device_stages=("forward", "sample")).steps[0].device_busy == 25


def test_cuda_analysis_counts_kernels_not_host_ops() -> None:
    events = _step(0, (10, 90), 100)
    events += [_x("aten::mm", 12, 14, "cpu_op"),  # the launch on the host: not device work on CUDA
               _x("gemm_kernel", 20, 50, "kernel"), _x("elementwise", 45, 60, "kernel"),  # two streams overlap
               _x("Memcpy HtoD", 5, 8, "gpu_memcpy"),  # the input copy, during prepare
               _x("cudaLaunchKernel", 12, 13, "cuda_runtime")]
    events += _step(100, (110, 180), 200) + [_x("gemm_kernel", 150, 170, "kernel")]  # between the steps: none
    a = analyze_trace(events)  # kernels present: guessed as CUDA
    assert a.device_type == "cuda"
    s0, s1 = a.steps
    assert s0.device_busy == 3 + 40 and s0.idle_between_kernels == 12 and s0.num_device_intervals == 2
    assert s1.device_busy == 20 and s1.idle_between_kernels == 0
    assert a.busy == 63 and a.idle_between_steps == 0
    assert a.idle_fraction == pytest.approx(1 - 63 / 200)
    assert a.host_share == pytest.approx((200 - 63) / 200)


def test_analysis_needs_steps_and_a_known_device() -> None:
    with pytest.raises(ValueError, match="no labkit::step"):
        analyze_trace([_x("aten::mm", 0, 1, "cpu_op")], "cpu")
    with pytest.raises(ValueError, match="device_type must be"):
        analyze_trace(_step(0, (1, 2), 3), "tpu")


def test_union_helpers() -> None:
    assert merge_intervals([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert busy_time([(0, 10), (2, 3), (8, 20)], 5, 15) == 10
    assert busy_time([], 0, 1) == 0


def test_an_async_engine_is_refused_not_traced_blind(tmp_path: Path) -> None:
    llm = LLM("labkit-tiny", engine="chunked", async_scheduling=True)
    with pytest.raises(ValueError, match="cannot trace an engine with async_scheduling=True: its forward pass runs "
                                         "on a worker thread"):
        profile_engine(llm, ["Once upon a time"], logdir=tmp_path)
    assert not llm.engine.has_unfinished_requests()


def test_stage_ranges_cost_nothing_without_a_profiler() -> None:
    """The engine's named ranges are recorded under a profiler and skipped otherwise (an idle record_function
    costs microseconds of host time per stage)."""
    from contextlib import nullcontext

    import torch

    from labkit.core.engine.step import profiler_range

    assert isinstance(profiler_range("labkit::idle"), nullcontext)
    with torch.profiler.profile() as p:
        with profiler_range("labkit::traced"):
            torch.ones(2) + 1
    assert "labkit::traced" in {e.name for e in p.events()}
