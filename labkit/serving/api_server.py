"""The OpenAI-compatible HTTP server: FastAPI routes over an ``AsyncLLM``, run by uvicorn.

Routes (the subset of vLLM's that load generators and the ``openai`` client use):

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's chat template), with
  ``stream: true`` as server-sent events: one chunk per token, then ``data: [DONE]``. The usage record
  (prompt, completion, total tokens) rides on the last token's chunk, or, with
  ``stream_options: {"include_usage": true}``, comes as OpenAI's separate final chunk with no choices;
* ``GET /v1/models``, ``GET /health``, and ``GET /metrics`` (Prometheus text format).

A client that disconnects has its request aborted at once (its KV blocks freed), streaming or not.
Bad input gets a 400 naming the field, the value and the limit (``labkit.serving.protocol``); an
unknown model name a 404. The server binds 127.0.0.1 unless told otherwise.

Run it with ``python -m labkit.serving`` (``labkit.serving.cli``).
Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from labkit.serving.async_engine import AsyncLLM, TokenDelta
from labkit.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    chat_input,
    check_lengths,
    completion_input,
    parse_request,
    sampling_params,
)


def _usage(delta: TokenDelta) -> dict[str, int]:
    return {"prompt_tokens": delta.num_prompt_tokens, "completion_tokens": delta.num_output_tokens,
            "total_tokens": delta.num_prompt_tokens + delta.num_output_tokens}


@dataclass
class _Generation:
    """One request being served: how its chunks and its full response are shaped (completion or chat)."""

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


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, so a gone client's request is aborted now.

    Notebook 09.
    """

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
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


def build_app(async_llm: AsyncLLM, served_model_name: str) -> FastAPI:
    """The FastAPI app serving one model through ``async_llm``. Introduced in notebook 09."""
    app = FastAPI(title="labkit OpenAI-compatible server")
    llm = async_llm.llm
    app.state.async_llm = async_llm
    metrics = async_llm.metrics

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if async_llm.is_running else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "labkit", "root": str(llm.source.name),
                                            "max_model_len": llm.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.exposition() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise RequestError(f"model '{name}' does not exist; this server serves '{served_model_name}' "
                               "(see GET /v1/models)", "model", 404, "not_found_error", "model_not_found")

    async def serve(request: Request, req: CompletionRequest | ChatCompletionRequest, prompt_ids: list[int],
                    max_tokens: tuple[int | None, str], chat: bool) -> Response:
        prompt_field = "messages" if chat else "prompt"
        limit = check_lengths(len(prompt_ids), max_tokens[0], llm.max_model_len, prompt_field, max_tokens[1])
        params = sampling_params(req, limit)
        try:
            seq = async_llm.make_request(prompt_ids, params)
        except (ValueError, TypeError) as exc:  # e.g. the KV pool could never hold this request
            raise RequestError(str(exc), prompt_field) from None
        gen = _Generation(chat, served_model_name, req.include_usage, req.return_token_ids, prompt_ids)
        if req.stream:
            return AbortingStreamingResponse(_stream(gen, async_llm.generate(seq)), media_type="text/event-stream")

        async def complete() -> Response:
            deltas = [d async for d in async_llm.generate(seq)]
            return JSONResponse(gen.response(deltas))

        return await _cancel_on_disconnect(request, complete())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_request(CompletionRequest, await request.body())
        check_model(req.model)
        ids = completion_input(req, llm.tokenizer, llm.model_config.vocab_size)
        return await serve(request, req, ids, (req.max_tokens, "max_tokens"), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_request(ChatCompletionRequest, await request.body())
        check_model(req.model)
        ids = chat_input(req, llm.tokenizer)
        return await serve(request, req, ids, req.output_limit, chat=True)

    return app


async def _stream(gen: _Generation, deltas: AsyncIterator[TokenDelta]) -> AsyncIterator[str]:
    last = None
    try:
        async with contextlib.aclosing(deltas):  # type: ignore[type-var]
            async for delta in deltas:
                last = delta
                yield _sse(gen.chunk(delta))
    except Exception as exc:  # the engine failed mid-stream: tell the client in-band, as vLLM does
        yield _sse(RequestError(f"generation failed: {exc}", error_type="server_error", status_code=500).body())
    if gen.include_usage and last is not None:
        yield _sse(gen.usage_chunk(last))
    yield _sse("[DONE]")
