"""What other programs use of this machine: measured before timing, so figures taken under load say so.

A classroom laptop runs a browser, a video call and a sync client; on two cores one busy neighbour halves what a
notebook measures and can flip a comparison. ``measure_load`` samples the whole machine's CPU time over a short
interval and subtracts this process and its children (the notebook's own work), leaving what the others used.
Introduced in notebook 03 (``03_kv_cache``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import psutil

# Other programs using at least this much of one core make a 2-4 core machine's timings move by tens of percent.
BUSY_CORES = 0.5


@dataclass(frozen=True)
class LoadReport:
    """Other processes' CPU use during a short sample, in cores. Notebook 03."""

    cpu_count: int
    others_cores: float  # CPU used by every other process, in cores (1.0 = one core fully busy)
    load_avg_1m: float | None  # the OS's 1-minute load average (None where the OS has none)
    sample_s: float

    @property
    def busy(self) -> bool:
        return self.others_cores >= BUSY_CORES

    def summary(self) -> str:
        avg = f", load average {self.load_avg_1m:.2f}" if self.load_avg_1m is not None else ""
        state = "BUSY" if self.busy else "quiet"
        return (f"machine {state}: other programs used {self.others_cores:.2f} of {self.cpu_count} cores "
                f"over {self.sample_s:.1f} s{avg}")

    def advice(self) -> str:
        """What to do when the machine is busy (empty when it is quiet)."""
        if not self.busy:
            return ""
        return ("Figures below are taken under load and may move between runs. To measure cleanly: close other "
                "programs (browser tabs playing video, video calls, sync clients, other notebooks' kernels); "
                f"or give this kernel fewer threads than cores (OMP_NUM_THREADS={max(1, self.cpu_count - 1)} "
                "before starting Jupyter, or torch.set_num_threads here) so it does not fight the neighbour; then "
                "re-run the measurement cell. Each comparison below says whether its conclusion held in every round.")


def _own_cpu_seconds(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a child ended between listing and reading
            continue
    return total


def measure_load(sample_s: float = 0.5) -> LoadReport:
    """Sample the machine for ``sample_s`` seconds and report what processes other than this one used."""
    me = psutil.Process(os.getpid())
    busy0 = _busy_seconds(psutil.cpu_times())
    own0 = _own_cpu_seconds(me)
    t0 = time.perf_counter()
    time.sleep(sample_s)
    wall = time.perf_counter() - t0
    busy = _busy_seconds(psutil.cpu_times()) - busy0
    own = _own_cpu_seconds(me) - own0
    others = max(0.0, (busy - own) / wall)
    try:
        load_avg: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        load_avg = None
    return LoadReport(cpu_count=psutil.cpu_count() or 1, others_cores=others, load_avg_1m=load_avg, sample_s=wall)


def _busy_seconds(times: Any) -> float:
    """CPU seconds spent not idle, summed over every core (``times``: psutil's ``cpu_times()``)."""
    fields: dict[str, float] = times._asdict()
    idle = fields.get("idle", 0.0) + fields.get("iowait", 0.0)
    # guest time is already inside user time on Linux; counting it twice would overstate the load
    guest = fields.get("guest", 0.0) + fields.get("guest_nice", 0.0)
    return sum(fields.values()) - guest - idle


def check_machine(sample_s: float = 0.5, verbose: bool = True) -> LoadReport:
    """Measure the load and, when other programs are busy, print what that means and what to do."""
    report = measure_load(sample_s)
    if verbose:
        print(report.summary())
        if report.busy:
            print(report.advice())
    return report
