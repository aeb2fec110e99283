"""labkit: a small, readable LLM inference engine built step by step in the workbook's notebooks.

    from labkit import LLM, SamplingParams, ENGINES
    from labkit import Scheduler, BlockManager, ATTENTION_BACKENDS   # the parts a learner can replace
"""

import os

# Everything runs offline: never let transformers or huggingface_hub reach for the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from labkit.core.attention import ATTENTION_BACKENDS, PagedAttentionBackend  # noqa: E402
from labkit.core.kv.block_manager import BlockManager  # noqa: E402
from labkit.core.kv.contiguous import ContiguousKVCache  # noqa: E402
from labkit.core.llm import LLM, RequestFailedError  # noqa: E402
from labkit.core.metrics import RequestMetrics, compute_latencies  # noqa: E402
from labkit.core.model import PRESETS, ModelConfig  # noqa: E402
from labkit.core.model.source import BUNDLED_MODEL  # noqa: E402
from labkit.core.outputs import CompletionOutput, RequestOutput  # noqa: E402
from labkit.core.presets import ENGINES  # noqa: E402
from labkit.core.sampling_params import SamplingParams  # noqa: E402
from labkit.core.sched.scheduler import Scheduler  # noqa: E402
from labkit.core.sched.static import StaticScheduler  # noqa: E402

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
