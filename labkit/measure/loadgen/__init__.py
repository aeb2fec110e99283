"""The load generator (notebook 09): ``vllm bench serve`` in small, for any OpenAI-compatible server.

    python -m labkit.measure.loadgen serve --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 8 \
        --goodput ttft:500 tpot:50 --result-file run.json

    from labkit.measure.loadgen import ServeBenchConfig, RandomDataset, benchmark_serving
    result = benchmark_serving(ServeBenchConfig(base_url=url, dataset=RandomDataset(64, 32, 0.5), request_rate=8))

Modules: ``datasets`` (what to send), ``arrivals`` (when), ``client`` (one timed streamed request),
``runner``; the metrics (TTFT/TPOT/ITL/E2EL, throughput, goodput as vLLM defines them) are
``labkit.measure.loadgen.metrics``, their statistics ``labkit.measure.stats.Percentiles`` (seconds; ms in reports).
"""

from labkit.measure.loadgen.arrivals import arrival_times
from labkit.measure.loadgen.datasets import DATASETS, BenchRequest, ChatLikeDataset, RandomDataset, SharedPrefixDataset
from labkit.measure.loadgen.metrics import (
    BenchMetrics,
    RequestRecord,
    calculate_metrics,
    parse_goodput,
    request_goodput,
)
from labkit.measure.loadgen.runner import BenchResult, ServeBenchConfig, benchmark_serving, run_serve_benchmark

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
