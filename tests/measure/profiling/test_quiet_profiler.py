"""The profiler's own log lines stay out of the learner's view, and TensorBoard is asked for every run on disk.

Kineto (PyTorch's profiler back end) writes ``USDT: ... profiler_start`` / ``profiler_stop`` to file descriptor 2
from C++; notebook 10 once showed about fifty of them. They are checked in a child process, whose stderr is its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from labkit import LLM, SamplingParams
from labkit.measure.profiling import profile_engine
from labkit.measure.profiling.tensorboard import TensorBoardServer, runs_on_disk

MARK = "--- labkit from here ---"


def run_child(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=300, check=True)


def test_native_writes_to_stderr_are_silenced_only_inside_the_block() -> None:
    out = run_child("""
        import os
        from labkit.measure.profiling.profiler import native_stderr_silenced
        os.write(2, b"before\\n")
        with native_stderr_silenced():
            os.write(2, b"hidden\\n")
        os.write(2, b"after\\n")
    """)
    assert out.stderr.split() == ["before", "after"]


def test_profile_engine_prints_no_profiler_log_lines() -> None:
    out = run_child(f"""
        import os, tempfile
        import torch
        from torch.profiler import profile, ProfilerActivity
        from labkit import LLM, SamplingParams
        from labkit.measure.profiling import profile_engine
        with profile(activities=[ProfilerActivity.CPU]):  # the bare profiler, as a control
            torch.ones(2) + 1
        os.write(2, b"{MARK}\\n")
        llm = LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32")
        prof = profile_engine(llm, ["Once upon a time"], SamplingParams(max_tokens=2, temperature=0.0),
                              logdir=tempfile.mkdtemp())
        print(prof.trace_path.is_file(), len(prof.step_stats))
    """)
    control, ours = out.stderr.split(MARK)
    assert "profiler_start" in control  # this torch logs them: the check below means something
    assert "profiler_start" not in ours and "profiler_stop" not in ours and "USDT" not in ours
    assert out.stdout.split() == ["True", "2"]


def test_tensorboard_is_waited_for_until_it_lists_every_run(tmp_path: Path) -> None:
    llm = LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for k in range(3):
        profile_engine(llm, ["Once upon a time"], params, logdir=tmp_path, run_name="loop b1", warmup=k == 0)
    on_disk = runs_on_disk(tmp_path)
    assert on_disk == ["loop_b1", "loop_b1_2", "loop_b1_3"]
    with TensorBoardServer(tmp_path) as tb:
        assert tb.wait_for_runs(on_disk, timeout=120) == []
        assert set(on_disk) <= set(tb.runs())
        assert tb.wait_for_runs(["no_such_run"], timeout=0) == ["no_such_run"]
    llm.close()
