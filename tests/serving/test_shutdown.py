"""Graceful shutdown under load (issue 19): on SIGTERM/SIGINT the server stops accepting, lets running
streams finish within the grace period, then ends each remaining one with an error event and ``[DONE]``
(a waiting non-streamed request gets a 503); the log has no traceback, and the exit code says what
happened (0: everything finished, 3: requests were ended). Before, streams were cut mid-way with neither,
the log filled with ``CancelledError`` tracebacks, and the process died of the re-raised signal."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from labkit.serving import ServerProcess
from labkit.serving.shutdown import EXIT_OK, EXIT_REQUESTS_ENDED

MODEL = "labkit-tiny"


class Client(threading.Thread):
    """One request in a thread: its ``data:`` lines (streamed) or its response (not streamed)."""

    def __init__(self, base_url: str, i: int, max_tokens: int, stream: bool) -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/v1/completions"
        self.body = {"model": MODEL, "prompt": f"Once upon a time, number {i}", "max_tokens": max_tokens,
                     "stream": stream, "ignore_eos": True}
        self.lines: list[str] = []
        self.response: httpx.Response | None = None

    def run(self) -> None:
        if not self.body["stream"]:
            self.response = httpx.post(self.url, json=self.body, timeout=60)
            return
        with httpx.stream("POST", self.url, json=self.body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    self.lines.append(line.removeprefix("data: "))


def num_requests(server: ServerProcess) -> float:
    """Requests the engine holds now (running and waiting), from /metrics."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in ("labkit:num_requests_running", "labkit:num_requests_waiting"))


def run_clients(server: ServerProcess, sig: signal.Signals, max_tokens: int) -> tuple[list[Client], int, float]:
    """Three streaming clients and a waiting one; once all have started, send ``sig``; the exit code and
    how long the server took to exit after the signal."""
    clients = [Client(server.base_url, i, max_tokens, stream=i < 3) for i in range(4)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 60
    while num_requests(server) < len(clients):  # all four are in the engine
        assert time.monotonic() < deadline, "the requests never all reached the engine"
        time.sleep(0.02)
    assert server.process is not None
    start = time.monotonic()
    server.process.send_signal(sig)
    code = server.process.wait(60)
    for c in clients:
        c.join(30)
    return clients, code, time.monotonic() - start


def test_streams_still_running_after_the_grace_period_end_with_an_error_event_and_done() -> None:
    server = ServerProcess(engine="chunked", max_model_len=512, timeout_graceful_shutdown=0.3).start()
    try:
        clients, code, _ = run_clients(server, signal.SIGTERM, max_tokens=500)
    finally:
        server.stop()
    for c in clients[:3]:
        assert c.lines[-1] == "[DONE]" and len(c.lines) < 500, c.lines[-3:]
        error = json.loads(c.lines[-2])["error"]
        assert error["code"] == "server_shutting_down" and "still running 0.3 s after shutdown began" in \
            error["message"]
    waiting = clients[3].response
    assert waiting is not None and waiting.status_code == 503
    assert waiting.json()["error"]["code"] == "server_shutting_down"
    log = server.log()
    assert code == EXIT_REQUESTS_ENDED, log  # the streams were cut short above (< 500 tokens): no wait for them
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "shutting down on SIGTERM: 4 request(s) running, waiting up to 0.3 s" in log
    assert "labkit.serving stopped on SIGTERM: 4 running request(s) ended after the grace period" in log


def test_streams_that_finish_within_the_grace_period_complete_and_the_exit_code_is_0() -> None:
    server = ServerProcess(engine="chunked", max_model_len=512, timeout_graceful_shutdown=60).start()
    try:
        clients, code, _ = run_clients(server, signal.SIGINT, max_tokens=200)
        try:
            httpx.get(f"{server.base_url}/health", timeout=2)
            raise AssertionError("the server still accepts connections after shutting down")
        except httpx.ConnectError:
            pass
    finally:
        server.stop()
    for c in clients[:3]:
        chunks = [json.loads(line) for line in c.lines[:-1]]
        assert c.lines[-1] == "[DONE]" and len(chunks) == 200 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert clients[3].response is not None and clients[3].response.json()["usage"]["completion_tokens"] == 200
    log = server.log()
    assert code == EXIT_OK, log
    assert "Traceback" not in log and "labkit.serving stopped on SIGINT: every request finished" in log
