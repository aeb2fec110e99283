"""A server whose engine died (chapter 12's prefill worker killed) says so: ``/health`` turns 503, every new
request gets a 503 naming the cause (not a 500, not a hang), and ``/metrics`` still answers (issue 34, item 6)."""

from __future__ import annotations

import os
import signal

import httpx

from labkit import LLM
from labkit.serving import ServerThread

MODEL = "labkit-tiny"
BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def test_health_turns_503_and_new_requests_get_a_503_naming_the_cause() -> None:
    llm = LLM(MODEL, engine="disaggregated", max_model_len=256)
    with ServerThread(llm, served_model_name=MODEL) as server, httpx.Client(base_url=server.base_url,
                                                                            timeout=60) as client:
        assert client.get("/health").status_code == 200
        first = client.post("/v1/completions", json=BODY)
        assert first.status_code == 200 and first.json()["choices"][0]["text"]
        os.kill(llm.engine.client.pid, signal.SIGKILL)
        llm.engine.client.process.join(30)
        assert client.get("/health").status_code == 503  # at once: no request had to fail first
        for stream in (False, True):
            refused = client.post("/v1/completions", json={**BODY, "stream": stream})
            assert refused.status_code == 503
            error = refused.json()["error"]
            assert error["code"] == "engine_dead"
            assert "the engine is dead: the prefill worker (pid" in error["message"]
            assert "exited with code -9 (killed by SIGKILL)" in error["message"]
        assert client.get("/metrics").status_code == 200
        assert not llm.is_alive()
    llm.close()
