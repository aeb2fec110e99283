"""Engine options, with vLLM's names, and the pluggable parts they name.

Every engine has a config dataclass; ``LLM(..., **options)`` fills it and rejects unknown names. The
pluggable parts are classes (or, from the command line, their import paths such as
``"mymodule.MyScheduler"``): ``scheduler_cls`` and ``block_manager_cls`` for the paged engines,
``attention_backend`` (a name in ``labkit.core.attention.ATTENTION_BACKENDS`` or a class), and ``kv_cache_cls``
for engine ``kvcache``. This is how a learner's code runs inside the real engine. Introduced in notebook 01.
"""

from __future__ import annotations

import os
import pkgutil
from dataclasses import dataclass, field
from typing import Any, TypeVar

from labkit.core.attention import ATTENTION_BACKENDS, AUTO, PagedAttentionBackend, resolve_attention_backend
from labkit.core.attention.metadata import captures_own_decode
from labkit.core.kv.block_manager import BlockManager
from labkit.core.kv.contiguous import ContiguousKVCache
from labkit.core.kv.quantized_pool import QuantizedKVPool, check_kv_cache_dtype
from labkit.core.sched.scheduler import Scheduler
from labkit.core.spec_decode.config import SpeculativeConfig

T = TypeVar("T")
MAX_CAPTURE_SIZE = 512  # vLLM's cap on CUDA-graph batch sizes: larger decode batches run eagerly


def debug_checks_default() -> bool:
    """``LABKIT_DEBUG_CHECKS=1`` turns the per-step invariant checks on by default (the test suite does)."""
    return os.environ.get("LABKIT_DEBUG_CHECKS", "") not in ("", "0")


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def resolve_class(option: str, value: object, base: type[T]) -> type[T]:
    """``value`` as a subclass of ``base``: a class, or an import path "package.module.Class"."""
    if isinstance(value, str):
        if "." not in value:
            raise ValueError(f"{option} must be a class or an import path like 'mymodule.{base.__name__}', "
                             f"got {value!r}")
        try:
            value = pkgutil.resolve_name(value)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"{option}={value!r} cannot be imported: {exc}") from exc
    if not (isinstance(value, type) and issubclass(value, base)):
        raise TypeError(f"{option} must be a subclass of labkit.{base.__name__} (or its import path), got {value!r}")
    return value


@dataclass
class EngineConfig:
    """Options every engine accepts (vLLM's names). Engines subclass it to add their own. Notebook 01."""

    max_model_len: int | None = None  # None: the model's max_position_embeddings


@dataclass
class KVCacheConfig(EngineConfig):
    """Options of the ``kvcache`` engine. Notebook 03."""

    max_num_seqs: int = 16  # rows in a static batch
    kv_cache_cls: type[ContiguousKVCache] = ContiguousKVCache  # a learner's cache, or its import path (notebook 03)

    def __post_init__(self) -> None:
        check_positive_int("max_num_seqs", self.max_num_seqs)
        self.kv_cache_cls = resolve_class("kv_cache_cls", self.kv_cache_cls, ContiguousKVCache)


