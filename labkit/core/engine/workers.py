"""Worker processes labkit starts, watched by their parent: a death is reported at once, a hang within a bound.

Chapter 12's prefill worker and chapter 15's tensor-parallel ranks are spawned processes that meet their parent on
a ``torch.distributed`` group. Forming that group blocks until every rank arrives, so a parent that simply waits
there waits the group's whole timeout for a worker that is already dead. ``WorkerProcess`` watches instead:

* ``start`` spawns the process; the child's stderr is teed (still printed where it always went) and its tail kept,
  so the parent can quote the worker's last error, even one raised before the worker's own code ran;
* ``wait_started`` waits until the child has reached its entry point (``started``), failing at once if the child
  dies, with its exit code and last error, and after ``join_timeout_s`` with the likely cause: the spawned process
  imports the main module again (as ``__mp_main__``), so a script without ``if __name__ == "__main__":`` runs its
  own work again there (and dies trying to start a worker of its own, or keeps working and never arrives);
* ``run_watched`` runs a blocking call (the parent's side of the rendezvous) while watching every worker;
* ``check_alive`` is the per-step liveness check (a poll of the process's sentinel: no wait, no reaping), which
  raises ``EngineDeadError`` naming the exit.

vLLM's engine core watches its worker processes the same way and raises ``EngineDeadError`` when one dies.
Introduced in notebook 12 (``12_disaggregated_prefill``); notebook 15 starts its ranks through it.
"""

from __future__ import annotations

import multiprocessing as std_mp
import os
import select
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch.multiprocessing as mp

from labkit.core.engine.errors import EngineDeadError, WorkerStartError

T = TypeVar("T")
DEFAULT_JOIN_TIMEOUT_S = 60.0  # a spawned worker imports torch and labkit first: seconds on a busy 2-core laptop
STARTED = "started"
GUARD_FIX = ('put the script\'s work under `if __name__ == "__main__":` (the spawned worker imports the main '
             "module again, as __mp_main__, and must not redo that work there)")
_TAIL_BYTES = 16384
_child_conn: Connection | None = None  # in a worker: the pipe to its parent (report_fatal writes there)


