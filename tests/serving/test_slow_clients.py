"""Slow clients, over raw sockets (issue 34, item 3): a request head trickled one line at a time, an idle
connection and a body that stops are closed with a 408 once their bound has passed; a slow but steady body is
served; beyond the connection cap a request gets a 503 naming the limit, and service resumes when connections
close. The bounds are short here (1.5-3 s) so the tests are quick; the defaults are in docs/serving.md."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from labkit import LLM
from labkit.serving import ServerThread
from labkit.serving.cli import parse_args
from labkit.serving.connections import ConnectionLimits

MODEL = "labkit-tiny"
HEADER_S, STALL_S = 1.5, 3.0
BODY = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}).encode()


def serve(**server_options: object) -> ServerThread:
    llm = LLM(MODEL, engine="chunked", max_model_len=128)
    return ServerThread(llm, served_model_name=MODEL, server_options=server_options)


@pytest.fixture(scope="module")
def quick() -> Iterator[ServerThread]:
    with serve(timeout_request_header=HEADER_S, timeout_body_stall=STALL_S) as server:
        yield server


def connect(server: ServerThread) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)  # the timeout only guards against a hang
    return sock


def head(server: ServerThread, extra: str = "") -> list[bytes]:
    host = server.base_url.removeprefix("http://")
    return [b"POST /v1/completions HTTP/1.1\r\n", f"Host: {host}\r\n".encode(),
            b"Content-Type: application/json\r\n", *([extra.encode()] if extra else [])]


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def trickle(sock: socket.socket, pieces: list[bytes], gap_s: float) -> int:
    """Send ``pieces`` ``gap_s`` apart; how many went out before the server closed the connection."""
    for sent, piece in enumerate(pieces):
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return sent
        time.sleep(gap_s)
    return len(pieces)


def test_a_request_head_trickled_line_by_line_is_closed_with_a_408(quick: ServerThread) -> None:
    # 40 header lines 0.25 s apart would take 10 s; the server's clock runs from the connection, not per line.
    lines = head(quick) + [f"X-Slow-{i}: {i}\r\n".encode() for i in range(40)]
    with connect(quick) as sock:
        sent = trickle(sock, lines, 0.25)
        answer = read_all(sock)
    assert sent < len(lines), "the server waited for the whole trickled head"
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout")
    assert b"request head not complete within 1.5 s (--timeout-request-header)" in answer
    assert healthy(quick)


def test_an_idle_connection_is_closed_with_a_408(quick: ServerThread) -> None:
    with connect(quick) as sock:
        answer = read_all(sock)  # nothing sent: the server ends it
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout")


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_that_stops_is_closed_and_its_request_dropped(quick: ServerThread, framing: str) -> None:
    if framing == "chunked":
        start, first = "Transfer-Encoding: chunked\r\n\r\n", b"%x\r\n%s\r\n" % (10, BODY[:10])
    else:
        start, first = f"Content-Length: {len(BODY)}\r\n\r\n", BODY[:10]
    with connect(quick) as sock:
        sock.sendall(b"".join(head(quick, start)) + first)  # the head in time, then part of the body, then nothing
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout")
    assert b"no request body bytes for 3 s (--timeout-body-stall)" in answer
    state = quick.async_llm.engine_state()
    assert state.unfinished_request_ids == () and state.kv_blocks_used == 0  # the request never reached the engine


def test_a_slow_but_steady_body_is_served(quick: ServerThread) -> None:
    # 12 pieces 0.4 s apart: the whole body takes ~4.8 s, longer than the head bound, each gap shorter than the stall
    # bound; the head itself is sent at once.
    chunks = [BODY[i * len(BODY) // 12:(i + 1) * len(BODY) // 12] for i in range(12)]
    with connect(quick) as sock:
        sock.sendall(b"".join(head(quick, f"Content-Length: {len(BODY)}\r\nConnection: close\r\n\r\n")))
        assert trickle(sock, chunks, 0.4) == len(chunks)
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["choices"][0]["text"]


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60  # only a guard against a hang
    while not condition():
        assert time.monotonic() < deadline, "the server never reached the expected state"
        time.sleep(0.02)


def healthy(server: ServerThread) -> bool:
    return httpx.get(f"{server.base_url}/health", timeout=60).status_code == 200


def test_beyond_the_connection_cap_a_request_gets_a_503_naming_the_limit() -> None:
    with serve(limit_concurrency=3, timeout_request_header=600) as server:
        held = [connect(server) for _ in range(3)]
        for sock in held:
            sock.sendall(head(server)[0])  # started, never finished: each holds its connection
        wait_for(lambda: len(server._server.server_state.connections) == 3)  # the server has taken them in
        refused = httpx.post(f"{server.base_url}/v1/completions", content=BODY,
                             headers={"content-type": "application/json"}, timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "too_many_connections"
        assert error["message"].startswith("the server is at its limit of 3 open connections (--limit-concurrency)")
        for sock in held:
            sock.close()
        wait_for(lambda: not server._server.server_state.connections)  # it has seen them close
        response = httpx.post(f"{server.base_url}/v1/completions", content=BODY,
                              headers={"content-type": "application/json"}, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["text"]


def test_the_bounds_are_options_with_documented_defaults() -> None:
    config = parse_args([])
    assert (config.timeout_request_header, config.timeout_body_stall, config.limit_concurrency,
            config.timeout_keep_alive) == (10.0, 10.0, 1024, 5.0)
    config = parse_args(["--timeout-request-header", "3", "--timeout-body-stall", "4", "--limit-concurrency", "9"])
    assert config.connection_limits == ConnectionLimits(3.0, 4.0, 9)
    with pytest.raises(SystemExit):
        parse_args(["--timeout-request-header", "0"])
    with pytest.raises(ValueError, match="limit_concurrency must be an int >= 1"):
        ConnectionLimits(limit_concurrency=0)
