"""Profiling the engine (notebook 10, ``10_profiling_host_overhead``): traces, host gaps, device idle time.

    from labkit.measure.profiling import profile_engine
    prof = profile_engine(llm, prompts, SamplingParams(max_tokens=16))
    analysis = prof.analyze()          # per-step stages, host overhead, device idle fraction
    plot_step_timeline(analysis)       # one or two steps, gaps marked
"""

from labkit.measure.profiling.profiler import EngineProfile, drive, profile_engine
from labkit.measure.profiling.trace_analysis import (
    StepBreakdown,
    TraceAnalysis,
    analyze_trace,
    busy_time,
    idle_fraction,
    merge_intervals,
)

__all__ = [
    "EngineProfile",
    "StepBreakdown",
    "TraceAnalysis",
    "analyze_trace",
    "busy_time",
    "drive",
    "idle_fraction",
    "merge_intervals",
    "profile_engine",
]
