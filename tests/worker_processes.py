"""What the tests of labkit's worker processes share: whether a pid still runs, waiting for pids to go, and the
"parent killed by SIGKILL" scenario (no close, no atexit: a worker must notice on its own that its parent died).
Used by chapter 12's prefill worker tests and chapter 15's tensor-parallel rank tests."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

ORPHAN_SCRIPT = """
import os, signal, sys
from labkit import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], {llm_options})
    print(*({worker_pids}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close, no atexit: the workers must notice on their own
"""


def pid_alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout_s: float = 30) -> list[int]:
    """The pids still running after up to ``timeout_s`` seconds (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]


def workers_left_by_killed_parent(tmp_path: Path, model_path: Path, llm_options: str, worker_pids: str) -> list[int]:
    """Start ``LLM(model_path, <llm_options>)`` in a script, print ``<worker_pids>`` (an expression over ``llm``
    giving an iterable of pids), SIGKILL the script; the worker pids still running 30 s later (expected: none)."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN_SCRIPT.format(llm_options=llm_options, worker_pids=worker_pids))
    run = subprocess.run([sys.executable, str(script), str(model_path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == -signal.SIGKILL, run.stderr
    pids = [int(p) for p in run.stdout.split()]
    assert pids, f"the script printed no worker pid: {run.stdout!r}"
    return wait_gone(pids)
