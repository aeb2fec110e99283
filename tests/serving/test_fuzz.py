"""A fuzz test of the HTTP API (issue 19). Hypothesis builds request bodies from the API's own fields with
valid, wrong-typed and extreme values (lone surrogates, NaN and infinities, huge integers, nested junk),
unknown fields, garbage bytes and other content types, on both routes, streamed or not. Whatever it sends:
never a 5xx, every answer is OpenAI-shaped JSON (or a stream that ends with ``[DONE]``), the server stays
healthy, and every KV block comes back. A small context and KV pool keep each valid request short (the
whole run takes seconds) and put the pool's limit within reach. Derandomized: the same bodies every run."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit.serving import ServerThread

MODEL = "labkit-tiny"

plain = st.text(max_size=12)
text = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])), max_size=12)  # Cs: lone surrogates
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(), text,
                    st.floats(allow_nan=True, allow_infinity=True))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                    max_leaves=8)

content = st.one_of(st.sampled_from(["Once upon a time", "Hi", ""]), plain,
                    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain}), max_size=2))
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": content})
PROMPT = {"/v1/completions": ("prompt", st.one_of(st.sampled_from(["Once upon a time", "Hi"]), plain,
                                                  st.lists(st.integers(0, 2047), min_size=1, max_size=40),
                                                  st.lists(plain, min_size=1, max_size=1))),
          "/v1/chat/completions": ("messages", st.lists(message, min_size=1, max_size=4))}
# Plausible values of every field: valid, with edge values, and now and then a value a real client gets wrong.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 40), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 1, 5, 3000]), "stream": st.booleans(),
    "stop": st.one_of(plain.filter(bool), st.lists(plain.filter(bool), max_size=4)),
    "seed": st.integers(-(2**63), 2**64 - 1), "ignore_eos": st.booleans(), "return_token_ids": st.booleans(),
    "presence_penalty": st.sampled_from([0, 0.0, 0.0, 0.0, 0.5]), "logprobs": st.sampled_from([None] * 4 + [0]),
}
CHAT_FIELDS = {**FIELDS, "max_completion_tokens": st.integers(1, 40),
               "logprobs": st.sampled_from([None, False, False, False, True]), "top_logprobs": st.sampled_from([0, 2])}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, str]:
    """(path, body, content type): a plausible request, one with a field (or a new field) set to junk, or
    junk JSON or bytes."""
    path = draw(st.sampled_from(sorted(PROMPT)))
    kind = draw(st.sampled_from(["plausible"] * 4 + ["one junk field"] * 2 + ["junk", "bytes"]))
    name, prompt = PROMPT[path]
    fields = CHAT_FIELDS if path.endswith("chat/completions") else FIELDS
    body = draw(st.fixed_dictionaries({"model": st.just(MODEL), name: prompt}, optional=fields))
    if kind == "one junk field":
        body[draw(st.sampled_from([*fields, name, "model"]) | text)] = draw(junk)
    raw = {"junk": lambda: json.dumps(draw(junk)).encode(), "bytes": lambda: draw(st.binary(max_size=40))}.get(
        kind, lambda: json.dumps(body).encode())()
    content_types = ["application/json"] * 8 + ["text/plain", "application/x-www-form-urlencoded"]
    return path, raw, draw(st.sampled_from(content_types))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(model=MODEL, engine="chunked", max_model_len=48, num_gpu_blocks=4, block_size=8,
                      max_num_batched_tokens=16) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def check_answer(r: httpx.Response, streamed: bool) -> None:
    assert r.status_code < 500, r.text
    if r.status_code == 200 and streamed:
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
        return
    answer = r.json()
    if r.status_code == 200:
        assert answer["usage"]["completion_tokens"] >= 1
    else:
        assert isinstance(answer["error"]["message"], str) and answer["error"]["message"]


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(request=requests())
def test_fuzzed_requests_never_get_a_5xx(server: ServerThread, client: httpx.Client,
                                         request: tuple[str, bytes, str]) -> None:
    path, body, content_type = request
    r = client.post(path, content=body, headers={"content-type": content_type})
    check_answer(r, streamed=b'"stream": true' in body)


def test_after_the_fuzzing_the_server_is_healthy_and_every_block_is_free(server: ServerThread,
                                                                          client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    deadline = time.monotonic() + 30
    while (state := server.async_llm.engine_state()).unfinished_request_ids and time.monotonic() < deadline:
        time.sleep(0.02)
    assert state.unfinished_request_ids == () and state.kv_blocks_used == 0
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
