"""The load generator: metrics on hand-computed timelines (vLLM's definitions), arrivals, datasets, the
stream parser, and a smoke run of ``python -m labkit.serving`` + ``labkit.measure.loadgen`` producing every metric."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from labkit.measure.loadgen import (
    BenchResult,
    ChatLikeDataset,
    RandomDataset,
    RequestRecord,
    ServeBenchConfig,
    SharedPrefixDataset,
    arrival_times,
    benchmark_serving,
    calculate_metrics,
    parse_goodput,
    request_goodput,
)
from labkit.measure.loadgen.__main__ import main as bench_main
from labkit.measure.loadgen.client import build_payload, send_request
from labkit.measure.loadgen.datasets import BenchRequest
from labkit.measure.loadgen.runner import load_tokenizer_for, run_sync
from labkit.measure.stats import Percentiles
from labkit.serving import ServerProcess

# ---- metrics on a hand-computed timeline ----
#
# Four requests over a 2-second run (seconds after each request was sent):
#   A  3 tokens, one chunk each: first at 0.10, then 0.15 and 0.20 -> TTFT 0.10, ITL [0.05, 0.05], E2EL 0.20,
#      TPOT (0.20 - 0.10) / 2 = 0.05
#   B  1 token (output length 1): at 0.30 -> TTFT 0.30, no ITL, E2EL 0.30, no TPOT (0 for goodput)
#   C  failed (HTTP 500): counts nowhere
#   D  4 tokens in a single chunk at 0.20 (a server that bundles tokens): TTFT 0.20, no ITL, E2EL 0.20,
#      TPOT (0.20 - 0.20) / 3 = 0
A = RequestRecord(success=True, prompt_len=10, output_tokens=3, ttft=0.10, itl=[0.05, 0.05], latency=0.20)
B = RequestRecord(success=True, prompt_len=20, output_tokens=1, ttft=0.30, itl=[], latency=0.30)
C = RequestRecord(success=False, prompt_len=30, error="HTTP 500")
D = RequestRecord(success=True, prompt_len=40, output_tokens=4, ttft=0.20, itl=[], latency=0.20)
RUN = [A, B, C, D]


def test_metrics_by_hand() -> None:
    m = calculate_metrics(RUN, duration=2.0, slos_ms={"ttft": 200})
    assert (m.completed, m.failed, m.total_input, m.total_output) == (3, 1, 70, 8)
    assert m.request_throughput == pytest.approx(1.5) and m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(39.0)
    # The statistics are in seconds. TTFT [0.1, 0.3, 0.2]: numpy's linear interpolation puts p90 at rank 1.8 of 0..2
    assert (m.ttft.mean, m.ttft.median, m.ttft.p90, m.ttft.p99) == pytest.approx((0.2, 0.2, 0.28, 0.298))
    assert m.ttft.std == pytest.approx(math.sqrt(2 / 3) * 0.1) and m.ttft.count == 3
    # TPOT only for requests with more than one output token: A 0.05 s, D 0 (its one chunk held all 4)
    assert (m.tpot.mean, m.tpot.median, m.tpot.p90, m.tpot.p99, m.tpot.count) == pytest.approx(
        (0.025, 0.025, 0.045, 0.0495, 2))
    # ITL pools every gap between chunks: only A has any
    assert (m.itl.mean, m.itl.p99, m.itl.count) == pytest.approx((0.05, 0.05, 2))
    assert (m.e2el.mean, m.e2el.median, m.e2el.p99) == pytest.approx((0.7 / 3, 0.2, 0.298))
    # the result file has vLLM's keys and units: milliseconds
    d = m.to_dict()
    assert (d["mean_ttft_ms"], d["p90_ttft_ms"], d["median_tpot_ms"], d["p99_itl_ms"]) == pytest.approx(
        (200, 280, 25, 50))
    assert d["std_ttft_ms"] == pytest.approx(math.sqrt(2 / 3) * 100) and d["p99_e2el_ms"] == pytest.approx(298)
    # goodput, TTFT <= 200 ms: A (100) and D (exactly 200) meet it, B (300) does not -> 2 requests / 2 s
    assert m.request_goodput == pytest.approx(1.0)


@pytest.mark.parametrize("slos, good", [
    ({"tpot": 40}, 2),  # A's TPOT is 50; B's counts as 0 (one token); D's is 0
    ({"ttft": 200, "tpot": 40}, 1),  # only D meets both
    ({"e2el": 250}, 2),  # A and D
    ({"ttft": 300, "tpot": 50, "e2el": 300}, 3),  # everyone completed; never the failed C
    ({"ttft": 99}, 0),
])
def test_goodput_by_hand(slos: dict[str, float], good: int) -> None:
    assert request_goodput(RUN, slos, 4.0) == pytest.approx(good / 4.0)
    assert calculate_metrics(RUN, 4.0, slos).request_goodput == pytest.approx(good / 4.0)


def test_output_length_one_and_single_chunk_runs() -> None:
    ones = [RequestRecord(success=True, prompt_len=5, output_tokens=1, ttft=t, latency=t) for t in (0.1, 0.2)]
    m = calculate_metrics(ones, duration=1.0)
    assert m.tpot.count == 0 and m.tpot.mean == 0.0  # no TPOT at all (vLLM reports 0)
    assert m.itl.count == 0 and m.itl.p99 == 0.0
    assert m.ttft.mean == pytest.approx(0.15) and m.e2el.mean == pytest.approx(0.15)
    assert m.to_dict()["mean_tpot_ms"] == 0.0 and m.to_dict()["p99_itl_ms"] == 0.0  # vLLM writes 0, not NaN
    assert m.request_goodput is None  # no SLOs given
    assert calculate_metrics(ones, 1.0, {"tpot": 0}).request_goodput == pytest.approx(2.0)  # TPOT counts as 0
    chunk = RequestRecord(success=True, prompt_len=5, output_tokens=8, ttft=0.4, itl=[], latency=0.4)
    m = calculate_metrics([chunk], duration=0.5)
    assert m.tpot.count == 1 and m.tpot.mean == 0.0 and m.itl.count == 0 and m.output_throughput == 16.0


def test_metrics_refuse_a_zero_duration_and_nothing_completed_is_zeros() -> None:
    with pytest.raises(ValueError, match="duration"):
        calculate_metrics(RUN, 0.0)
    m = calculate_metrics([C], 1.0)
    assert (m.completed, m.failed, m.request_throughput, m.ttft.count, m.ttft.mean) == (0, 1, 0.0, 0, 0.0)
    assert m.ttft == Percentiles.of([]) == Percentiles(0.0, 0.0, 0.0, 0.0, 0.0, 0)


def test_parse_goodput() -> None:
    assert parse_goodput("ttft:500 tpot:50") == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_goodput({"tpot": 20}) == {"tpot": 20.0} and parse_goodput(None) == {}
    for bad, match in (("ttft", "KEY:MILLISECONDS"), ("itl:5", "not one of ttft, tpot, e2el"),
                       ("ttft:fast", "number of milliseconds"), ("ttft:-1", ">= 0"), ("tpot:nan", ">= 0")):
        with pytest.raises(ValueError, match=match):
            parse_goodput(bad)


# ---- arrivals ----

def test_arrivals_all_at_once_and_fixed_rate() -> None:
    assert arrival_times(4, math.inf) == [0.0] * 4
    assert arrival_times(4, 2.0, burstiness=math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_poisson_and_gamma_arrivals() -> None:
    t = arrival_times(2000, 10.0, burstiness=1.0, seed=3)
    assert t == arrival_times(2000, 10.0, burstiness=1.0, seed=3) != arrival_times(2000, 10.0, seed=4)
    assert all(b >= a for a, b in itertools.pairwise(t))
    assert t[-1] == pytest.approx(200.0)  # rescaled to n / rate, as vLLM
    cv = {}
    for k in (0.25, 1.0, 4.0):
        gaps = np.diff([0.0, *arrival_times(2000, 10.0, burstiness=k, seed=0)])
        cv[k] = gaps.std() / gaps.mean()  # a gamma's coefficient of variation is 1 / sqrt(shape)
    assert cv[0.25] > 1.6 and 0.85 < cv[1.0] < 1.15 and cv[4.0] < 0.6


@pytest.mark.parametrize("kwargs, match", [({"num_requests": 0, "request_rate": 1.0}, "num_requests"),
                                           ({"num_requests": 3, "request_rate": 0.0}, "request_rate"),
                                           ({"num_requests": 3, "request_rate": 1.0, "burstiness": 0.0}, "burstiness")])
def test_arrivals_refuse_bad_input(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        arrival_times(**kwargs)


# ---- datasets ----

def test_random_dataset_lengths_and_seed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ds = RandomDataset(input_len=40, output_len=20, range_ratio=0.5)
    (i_lo, i_hi), (o_lo, o_hi) = ds.length_ranges()
    assert (i_lo, i_hi, o_lo, o_hi) == (20, 60, 10, 30)  # [floor(L(1-r)), ceil(L(1+r))], as vLLM
    reqs = ds.sample(tokenizer, 30, seed=1)
    assert reqs == ds.sample(tokenizer, 30, seed=1) != ds.sample(tokenizer, 30, seed=2)
    assert all(o_lo <= r.expected_output_len <= o_hi for r in reqs)
    assert all(i_lo - 2 <= r.prompt_len <= i_hi + 2 for r in reqs)  # re-tokenizing text may merge a token
    assert len({r.prompt_len for r in reqs}) > 5 and len({r.prompt for r in reqs}) == 30
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt)) for r in reqs)
    with pytest.raises(ValueError, match="range_ratio"):
        RandomDataset(range_ratio=1.0)


def test_shared_prefix_dataset_shares_prefix_tokens(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ds = SharedPrefixDataset(num_prefixes=2, prefix_len=48, suffix_len=8, output_len=5)
    reqs = ds.sample(tokenizer, 6, seed=0)
    ids = [tokenizer.encode(r.prompt) for r in reqs]
    for i in range(2, 6):  # request i shares prefix i % 2 token for token; the two prefixes differ
        assert ids[i][:47] == ids[i % 2][:47]
    assert ids[0][:47] != ids[1][:47] and len({r.prompt for r in reqs}) == 6


def test_chat_like_dataset_is_heavy_tailed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reqs = ChatLikeDataset(input_median=20, output_median=20, sigma=1.0, input_max=300, output_max=300).sample(
        tokenizer, 200, seed=0)
    out = np.array([r.expected_output_len for r in reqs])
    assert np.max(out) > 4 * np.median(out) and 14 <= np.median(out) <= 28


# ---- the stream parser, against canned server-sent events ----

def _sse(*events: object) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def _fetch(handler) -> RequestRecord:  # type: ignore[no-untyped-def]
    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(client, "http://test/v1/chat/completions",
                                      {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, 7)
    return run_sync(go())


def test_stream_parser_counts_token_chunks_and_reads_usage() -> None:
    body = b": keep-alive\n\n" + _sse(
        {"choices": [{"delta": {"role": "assistant", "content": "Once"}}]},
        {"choices": [{"delta": {"content": " upon"}}]}, {"choices": [{"delta": {"content": " a time"}}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}, "[DONE]")
    rec = _fetch(lambda request: httpx.Response(200, content=body))
    assert rec.success and rec.generated_text == "Once upon a time" and len(rec.itl) == 2
    assert (rec.output_tokens, rec.prompt_len) == (4, 9)  # the usage record wins over counting chunks
    assert 0 < rec.ttft <= rec.latency and rec.latency == pytest.approx(rec.ttft + sum(rec.itl))


def test_stream_parser_reports_failures() -> None:
    rec = _fetch(lambda request: httpx.Response(400, json={"error": {"message": "max_tokens is too large"}}))
    assert not rec.success and "HTTP 400" in rec.error and "max_tokens is too large" in rec.error
    rec = _fetch(lambda request: httpx.Response(200, content=_sse("[DONE]")))
    assert not rec.success and "without a single token" in rec.error
    rec = _fetch(lambda request: httpx.Response(200, content=_sse({"choices": [{"delta": {"content": "x"}}]},
                                                                   {"error": {"message": "engine died"}})))
    assert not rec.success and rec.error == "engine died"

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    rec = _fetch(refuse)
    assert not rec.success and "ConnectError" in rec.error


def test_payloads_follow_the_openai_api() -> None:
    req = BenchRequest("Once upon a time", 5, 12)
    p = build_payload("/v1/completions", "m", req, 0.0, True)
    assert (p["prompt"], p["max_tokens"], p["stream"], p["ignore_eos"]) == ("Once upon a time", 12, True, True)
    assert p["stream_options"] == {"include_usage": True}
    p = build_payload("/v1/chat/completions", "m", req, 0.0, False)
    assert p["messages"] == [{"role": "user", "content": "Once upon a time"}] and p["max_completion_tokens"] == 12
    assert "ignore_eos" not in p


def test_config_checks_its_fields() -> None:
    for kwargs, match in (({"base_url": "127.0.0.1:8000"}, "http://"), ({"num_prompts": 0}, "num_prompts"),
                          ({"request_rate": -1.0}, "request_rate"), ({"goodput": "ttft=5"}, "KEY:MILLISECONDS"),
                          ({"max_concurrency": 0}, "max_concurrency")):
        with pytest.raises(ValueError, match=match):
            ServeBenchConfig(**{"base_url": "http://127.0.0.1:1", **kwargs})  # type: ignore[arg-type]


# ---- a smoke run against the real server (python -m labkit.serving in a child process) ----

@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    proc = ServerProcess(engine="chunked", max_model_len=256, max_num_batched_tokens=64, num_threads=1)
    try:
        yield proc.start()
    finally:
        proc.stop()
    assert not proc.is_alive()


def test_smoke_run_produces_every_metric(server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = ServeBenchConfig(base_url=server.base_url, dataset=RandomDataset(24, 6, 0.5), num_prompts=8,
                              request_rate=40.0, max_concurrency=6, num_warmups=1, seed=0, ignore_eos=True,
                              goodput="ttft:60000 tpot:60000 e2el:60000", disable_tqdm=True)
    result = benchmark_serving(config)
    m = result.metrics
    expected_out = sum(r.expected_output_len for r in config.dataset.sample(load_tokenizer_for(config), 8, 0))
    assert (m.completed, m.failed, m.total_output) == (8, 0, expected_out)  # ignore_eos: exact lengths
    assert all(r.output_tokens == len(r.itl) + 1 for r in result.records)  # one chunk per token
    assert m.request_goodput == pytest.approx(m.request_throughput)  # SLOs of a minute: everyone meets them
    for name in ("ttft", "tpot", "itl", "e2el"):
        stats = getattr(m, name)
        assert stats.count > 0 and 0 < stats.median <= stats.p90 <= stats.p99 and stats.mean > 0, name
    assert m.e2el.mean > m.ttft.mean and m.total_input > 0 and m.output_throughput > m.request_throughput > 0
    # the JSON file has vLLM's keys, and loads back to the same numbers; goodput recomputes for other SLOs
    data = json.loads(result.save(tmp_path / "run.json").read_text())
    for key in ("request_throughput", "request_goodput", "output_throughput", "mean_ttft_ms", "median_tpot_ms",
                "p99_itl_ms", "p90_e2el_ms", "std_ttft_ms", "total_input_tokens", "total_output_tokens"):
        assert key in data, key
    again = BenchResult.load(tmp_path / "run.json")
    assert again.metrics == m
    strict = again.with_slos({"ttft": 0.0})
    assert strict.request_goodput == 0.0 and strict.ttft == m.ttft
    assert "Serving Benchmark Result" in result.report() and "P99 ITL (ms)" in result.report()


def test_cli_against_the_server(server, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "cli.json"
    code = bench_main(["serve", "--base-url", server.base_url, "--endpoint", "/v1/chat/completions",
                       "--dataset", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "32", "--suffix-len", "4",
                       "--output-len", "3", "--num-prompts", "4", "--request-rate", "inf", "--ignore-eos",
                       "--goodput", "ttft:60000", "--result-file", str(out), "--disable-tqdm"])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["completed"] == 4 and data["total_output_tokens"] == 12 and data["request_goodput"] > 0
    assert "Request goodput (req/s)" in capsys.readouterr().out
    # the server counted them too: /metrics' TTFT histogram saw every request of both tests (+ a warm-up)
    text = httpx.get(f"{server.base_url}/metrics").text
    count = [line for line in text.splitlines() if line.startswith("labkit:time_to_first_token_seconds_count")]
    assert count and float(count[0].split()[-1]) == 8 + 1 + 4


def test_cli_rejects_bad_options(capsys) -> None:  # type: ignore[no-untyped-def]
    assert bench_main(["serve", "--base-url", "http://127.0.0.1:1", "--goodput", "latency:5"]) == 2
    assert "not one of ttft, tpot, e2el" in capsys.readouterr().err
