"""One big request must not stall the server (issue 19): a 5 MB body and a 100k-message chat, sent while
another client streams, each get their 4xx at once, while ``/health`` keeps answering within 0.5 s and the
stream's largest gap between tokens stays under 1 s. Before the fix the server tokenized on its event loop
and froze for about 2 s per MB. A valid 3 MB chat of 120k (empty) content parts, whose validation alone
takes most of a second, is served without stalling either.

The server runs in its own process (as in production, and as notebook 09 runs it), so the test's clients do
not share its interpreter. The bounds are the issue's, plus whatever this machine shows when idle (measured
first, the same way), so a busy machine does not fail the test for the wrong reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from labkit.measure.loadgen.runner import run_sync
from labkit.serving import ServerProcess

MODEL = "labkit-tiny"
HEALTH_BOUND, GAP_BOUND = 0.5, 1.0  # seconds: the bounds
FIVE_MB = json.dumps({"model": MODEL, "prompt": "Once upon a time " * 300_000}).encode()  # 5.1 MB, valid JSON
CHAT_100K = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 100_000}).encode()
PARTS_120K = json.dumps({"model": MODEL, "max_completion_tokens": 2, "messages": [
    {"role": "user", "content": [{"type": "text", "text": ""}] * 120_000}]}).encode()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(engine="chunked", max_model_len=512) as srv:  # default body limit (4 MiB)
        yield srv


@dataclass
class Timings:
    health: list[float] = field(default_factory=list)  # seconds each GET /health took
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive chunks of one stream


async def measure(base_url: str, duration: float, hostile: list[tuple[str, bytes]]) -> tuple[Timings, list]:
    """Stream (one request after another) and poll /health for ``duration`` seconds; meanwhile send ``hostile``."""
    timings, answers = Timings(), []
    deadline = time.perf_counter() + duration
    limits = httpx.Limits(max_connections=8)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:

        async def stream() -> None:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "stream": True,
                    "ignore_eos": True, "temperature": 0.0}
            while time.perf_counter() < deadline:
                last = None
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            now = time.perf_counter()
                            if last is not None:
                                timings.gaps.append(now - last)
                            last = now

        async def health() -> None:
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                timings.health.append(time.perf_counter() - start)
                await asyncio.sleep(0.05)

        async def send_hostile() -> None:
            await asyncio.sleep(0.5)  # the stream is running by now
            for path, body in hostile:
                r = await client.post(path, content=body, headers={"content-type": "application/json"})
                answers.append((r.status_code, r.json()))

        await asyncio.gather(stream(), health(), send_hostile())
    return timings, answers


def test_a_5mb_body_and_a_100k_message_chat_do_not_stall_health_or_streams(server: ServerProcess) -> None:
    idle, _ = run_sync(measure(server.base_url, 2.0, []))
    hostile = [("/v1/completions", FIVE_MB), ("/v1/chat/completions", CHAT_100K),
               ("/v1/chat/completions", PARTS_120K)] * 2
    busy, answers = run_sync(measure(server.base_url, 4.0, hostile))
    health_limit = HEALTH_BOUND + max(idle.health)
    gap_limit = GAP_BOUND + max(idle.gaps)
    print(f"idle: health max {max(idle.health):.3f} s, stream gap max {max(idle.gaps):.3f} s; with the big "
          f"requests: health max {max(busy.health):.3f} s, gap max {max(busy.gaps):.3f} s "
          f"({len(busy.health)} polls, {len(busy.gaps)} gaps)")
    assert max(busy.health) < health_limit and max(busy.gaps) < gap_limit
    assert len(busy.gaps) > 100  # the stream really ran throughout
    assert [status for status, _ in answers] == [413, 400, 200] * 2
    assert answers[0][1]["error"]["param"] is None and answers[1][1]["error"]["param"] == "messages"
    assert "more than this server accepts: 4194304 bytes" in answers[0][1]["error"]["message"]
    assert "messages has 100000 messages" in answers[1][1]["error"]["message"]
    assert answers[2][1]["usage"]["completion_tokens"] == 2
