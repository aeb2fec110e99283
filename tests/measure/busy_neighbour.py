"""A busy neighbour for the measurement tests: a process spinning on one core that is NOT this test's descendant.

``measure_load`` counts the notebook kernel's own children (servers, workers) as its own work, so a neighbour
started as a child would be invisible; the shell starts it in the background and exits, and the orphan is adopted
by init, as a video call on a learner's laptop would be unrelated to the notebook.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

SPIN = "import time\nend = time.time() + 300\nwhile time.time() < end:\n    pass"  # never outlives a killed run by long


def start_unrelated_spinner() -> int:
    """Start a spinning Python process outside this process's tree; its pid."""
    out = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$SPIN" >/dev/null 2>&1 & echo $!'],
                         env={**os.environ, "SPIN": SPIN}, capture_output=True, text=True, check=True)
    pid = int(out.stdout.strip())
    deadline = time.perf_counter() + 20
    while psutil.Process(pid).cpu_times().user < 0.3 and time.perf_counter() < deadline:
        time.sleep(0.1)  # until the interpreter has started and spins
    return pid
