"""The OpenAI-compatible server: the official ``openai`` client gets the offline engine's exact tokens,
every bad field gets a clear 4xx while the server keeps serving, 32 clients stream at once, and a
client that disconnects has its request aborted and its KV blocks freed (seen in the engine's state)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from engine_gates import commands_waiting, engine_held_after, wait_for
from prometheus_client.parser import text_string_to_metric_families

from labkit import LLM, SamplingParams
from labkit.measure.loadgen.runner import run_sync
from labkit.serving import ServerThread
from labkit.serving.cli import parse_args

MODEL = "labkit-tiny"
PROMPT = "Once upon a time, there was a little fox named Lily. One day, Lily"
CHAT = [{"role": "system", "content": "You are a friendly storyteller for children."},
        {"role": "user", "content": "Tell me a story about a fox."}]
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float64: scheduling never changes a token, so streams must equal offline generate exactly
    return LLM(MODEL, engine="chunked", dtype="float64", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
               max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def expected(llm: LLM) -> dict[str, object]:
    """Offline greedy outputs, computed before the engine thread owns the engine."""
    params = SamplingParams(max_tokens=24, temperature=0.0)
    chat_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                      tokenize=False), add_special_tokens=False)
    return {"completion": llm.generate(PROMPT, params, use_tqdm=False)[0],
            "chat": llm.generate([chat_ids], SamplingParams(max_tokens=40, temperature=0.0), use_tqdm=False)[0]}


@pytest.fixture(scope="module")
def server(llm: LLM, expected: dict[str, object]):  # type: ignore[no-untyped-def]
    srv = ServerThread(llm, served_model_name=MODEL)
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def wait_until_idle(server: ServerThread, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    """The engine's state once it has no request left (polled; the deadline only guards against a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        state = server.async_llm.engine_state()
        if not state.unfinished_request_ids or time.monotonic() > deadline:
            return state
        time.sleep(0.02)


# ---- the openai client, against offline generate ----

def test_openai_non_streaming_equals_offline_generate(client: openai.OpenAI, expected: dict) -> None:
    want = expected["completion"].outputs[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.text == want.text and choice.finish_reason == want.finish_reason == "length"
    assert choice.model_extra["token_ids"] == want.token_ids
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(expected["completion"].prompt_token_ids), 24)
    assert out.object == "text_completion" and out.model == MODEL


def test_openai_streaming_equals_offline_generate_token_by_token(client: openai.OpenAI, expected: dict) -> None:
    want = expected["completion"].outputs[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"return_token_ids": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert [c.choices[0].model_extra["token_ids"] for c in token_chunks] == [[t] for t in want.token_ids]  # 1/chunk
    assert "".join(c.choices[0].text for c in token_chunks) == want.text
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 23 + ["length"]
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 24  # the final usage record
    assert all(c.usage is None for c in token_chunks)


def test_openai_chat_streaming_and_not(client: openai.OpenAI, expected: dict) -> None:
    want = expected["chat"].outputs[0]  # ends at the chat template's <|end|> (an EOS) or at 40 tokens
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=40, temperature=0.0)
    assert out.choices[0].message.content == want.text and out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == want.finish_reason and out.usage.completion_tokens == len(want.token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=40, temperature=0.0,
                                            stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert len(chunks) == len(want.token_ids) and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)  # without include_usage: on the last chunk


def test_models_health_and_default_bind(server: ServerThread, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert server.base_url.startswith("http://127.0.0.1:")
    assert parse_args([]).host == "127.0.0.1"  # the CLI binds this machine only unless told otherwise
    assert parse_args(["--async-scheduling"]).engine_options == {"async_scheduling": True}
    assert "async_scheduling" not in parse_args([]).engine_options


# ---- validation: a clear 4xx for every bad field, and the server keeps serving ----

BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400, None, "not valid JSON"),
    ("/v1/completions", "[1, 2]", 400, None, "must be a JSON object"),
    ("/v1/completions", {"prompt": "hi"}, 400, "model", "missing required field 'model'"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "missing required field 'prompt'"),
    ("/v1/completions", {"model": MODEL, "prompt": 42}, 400, "prompt", "prompt: wrong type, got 42"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "8"}, 400, "max_tokens",
     'max_tokens: Input should be a valid integer, got "8"'),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens", "got true"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature",
     "temperature: Input should be a valid number"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", "stream:"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens",
     "max_tokens: Input should be greater than or equal to 1, got -5"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "got 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens",  # BOS + 2
     "max_tokens 1000000000000 is too large: the prompt has 3 tokens and max_model_len is 256, so "
     "max_tokens can be at most 253"),
    ("/v1/completions", {"model": MODEL, "prompt": "Once upon a time " * 80}, 400, "prompt",
     "this model's max_model_len is 256"),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 300}, 400, "prompt",
     "prompt has 300 tokens, but this model's max_model_len is 256 (prompt + output); shorten it to at most 255"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 5, 4096]}, 400, "prompt",
     "token id 4096 is outside the vocabulary [0, 2048)"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "prompt is empty"),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, 404, "model",
     "model 'gpt-4o' does not exist; this server serves 'labkit-tiny'"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 2.5}, 400, "temperature",
     "less than or equal to 2, got 2.5"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_k": 0}, 400, "top_k", "top_k must be -1"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 3}, 400, "n", "less than or equal to 1, got 3"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed",
     "seed: Input should be less than or equal to 9223372036854775807"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "seed": -1}, 400, "seed",  # SamplingParams' bound, not torch's
     "seed: Input should be greater than or equal to 0"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ""}, 400, "stop", "stop strings must be non-empty"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop",
     "at most 4"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty",
     "frequency_penalty=0.5 is not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokns": 5}, 400, "max_tokns",
     "unrecognized request argument 'max_tokns'"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", "only allowed with stream=true"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "missing required field 'messages'"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "at least 1 item"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages.0.role", "'system', 'user' or 'assistant', got \"robot\""),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 7}]}, 400,
     "messages.0.content", "wrong type, got 7"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 5000}, 400, "max_completion_tokens",
     "max_completion_tokens 5000 is too large"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 0, "temperature": 0, "max_tokens": 2,
                         "stop": "zzz", "seed": 1, "top_p": 1}, 200, None, ""),  # ints where floats go are fine
]


