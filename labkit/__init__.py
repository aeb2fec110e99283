"""labkit: a small, readable LLM inference engine built step by step in the workbook's notebooks.

    from labkit import LLM, SamplingParams, ENGINES
"""

import os

# Everything runs offline: never let transformers or huggingface_hub reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from labkit.engine import ENGINES  # noqa: E402
from labkit.llm import LLM, RequestFailedError  # noqa: E402
from labkit.metrics.request import RequestMetrics, compute_latencies  # noqa: E402
from labkit.model import PRESETS, ModelConfig  # noqa: E402
from labkit.model.source import BUNDLED_MODEL  # noqa: E402
from labkit.outputs import CompletionOutput, RequestOutput  # noqa: E402
from labkit.sampling_params import SamplingParams  # noqa: E402

__all__ = [
    "BUNDLED_MODEL",
    "ENGINES",
    "LLM",
    "PRESETS",
    "CompletionOutput",
    "ModelConfig",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "compute_latencies",
]
