"""Hostile and oversized input (issue 19): every malformed request gets a 4xx naming the field (deep
nesting, a lone surrogate anywhere, logprobs in a form we do not support), a body over the limit a 413
naming it, a prompt that cannot fit is refused before the tokenizer sees it (and a valid one never is), a
request too big for the KV pool names ``max_tokens``, and the server keeps serving throughout."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit import LLM
from labkit.serving import AsyncLLM, ServerMetrics, ServerThread
from labkit.serving.cli import bind_socket, main, parse_args
from labkit.serving.limits import PromptLimits, max_token_chars, min_message_tokens, prevalidate_messages
from labkit.serving.protocol import RequestError

MODEL = "labkit-tiny"
MAX_MODEL_LEN = 256
NUM_BLOCKS, BLOCK_SIZE = 8, 16  # a KV pool of 128 tokens: smaller than max_model_len
BODY_LIMIT = 64 * 1024
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    srv = ServerThread(model=MODEL, engine="chunked", max_model_len=MAX_MODEL_LEN, num_gpu_blocks=NUM_BLOCKS,
                       block_size=BLOCK_SIZE, server_options={"max_request_body_bytes": BODY_LIMIT})
    with srv:
        yield srv


@pytest.fixture
def encode_calls(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many texts the server's tokenizer encoded during the test."""
    tokenizer = server.async_llm.llm.tokenizer
    calls: list[int] = []
    original = tokenizer.encode

    def counting(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting)
    return calls


def post(server: ServerThread, path: str, body: str | bytes | dict, headers: dict[str, str] | None = None
         ) -> httpx.Response:
    content = json.dumps(body) if isinstance(body, dict) else body
    return httpx.post(server.base_url + path, content=content, headers=headers or JSON, timeout=60)


def deep(levels: int, inner: str = "1") -> str:
    return "[" * levels + inner + "]" * levels


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = '"model": "labkit-tiny", "prompt": "hi"'
USER = '"model": "labkit-tiny", "messages": [{"role": "user", "content": "hi"}]'

