"""Start and stop a server from a notebook or a test: as a child process, or in this process.

``ServerProcess`` runs ``python -m labkit.serving`` as a child process, as you would in production:
the engine has its own interpreter, so the load generator in the notebook does not compete with it
for Python's lock. Its output goes to a log file (``.log()`` reads it). ``ServerThread`` runs the
same app with uvicorn in a thread of this process: it starts in a second and gives direct access to
the engine (``.async_llm.engine_state()``), which is what tests need. Both bind 127.0.0.1 on a free
port, wait until ``GET /health`` answers, and ``stop()`` for good (also on ``with``-block exit).

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from labkit.core.llm import LLM
from labkit.serving.api_server import build_app
from labkit.serving.async_engine import AsyncLLM
from labkit.serving.cli import READY_LINE, ServerConfig, bind_socket, make_async_llm, uvicorn_server
from labkit.serving.prometheus import ServerMetrics
from labkit.serving.timings import ServerTimings


def wait_for_health(base_url: str, timeout: float, alive: Any = None) -> None:
    """Poll ``GET /health`` until it answers 200; ``alive()`` returning False aborts the wait."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError("the server stopped while starting")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"no healthy server at {base_url} after {timeout:.0f} s")


class ServerProcess:
    """``python -m labkit.serving`` as a child process on 127.0.0.1. Notebook 09.

        with ServerProcess(engine="chunked", max_num_batched_tokens=256) as server:
            run = benchmark_serving(ServeBenchConfig(base_url=server.base_url, ...))
    """

    def __init__(self, model: str = "labkit-tiny", engine: str | None = None, host: str = "127.0.0.1",
                 port: int = 0, startup_timeout: float = 180.0, log_path: str | Path | None = None,
                 extra_args: list[str] | None = None, **options: Any) -> None:
        self.args = ["--model", str(model), "--host", host, "--port", str(port)]
        if engine is not None:
            self.args += ["--engine", engine]
        for name, value in options.items():  # snake_case -> the CLI flag: max_num_seqs=8 -> --max-num-seqs 8
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                self.args += [flag] if value else []
            elif isinstance(value, (list, tuple)):  # allowed_origins=["http://localhost:3000"]
                self.args += [flag, json.dumps(list(value))]
            else:
                self.args += [flag, str(value)]
        self.args += list(extra_args or [])
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkdtemp(prefix="labkit-serve-")) / "server.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.base_url = ""
        self._deadline = 0.0

    def start(self) -> ServerProcess:
        """Launch the child and wait until it is healthy."""
        return self.launch().wait_until_ready()

    def launch(self) -> ServerProcess:
        """Launch the child and return at once (start several, then ``wait_until_ready`` each)."""
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "labkit.serving", *self.args], stdout=log,
                                            stderr=subprocess.STDOUT, env=env)
        self._deadline = time.monotonic() + self.startup_timeout
        return self

    def wait_until_ready(self) -> ServerProcess:
        """Wait for the ready line (which port it bound), then for ``GET /health``; stop it on failure."""
        if self.process is None:
            raise RuntimeError("launch() the server first")
        try:
            while not self.base_url:
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.process.returncode}:\n"
                                       f"{self.log()[-3000:]}")
                if time.monotonic() > self._deadline:
                    raise TimeoutError(f"the server did not start in {self.startup_timeout:.0f} s:\n"
                                       f"{self.log()[-3000:]}")
                match = re.search(re.escape(READY_LINE) + r" (http://\S+)", self.log())
                if match:
                    self.base_url = match.group(1)
                time.sleep(0.05)
            wait_for_health(self.base_url, max(1.0, self._deadline - time.monotonic()), self.is_alive)
        except BaseException:
            self.stop()
            raise
        return self

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (uvicorn shuts down gracefully), then SIGKILL if it is still there after ``timeout``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout)

    def __enter__(self) -> ServerProcess:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "stopped"
        return f"ServerProcess({self.base_url or 'not started'}, {state}, pid={self.process and self.process.pid})"


class ServerThread:
    """The same server with uvicorn in a thread of this process; exposes the engine. Notebook 09.

    Pass an ``LLM`` to serve it (e.g. one a test also inspects), or a model, engine and engine options.
    ``server_options``: the server's own (``ServerConfig`` fields such as ``allowed_origins``,
    ``max_request_body_bytes``, ``timeout_graceful_shutdown``).
    """

    def __init__(self, llm: LLM | None = None, model: str = "labkit-tiny", engine: str | None = None,
                 served_model_name: str | None = None, startup_timeout: float = 60.0,
                 server_options: dict[str, Any] | None = None, **engine_options: Any) -> None:
        self.config = ServerConfig(model=model, engine=engine, host="127.0.0.1", port=0,
                                   served_model_name=served_model_name, engine_options=engine_options,
                                   **(server_options or {}))
        name = served_model_name or (llm.source.name if llm is not None else model)
        self.served_model_name = name
        self.async_llm: AsyncLLM = (AsyncLLM(llm, ServerMetrics(name), hand_off=self.config.hand_off,
                                             timings=ServerTimings() if self.config.record_timings else None,
                                             coalesce=self.config.stream_coalesce)
                                    if llm is not None else make_async_llm(self.config))
        self.startup_timeout = startup_timeout
        self.base_url = ""
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> ServerThread:
        self.async_llm.start()
        app = build_app(self.async_llm, self.served_model_name, self.config.access,
                        self.config.max_request_body_bytes)
        sock = bind_socket(self.config.host, self.config.port)
        host, port = sock.getsockname()[:2]
        self.base_url = f"http://{host}:{port}"
        self._server = uvicorn_server(app, self.config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="labkit-uvicorn")
        self._thread.start()
        try:
            wait_for_health(self.base_url, self.startup_timeout, self._thread.is_alive)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 15.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        self.async_llm.shutdown()

    def __enter__(self) -> ServerThread:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
