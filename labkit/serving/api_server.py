"""The OpenAI-compatible HTTP server: FastAPI routes over an ``AsyncLLM``, run by uvicorn.

Routes (the subset of vLLM's that load generators and the ``openai`` client use):

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's chat template), with
  ``stream: true`` as server-sent events: one chunk per token, then ``data: [DONE]``. The usage record
  (prompt, completion, total tokens) rides on the last token's chunk, or, with
  ``stream_options: {"include_usage": true}``, comes as OpenAI's separate final chunk with no choices;
* ``GET /v1/models``, ``GET /health``, and ``GET /metrics`` (Prometheus text format).

A client that disconnects has its request aborted at once (its KV blocks freed), streaming or not.
Bad input gets a 4xx naming the field, the value and the limit (``labkit.serving.protocol``,
``labkit.serving.limits``); an unknown model name a 404. Reading JSON, tokenizing and chat templating run
in worker threads, not on the event loop, so a large request never stalls ``/health`` or other streams.
The server binds 127.0.0.1 and refuses what a web page could send (``labkit.serving.security``); on
SIGINT/SIGTERM it lets running streams finish, then ends the rest properly (``labkit.serving.shutdown``).

Run it with ``python -m labkit.serving`` (``labkit.serving.cli``).
Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from labkit.core.engine.errors import EngineDeadError
from labkit.core.sequence import Sequence
from labkit.serving.async_engine import AsyncLLM
from labkit.serving.limits import (
    PromptLimits,
    decode_json,
    default_max_request_body_bytes,
    prevalidate_messages,
    read_body,
    request_capacity,
)
from labkit.serving.openapi import openapi_schema
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
from labkit.serving.responses import (
    AbortingStreamingResponse,
    ActiveRequests,
    ErrorResponse,
    Generation,
    cancel_on_disconnect,
    complete,
    shutdown_error,
    stream_events,
)
from labkit.serving.security import AccessPolicy, add_browser_protection
from labkit.serving.timings import ServerTimings

NUM_INPUT_THREADS = 2  # tokenizing is CPU work: a few threads keep the event loop free without crowding the engine


@dataclass
class _Prepared:
    req: CompletionRequest | ChatCompletionRequest
    seq: Sequence
    gen: Generation


def build_app(async_llm: AsyncLLM, served_model_name: str, access: AccessPolicy | None = None,
              max_request_body_bytes: int | None = None) -> FastAPI:
    """The FastAPI app serving one model through ``async_llm``. Introduced in notebook 09.

    ``access``: the Host/Origin policy (default: this machine only, no browser origins);
    ``max_request_body_bytes``: default ``labkit.serving.limits.default_max_request_body_bytes``.
    When ``async_llm.timings`` is set (``--record-timings``), ``GET /timings`` returns where the server's time went
    (``labkit.serving.timings``); otherwise that route answers 404.
    """
    app = FastAPI(title="labkit OpenAI-compatible server")
    llm = async_llm.llm
    app.state.async_llm = async_llm
    app.state.active_requests = active = ActiveRequests()
    metrics = async_llm.metrics
    timings: ServerTimings | None = async_llm.timings
    if max_request_body_bytes is not None and max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")
    body_limit = max_request_body_bytes or default_max_request_body_bytes(llm.max_model_len)
    limits = PromptLimits.for_tokenizer(llm.tokenizer, llm.max_model_len)
    capacity = request_capacity(llm.engine)
    executor = ThreadPoolExecutor(NUM_INPUT_THREADS, thread_name_prefix="labkit-input")
    add_browser_protection(app, access or AccessPolicy())

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> Response:
        return ErrorResponse(exc)

    @app.get("/health")
    async def health() -> Response:
        # 503 once the engine thread stopped or the engine died (a worker process it needs is gone, e.g. chapter
        # 12's prefill worker): a load balancer or supervisor then restarts the server.
        return Response(status_code=200 if async_llm.is_running and llm.is_alive() else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "labkit", "root": str(llm.source.name),
                                            "max_model_len": llm.max_model_len}]}

    @app.get("/timings")
    async def server_timings() -> Response:
        if timings is None:
            return Response(status_code=404)
        return JSONResponse(timings.snapshot())

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = metrics.exposition() if metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise RequestError(f"model '{name}' does not exist; this server serves '{served_model_name}' "
                               "(see GET /v1/models)", "model", 404, "not_found_error", "model_not_found")

    def prepare(chat: bool, body: bytes) -> _Prepared:
        """Bytes -> a validated engine request, in a worker thread: every check, then the tokenizer."""
        if timings is None:
            return prepare_request(chat, body, None)
        start = time.perf_counter()
        spent: list[float] = []  # the tokenizer's share, recorded by prepare_request
        try:
            return prepare_request(chat, body, spent)
        finally:
            whole = time.perf_counter() - start
            timings.add("prepare", whole)
            timings.add("tokenize", sum(spent))
            timings.add("parse", whole - sum(spent))

    def prepare_request(chat: bool, body: bytes, tokenize_seconds: list[float] | None) -> _Prepared:
        data = decode_json(body)
        limits.check_raw(data)  # before validating or tokenizing what could never fit
        prevalidate_messages(data)
        req = parse_request(ChatCompletionRequest if chat else CompletionRequest, data)
        check_model(req.model)
        start = time.perf_counter()
        if isinstance(req, ChatCompletionRequest):
            ids = chat_input(req, llm.tokenizer, limits.check_text)
            max_tokens = req.output_limit
        else:
            ids = completion_input(req, llm.tokenizer, llm.model_config.vocab_size)
            max_tokens = (req.max_tokens, "max_tokens")
        if tokenize_seconds is not None:
            tokenize_seconds.append(time.perf_counter() - start)
        prompt_field = "messages" if chat else "prompt"
        limit = check_lengths(len(ids), max_tokens[0], llm.max_model_len, prompt_field, max_tokens[1], capacity)
        try:
            seq = async_llm.make_request(ids, sampling_params(req, limit))
        except (ValueError, TypeError) as exc:  # a limit of a pluggable scheduler, say
            raise RequestError(str(exc), prompt_field) from None
        return _Prepared(req, seq, Generation(chat, served_model_name, req.include_usage, req.return_token_ids, ids))

    async def run_in_thread(fn: Callable[..., _Prepared], *args: Any) -> _Prepared:
        try:
            return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)
        except RecursionError:  # nesting that got past the JSON parser, in validation or an error message
            raise RequestError("request body nests JSON arrays or objects too deeply") from None

    async def serve(request: Request, chat: bool) -> Response:
        cause = llm.death_cause()
        if cause is not None:
            raise shutdown_error(EngineDeadError(cause))
        p = await run_in_thread(prepare, chat, await read_body(request, body_limit))
        if p.req.stream:
            return AbortingStreamingResponse(stream_events(p.gen, async_llm.generate(p.seq), active, timings),
                                             media_type="text/event-stream")
        return await cancel_on_disconnect(request, complete(p.gen, async_llm.generate(p.seq), active))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    schema = openapi_schema(served_model_name, app.title)  # the routes read their own bodies: FastAPI cannot infer it
    app.openapi = lambda: schema  # type: ignore[method-assign]
    return app
