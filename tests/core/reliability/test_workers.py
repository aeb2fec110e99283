"""``labkit.core.engine.workers``: a worker process's death is reported at once with its exit code and last error,
the per-step liveness check raises ``EngineDeadError``, and a rendezvous waiting on a dead worker fails at once.

Each test spawns a small worker (``worker_targets``); the start-up failures of a real engine (a script without
the main-module guard, a worker that never joins) are tested on the disaggregated engine (tests/core/disagg)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from labkit.core.engine.errors import EngineDeadError, WorkerStartError
from labkit.core.engine.workers import WorkerProcess, exit_text, last_exception_line, run_watched

from . import worker_targets as targets


def started(target, name: str) -> WorkerProcess:  # type: ignore[no-untyped-def]
    worker = WorkerProcess(target, (), name=name, join_timeout_s=120).start()
    worker.wait_started()
    return worker


def test_a_worker_that_raises_is_reported_with_its_exit_code_and_last_error() -> None:
    worker = started(targets.raise_at_once, "raiser")
    worker.process.join(60)
    with pytest.raises(EngineDeadError) as info:
        worker.check_alive()
    assert info.value.cause == (f"the worker raiser (pid {worker.pid}) exited with code 1; its last error: "
                                "ValueError: planted start-up fault in the worker")
    assert "worker: about to fail" in worker.stderr.text()  # its stderr was kept (and still printed)
    worker.stop()


def test_a_killed_worker_is_seen_by_the_liveness_check_and_by_a_waiting_rendezvous() -> None:
    worker = started(targets.serve_forever, "server")
    worker.check_alive()  # alive: nothing raised
    never = threading.Event()
    killer = threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL))
    killer.start()
    with pytest.raises(WorkerStartError, match=r"forming the group: the worker server \(pid \d+\) exited with code "
                                               r"-9 \(killed by SIGKILL\)"):
        run_watched(lambda: never.wait(3600), [worker], "forming the group", timeout_s=3600)
    assert not worker.is_alive()
    with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
        worker.check_alive()
    never.set()
    worker.stop()


def test_a_clean_exit_is_a_death_too_and_stop_is_safe_to_repeat() -> None:
    worker = started(targets.exit_cleanly, "quitter")
    worker.process.join(60)
    assert worker.exitcode == 0 and not worker.is_alive()
    with pytest.raises(EngineDeadError, match=r"quitter \(pid \d+\) exited with code 0\."):
        worker.check_alive()
    worker.stop()
    worker.stop()


def test_the_last_exception_is_read_from_a_traceback() -> None:
    text = ("noise\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n    f()\n"
            "RuntimeError: \n        An attempt has been made to start a new process before the\n"
            "        current process has finished its bootstrapping phase.\n")
    assert last_exception_line(text) == ("RuntimeError: An attempt has been made to start a new process before the "
                                         "current process has finished its bootstrapping phase.")
    assert last_exception_line("no traceback here") is None
    assert exit_text(-9) == "exited with code -9 (killed by SIGKILL)" and exit_text(3) == "exited with code 3"
    with pytest.raises(ValueError, match="join_timeout_s must be a positive number"):
        WorkerProcess(targets.exit_cleanly, (), "x", join_timeout_s=0)


def test_an_engine_without_workers_is_alive_until_closed() -> None:
    from labkit import LLM

    llm = LLM("labkit-tiny", engine="naive", max_model_len=64)
    assert llm.is_alive() and llm.death_cause() is None
    llm.close()
    assert not llm.is_alive()
