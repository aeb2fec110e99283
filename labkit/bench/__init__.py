"""The load generator (notebook 09): ``vllm bench serve`` in small, for any OpenAI-compatible server.

    python -m labkit.bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 8 \
        --goodput ttft:500 tpot:50 --result-file run.json

    from labkit.bench import ServeBenchConfig, RandomDataset, benchmark_serving
    result = benchmark_serving(ServeBenchConfig(base_url=url, dataset=RandomDataset(64, 32, 0.5), request_rate=8))

Modules: ``datasets`` (what to send), ``arrivals`` (when), ``client`` (one timed streamed request),
``runner``; the metrics (TTFT/TPOT/ITL/E2EL, throughput, goodput as vLLM defines them) are
``labkit.metrics.benchmark``, their statistics ``labkit.metrics.stats.Percentiles`` (seconds; ms in reports).
"""

from labkit.bench.arrivals import arrival_times
from labkit.bench.datasets import DATASETS, BenchRequest, ChatLikeDataset, RandomDataset, SharedPrefixDataset
from labkit.bench.runner import BenchResult, ServeBenchConfig, benchmark_serving, run_serve_benchmark
from labkit.metrics.benchmark import BenchMetrics, RequestRecord, calculate_metrics, parse_goodput, request_goodput

__all__ = [
    "DATASETS",
    "BenchMetrics",
    "BenchRequest",
    "BenchResult",
    "ChatLikeDataset",
    "RandomDataset",
    "RequestRecord",
    "ServeBenchConfig",
    "SharedPrefixDataset",
    "arrival_times",
    "benchmark_serving",
    "calculate_metrics",
    "parse_goodput",
    "request_goodput",
    "run_serve_benchmark",
]