@dataclass
class PagedConfig(EngineConfig):
    """Options of the paged engines ``paged``, ``continuous`` and ``chunked`` (vLLM's names; ``kv_cache_memory`` is a
    byte budget). Each preset (``labkit.core.presets``) fills in its own defaults and refuses what it does not take.
    Notebook 06; the token budget in 07-08, speculative decoding in 13."""

    max_num_seqs: int = 16
    # The per-step token budget. None: the preset's (a whole max_model_len prompt; 512 when chunking).
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = False  # split prompts into chunks under the budget (set by preset "chunked")
    # Speculative decoding (notebook 13): vLLM's dict ("method", "num_speculative_tokens", ...), checked here.
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None  # pool size in blocks; overrides the memory budget
    kv_cache_memory: int | None = None  # pool size in bytes (all layers, K and V)
    gpu_memory_utilization: float = 0.9  # on CUDA: share of free memory the pool may take
    enable_prefix_caching: bool = False
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "int8" or "fp8": 8-bit K/V (notebook 14)
    kv_pool_cls: type[QuantizedKVPool] | None = None  # the 8-bit pool's class (a learner's: notebook 14's Build task)
    # Pluggable parts (vLLM's names): classes, or their import paths "module.Class" (made classes on creation).
    scheduler_cls: type[Scheduler] | None = None  # None: the engine's own (static for "paged")
    block_manager_cls: type[BlockManager] = BlockManager
    # A name in ATTENTION_BACKENDS, a class, or "auto": "cpp" on a CPU where its kernel builds, else "torch".
    attention_backend: type[PagedAttentionBackend] | str = AUTO
    # Check the block manager's books after every step (default: on when LABKIT_DEBUG_CHECKS=1, as in the tests).
    debug_checks: bool = field(default_factory=debug_checks_default)
    # Host-side options (notebook 10). "loop" is the per-token Python input preparation it starts from.
    prepare_inputs: str = "vectorized"
    # CUDA graphs for decode steps (notebook 10). None: graphs on CUDA, eager elsewhere; False off CUDA is an error.
    enforce_eager: bool | None = None
    # Decode batch sizes captured at start-up (vLLM's name). None: capture_sizes(max_num_seqs).
    cuda_graph_sizes: tuple[int, ...] | None = None
    async_scheduling: bool = False  # plan step N+1 while the device runs step N (continuous, chunked; notebook 10)
    # CPU decode steps as a prebuilt list of C++ calls, no per-layer Python (labkit.core.engine.decode_plan): the
    # CPU's counterpart of CUDA graphs, for float32 activations on the "cpp" attention backend (notebook 14).
    decode_plan: bool = False
    # Shard the model over N ranks, Megatron-style (continuous, chunked; notebook 15, labkit.core.parallel).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_positive_int("max_num_seqs", self.max_num_seqs)
        check_positive_int("block_size", self.block_size)
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        if self.num_gpu_blocks is not None:
            check_positive_int("num_gpu_blocks", self.num_gpu_blocks)
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_pool_cls is not None:
            if self.kv_cache_dtype == "auto":
                raise ValueError("kv_pool_cls is the class of an 8-bit KV pool: give kv_cache_dtype='int8' or "
                                 "'fp8' with it")
            self.kv_pool_cls = resolve_class("kv_pool_cls", self.kv_pool_cls, QuantizedKVPool)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.prepare_inputs not in ("loop", "vectorized"):
            raise ValueError(f"prepare_inputs must be 'loop' or 'vectorized', got {self.prepare_inputs!r}")
        if not isinstance(self.decode_plan, bool):
            raise ValueError(f"decode_plan must be True or False, got {self.decode_plan!r}")
        if self.decode_plan and self.tensor_parallel_size > 1:
            raise ValueError("decode_plan=True runs the whole model in one process; it cannot be combined with "
                             f"tensor_parallel_size={self.tensor_parallel_size}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be True, False or None (CUDA graphs on CUDA only), "
                             f"got {self.enforce_eager!r}")
        sizes = capture_sizes(self.max_num_seqs) if self.cuda_graph_sizes is None else tuple(self.cuda_graph_sizes)
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"cuda_graph_sizes must be positive ints, got {self.cuda_graph_sizes!r}")
        self.cuda_graph_sizes = tuple(sorted(set(sizes)))
        if self.scheduler_cls is not None:
            self.scheduler_cls = resolve_class("scheduler_cls", self.scheduler_cls, Scheduler)
        self.block_manager_cls = resolve_class("block_manager_cls", self.block_manager_cls, BlockManager)
        backend = self.attention_backend
        if isinstance(backend, str) and "." in backend:  # an import path, e.g. from the server's command line
            backend = resolve_class("attention_backend", backend, PagedAttentionBackend)
        # "auto" waits for the device (the engine resolves it); anything else is checked now
        self.attention_backend = backend if backend == AUTO else resolve_attention_backend(backend)
        if self.max_num_batched_tokens is not None:
            check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.speculative_config is not None:
            self.speculative_config = SpeculativeConfig.from_option(self.speculative_config)
            if self.async_scheduling:
                raise ValueError("speculative_config cannot be combined with async_scheduling=True: the next step's "
                                 "proposals depend on how many of this step's were accepted")

    def use_cuda_graphs(self, device_type: str) -> bool:
        """Whether decode steps run as CUDA graphs on this device: ``enforce_eager=None`` means yes on CUDA and no
        elsewhere (vLLM's default on a GPU); ``enforce_eager=False`` off CUDA is an error, not a silent no-op."""
        # A captured decode step replays the backend's graph_decode: labkit's PyTorch path, or the backend's own
        # kernel ("triton"); a backend that brings none (a learner's) would be bypassed, so it runs eagerly.
        backend = resolve_attention_backend(self.attention_backend, device_type)
        own_backend = backend is ATTENTION_BACKENDS["torch"] or captures_own_decode(backend)
        own_backend = own_backend and self.kv_cache_dtype == "auto"  # graphs replay a float pool's decode
        if self.tensor_parallel_size > 1:  # a captured step would replay no all-reduce with the other ranks
            if self.enforce_eager is False:
                raise ValueError("enforce_eager=False (CUDA graphs) is not supported with tensor_parallel_size > 1")
            return False
        if self.enforce_eager is None:
            return device_type == "cuda" and own_backend
        if not self.enforce_eager and device_type != "cuda":
            raise ValueError(f"enforce_eager=False needs a CUDA device (CUDA graphs hide GPU launch overhead); this "
                             f"engine runs on {device_type}. Notebook 10 shows the CPU-side fixes instead.")
        if not self.enforce_eager and not own_backend:
            raise ValueError("enforce_eager=False captures decode steps with labkit's own attention, which would "
                             f"bypass attention_backend={self.attention_backend!r}; use enforce_eager=True (or None)")
        return not self.enforce_eager


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """vLLM's CUDA-graph capture sizes: 1, 2, 4, 8, then every multiple of 8, up to the first size that holds
    ``max_num_seqs`` decodes (so every decode batch has a bucket) and never beyond ``cap``."""
    sizes = [1, 2, 4] + list(range(8, cap + 1, 8))
    last = next((i for i, b in enumerate(sizes) if b >= max_num_seqs), len(sizes) - 1)
    return tuple(sizes[: last + 1])
