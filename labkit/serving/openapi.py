"""The server's OpenAPI document: what each route accepts and answers, precise enough to test against.

The routes read their bodies themselves (``labkit.serving.limits``: size, JSON shape and Unicode are checked before
pydantic runs), so FastAPI cannot infer a schema from their signatures; this module writes it. Request bodies are
the pydantic models' own schemas (``CompletionRequest``, ``ChatCompletionRequest``) with the served model's name
and, for the OpenAI fields labkit accepts only at their neutral value, that value; responses name each status the
route can answer with, the OpenAI-shaped body of each, and, for ``stream: true``, the schema of every event.
``tests/serving/test_schema_fuzz.py`` draws requests from this document and checks the answers against it.
Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

from typing import Any

from labkit.serving.protocol import MAX_STOP_STRINGS, ChatCompletionRequest, CompletionRequest

REF = "#/components/schemas/{model}"
JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _object(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


INT = {"type": "integer", "minimum": 0}
TOKEN_IDS = {"type": "array", "items": INT}
FINISH = {"enum": ["stop", "length", "abort", None]}  # None: a streamed chunk before the last
USAGE = _object(["prompt_tokens", "completion_tokens", "total_tokens"], prompt_tokens=INT, completion_tokens=INT,
                total_tokens=INT)


def _envelope(prefix: str, kind: str, choice: dict[str, Any], chunk: bool) -> dict[str, Any]:
    usage = {"anyOf": [_ref("Usage"), {"type": "null"}]} if chunk else _ref("Usage")
    return _object(["id", "object", "created", "model", "choices"] + ([] if chunk else ["usage"]),
                   id={"type": "string", "pattern": f"^{prefix}"}, object={"const": kind}, created=INT,
                   model={"type": "string"}, choices={"type": "array", "items": choice, "maxItems": 1,
                                                      "minItems": 0 if chunk else 1}, usage=usage)


def _choice(**fields: Any) -> dict[str, Any]:
    return _object(["index", "logprobs", "finish_reason", *fields], index={"const": 0}, logprobs={"type": "null"},
                   finish_reason=FINISH, token_ids=TOKEN_IDS, prompt_token_ids=TOKEN_IDS, **fields)


RESPONSES: dict[str, dict[str, Any]] = {
    "Usage": USAGE,
    "Error": _object(["error"], error=_object(["message", "type", "param", "code"], message={"type": "string"},
                                              type={"type": "string"}, param={"type": ["string", "null"]},
                                              code={"type": ["string", "null"]})),
    "CompletionResponse": _envelope("cmpl-", "text_completion", _choice(text={"type": "string"}), chunk=False),
    "CompletionChunk": _envelope("cmpl-", "text_completion", _choice(text={"type": "string"}), chunk=True),
    "ChatCompletionResponse": _envelope("chatcmpl-", "chat.completion", _choice(
        message=_object(["role", "content"], role={"const": "assistant"}, content={"type": "string"})), chunk=False),
    "ChatCompletionChunk": _envelope("chatcmpl-", "chat.completion.chunk", _choice(
        delta=_object(["content"], role={"const": "assistant"}, content={"type": "string"})), chunk=True),
    "ModelList": _object(["object", "data"], object={"const": "list"}, data={"type": "array", "items": _object(
        ["id", "object", "created", "owned_by", "root", "max_model_len"], id={"type": "string"},
        object={"const": "model"}, created=INT, owned_by={"type": "string"}, root={"type": "string"},
        max_model_len=INT)}),
}
# The statuses a generation route answers with, besides 200: bad input (400), a Host or Origin refused (403), an
# unknown model (404), a body past the limit (413), a wrong content type (415), a client gone (499), and 503 (at
# the connection limit, shutting down, or the engine dead). A 408 closes a slow connection before any route runs.
ERROR_STATUSES = {"400": "invalid request", "403": "Host or Origin refused", "404": "unknown model",
                  "413": "request body too large", "415": "not JSON", "503": "unavailable: at the connection limit, "
                  "shutting down, or the engine is dead (GET /health says 503 too)"}


def _request_schema(model: type[CompletionRequest] | type[ChatCompletionRequest], served_model_name: str,
                    components: dict[str, Any]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template=REF)
    components.update(schema.pop("$defs", {}))
    props = schema["properties"]
    props["model"] = {"const": served_model_name, "type": "string", "title": "Model"}
    for name, neutral in model.NEUTRAL.items():  # accepted only at the value that means "off"
        if name in props:
            props[name] = {"enum": list(neutral), "title": props[name].get("title", name),
                           "description": "not implemented by labkit: only this neutral value is accepted"}
    props["stop"]["anyOf"][1]["maxItems"] = MAX_STOP_STRINGS
    return schema


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _generation(name: str, chunk: str, summary: str) -> dict[str, Any]:
    errors = {status: _json(_ref("Error"), why) for status, why in ERROR_STATUSES.items()}
    events = {"schema": {"type": "string"}, "x-event-schema": {"anyOf": [_ref(chunk), _ref("Error")]},
              "x-event-terminator": "data: [DONE]"}
    return {"post": {"summary": summary, "operationId": name,
                     "requestBody": {"required": True, "content": {JSON: {"schema": _ref(name + "Request")}}},
                     "responses": {"200": {"description": "the completion (stream: false), or server-sent events "
                                                          "(stream: true), each `data: <x-event-schema>`, then "
                                                          "`data: [DONE]`",
                                           "content": {JSON: {"schema": _ref(name + "Response")},
                                                       "text/event-stream": events}}, **errors}}}


def openapi_schema(served_model_name: str, title: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the app ``build_app`` makes."""
    components: dict[str, Any] = dict(RESPONSES)
    components["CompletionRequest"] = _request_schema(CompletionRequest, served_model_name, components)
    components["ChatCompletionRequest"] = _request_schema(ChatCompletionRequest, served_model_name, components)
    plain = {"description": "text", "content": {"text/plain": {"schema": {"type": "string"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": {
            "/v1/completions": _generation("Completion", "CompletionChunk", "OpenAI's completions"),
            "/v1/chat/completions": _generation("ChatCompletion", "ChatCompletionChunk",
                                                "OpenAI's chat completions (the tokenizer's chat template)"),
            "/v1/models": {"get": {"summary": "the served model", "operationId": "models",
                                   "responses": {"200": _json(_ref("ModelList"), "one model")}}},
            "/health": {"get": {"summary": "liveness", "operationId": "health", "responses": {
                "200": {"description": "the engine serves"},
                "503": {"description": "the engine thread stopped, or the engine is dead (a worker process it "
                                       "needs is gone): restart the server"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "operationId": "metrics",
                                 "responses": {"200": plain}}},
            "/timings": {"get": {"summary": "where the server's time went (--record-timings)",
                                 "operationId": "timings",
                                 "responses": {"200": _json({"type": "object"}, "the totals"),
                                               "404": {"description": "timings are not recorded"}}}},
        },
        "components": {"schemas": components},
    }