class StderrTail:
    """A pipe the child writes its stderr into; a thread forwards every byte to where stderr went before and keeps
    the last ``_TAIL_BYTES``. Best effort: without ``os.pipe``/``dup2`` (Windows) nothing is captured."""

    def __init__(self) -> None:
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._out: int | None = None
        try:
            self._read_fd, self._write_fd = os.pipe()
            self._out = os.dup(2)
        except (OSError, AttributeError):
            self._read_fd = self._write_fd = self._out = None

    @contextmanager
    def installed(self) -> Iterator[None]:
        """While the child is created, fd 2 is the pipe (it inherits it); this process's own writes in that
        moment pass through the pipe too, so nothing is lost."""
        if self._write_fd is None or os.name == "nt":
            yield
            return
        saved = os.dup(2)
        os.dup2(self._write_fd, 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            os.close(self._write_fd)  # only the child holds the write end now
            self._write_fd = None
            threading.Thread(target=self._pump, name="labkit-worker-stderr", daemon=True).start()

    def _pump(self) -> None:
        while self._read_fd is not None:
            try:
                readable = select.select([self._read_fd], [], [], 0.1)[0]
            except (OSError, ValueError, TypeError):
                return
            if readable and not self.drain():
                return

    def drain(self) -> bool:
        """Forward and keep what is in the pipe now; False at end of file. The parent calls it after the child
        exited, so the tail holds everything the child wrote."""
        with self._lock:
            while self._read_fd is not None:
                try:
                    if not select.select([self._read_fd], [], [], 0)[0]:
                        return True
                    data = os.read(self._read_fd, 65536)
                except (OSError, ValueError):
                    return False
                if not data:
                    self._close_locked()
                    return False
                self._tail = (self._tail + data)[-_TAIL_BYTES:]
                if self._out is not None:
                    try:
                        os.write(self._out, data)
                    except OSError:
                        pass  # where stderr went is gone: keep the tail anyway
            return False

    def text(self) -> str:
        self.drain()
        return self._tail.decode(errors="replace")

    def close(self) -> None:
        self.drain()
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        for name in ("_read_fd", "_out", "_write_fd"):
            fd = getattr(self, name)
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
                setattr(self, name, None)


def last_exception_line(text: str, limit: int = 240) -> str | None:
    """The exception that ended the last traceback in ``text`` ("RuntimeError: ...", its continuation lines
    joined), or None without one."""
    at = text.rfind("Traceback (most recent call last):")
    if at < 0:
        return None
    lines = text[at:].splitlines()[1:]
    heads = [i for i, line in enumerate(lines) if line.strip() and not line.startswith((" ", "\t"))]
    if not heads:
        return None
    words = " ".join(" ".join(lines[heads[-1]:]).split())
    return words if len(words) <= limit else words[: limit - 3] + "..."


def exit_text(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"exited with code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"exited with code {code} (killed by signal {-code})"
    return f"exited with code {code}"


def _bootstrap(conn: Connection, target: Callable[..., None], args: tuple[Any, ...]) -> None:
    """The child's entry point: tell the parent it arrived, run ``target``, report an exception before dying."""
    global _child_conn
    _child_conn = conn
    conn.send((STARTED, ""))
    try:
        target(*args)
    except BaseException as exc:  # noqa: BLE001  reported to the parent; exit code 1
        report_fatal(exc)
        raise SystemExit(1) from None  # the traceback is printed once (multiprocessing would print it again)


def report_fatal(exc: BaseException) -> None:
    """In a worker: tell the parent why this process is about to end, and print the traceback to stderr (a worker
    that leaves with ``os._exit`` calls it first; ``_bootstrap`` does for an exception that escapes)."""
    traceback.print_exception(exc)
    sys.stderr.flush()
    if _child_conn is not None:
        try:
            _child_conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except (OSError, ValueError):
            pass  # the parent is gone


class WorkerProcess:
    """One spawned worker and its parent's watch over it. Notebook 12 (the prefill worker); notebook 15 (ranks).

        worker = WorkerProcess(run_rank, (spec,), name="labkit-tp-rank-1").start()
        worker.wait_started()                        # dies -> at once; never arrives -> join_timeout_s
        group = run_watched(lambda: open_group(...), [worker], "forming the process group", timeout_s=120)
        ...
        worker.check_alive()                          # every step: EngineDeadError once it is gone
        worker.stop(ask=lambda: link.send_stop())     # politely, then terminate, then kill
    """

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...], name: str,
                 join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S, daemon: bool = True, label: str | None = None
                 ) -> None:
        if isinstance(join_timeout_s, bool) or not isinstance(join_timeout_s, (int, float)) or not join_timeout_s > 0:
            raise ValueError(f"join_timeout_s must be a positive number of seconds, got {join_timeout_s!r}")
        self.name = name
        self.label = label or f"the worker {name}"  # how messages name it ("the prefill worker")
        self.join_timeout_s = float(join_timeout_s)
        self._conn, child_conn = std_mp.Pipe(duplex=False)
        self.process = mp.get_context("spawn").Process(target=_bootstrap, args=(child_conn, target, args),
                                                      name=name, daemon=daemon)
        self._child_conn: Connection | None = child_conn
        self.stderr = StderrTail()
        self.started = False  # the child reached its entry point
        self.reported_error: str | None = None  # what the child said before it died (``report_fatal``)

    def start(self) -> WorkerProcess:
        try:  # spawn's helper process, started once per interpreter: not inside the tee (it would hold the pipe)
            from multiprocessing import resource_tracker
            resource_tracker.ensure_running()
        except (ImportError, OSError):
            pass
        with self.stderr.installed():
            self.process.start()
        assert self._child_conn is not None
        self._child_conn.close()  # the child holds its end: the parent sees end of file once it is gone
        self._child_conn = None
        return self

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode if not self.is_alive() else None

    def is_alive(self) -> bool:
        """Whether the process still runs: a poll of its sentinel (safe from any thread, reaps nothing)."""
        if self.process.pid is None:
            return False
        return not wait([self.process.sentinel], 0)

    def _read_messages(self) -> None:
        while True:
            try:
                if not self._conn.poll(0):
                    return
                kind, text = self._conn.recv()
            except (EOFError, OSError):
                return
            if kind == STARTED:
                self.started = True
            elif kind == "error":
                self.reported_error = text

    def last_error(self) -> str | None:
        """The worker's last error: what it reported, else the last traceback line it wrote to stderr."""
        self._read_messages()
        return self.reported_error or last_exception_line(self.stderr.text())

    def describe_exit(self) -> str:
        """'worker <name> (pid N) exited with code C: <last error>', after giving an exiting process a moment
        (its end of a socket resets a moment before its exit code can be read)."""
        self.process.join(timeout=2.0)
        error = self.last_error() if self.process.exitcode is not None else None
        return f"{self.label} (pid {self.pid}) {exit_text(self.process.exitcode)}" + \
            (f"; its last error: {error}" if error else "")

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` naming the exit if the process is gone: the per-step liveness check."""
        if not self.is_alive():
            raise EngineDeadError(self.describe_exit())

    # ---- start-up ----

    def wait_started(self) -> None:
        """Wait until the child reached its entry point, watching it; raises ``WorkerStartError`` at once if it
        died, or after ``join_timeout_s`` if it never arrived (the missing main-module guard, most likely)."""
        deadline = time.monotonic() + self.join_timeout_s
        while not self.started:
            ready = wait([self._conn, self.process.sentinel], timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            self._read_messages()
            if self.started:
                return
            if self.process.sentinel in ready or not self.is_alive():
                self.stop()
                raise WorkerStartError(self._died_before_start())
            if time.monotonic() >= deadline:
                self.stop()
                raise WorkerStartError(
                    f"{self.label} (pid {self.pid}) did not start within {self.join_timeout_s:g} s "
                    "(join timeout). The likely cause: the script that created it has no main-module guard, so the "
                    "spawned process, which imports that script again, is busy redoing its work. Fix: "
                    f"{GUARD_FIX}. If the machine is only slow, raise the join timeout (worker_join_timeout_s).")

    def _died_before_start(self) -> str:
        tail = self.stderr.text()
        error = self.last_error()
        died = f"{self.label} (pid {self.pid}) {exit_text(self.process.exitcode)} before it started"
        died += f"; its last error: {error}" if error else ""
        if "bootstrapping phase" in tail or "freeze_support" in tail:
            return (f"{died}. Cause: the script that created it has no main-module guard: the spawned process "
                    "imported that script again and tried to start a worker of its own. Fix: " + GUARD_FIX + ".")
        return (f"{died}. It died while importing (the spawned process imports the main module again, then "
                f"labkit and torch); if your script does work at import time, {GUARD_FIX}.")

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Poll ``ready()`` until true, watching the process: its death or the timeout raises ``WorkerStartError``."""
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not self.is_alive():
                self.stop()
                raise WorkerStartError(f"{what}: {self.describe_exit()}")
            if time.monotonic() > deadline:
                self.stop()
                raise WorkerStartError(f"{what}: no answer from {self.label} (pid {self.pid}) within "
                                       f"{timeout_s:g} s")
            wait([self.process.sentinel], timeout=0.01)

    # ---- shutdown ----

    def stop(self, ask: Callable[[], None] | None = None, grace_s: float = 5.0) -> None:
        """``ask()`` it to stop (a message on its link), then terminate, then kill; safe to repeat."""
        if self.process.pid is None:
            return
        if ask is not None and self.is_alive():
            try:
                ask()
            except RuntimeError:
                pass  # the link is broken already: terminate below
        self.process.join(timeout=grace_s if ask is not None else 0.1)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self._read_messages()
        self.stderr.close()


def run_watched(fn: Callable[[], T], workers: Sequence[WorkerProcess], what: str, timeout_s: float) -> T:
    """``fn()`` (a blocking rendezvous, e.g. the parent's side of forming the group) in a helper thread while the
    ``workers`` are watched: one that dies raises ``WorkerStartError`` at once, naming it; ``timeout_s`` bounds the
    whole wait. An abandoned ``fn`` ends with its own timeout (the group's)."""
    result: list[T] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def call() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # noqa: BLE001  re-raised in the caller's thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=call, name="labkit-rendezvous", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not done.wait(0.05):
        for worker in workers:
            if not worker.is_alive():
                raise WorkerStartError(f"{what}: {worker.describe_exit()}")
        if time.monotonic() > deadline:
            names = ", ".join(f"{w.label} (pid {w.pid})" for w in workers)
            raise WorkerStartError(f"{what}: not done within {timeout_s:g} s; {names} alive but not joined")
    if failure:
        dead = [w for w in workers if not w.is_alive()]
        if dead:  # the rendezvous failed because a worker died: name the death, not the socket error
            raise WorkerStartError(f"{what}: {dead[0].describe_exit()}") from failure[0]
        raise failure[0]
    return result[0]