@pytest.mark.parametrize("path, body, status, param, message", BAD_REQUESTS,
                         ids=[f"{i}-{b[3] or 'body'}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_a_clear_error(server: ServerThread, path: str, body: object, status: int,
                                        param: str | None, message: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.base_url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    if status == 200:
        assert r.json()["usage"]["completion_tokens"] >= 1
        return
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert error["type"] == ("invalid_request_error" if status == 400 else "not_found_error")


def test_the_openai_client_raises_with_the_message_and_the_server_keeps_serving(client: openai.OpenAI,
                                                                                  server: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens can be at most"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi")
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0.0)
    assert out.usage.completion_tokens >= 1
    state = wait_until_idle(server)
    assert state.kv_blocks_used == 0 and server.async_llm.is_running


# ---- load and disconnects ----

def test_32_concurrent_streaming_clients_all_complete(server: ServerThread) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)

    async def one(i: int) -> tuple[int, str | None, int]:
        stream = await aclient.completions.create(model=MODEL, prompt=f"Once upon a time, number {i}", max_tokens=8,
                                                  temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        return len(chunks), chunks[-1].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    async def main() -> list[tuple[int, str | None, int]]:
        async with aclient:
            return list(await asyncio.gather(*(one(i) for i in range(32))))

    results = run_sync(main())
    assert results == [(8, "length", 8)] * 32  # max_num_seqs=8: most of them queued, and all finished
    assert wait_until_idle(server).kv_blocks_used == 0


def test_a_streaming_client_that_disconnects_frees_its_blocks(server: ServerThread) -> None:
    aborted_before = _abort_count(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    # The engine pauses at its 4th token until the server has sent the abort: on any machine the request is still
    # running when the client hangs up (200 tokens of a tiny model can take less than a client's reads).
    with engine_held_after(server.async_llm, 4) as held:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens (and blank separators), then hang up mid-stream
            wait_for(held.is_set, "the engine holds at the 4th token")
            assert server.async_llm.llm.engine.block_manager.num_used_blocks > 0
        wait_for(lambda: commands_waiting(server.async_llm), "the server sends the abort")
    assert any(line.startswith("data: ") for line in got)
    state = wait_until_idle(server)
    assert state.unfinished_request_ids == () and state.kv_blocks_used == 0
    assert _abort_count(server) == aborted_before + 1  # aborted, not finished: 200 tokens were asked for


def test_a_waiting_non_streaming_client_that_disconnects_frees_its_blocks(server: ServerThread) -> None:
    aborted_before = _abort_count(server)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 220, "temperature": 0.0, "ignore_eos": True}
    with engine_held_after(server.async_llm, 2):  # the request cannot finish before the client gives up
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.3 s and closes the connection
            httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(5.0, read=0.3))
        wait_for(lambda: commands_waiting(server.async_llm), "the server sends the abort")
    state = wait_until_idle(server)
    assert state.unfinished_request_ids == () and state.kv_blocks_used == 0
    assert _abort_count(server) == aborted_before + 1


def _abort_count(server: ServerThread) -> float:
    for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text):
        for s in family.samples:
            if s.name == "labkit:request_success_total" and s.labels.get("finished_reason") == "abort":
                return s.value
    return 0.0


def test_metrics_endpoint_reports_the_serving_state(server: ServerThread) -> None:
    r = httpx.get(f"{server.base_url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {(s.name, s.labels.get("le", "")): s.value
               for f in text_string_to_metric_families(r.text) for s in f.samples}
    for name in ("labkit:time_to_first_token_seconds_count", "labkit:inter_token_latency_seconds_count",
                 "labkit:e2e_request_latency_seconds_count", "labkit:num_requests_running",
                 "labkit:num_requests_waiting", "labkit:kv_blocks_used", "labkit:kv_blocks_total",
                 "labkit:kv_cache_usage_perc", "labkit:num_preemptions_total", "labkit:prefix_cache_hit_rate",
                 "labkit:prefix_cache_queries_total", "labkit:prompt_tokens_total", "labkit:generation_tokens_total"):
        assert (name, "") in samples, name
    assert samples[("labkit:time_to_first_token_seconds_count", "")] >= 32  # the load test's requests at least
    assert samples[("labkit:time_to_first_token_seconds_bucket", "+Inf")] == \
        samples[("labkit:time_to_first_token_seconds_count", "")]
    assert samples[("labkit:kv_blocks_total", "")] == server.async_llm.llm.engine.num_blocks
