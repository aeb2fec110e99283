"""One streamed request to any OpenAI-compatible server, timed chunk by chunk (httpx, async).

The load generator must measure what a user would see, so it times the stream as it arrives: the
clock starts just before the request is sent; each server-sent event that carries a choice is a
"token chunk" (TTFT at the first, an ITL gap at each next one, by ``labkit.core.metrics``'s
definitions, as the engine times its own tokens); the final usage record says how many tokens there
were. This is vLLM's ``async_request_openai_completions`` / ``..._chat_completions``, with httpx
instead of aiohttp. Works against labkit, vLLM, SGLang, TGI (its OpenAI-compatible ``/v1`` routes)
and OpenAI's own API.

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from labkit.core.metrics import compute_latencies
from labkit.measure.loadgen.datasets import BenchRequest
from labkit.measure.loadgen.metrics import RequestRecord

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


def build_payload(endpoint: str, model: str, request: BenchRequest, temperature: float, ignore_eos: bool,
                  extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body for one request: streamed, asking for the usage record, ``max_tokens`` as expected."""
    payload: dict[str, Any] = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                               "temperature": temperature}
    if endpoint.endswith("chat/completions"):
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        payload["max_completion_tokens"] = request.expected_output_len
    else:
        payload["prompt"] = request.prompt
        payload["max_tokens"] = request.expected_output_len
    if ignore_eos:
        payload["ignore_eos"] = True  # a vLLM extension (labkit, vLLM and SGLang accept it)
    payload.update(extra_body or {})
    return payload


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def send_request(client: httpx.AsyncClient, url: str, payload: dict[str, Any], prompt_len: int
                       ) -> RequestRecord:
    """POST one streamed request and time every token chunk; errors end up in ``record.error``."""
    chat = "messages" in payload
    record = RequestRecord(prompt_len=prompt_len)
    text: list[str] = []
    chunk_times: list[float] = []  # when each chunk with a choice arrived: the client's token times
    start = time.perf_counter()
    record.start_time = start
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:500]}"
                return record
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):  # blank separators, ": ping" comments, "event:" lines
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    record.error = str(chunk["error"].get("message", chunk["error"]))
                if chunk.get("choices"):
                    chunk_times.append(time.perf_counter())
                    text.append(_chunk_text(chunk["choices"][0], chat))
                if chunk.get("usage"):
                    record.output_tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    record.prompt_len = int(chunk["usage"].get("prompt_tokens") or prompt_len)
    except Exception as exc:  # connection refused, reset, bad JSON...: a failed request, not a crashed run
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.generated_text = "".join(text)
    if not chunk_times:
        record.error = record.error or "the stream ended without a single token chunk"
        return record
    lat = compute_latencies(start, chunk_times)  # sent at ``start``: the request's arrival, as the client sees it
    record.ttft, record.itl, record.latency = lat.ttft, lat.itl, lat.e2e
    if not record.output_tokens:
        record.output_tokens = len(chunk_times)  # no usage record: count chunks (one token each on labkit)
    record.success = not record.error
    return record
