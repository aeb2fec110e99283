"""A property-based fuzzer driven by the server's own ``/openapi.json`` (issue 34, item 2).

For every operation in the document, hypothesis draws request bodies from its request schema (the
pydantic models' own, ``labkit.serving.openapi``); every answer must be a status the document lists for that
operation, never a 5xx, with a body that matches the schema given for that status (for ``stream: true``, every
event, then ``data: [DONE]``). Afterwards the server still answers a normal request with the same greedy text, and
every KV block is free. ``tests/serving/test_fuzz.py`` (issue 19) adds junk the schema does not describe.

Smoke mode draws ``SMOKE_EXAMPLES`` bodies per generation route (derandomized: the same ones every run); set
``LABKIT_FUZZ_EXAMPLES`` for more (e.g. 2000 per route for a long run)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import from_schema

from labkit import LLM
from labkit.core.sampling_params import MAX_SEED
from labkit.serving import ServerThread

MODEL = "labkit-tiny"
SMOKE_EXAMPLES = 30
EXAMPLES = int(os.environ.get("LABKIT_FUZZ_EXAMPLES", "0")) or SMOKE_EXAMPLES
GENERATION = ("/v1/completions", "/v1/chat/completions")
NORMAL = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    # A short context and a small pool: every valid request is short, and the pool's limits are within reach.
    llm = LLM(MODEL, engine="chunked", max_model_len=64, num_gpu_blocks=24, block_size=8, max_num_seqs=4)
    with ServerThread(llm, served_model_name=MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def spec(client: httpx.Client) -> dict[str, Any]:
    return client.get("/openapi.json").json()


@pytest.fixture(scope="module")
def before(client: httpx.Client, spec: dict[str, Any]) -> str:
    """A normal request's greedy text, before any fuzzing."""
    return client.post("/v1/completions", json=NORMAL).json()["choices"][0]["text"]


def inline(schema: Any, spec: dict[str, Any]) -> Any:
    """``schema`` with every ``$ref`` into the document's components replaced by its target (none is recursive)."""
    if isinstance(schema, dict):
        if "$ref" in schema:
            return inline(spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]], spec)
        return {k: inline(v, spec) for k, v in schema.items()}
    if isinstance(schema, list):
        return [inline(v, spec) for v in schema]
    return schema


def problems(spec: dict[str, Any], path: str, method: str, response: httpx.Response) -> list[str]:
    """What is wrong with ``response`` by the document: a 5xx, a status it does not list, a body off its schema."""
    declared = spec["paths"][path][method]["responses"]
    status = str(response.status_code)
    if response.status_code >= 500 and status not in declared:
        return [f"{status} (a server error): {response.text[:300]}"]
    if status not in declared:
        return [f"status {status} is not in the document ({sorted(declared)}): {response.text[:300]}"]
    content = declared[status].get("content")
    if content is None:
        return []
    kind = response.headers.get("content-type", "").split(";")[0]
    if kind not in content:
        return [f"content type {kind!r} is not documented for {status} ({sorted(content)})"]
    if kind == "text/event-stream":
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        if not events or events[-1] != "[DONE]":
            return [f"the stream does not end with data: [DONE]: {events[-1:]}"]
        schema = inline(content[kind]["x-event-schema"], spec)
        return [f"event {e[:200]}: {err}" for e in events[:-1] for err in schema_errors(json.loads(e), schema)]
    if kind == "text/plain":
        return []
    return schema_errors(response.json(), inline(content[kind]["schema"], spec))


def schema_errors(instance: Any, schema: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or 'body'}: {e.message[:200]}"
            for e in jsonschema.Draft202012Validator(schema).iter_errors(instance)]


def request_bodies(spec: dict[str, Any], path: str) -> st.SearchStrategy[dict[str, Any]]:
    operation = spec["paths"][path]["post"]
    return from_schema(inline(operation["requestBody"]["content"]["application/json"]["schema"], spec))


def test_the_document_describes_every_route_and_one_source_for_each_limit(spec: dict[str, Any]) -> None:
    assert set(spec["paths"]) == {*GENERATION, "/v1/models", "/health", "/metrics", "/timings"}
    for path in GENERATION:
        assert "requestBody" in spec["paths"][path]["post"]
    seed = spec["components"]["schemas"]["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (0, MAX_SEED)  # SamplingParams' bound, not a copy
    assert spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]["const"] == MODEL


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics", "/timings"])
def test_every_read_route_answers_by_the_document(client: httpx.Client, spec: dict[str, Any], path: str) -> None:
    assert problems(spec, path, "get", client.get(path)) == []


@pytest.mark.parametrize("path", GENERATION)
def test_generated_requests_get_documented_answers_and_never_a_5xx(client: httpx.Client, spec: dict[str, Any],
                                                                   before: str, path: str) -> None:
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
    @given(body=request_bodies(spec, path))
    def check(body: dict[str, Any]) -> None:
        response = client.post(path, json=body)
        statuses.append(response.status_code)
        assert problems(spec, path, "post", response) == [], json.dumps(body)[:500]

    check()
    assert 200 in statuses, f"no generated request was served: {sorted(set(statuses))}"  # not only refusals


def test_afterwards_the_same_greedy_text_and_every_kv_block_free(server: ServerThread, client: httpx.Client,
                                                                  before: str) -> None:
    after = client.post("/v1/completions", json=NORMAL)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before
    state = server.async_llm.engine_state()
    assert state.unfinished_request_ids == () and state.kv_blocks_used == 0
    assert client.get("/health").status_code == 200
