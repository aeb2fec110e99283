"""measure_load: other programs' CPU use, with this process's own work subtracted."""

from __future__ import annotations

import os
import signal
from collections import namedtuple

import psutil
import pytest
from busy_neighbour import start_unrelated_spinner

from labkit.measure import load as load_mod
from labkit.measure.load import BUSY_CORES, LoadReport, OtherLoad, check_machine, measure_load

CpuTimes = namedtuple("CpuTimes", "user nice system idle iowait guest guest_nice")


class _FakeProcess:
    def __init__(self, own: list[float]) -> None:
        self.own = own

    def cpu_times(self) -> object:
        return namedtuple("P", "user system")(self.own.pop(0), 0.0)

    def children(self, recursive: bool = False) -> list[object]:
        return []


def _fake_machine(monkeypatch: pytest.MonkeyPatch, busy: tuple[float, float], own: tuple[float, float]) -> None:
    """Machine-wide busy seconds and this process's CPU seconds before and after the sample."""
    machine = [CpuTimes(b, 0.0, 0.0, 100.0, 0.0, 0.0, 0.0) for b in busy]
    monkeypatch.setattr(load_mod.psutil, "cpu_times", lambda: machine.pop(0))
    monkeypatch.setattr(load_mod.psutil, "Process", lambda pid: _FakeProcess(list(own)))
    monkeypatch.setattr(load_mod.psutil, "cpu_count", lambda: 2)
    monkeypatch.setattr(load_mod.time, "sleep", lambda s: None)
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(load_mod.time, "perf_counter", lambda: next(clock))


def test_own_work_is_not_counted_as_load(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1.5 core-seconds busy over 1 s, 1.2 of them this process's: others used 0.3 of a core
    _fake_machine(monkeypatch, busy=(10.0, 11.5), own=(4.0, 5.2))
    report = measure_load(1.0)
    assert report.others_cores == pytest.approx(0.3)
    assert not report.busy and report.advice() == ""
    assert "quiet" in report.summary() and "0.30 of 2 cores" in report.summary()


def test_a_busy_neighbour_is_reported_with_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_machine(monkeypatch, busy=(10.0, 11.5), own=(4.0, 4.4))
    report = measure_load(1.0)
    assert report.others_cores == pytest.approx(1.1)
    assert report.busy
    advice = report.advice()
    assert "close other programs" in advice and "OMP_NUM_THREADS=1" in advice and "re-run" in advice


def test_a_run_counts_children_it_waited_for_as_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark stops (and waits for) its servers before reading its meter: their CPU time, now in this process's
    children_* fields, is still its own work."""
    own = namedtuple("P", "user system children_user children_system")
    times = [own(4.0, 0.0, 0.0, 0.0), own(4.2, 0.0, 1.0, 0.0)]  # 0.2 s of its own, 1.0 s of a reaped server
    process = _FakeProcess([])
    monkeypatch.setattr(process, "cpu_times", lambda: times.pop(0))
    machine = [CpuTimes(b, 0.0, 0.0, 100.0, 0.0, 0.0, 0.0) for b in (10.0, 11.5)]
    monkeypatch.setattr(load_mod.psutil, "cpu_times", lambda: machine.pop(0))
    monkeypatch.setattr(load_mod.psutil, "Process", lambda pid: process)
    monkeypatch.setattr(load_mod.psutil, "cpu_count", lambda: 2)
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(load_mod.time, "perf_counter", lambda: next(clock))
    report = OtherLoad().report()
    assert report.others_cores == pytest.approx(0.3)  # 1.5 busy - 0.2 own - 1.0 the server's
    assert report.fraction == pytest.approx(0.15)  # of both cores


def test_guest_time_is_not_counted_twice() -> None:
    times = CpuTimes(user=5.0, nice=0.0, system=1.0, idle=10.0, iowait=1.0, guest=2.0, guest_nice=0.0)
    assert load_mod._busy_seconds(times) == pytest.approx(6.0)


def test_busy_threshold() -> None:
    assert LoadReport(2, BUSY_CORES, None, 0.5).busy
    assert not LoadReport(2, BUSY_CORES - 0.01, None, 0.5).busy
    assert "load average" not in LoadReport(2, 0.0, None, 0.5).summary()


@pytest.mark.skipif((psutil.cpu_count() or 1) < 2, reason="needs a second core for the neighbour")
def test_a_real_spinning_process_makes_the_machine_busy(capsys: pytest.CaptureFixture[str]) -> None:
    pid = start_unrelated_spinner()
    try:
        report = check_machine(sample_s=1.0)
    finally:
        os.kill(pid, signal.SIGKILL)
    assert report.others_cores > 0.7  # one core spinning, measured over a second
    assert report.busy
    out = capsys.readouterr().out
    assert "BUSY" in out and "close other programs" in out


class _FakeTree:
    """A process with CPU counters read from a script, and its (live) children."""

    def __init__(self, times: list[tuple[float, ...]], children: list[_FakeTree] | None = None) -> None:
        self.times = times  # (user, system[, children_user]) per read, in order
        self.kids = children or []

    def cpu_times(self) -> object:
        if not self.times:
            raise psutil.NoSuchProcess(pid=0)  # ended between listing and reading
        user, system, *reaped = self.times.pop(0)
        return namedtuple("P", "user system children_user children_system")(user, system, sum(reaped), 0.0)

    def children(self, recursive: bool = False) -> list[_FakeTree]:
        assert recursive  # a worker's own helpers (a server's engine process) are the notebook's work too
        return [p for kid in self.kids for p in (kid, *kid.children(recursive=True))]


def test_this_process_children_count_as_its_own_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A notebook's servers and workers are its own work, not a neighbour: the CPU time of its live children (and
    theirs) is subtracted from the machine's, and so is a child's that ended during the sample (waited for, its time
    is in this process's children_* fields). The counters are injected: this checks the accounting, not how busy the
    machine happens to be (the real-process check is test_a_real_spinning_process_makes_the_machine_busy)."""
    grandchild = _FakeTree([(1.0, 0.0), (1.4, 0.1)])  # 0.5 s: a server's engine process
    child = _FakeTree([(2.0, 0.0), (2.8, 0.2)], [grandchild])  # 1.0 s: a spinning server
    ended = _FakeTree([(5.0, 0.0)])  # a worker stopped and waited for: 0.3 s more, then gone before the second read
    me = _FakeTree([(3.0, 0.0), (3.2, 0.0, 5.3)], [child, ended])  # 0.2 s of its own; ended's 5.3 s moved here
    machine = [CpuTimes(b, 0.0, 0.0, 100.0, 0.0, 0.0, 0.0) for b in (10.0, 12.3)]  # 2.3 core-seconds busy
    monkeypatch.setattr(load_mod.psutil, "cpu_times", lambda: machine.pop(0))
    monkeypatch.setattr(load_mod.psutil, "Process", lambda pid: me)
    monkeypatch.setattr(load_mod.psutil, "cpu_count", lambda: 2)
    monkeypatch.setattr(load_mod.time, "sleep", lambda s: None)
    clock = iter([0.0, 1.0])
    monkeypatch.setattr(load_mod.time, "perf_counter", lambda: next(clock))
    report = measure_load(1.0)
    # 2.3 busy - 0.2 own - 1.0 child - 0.5 grandchild - 0.3 ended = 0.3 cores from other programs: quiet. Without the
    # live children it would read 1.8 cores (BUSY), without the grandchild 0.8 (BUSY)
    assert report.others_cores == pytest.approx(0.3)
    assert not report.busy
