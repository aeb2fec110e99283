"""How the server answers: OpenAI's response and chunk shapes, server-sent events, and streams that always end.

A streamed answer is one chunk per token, then ``data: [DONE]``. Whatever happens to the request (the
engine fails mid-stream, the server shuts down), the client still gets an error event and ``[DONE]``, so
it never waits on a stream that will not end; a client that leaves has its request aborted at once.
Error bodies are written as ASCII JSON, so no text a client sent can break the response.

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from labkit.core.engine.errors import EngineDeadError as CoreEngineDeadError
from labkit.serving.async_engine import EngineDeadError, TokenDelta
from labkit.serving.protocol import RequestError
from labkit.serving.timings import ServerTimings


class ErrorResponse(JSONResponse):
    """A ``RequestError`` in OpenAI's format; ASCII, so a lone surrogate echoed back cannot break it. Notebook 09."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.body(), status_code=error.status_code)

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def shutdown_error(exc: CoreEngineDeadError) -> RequestError:
    """A 503: the server is shutting down, or its engine died (a worker process is gone: /health says 503 too)."""
    if isinstance(exc, EngineDeadError):
        return RequestError(f"the server is shutting down: {exc}", error_type="server_error", status_code=503,
                            code="server_shutting_down")
    return RequestError(f"{exc} (the server must be restarted)", error_type="server_error", status_code=503,
                        code="engine_dead")


def generation_error(exc: Exception) -> RequestError:
    return RequestError(f"generation failed: {exc}", error_type="server_error", status_code=500)


def _usage(delta: TokenDelta) -> dict[str, int]:
    return {"prompt_tokens": delta.num_prompt_tokens, "completion_tokens": delta.num_output_tokens,
            "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens}


@dataclass
class Generation:
    """One request being served: how its chunks and its full response are shaped (completion or chat). Notebook 09."""

    chat: bool
    model: str
    include_usage: bool
    return_token_ids: bool
    prompt_token_ids: list[int]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _first: bool = True

    def _envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, delta: TokenDelta) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": delta.finish_reason}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": delta.text} if self._first else {"content": delta.text}
        else:
            choice["text"] = delta.text
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        self._first = False
        body = self._envelope([choice], chunk=True)
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the separate final one
        elif delta.finished:
            body["usage"] = _usage(delta)
        return body

    def usage_chunk(self, last: TokenDelta) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": _usage(last)}

    def response(self, deltas: list[TokenDelta]) -> dict[str, Any]:
        last = deltas[-1]
        text = "".join(d.text for d in deltas)
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if self.return_token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
            choice["prompt_token_ids"] = self.prompt_token_ids
        return {**self._envelope([choice], chunk=False), "usage": _usage(last)}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class ActiveRequests:
    """How many generation requests are in flight: what a graceful shutdown waits for. Notebook 09."""

    def __init__(self) -> None:
        self.count = 0  # the event loop's thread only

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1


async def stream_events(gen: Generation, deltas: AsyncIterator[TokenDelta], active: ActiveRequests,
                        timings: ServerTimings | None = None) -> AsyncIterator[str]:
    """The server-sent events of one streamed request; always ends with ``data: [DONE]``.

    With ``timings``, each token's time is split into waiting for it, framing its event and sending it (the web
    server writes the event before asking for the next), plus its hand-off from the engine thread."""
    last = None
    resumed = start = time.perf_counter()
    try:
        with active.track():
            try:
                async with contextlib.aclosing(deltas):  # type: ignore[type-var]
                    async for delta in deltas:
                        last = delta
                        if timings is None:
                            yield sse(gen.chunk(delta))
                            continue
                        picked = time.perf_counter()
                        event = sse(gen.chunk(delta))
                        framed = time.perf_counter()
                        yield event
                        timings.add("hand_off", picked - delta.time)
                        timings.add("wait", picked - resumed)
                        timings.add("frame", framed - picked)
                        timings.add("streamed_tokens", 0.0, len(delta.token_ids))
                        resumed = time.perf_counter()
                        timings.add("send", resumed - framed)
            except CoreEngineDeadError as exc:  # shut down mid-stream: say so in-band
                yield sse(shutdown_error(exc).body())
            except Exception as exc:  # the engine failed mid-stream: tell the client in-band, as vLLM does
                yield sse(generation_error(exc).body())
        if gen.include_usage and last is not None:
            yield sse(gen.usage_chunk(last))
        yield sse("[DONE]")
    finally:  # also when the client leaves mid-stream
        if timings is not None:
            timings.add("stream", time.perf_counter() - start)


async def complete(gen: Generation, deltas: AsyncIterator[TokenDelta], active: ActiveRequests) -> Response:
    """The whole answer of a non-streamed request (a 503 if the server shuts down first)."""
    with active.track():
        try:
            return JSONResponse(gen.response([d async for d in deltas]))
        except CoreEngineDeadError as exc:
            return ErrorResponse(shutdown_error(exc))
        except Exception as exc:  # the engine failed this request: a 500 with the reason, not a traceback
            return ErrorResponse(generation_error(exc))


class AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so a gone client's request is aborted now.

    Notebook 09.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run ``work``; if the client disconnects first, cancel it (which aborts the request in the engine)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # nginx's "client closed request"; nobody is there to read it
