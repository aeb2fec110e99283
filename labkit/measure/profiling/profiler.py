"""Profile an engine run with ``torch.profiler``: one trace for TensorBoard, Perfetto and the notebook.

``profile_engine(llm, prompts, params)`` runs the requests the way a server does (queue them, then
``step`` the engine and hand each request its new text after every step) under ``torch.profiler`` with
CPU activity, plus CUDA activity on a GPU. Every step is a ``labkit::step`` range with its stages
inside (``labkit::schedule / prepare / forward / sample / detokenize``, the engine's ``StageClock``);
the driver adds ``labkit::tokenize`` (queueing the prompts) and ``labkit::stream`` (after each step).

The trace is written once, by ``torch.profiler.tensorboard_trace_handler``, as
``<logdir>/<run_name>/<worker>.<id>.pt.trace.json``. That one file is what the torch-tb-profiler
plugin of TensorBoard reads (``tensorboard --logdir <logdir>``), what Perfetto (ui.perfetto.dev) and
``chrome://tracing`` open, and what ``labkit.measure.profiling.trace_analysis`` parses.

Profiling costs time: every recorded operator adds a microsecond or so, so traced steps run slower
than untraced ones. Read a trace for *where* time goes; time untraced runs for *how much* (the
benchmark ``scripts/bench_host_overhead.py`` does both).

Introduced in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function, tensorboard_trace_handler

from labkit.core.engine.step import StepStats
from labkit.core.llm import LLM, Prompt
from labkit.core.sampling_params import SamplingParams
from labkit.measure.profiling.trace_analysis import TraceAnalysis, analyze_trace

TRACE_SUFFIX = ".pt.trace.json"  # the plugin finds runs by this suffix


@dataclass
class EngineProfile:
    """A profiled engine run: where its trace is, its events, and what the engine did. Notebook 10."""

    logdir: Path  # give this to TensorBoard: ``tensorboard --logdir <logdir>``
    run_name: str  # the run's folder under logdir, and its name in TensorBoard
    trace_path: Path  # the Chrome trace JSON (open it in Perfetto or chrome://tracing)
    device_type: str  # "cuda" or "cpu"
    events: list[dict[str, Any]]  # the trace's traceEvents
    step_stats: list[StepStats]  # the engine's own record of the profiled steps
    texts: list[str]  # each request's streamed text, in prompt order (n > 1: one per sample)
    wall_time: float  # seconds the profiled run took (profiler overhead included)

    @property
    def run_dir(self) -> Path:
        return self.logdir / self.run_name

    def range_names(self) -> set[str]:
        """Names of the labkit:: ranges in the trace."""
        return {str(e["name"]) for e in self.events if str(e.get("name", "")).startswith("labkit::")}

    def analyze(self, device_stages: Seq[str] = ("forward",)) -> TraceAnalysis:
        """The per-step breakdown and device idle time (``labkit.measure.profiling.trace_analysis``)."""
        return analyze_trace(self.events, self.device_type, device_stages)


@contextmanager
def native_stderr_silenced() -> Iterator[None]:
    """Send what native code writes to file descriptor 2 to /dev/null while the block runs.

    The profiler's C++ side (Kineto) logs ``USDT: ... profiler_start`` and ``profiler_stop`` straight to the
    process's stderr, below Python, so a notebook shows two such lines per profiled run. Python's own ``sys.stderr``
    (warnings, tracebacks) is untouched in a notebook, where it is not file descriptor 2.
    """
    try:
        sys.stderr.flush()
    except (AttributeError, ValueError):  # no stderr, or a closed one
        pass
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _run_name(logdir: Path, wanted: str) -> str:
    """A folder name TensorBoard shows as is; a new one if ``wanted`` already holds a trace."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", wanted).strip("._") or "run"
    name, k = base, 2
    while (logdir / name).is_dir() and any((logdir / name).glob(f"*{TRACE_SUFFIX}*")):
        name, k = f"{base}_{k}", k + 1
    return name


