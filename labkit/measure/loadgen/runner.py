"""The load generator: send a dataset to a server at a request rate, time every token, report.

This is ``vllm bench serve`` in small: draw requests (``labkit.measure.loadgen.datasets``) and their send times
(``labkit.measure.loadgen.arrivals``), send warm-up requests first (not measured: first calls pay one-off
costs), then send each request at its time, at most ``max_concurrency`` in flight, each streamed and
timed (``labkit.measure.loadgen.client``), with a progress bar. The result holds every request's record and
the run's metrics (``labkit.measure.loadgen.metrics``); it saves to JSON with vLLM's keys, loads back, and
recomputes goodput for other SLOs without re-running anything.

    result = benchmark_serving(ServeBenchConfig(base_url="http://127.0.0.1:8000", num_prompts=64,
                                                request_rate=8, goodput={"ttft": 500, "tpot": 50}))
    result.metrics.ttft.p99  # seconds; result.save("run.json") and result.print_report() show ms, as vLLM

Any OpenAI-compatible base URL works (labkit, vLLM, SGLang, TGI); pass the server's tokenizer for
lengths that match its counting. Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import json
import math
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from tqdm.auto import tqdm

from labkit.measure.loadgen.arrivals import arrival_times
from labkit.measure.loadgen.client import COMPLETIONS_ENDPOINT, build_payload, send_request
from labkit.measure.loadgen.datasets import BenchRequest, ChatLikeDataset, Dataset, RandomDataset, SharedPrefixDataset
from labkit.measure.loadgen.metrics import BenchMetrics, RequestRecord, calculate_metrics, parse_goodput

T = TypeVar("T")


@dataclass
class ServeBenchConfig:
    """What to send, where, and how fast (``vllm bench serve``'s options, same names). Notebook 09."""

    base_url: str
    dataset: RandomDataset | SharedPrefixDataset | ChatLikeDataset = field(default_factory=RandomDataset)
    num_prompts: int = 32
    endpoint: str = COMPLETIONS_ENDPOINT  # or "/v1/chat/completions"
    model: str | None = None  # None: the first model the server lists
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # 1: Poisson arrivals; < 1 burstier; > 1 more even
    max_concurrency: int | None = None  # requests in flight at most (None: no limit)
    num_warmups: int = 0  # copies of the first request sent (and not measured) before the run
    seed: int = 0
    goodput: dict[str, float] | str | None = None  # SLOs in ms: {"ttft": 500} or "ttft:500 tpot:50"
    ignore_eos: bool = False  # ask for exactly the dataset's output lengths (vLLM extension)
    temperature: float = 0.0  # greedy, as vllm bench serve defaults to
    tokenizer: str | None = None  # a tokenizer folder; None: the bundled model's
    extra_body: dict[str, Any] | None = None  # more JSON fields for every request
    disable_tqdm: bool = False
    request_timeout: float = 3600.0  # seconds; long, because queueing under overload is what we measure
    label: str = ""

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if isinstance(self.num_prompts, bool) or not isinstance(self.num_prompts, int) or self.num_prompts < 1:
            raise ValueError(f"num_prompts must be an int >= 1, got {self.num_prompts!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")
        self.goodput = parse_goodput(self.goodput)
        arrival_times(1, self.request_rate, self.burstiness)  # checks rate and burstiness with clear errors

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["dataset"] = {"name": self.dataset.name, **dataclasses.asdict(self.dataset)}
        out["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        out["burstiness"] = "inf" if math.isinf(self.burstiness) else self.burstiness
        return out


@dataclass
class BenchResult:
    """One run: its configuration, every request's record, and the metrics. Notebook 09."""

    config: dict[str, Any]
    records: list[RequestRecord]
    duration: float
    metrics: BenchMetrics
    date: str = ""

    def with_slos(self, slos: Mapping[str, float] | str) -> BenchMetrics:
        """The metrics again, with goodput for other SLOs (nothing is re-run)."""
        return calculate_metrics(self.records, self.duration, parse_goodput(slos))

    def to_dict(self) -> dict[str, Any]:
        done = [r for r in self.records if r.success]
        return {"date": self.date, "config": self.config, **self.metrics.to_dict(),
                "input_lens": [r.prompt_len for r in done], "output_lens": [r.output_tokens for r in done],
                "ttfts": [r.ttft for r in done], "itls": [r.itl for r in done],
                "errors": [r.error for r in self.records if not r.success],
                "records": [r.to_dict() for r in self.records]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> BenchResult:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        records = [RequestRecord.from_dict(r) for r in data["records"]]
        return cls(config=data["config"], records=records, duration=data["duration"],
                   metrics=calculate_metrics(records, data["duration"], data.get("goodput_slos_ms")),
                   date=data.get("date", ""))

    def report(self) -> str:
        """The run as ``vllm bench serve`` prints it."""
        m, c = self.metrics, self.config
        rows = [("Successful requests:", m.completed), ("Failed requests:", m.failed),
                ("Request rate configured (RPS):", c.get("request_rate")),
                ("Maximum request concurrency:", c.get("max_concurrency")),
                ("Benchmark duration (s):", f"{m.duration:.2f}"), ("Total input tokens:", m.total_input),
                ("Total generated tokens:", m.total_output),
                ("Request throughput (req/s):", f"{m.request_throughput:.2f}")]
        if m.request_goodput is not None:
            rows.append(("Request goodput (req/s):", f"{m.request_goodput:.2f}"))
        rows += [("Output token throughput (tok/s):", f"{m.output_throughput:.2f}"),
                 ("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}")]
        lines = [f"{' Serving Benchmark Result ':=^52}"] + [f"{k:<40} {v}" for k, v in rows]
        titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                  "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
        for name, title in titles.items():
            ms = getattr(m, name).ms()  # the statistics are in seconds; vLLM's report is in ms
            lines.append(f"{title:-^52}")
            for stat in ("mean", "median", "p90", "p99"):
                lines.append(f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} "
                             f"{name.upper()} (ms):".ljust(41) + f"{ms[stat]:.2f}")
        lines.append("=" * 52)
        return "\n".join(lines)

    def print_report(self) -> None:
        print(self.report())


def load_tokenizer_for(config: ServeBenchConfig) -> Any:
    from labkit.core.model.source import bundled_model_path
    from labkit.core.text.tokenizer import load_tokenizer

    return load_tokenizer(config.tokenizer or bundled_model_path())


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model ``GET /v1/models`` lists (what ``--model`` defaults to, as in vLLM)."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass model=...")
    return str(models[0]["id"])


async def run_serve_benchmark(config: ServeBenchConfig, requests: list[BenchRequest] | None = None) -> BenchResult:
    """Run the benchmark (async). ``requests`` overrides sampling them from ``config.dataset``."""
    if requests is None:
        requests = config.dataset.sample(load_tokenizer_for(config), config.num_prompts, config.seed)
    times = arrival_times(len(requests), config.request_rate, config.burstiness, config.seed)
    url = config.base_url + config.endpoint
    limits = httpx.Limits(max_connections=config.max_concurrency or len(requests) + config.num_warmups + 1,
                          max_keepalive_connections=None)
    timeout = httpx.Timeout(config.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = config.model or await first_model(client, config.base_url)
        payloads = [build_payload(config.endpoint, model, r, config.temperature, config.ignore_eos, config.extra_body)
                    for r in requests]
        gate = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()

        async def limited(payload: dict[str, Any], prompt_len: int, bar: tqdm | None) -> RequestRecord:
            async with gate:  # type: ignore[attr-defined]
                record = await send_request(client, url, payload, prompt_len)
            if bar is not None:
                bar.update(1)
            return record

        if config.num_warmups:
            warm = await asyncio.gather(*(limited(payloads[0], requests[0].prompt_len, None)
                                          for _ in range(config.num_warmups)))
            failed = [w.error for w in warm if not w.success]
            if failed:
                raise RuntimeError(f"warm-up request failed: {failed[0]}")
        bar = tqdm(total=len(requests), desc=config.label or "requests", unit="req", disable=config.disable_tqdm)
        start = time.perf_counter()
        tasks = []
        for payload, request, t in zip(payloads, requests, times):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(payload, request.prompt_len, bar)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
    metrics = calculate_metrics(records, duration, config.goodput)  # type: ignore[arg-type]
    return BenchResult(config={**config.to_dict(), "model": model}, records=records, duration=duration,
                       metrics=metrics, date=dt.datetime.now().isoformat(timespec="seconds"))


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion, also from inside Jupyter (whose event loop is already running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a loop is running here: use a fresh one
        return pool.submit(asyncio.run, coro).result()


def benchmark_serving(config: ServeBenchConfig, requests: list[BenchRequest] | None = None) -> BenchResult:
    """Run the benchmark and return its result (blocking; works in notebooks). Notebook 09."""
    return run_sync(run_serve_benchmark(config, requests))


__all__ = ["BenchResult", "Dataset", "ServeBenchConfig", "benchmark_serving", "run_serve_benchmark", "run_sync"]
