"""labkit: a small, readable LLM inference engine built step by step in the workbook's notebooks.

    from labkit import LLM, SamplingParams, ENGINES
    from labkit import Scheduler, BlockManager, ATTENTION_BACKENDS   # the parts a learner can replace
"""

import os

# Everything runs offline: never let transformers or huggingface_hub reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from labkit.attention import ATTENTION_BACKENDS, PagedAttentionBackend  # noqa: E402
from labkit.cache.block_manager import BlockManager  # noqa: E402
from labkit.cache.contiguous import ContiguousKVCache  # noqa: E402
from labkit.engine import ENGINES  # noqa: E402
from labkit.engine.sched.scheduler import Scheduler  # noqa: E402
from labkit.engine.sched.static import StaticScheduler  # noqa: E402
from labkit.llm import LLM, RequestFailedError  # noqa: E402
from labkit.metrics.request import RequestMetrics, compute_latencies  # noqa: E402
from labkit.model import PRESETS, ModelConfig  # noqa: E402
from labkit.model.source import BUNDLED_MODEL  # noqa: E402
from labkit.outputs import CompletionOutput, RequestOutput  # noqa: E402
from labkit.sampling_params import SamplingParams  # noqa: E402

__all__ = [
    "ATTENTION_BACKENDS",
    "BUNDLED_MODEL",
    "BlockManager",
    "ContiguousKVCache",
    "ENGINES",
    "LLM",
    "PRESETS",
    "CompletionOutput",
    "ModelConfig",
    "PagedAttentionBackend",
    "RequestFailedError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "Scheduler",
    "StaticScheduler",
    "compute_latencies",
]