# (path, raw body, status, param, part of the message). Raw strings: JSON's "\\ud800" is a lone surrogate.
MALFORMED = [
    (COMPLETIONS, '{"model": "labkit-tiny", "prompt": ' + deep(1000) + "}", 400, None, "nests JSON arrays or objects"),
    (COMPLETIONS, deep(30_000), 400, None, "nests JSON arrays or objects too deeply"),
    (COMPLETIONS, "{" + HI + ', "logit_bias": ' + '{"a": ' * 1000 + "1" + "}" * 1000 + "}", 400, None,
     "nests JSON arrays or objects"),
    (COMPLETIONS, '{"model": "labkit-tiny", "prompt": ' + deep(900) + "}", 400, "prompt",
     "prompt: Input should be a valid string, got [[["),
    (COMPLETIONS, '{"model": "labkit-tiny", "prompt": "once \\ud800 upon"}', 400, "prompt",
     "prompt: invalid Unicode: a lone surrogate '\\ud800' at character 5"),
    (COMPLETIONS, '{"model": "labkit-tiny", "prompt": ["\\udfff"]}', 400, "prompt.0", "lone surrogate '\\udfff'"),
    (CHAT, '{"model": "labkit-tiny", "messages": [{"role": "user", "content": "hi\\ud83d"}]}', 400,
     "messages.0.content", "messages.0.content: invalid Unicode"),
    (CHAT, '{"model": "labkit-tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": '
           '"\\ud800"}]}]}', 400, "messages.0.content.0.text", "invalid Unicode"),
    (COMPLETIONS, '{"model": "\\ud800", "prompt": "hi"}', 400, "model", "model: invalid Unicode"),
    (COMPLETIONS, "{" + HI + ', "stop": ["\\ud800"]}', 400, "stop.0", "invalid Unicode"),
    (COMPLETIONS, "{" + HI + ', "\\ud800": 1}', 400, None, "a field name at the top level is not valid Unicode"),
    (CHAT, '{"model": "labkit-tiny", "messages": [{"role": "user", "content": "hi", "\\udc00x": 1}]}', 400,
     "messages.0", "a field name in messages.0 is not valid Unicode"),
    (COMPLETIONS, b'{"model": "labkit-tiny", "prompt": "\xed\xa0\x80"}', 400, None, "not valid UTF-8"),
    (COMPLETIONS, b'{"model": "labkit-tiny", "prompt": "\xff"}', 400, None, "not valid UTF-8"),
    (COMPLETIONS, ("{" + HI + "}").encode("utf-16"), 400, None, "not valid UTF-8"),
    (COMPLETIONS, "{" + HI + ', "logprobs": 0}', 400, "logprobs", "logprobs=0 is not supported"),
    (COMPLETIONS, "{" + HI + ', "logprobs": 5}', 400, "logprobs", "logprobs=5 is not supported"),
    (COMPLETIONS, "{" + HI + ', "logprobs": -1}', 400, "logprobs", "logprobs=-1 is not supported"),
    (COMPLETIONS, "{" + HI + ', "logprobs": true}', 400, "logprobs", "logprobs: Input should be a valid integer"),
    (COMPLETIONS, "{" + HI + ', "logprobs": false}', 400, "logprobs", "logprobs: Input should be a valid integer"),
    (CHAT, "{" + USER + ', "logprobs": true}', 400, "logprobs", "logprobs=true is not supported"),
    (CHAT, "{" + USER + ', "logprobs": 1}', 400, "logprobs", "logprobs: Input should be a valid boolean"),
    (CHAT, "{" + USER + ', "top_logprobs": 3}', 400, "top_logprobs", "top_logprobs=3 is not supported"),
    (COMPLETIONS, "{" + HI + ', "max_tokens": 200}', 400, "max_tokens",
     "max_tokens 200 is too large: this server's KV cache holds 128 tokens (8 blocks of 16; --num-gpu-blocks), "
     "and the prompt has 3, so max_tokens can be at most 126"),
    (COMPLETIONS, json.dumps({"model": MODEL, "prompt": [5] * 200}), 400, "prompt",
     "prompt has 200 tokens, but this server's KV cache holds 128 tokens"),
    (CHAT, "{" + USER + ', "max_completion_tokens": 200}', 400, "max_completion_tokens",
     "max_completion_tokens 200 is too large: this server's KV cache holds 128 tokens"),
    (CHAT, "{" + USER + ', "max_tokens": 200}', 400, "max_tokens", "max_tokens 200 is too large: this server's KV"),
    # Integers past Python's 4,300-digit limit: a 400 naming the limit, never a 500 (in a field, a token-id prompt, a
    # chat's seed).
    (COMPLETIONS, "{" + HI + ', "max_tokens": ' + "9" * 5000 + "}", 400, None,
     "a number too long to read: Exceeds the limit (4300 digits)"),
    (COMPLETIONS, '{"model": "labkit-tiny", "prompt": [1, ' + "7" * 4301 + "]}", 400, None, "4300 digits"),
    (CHAT, "{" + USER + ', "seed": -' + "1" * 10_000 + "}", 400, None, "a number too long to read"),
]


@pytest.mark.parametrize("path, body, status, param, message", MALFORMED,
                         ids=[f"{i}-{m[3] or 'body'}" for i, m in enumerate(MALFORMED)])
def test_malformed_input_gets_a_4xx_naming_the_field(server: ServerThread, path: str, body: str | bytes,
                                                      status: int, param: str | None, message: str) -> None:
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.content.isascii()  # whatever the client sent, the answer is valid (ASCII) JSON
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param, error
    assert not error["message"].startswith("None")


def test_long_lists_are_validated_a_chunk_at_a_time_with_the_same_errors(server: ServerThread) -> None:
    parts = [{"type": "text", "text": "a"}] * 1500
    bad = [*parts[:700], {"type": "image_url"}, *parts[700:]]
    r = post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": bad}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.700.type", r.text
    messages = [{"role": "user", "content": ""}] * 1100  # (a template that spends no token per message)
    messages[1030] = {"role": "robot", "content": "hi"}
    with pytest.raises(RequestError) as info:
        prevalidate_messages({"messages": messages})
    assert info.value.param == "messages.1030.role" and "got \"robot\"" in info.value.message
    r = post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]
                                                          * 2000}], "max_completion_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_neutral_logprobs_are_accepted_and_the_server_keeps_serving(server: ServerThread) -> None:
    for path, body in ((COMPLETIONS, "{" + HI + ', "logprobs": null, "max_tokens": 2}'),
                       (CHAT, "{" + USER + ', "logprobs": false, "top_logprobs": 0, "max_completion_tokens": 2}')):
        r = post(server, path, body)
        assert r.status_code == 200, r.text
    state = server.async_llm.engine_state()
    assert server.async_llm.is_running and state.kv_blocks_used == 0


