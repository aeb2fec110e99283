"""The browser tests' process handling: what they start is stopped by pid, kernels included."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil

from .browser_services import copy_workbook, stop_process_tree

# A parent that starts a child in a session of its own (as Jupyter starts kernels), then waits.
PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(600)\n")


def test_stop_process_tree_stops_descendants_in_their_own_sessions() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    try:
        child_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        child = psutil.Process(child_pid)
        assert child.ppid() == parent.pid and child.status() != psutil.STATUS_ZOMBIE
    finally:
        stop_process_tree(parent, grace_s=5)
    assert parent.poll() is not None
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child_pid) and psutil.Process(child_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"child {child_pid} survived its parent's stop"
        time.sleep(0.1)


def test_the_workbook_is_served_from_a_copy(tmp_path: Path) -> None:
    served = copy_workbook(tmp_path)
    (served / "00_setup_and_hardware.ipynb").write_text("{}")  # what a save in JupyterLab would do
    committed = Path(__file__).resolve().parents[3] / "notebooks" / "00_setup_and_hardware.ipynb"
    assert committed.read_text() != "{}"
    assert (tmp_path / "data").resolve() == committed.parents[1] / "data"  # ../data still resolves
