"""What other programs use of this machine: measured before timing, so figures taken under load say so.

A classroom laptop runs a browser, a video call and a sync client; on two cores one busy neighbour halves what a
notebook measures and can flip a comparison. ``measure_load`` samples the whole machine's CPU time over a short
interval and subtracts this process and its children (the notebook's own work), leaving what the others used;
``OtherLoad`` is the same meter read over a whole run (the benchmark scripts' "other processes' CPU load").
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

    @property
    def fraction(self) -> float:
        """Share of all CPUs other processes kept busy (1.0: every core)."""
        return self.others_cores / self.cpu_count

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
    """CPU seconds of ``proc`` and its descendants: the live ones, and those that ended and were waited for (their
    time moves into their parent's ``children_*`` fields), so a server started and stopped during a benchmark still
    counts as this process's own work."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:  # a child ended between listing and reading
            continue
        total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
    return total


class OtherLoad:
    """What other programs used of this machine since ``start()``: for the length of a whole run. Notebook 03.

    ``measure_load`` is this meter over a short sleep; a benchmark script starts one when it starts timing and reads
    it at the end, so its report says how busy the neighbours kept the CPUs while it ran. Read it once the run's
    own child processes have been waited for, or their last moments count as another program's.
    """

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._me = psutil.Process(os.getpid())
        self._busy = _busy_seconds(psutil.cpu_times())
        self._own = _own_cpu_seconds(self._me)
        self._t0 = time.perf_counter()

    def report(self) -> LoadReport:
        """Other processes' CPU use since ``start()``, in cores."""
        wall = time.perf_counter() - self._t0
        busy = _busy_seconds(psutil.cpu_times()) - self._busy
        own = _own_cpu_seconds(self._me) - self._own
        others = max(0.0, (busy - own) / wall) if wall > 0 else 0.0
        try:
            load_avg: float | None = os.getloadavg()[0]
        except (AttributeError, OSError):  # Windows
            load_avg = None
        return LoadReport(cpu_count=psutil.cpu_count() or 1, others_cores=others, load_avg_1m=load_avg,
                          sample_s=wall)

    def fraction(self) -> float:
        """Share of all CPUs other processes kept busy since ``start()`` (1.0: every core)."""
        return self.report().fraction


def measure_load(sample_s: float = 0.5) -> LoadReport:
    """Sample the machine for ``sample_s`` seconds and report what processes other than this one used."""
    meter = OtherLoad()
    time.sleep(sample_s)
    return meter.report()


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