def drive(llm: LLM, prompts: Seq[Prompt], params: Seq[SamplingParams],
          before_step: Callable[[], None] | None = None) -> list[str]:
    """Queue every prompt, step the engine until all are done, stream each request's new text after every step.

    A server's engine loop in miniature (notebook 09), run by the engine's own loop (``Engine.run``) like every other
    front end, with the driver's work in named ranges. ``before_step`` runs before every engine step (the profiler's
    ``step()``, which marks steps for TensorBoard). Raises ``RequestFailedError`` if a step failed a request.
    """
    with record_function("labkit::tokenize"):
        groups = llm.input_processor.make_sequences(list(prompts), list(params))
    outputs = llm.output_processor
    texts = {s.seq_id: "" for g in groups for s in g}
    with closing(llm.engine.run(groups, before_step=before_step)) as steps:
        for stepped in steps:
            with record_function("labkit::stream"):
                for seq in stepped:
                    if seq.seq_id in texts:
                        texts[seq.seq_id] += outputs.pop_delta(seq)
    outputs.make_outputs(groups)
    return [texts[s.seq_id] for g in groups for s in g]


def profile_engine(
    llm: LLM,
    prompts: Prompt | Seq[Prompt],
    params: SamplingParams | Seq[SamplingParams] | None = None,
    logdir: str | Path | None = None,
    run_name: str | None = None,
    record_shapes: bool = False,
    with_stack: bool = False,
    warmup: bool = True,
) -> EngineProfile:
    """Profile ``llm`` serving ``prompts``; write the trace under ``logdir`` and return it parsed.

    ``logdir``: a folder for TensorBoard (a new temporary one if None); the trace goes to
    ``logdir/run_name/``. ``record_shapes`` / ``with_stack`` make the trace richer and the run slower.
    ``warmup`` first runs one short untraced request, so one-off start-up costs stay out of the trace.
    """
    if llm.engine.async_scheduling:
        raise ValueError("profile_engine cannot trace an engine with async_scheduling=True: its forward pass runs on "
                         "a worker thread, whose operators torch.profiler does not record, so the trace would show a "
                         "device that never works. Profile the same engine with async_scheduling=False (its steps "
                         "compute the same), and compare wall time per step to see what the overlap saves")
    prompts, plist = llm.input_processor.broadcast(prompts, params)
    if not prompts:
        raise ValueError("profile_engine needs at least one prompt")
    root = Path(logdir) if logdir is not None else Path(tempfile.mkdtemp(prefix="labkit-profile-"))
    root.mkdir(parents=True, exist_ok=True)
    name = _run_name(root, run_name or f"{llm.engine_name}_{llm.source.name}")
    run_dir = root / name
    if warmup:  # one prefill and one decode step, if the first prompt leaves room for them
        room = llm.max_model_len - len(llm.encode(prompts[0]))
        drive(llm, prompts[:1], [SamplingParams(max_tokens=max(1, min(2, room)), temperature=0.0, ignore_eos=True)])

    activities = [ProfilerActivity.CPU]
    if llm.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    before = set(run_dir.glob(f"*{TRACE_SUFFIX}")) if run_dir.is_dir() else set()
    first_step = len(llm.engine.step_stats)
    handler = tensorboard_trace_handler(str(run_dir), worker_name=llm.engine_name)
    t0 = time.perf_counter()
    # A schedule that always records makes the profiler mark each step (ProfilerStep#N), so TensorBoard's
    # overview breaks the run down by engine step; the trace is written once, when the block ends.
    # The profiler's start and stop log to the process's stderr from C++: kept out of the learner's view.
    prof = profile(activities=activities, record_shapes=record_shapes, with_stack=with_stack,
                   schedule=lambda step: ProfilerAction.RECORD, on_trace_ready=handler)
    with native_stderr_silenced():
        prof.__enter__()
    try:
        texts = drive(llm, prompts, plist, before_step=prof.step)
    finally:
        with native_stderr_silenced():
            prof.__exit__(None, None, None)  # stops the profiler and writes the trace
    wall = time.perf_counter() - t0
    written = sorted(set(run_dir.glob(f"*{TRACE_SUFFIX}")) - before)
    if len(written) != 1:
        raise RuntimeError(f"expected the profiler to write one {TRACE_SUFFIX} file in {run_dir}, found {written}")
    trace_path = written[0]
    events = json.loads(trace_path.read_text())["traceEvents"]
    return EngineProfile(
        logdir=root, run_name=name, trace_path=trace_path, device_type=llm.device.type, events=events,
        step_stats=list(llm.engine.step_stats[first_step:]), texts=texts, wall_time=wall,
    )
