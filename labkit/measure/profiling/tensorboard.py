"""Run TensorBoard on a trace folder, and ask its PyTorch Profiler plugin what it has loaded.

``TensorBoardServer(logdir)`` starts ``python -m tensorboard.main --logdir <logdir>`` as a child process
bound to 127.0.0.1 on a port the OS picks, waits until it answers, and ``stop()`` ends it by its pid
(also on ``with``-block exit). The torch-tb-profiler plugin serves its data as JSON under
``/data/plugin/pytorch_profiler/``: ``runs`` (the run folders it has found), ``views?run=``,
``workers?run=&view=``, ``spans?run=&worker=`` and ``overview?run=&worker=&span=`` (what the
browser UI draws). Reading those endpoints needs no browser and no internet; the plugin's browser UI
does: its pages fetch their chart library from the internet, so offline the profiler tab spins forever.
Offline, open the trace file in Chrome's built-in trace viewer (``chrome://tracing``, Load) or look at
``labkit.measure.profiling.timeline`` in the notebook. The plugin loads runs one by one in the background:
``wait_for_runs(runs_on_disk(logdir))`` waits until it lists them all.

In a notebook, ``%load_ext tensorboard`` then ``%tensorboard --logdir <logdir> --host 127.0.0.1``
embeds the same UI.

Introduced in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

PLUGIN = "pytorch_profiler"
READY = re.compile(r"TensorBoard \S+ at (http://[^\s/]+)/")
# Requests go straight to the local server, never through a proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def runs_on_disk(logdir: str | Path) -> list[str]:
    """The run folders under ``logdir`` that hold a trace, as TensorBoard names them (paths relative to logdir)."""
    root = Path(logdir)
    folders = {p.parent for p in root.rglob("*.pt.trace.json*")}
    return sorted(str(f.relative_to(root)) for f in folders)


class TensorBoardServer:
    """TensorBoard as a child process on 127.0.0.1 (a free port). Notebook 10."""

    def __init__(self, logdir: str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        self.logdir = Path(logdir)
        if not self.logdir.is_dir():
            raise ValueError(f"logdir {str(self.logdir)!r} is not a folder; profile a run into it first")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0: let the OS pick), got {port}")
        self.host, self.port = host, port
        self.url: str | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None  # the server's output while it runs

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def log(self) -> str:
        """What the server printed so far (the file is removed by ``stop()``)."""
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def start(self, timeout: float = 120.0) -> TensorBoardServer:
        """Start the server and wait until it answers (raising, with its log, if it does not in ``timeout`` s)."""
        if self.process is not None:
            raise RuntimeError(f"this TensorBoard is already running (pid {self.pid})")
        fd, name = tempfile.mkstemp(prefix="tensorboard-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        with self.log_path.open("wb") as log:
            # --load_fast=false: one Python process (the fast loader starts a separate data-server binary).
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tensorboard.main", "--logdir", str(self.logdir), "--host", self.host,
                 "--port", str(self.port), "--load_fast=false"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() also ends the plugin's loader processes
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code, log = self.process.returncode, self.log()
                self.stop()
                raise RuntimeError(f"TensorBoard exited with code {code} while starting:\n{log[-2000:]}")
            found = READY.search(self.log())
            if found:
                self.url = found.group(1)
                try:
                    self.get_json("/data/plugins_listing")
                    return self
                except OSError:
                    pass  # printed its address but not serving yet
            time.sleep(0.25)
        log = self.log()
        self.stop()
        raise TimeoutError(f"TensorBoard did not answer within {timeout:.0f} s:\n{log[-2000:]}")

    def stop(self, timeout: float = 10.0) -> None:
        """End the server and its process group (SIGTERM, then SIGKILL if it lingers). Safe to call twice."""
        if self.process is None:
            return
        process, self.process, self.url = self.process, None, None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)  # the group this server leads (start_new_session), nothing else
            except ProcessLookupError:
                break
            try:
                process.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        if process.poll() is None:
            process.kill()
            process.wait(timeout)
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> TensorBoardServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ---- the plugin's data endpoints ----

    def get_json(self, path: str, **params: str) -> Any:
        if self.url is None:
            raise RuntimeError("TensorBoard is not running; call start() first")
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with _OPENER.open(f"{self.url}{path}{query}", timeout=30) as response:
            return json.loads(response.read())

    def plugin(self, route: str, **params: str) -> Any:
        """GET ``/data/plugin/pytorch_profiler/<route>`` as JSON."""
        return self.get_json(f"/data/plugin/{PLUGIN}/{route}", **params)

    def runs(self) -> list[str]:
        """The run folders the plugin has loaded so far."""
        return list(self.plugin("runs")["runs"])

    def wait_for_run(self, run: str, timeout: float = 120.0) -> list[str]:
        """Wait until the plugin has loaded ``run`` (it scans the logdir every 10 s); return its views."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if run in self.runs():
                return list(self.plugin("views", run=run))
            time.sleep(0.5)
        raise TimeoutError(f"the profiler plugin did not list run {run!r} within {timeout:.0f} s; it has "
                           f"{self.runs()}")

    def wait_for_runs(self, runs: list[str], timeout: float = 60.0) -> list[str]:
        """Wait until the plugin lists every run in ``runs`` (it loads them one by one, in the background); return
        the ones still missing when ``timeout`` s have passed (empty when all are loaded)."""
        deadline = time.monotonic() + timeout
        while True:
            missing = [r for r in runs if r not in set(self.runs())]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.5)

    def workers(self, run: str, view: str = "Overview") -> list[str]:
        return list(self.plugin("workers", run=run, view=view))

    def spans(self, run: str, worker: str) -> list[str]:
        return list(self.plugin("spans", run=run, worker=worker))

    def overview(self, run: str, worker: str, span: str) -> dict[str, Any]:
        """The plugin's overview page as data (step time breakdown, environment, recommendations)."""
        return dict(self.plugin("overview", run=run, worker=worker, span=span))
