"""The server's own time, recorded (``--record-timings``): every part present, parts within their wholes; and the
hand-off change (one event-loop wake-up per step instead of per token) streams exactly the same tokens and text."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from engine_gates import admit_each_arrival_before_stepping_on

from labkit import LLM, SamplingParams
from labkit.measure.loadgen.runner import run_sync
from labkit.serving import ServerThread
from labkit.serving.async_engine import AsyncLLM
from labkit.serving.cli import parse_args
from labkit.serving.timings import PER_REQUEST, PER_STEP, PER_TOKEN, ServerTimings, TimingBreakdown

MODEL = "labkit-tiny"
PROMPTS = ["Once upon a time, there was a little fox", "The sun was hot and the dog", "Tom had a red ball. He",
           "One day, a bird"]
MAX_TOKENS = 12


def make_llm() -> LLM:
    # float64: scheduling never changes a token, so every stream must equal offline generate exactly
    return LLM(MODEL, engine="chunked", dtype="float64", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def expected() -> list[tuple[list[int], str]]:
    with make_llm() as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


async def _stream_all(base_url: str, chat_too: bool) -> list[tuple[list[int], str]]:
    async def one(client: httpx.AsyncClient, prompt: str) -> tuple[list[int], str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
                "return_token_ids": True}
        ids, text = [], ""
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    ids += choice["token_ids"]
                    text += choice["text"]
        return ids, text

    async with httpx.AsyncClient(timeout=60) as client:
        results = await asyncio.gather(*(one(client, p) for p in PROMPTS))
        if chat_too:
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4}
            assert (await client.post(f"{base_url}/v1/chat/completions", json=chat)).status_code == 200
    return list(results)


def test_breakdown_is_present_and_parts_fit_in_their_wholes(expected) -> None:  # type: ignore[no-untyped-def]
    with ServerThread(make_llm(), served_model_name=MODEL, server_options={"record_timings": True}) as server:
        before = httpx.get(f"{server.base_url}/timings").json()
        assert run_sync(_stream_all(server.base_url, chat_too=True)) == expected
        after = httpx.get(f"{server.base_url}/timings").json()
    b = TimingBreakdown.between(before, after)
    assert b.num_requests == len(PROMPTS) + 1
    assert b.num_tokens == len(PROMPTS) * MAX_TOKENS  # one event per streamed token (the chat was not streamed)
    assert b.counts["stream"] == len(PROMPTS)
    assert b.num_steps >= MAX_TOKENS  # at least one step per token of the longest stream
    for part in (*PER_REQUEST, *PER_STEP, *PER_TOKEN, "stream"):
        assert part in b.seconds and b.seconds[part] >= 0, part
    assert {"schedule", "forward", "sample", "detokenize"} <= set(b.engine_stages_ms())
    b.check_nesting()  # parse + tokenize <= prepare; wait + frame + send <= stream; stages <= engine_step
    assert set(b.per_token_ms()) >= {"engine_step", "post", "frame", "send", "engine:forward"}
    assert b.per_request_ms()["tokenize"] > 0


def test_check_nesting_catches_a_part_longer_than_its_whole() -> None:
    snapshot = {"seconds": {"prepare": 1.0, "parse": 0.7, "tokenize": 0.5}, "counts": {"prepare": 1}}
    with pytest.raises(AssertionError, match="prepare"):
        TimingBreakdown.between({"seconds": {}, "counts": {}}, snapshot).check_nesting()


def test_timings_are_off_unless_asked() -> None:
    with ServerThread(make_llm(), served_model_name=MODEL) as server:
        assert httpx.get(f"{server.base_url}/timings").status_code == 404
        assert server.async_llm.timings is None and server.async_llm.hand_off == "per_token"


@pytest.mark.parametrize("hand_off", ["per_token", "per_step"])
def test_either_hand_off_streams_the_same_tokens_and_text(hand_off: str, expected) -> None:  # type: ignore[no-untyped-def]
    options = {"hand_off": hand_off, "record_timings": True}
    with ServerThread(make_llm(), served_model_name=MODEL, server_options=options) as server:
        assert server.async_llm.hand_off == hand_off
        # The 4 streams share steps on any machine: a step waits for the next request until all 4 have arrived.
        admit_each_arrival_before_stepping_on(server.async_llm, len(PROMPTS))
        assert run_sync(_stream_all(server.base_url, chat_too=False)) == expected  # 4 concurrent streams
        b = TimingBreakdown.between({"seconds": {}, "counts": {}}, httpx.get(f"{server.base_url}/timings").json())
    if hand_off == "per_token":  # one wake-up of the event loop per streamed token
        assert b.counts["wake_ups"] == b.num_tokens
    else:  # at most one per step, so fewer than tokens once the 4 streams share steps
        assert b.counts["wake_ups"] <= b.num_steps and b.counts["wake_ups"] < b.num_tokens


def test_options_and_errors() -> None:
    assert parse_args(["--hand-off", "per-token"]).hand_off == "per_token"
    assert parse_args(["--hand-off", "per_step"]).hand_off == "per_step"
    assert parse_args([]).hand_off == "per_token" and not parse_args([]).record_timings
    assert parse_args(["--record-timings"]).record_timings
    with pytest.raises(SystemExit):
        parse_args(["--hand-off", "sometimes"])
    with make_llm() as llm, pytest.raises(ValueError, match="hand_off"):
        AsyncLLM(llm, hand_off="sometimes")
    timings = ServerTimings()
    with timings.time("parse"):
        pass
    timings.add("parse", 0.5, count=2)
    snap = timings.snapshot()
    assert snap["counts"]["parse"] == 3 and snap["seconds"]["parse"] >= 0.5


def test_token_weighted_engine_share_of_a_turn() -> None:
    from labkit.core.engine.step import StepStats
    from labkit.serving.streams import TokenDelta

    def delta(num_output_tokens: int) -> TokenDelta:
        return TokenDelta(0, [7], "x", False, None, 3, num_output_tokens, 0.0)

    timings = ServerTimings()
    # two turns: 10 ms step + 2 ms serving, 4 deltas of which one is a first token (its wait is TTFT, not an ITL);
    # then 30 ms step + 0 ms serving, 1 later token
    timings.record_step([StepStats(0, 0.0, 0.01, 4, 4, 4, {"forward": 0.008})], [0.0, 0.010, 0.011, 0.0115, 0.012],
                        [delta(1), delta(2), delta(5), delta(9)])
    timings.record_step([StepStats(1, 0.0, 0.03, 1, 1, 1, {"forward": 0.025})], [1.0, 1.030, 1.030, 1.030, 1.030],
                        [delta(3), RuntimeError("a failed request's error is not a token")])
    b = TimingBreakdown.between({"seconds": {}, "counts": {}}, timings.snapshot())
    assert b.num_steps == 2 and b.seconds["post"] == pytest.approx(0.0005)
    assert b.mean_engine_step_per_token_ms == pytest.approx((3 * 10 + 1 * 30) / 4)
    assert b.engine_share_of_turn == pytest.approx((3 * 0.010 + 0.030) / (3 * 0.012 + 0.030))
    assert b.engine_stages_ms() == {"forward": pytest.approx(1e3 * 0.033 / max(1, b.num_tokens))}
    b.check_nesting()
