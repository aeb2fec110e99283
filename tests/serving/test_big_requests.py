"""One big request must not stall the server (issue 19): the server parses, validates and tokenizes a request
body on a worker thread, never on its event loop, so ``/health`` and other clients' streams keep going while it
does. Before the fix the server tokenized on its event loop and froze for about 2 s per MB.

Checked without a clock (issue 34: no timing-dependent assertion): the test holds one request's parsing at a gate
and shows that, while it is held, ``/health`` answers and another request streams to its end; then it lets the
parsing go and the request is answered. A 5 MB body, a 100k-message chat and a valid 3 MB chat of 120k (empty)
content parts, sent to a server in its own process (as in production, and as notebook 09 runs it), get their 413,
400 and 200.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import labkit.serving.api_server as api_server
from labkit.serving import ServerProcess, ServerThread

MODEL = "labkit-tiny"
HANG_S = 60.0  # not a performance bound: only how long to wait before calling a blocked request a hang
FIVE_MB = json.dumps({"model": MODEL, "prompt": "Once upon a time " * 300_000}).encode()  # 5.1 MB, valid JSON
CHAT_100K = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 100_000}).encode()
PARTS_120K = json.dumps({"model": MODEL, "max_completion_tokens": 2, "messages": [
    {"role": "user", "content": [{"type": "text", "text": ""}] * 120_000}]}).encode()
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(engine="chunked", max_model_len=512) as srv:  # default body limit (4 MiB)
        yield srv


def test_health_and_streams_go_on_while_a_request_body_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = threading.Event(), threading.Event()
    original = api_server.decode_json

    def gated(body: bytes) -> dict[str, Any]:
        if len(body) > 1_000_000:  # only the big request waits at the gate
            entered.set()
            assert release.wait(HANG_S), "the test never released the gate"
        return original(body)

    monkeypatch.setattr(api_server, "decode_json", gated)
    with ServerThread(model=MODEL, engine="chunked", max_model_len=512) as srv:
        answers: list[httpx.Response] = []
        big = threading.Thread(target=lambda: answers.append(httpx.post(
            srv.base_url + "/v1/chat/completions", content=PARTS_120K, headers=JSON, timeout=HANG_S)))
        big.start()
        try:
            assert entered.wait(HANG_S), "the big request never reached the parser"
            # the big request is held inside its parsing now: the server must go on serving everyone else
            assert httpx.get(srv.base_url + "/health", timeout=HANG_S).status_code == 200
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "stream": True,
                    "ignore_eos": True, "temperature": 0.0}
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=HANG_S) as r:
                events = [line for line in r.iter_lines() if line.startswith("data:")]
            assert len(events) >= 2 and events[-1] == "data: [DONE]"  # streamed to its end
            assert big.is_alive() and not answers  # ... all while the big request was still being parsed
        finally:
            release.set()
            big.join(HANG_S)
        assert [r.status_code for r in answers] == [200]
        assert answers[0].json()["usage"]["completion_tokens"] == 2


def test_big_bodies_get_their_4xx_and_a_big_valid_chat_is_served(server: ServerProcess) -> None:
    answers = []
    for path, body in [("/v1/completions", FIVE_MB), ("/v1/chat/completions", CHAT_100K),
                       ("/v1/chat/completions", PARTS_120K)]:
        r = httpx.post(server.base_url + path, content=body, headers=JSON, timeout=HANG_S)
        answers.append((r.status_code, r.json()))
    assert [status for status, _ in answers] == [413, 400, 200]
    assert answers[0][1]["error"]["param"] is None and answers[1][1]["error"]["param"] == "messages"
    assert "more than this server accepts: 4194304 bytes" in answers[0][1]["error"]["message"]
    assert "messages has 100000 messages" in answers[1][1]["error"]["message"]
    assert answers[2][1]["usage"]["completion_tokens"] == 2