def test_a_chat_without_max_completion_tokens_gets_what_the_kv_pool_holds(server: ServerThread) -> None:
    """Not refused with advice to lower a field the client never sent: the default is whatever fits."""
    r = post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}],
                            "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == NUM_BLOCKS * BLOCK_SIZE + 1


def test_a_body_over_the_limit_gets_a_413_naming_it(server: ServerThread) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * BODY_LIMIT}).encode()
    r = post(server, COMPLETIONS, big)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["message"] == (f"request body is {len(big)} bytes, more than this server accepts: {BODY_LIMIT} "
                                "bytes (--max-request-body-bytes)") and error["code"] == "request_too_large"
    chunked = httpx.post(server.base_url + COMPLETIONS, content=iter([big[:40_000], big[40_000:]]), headers=JSON)
    assert chunked.status_code == 413 and "more than this server accepts" in chunked.text  # no Content-Length
    at_limit = b'{"model": "labkit-tiny", "prompt": "hi", "max_tokens": 1}'.ljust(BODY_LIMIT)  # JSON allows spaces
    assert post(server, COMPLETIONS, at_limit).status_code == 200


def test_prompts_that_cannot_fit_are_refused_before_tokenizing(server: ServerThread, encode_calls: list[int]) -> None:
    limits = PromptLimits.for_tokenizer(server.async_llm.llm.tokenizer, MAX_MODEL_LEN)
    assert limits.max_prompt_chars is not None and limits.min_message_tokens >= 1
    encode_calls.clear()  # the chat template's probe (above) encodes; only the requests below count
    too_long = "a" * (limits.max_prompt_chars + 1)
    for path, body, param in ((COMPLETIONS, {"model": MODEL, "prompt": too_long}, "prompt"),
                              (COMPLETIONS, {"model": MODEL, "prompt": [too_long]}, "prompt"),
                              (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 200}, "messages"),
                              (COMPLETIONS, {"model": MODEL, "prompt": [1] * 20_000}, "prompt")):
        r = post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert encode_calls == []
    chat = post(server, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x" * 60_000}]})
    assert chat.status_code == 400 and "messages has" in chat.text and "characters" in chat.text
    assert encode_calls == []  # the rendered chat template is checked before the tokenizer sees it


def test_the_character_bound_never_refuses_a_prompt_that_fits(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The longest prompt that fits: max_model_len - 1 tokens, each the longest vocabulary entry."""
    limits = PromptLimits.for_tokenizer(tokenizer, MAX_MODEL_LEN)
    longest = max(tokenizer.get_vocab(), key=len)
    text = tokenizer.convert_tokens_to_string([longest]) * (MAX_MODEL_LEN - 2)
    assert len(tokenizer.encode(text)) < MAX_MODEL_LEN
    limits.check_text(text, "prompt")  # no error
    assert limits.max_token_chars == len(longest)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(st.characters(exclude_categories=["Cs"]), max_size=400))
def test_no_token_covers_more_characters_than_the_bound(tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    bound = max_token_chars(tokenizer)
    assert bound is not None and len(text) <= bound * len(tokenizer.encode(text, add_special_tokens=False))


@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=30)),
                         min_size=1, max_size=12))
def test_every_chat_message_costs_at_least_the_probed_tokens(tokenizer, messages) -> None:  # type: ignore[no-untyped-def]
    rendered = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                             add_generation_prompt=True, tokenize=False)
    assert len(tokenizer.encode(rendered, add_special_tokens=False)) >= len(messages) * min_message_tokens(tokenizer)


def test_metrics_show_the_kv_pool_before_the_first_request() -> None:
    llm = LLM(MODEL, engine="chunked", max_model_len=64, num_gpu_blocks=6)
    async_llm = AsyncLLM(llm, ServerMetrics(MODEL)).start()
    try:
        text = async_llm.metrics.exposition().decode()  # type: ignore[union-attr]
    finally:
        async_llm.shutdown()
    assert f'labkit:kv_blocks_total{{model_name="{MODEL}"}} 6.0' in text


def test_a_port_out_of_range_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["--port", "70000"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--port: must be in [0, 65535] (0: any free port), got 70000" in err
    with pytest.raises(ValueError, match=r"port must be an int in \[0, 65535\] \(0: any free port\), got 70000"):
        bind_socket("127.0.0.1", 70000)
    with pytest.raises(SystemExit) as info:
        main(["--max-request-body-bytes", "0"])
    assert info.value.code == 2 and "must be an int >= 1, got 0" in capsys.readouterr().err
