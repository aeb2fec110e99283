"""The engines by name, in teaching order (``ENGINES``), and how an engine is built from ``LLM``'s options.

Each name is a preset: the class that runs it and the settings that make it that stage of the workbook. ``naive``
and ``kvcache`` are engines of their own (the teaching baselines); ``paged``, ``continuous`` and ``chunked`` are one
engine, ``EngineCore``, with a static or an iteration-level scheduler, and prompts whole or in chunks under a token
budget; ``disaggregated`` adds a prefill worker in a second process. ``create_engine`` checks the options against
the preset (vLLM's names) and builds it. Introduced in notebook 01 (``01_anatomy_of_a_request``).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field

from labkit.core.disagg import DisaggregatedEngine
from labkit.core.engine.async_engine_core import AsyncEngineCore
from labkit.core.engine.base import Engine
from labkit.core.engine.config import EngineConfig, PagedConfig
from labkit.core.engine.engine_core import EngineCore
from labkit.core.engine.kvcache import KVCacheEngine
from labkit.core.engine.naive import NaiveEngine
from labkit.core.model import CausalLM
from labkit.core.parallel import TensorParallelEngineCore
from labkit.core.sched.static import StaticScheduler

# Options only a preset sets: they are what makes it that stage of the workbook.
PRESET_OPTIONS = ("enable_chunked_prefill",)


@dataclass(frozen=True)
class EnginePreset:
    """One stage of the workbook as an engine: its class and the settings that make it this stage. Notebook 01."""

    name: str
    engine_cls: type[Engine]
    description: str
    defaults: dict[str, object] = field(default_factory=dict)  # option values unless the caller gives their own
    not_taken: tuple[str, ...] = ()  # options of its config this stage does not offer
    static_batches: bool = False  # a batch runs until its last request finishes (no async scheduling, no budget)

    @property
    def config_class(self) -> type[EngineConfig]:
        return self.engine_cls.config_class

    def accepted_options(self) -> list[str]:
        skip = set(self.not_taken) | set(PRESET_OPTIONS)
        return [f.name for f in dataclasses.fields(self.config_class) if f.name not in skip]

    def make_config(self, options: dict[str, object], max_model_len: int) -> EngineConfig:
        """The config for these options (checked by its ``__post_init__``), with this stage's settings."""
        config = self.config_class(**{**self.defaults, **options})  # type: ignore[arg-type]
        if config.max_model_len is None:
            config.max_model_len = max_model_len
        elif not is_int(config.max_model_len) or not 1 < config.max_model_len <= max_model_len:
            raise ValueError(f"max_model_len must be in [2, {max_model_len}] (the model's max_position_embeddings), "
                             f"got {config.max_model_len!r}")
        if isinstance(config, PagedConfig) and self.static_batches:
            if config.async_scheduling:
                raise ValueError(f"async_scheduling=True needs an iteration-level scheduler: use engine 'continuous' "
                                 f"or 'chunked' (engine {self.name!r} runs static batches)")
            config.max_num_batched_tokens = config.max_num_seqs * config.max_model_len  # prompts are never limited
        return config

    def build(self, model: CausalLM, config: EngineConfig) -> Engine:
        """The engine over ``model``: ``AsyncEngineCore`` where ``async_scheduling=True`` asks for it, else the
        preset's class."""
        cls = self.engine_cls
        if cls is EngineCore and isinstance(config, PagedConfig) and config.async_scheduling:
            cls = AsyncEngineCore
        if cls in (EngineCore, AsyncEngineCore) and isinstance(config, PagedConfig) and config.tensor_parallel_size > 1:
            cls = TensorParallelEngineCore  # rank 0 of N (notebook 15); refuses async_scheduling with a clear error
        engine = cls(model, config)  # type: ignore[arg-type]
        engine.name = self.name  # type: ignore[misc]  # the stage it runs as ("paged", "continuous", "chunked")
        return engine


ENGINES: dict[str, EnginePreset] = {p.name: p for p in [
    EnginePreset("naive", NaiveEngine, "no KV cache: the whole sequence recomputed per token, one request at a time"),
    EnginePreset("kvcache", KVCacheEngine, "a contiguous KV cache and static, padded batches"),
    EnginePreset("paged", EngineCore, "static batches over a paged KV pool",
                 defaults={"scheduler_cls": StaticScheduler}, static_batches=True,
                 not_taken=("max_num_batched_tokens", "speculative_config", "tensor_parallel_size")),
    EnginePreset("continuous", EngineCore, "iteration-level scheduling: requests join and leave at every step"),
    EnginePreset("chunked", EngineCore, "continuous batching with prompts in chunks under a per-step token budget",
                 defaults={"enable_chunked_prefill": True}),
    # Two processes (notebook 12): listed after the default, never it.
    EnginePreset("disaggregated", DisaggregatedEngine, "a prefill worker in a second process, KV moved between them",
                 not_taken=("tensor_parallel_size", "kv_cache_dtype")),  # its KV travels in the model's dtype
]}
DEFAULT_ENGINE = "chunked"  # the most complete single-process engine


def default_engine() -> str:
    """``LLM``'s engine when none is named: ``chunked``, the most complete engine in one process (``disaggregated``,
    after it in teaching order, starts a second process and is chosen by name)."""
    return DEFAULT_ENGINE


def engine_preset(engine: str | type[Engine], options: dict[str, object]) -> EnginePreset:
    """The preset for a name in ``ENGINES``, or one made for an ``Engine`` subclass (a learner's engine, notebooks 02
    and 05); a clear error for an unknown engine or option, before anything is loaded."""
    if isinstance(engine, type) and issubclass(engine, Engine):
        preset = EnginePreset(getattr(engine, "name", engine.__name__), engine, f"{engine.__name__}, your engine")
        name = f"{engine.__name__} (engine {getattr(engine, 'name', '?')!r})"
    elif isinstance(engine, str) and engine in ENGINES:
        preset, name = ENGINES[engine], repr(engine)
    else:
        raise ValueError(f"unknown engine {engine!r}; engines are (in teaching order): {', '.join(ENGINES)}, "
                         "or a subclass of labkit.core.engine.Engine")
    accepted = preset.accepted_options()
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"engine {name} does not take option(s) {', '.join(unknown)}; "
                         f"it accepts: {', '.join(accepted)}")
    return preset


def create_engine(engine: str | type[Engine], model: CausalLM, **options: object) -> Engine:
    """Build ``engine`` (a name in ``ENGINES`` or an ``Engine`` subclass) over ``model``; ``max_model_len`` defaults
    to the model's limit."""
    preset = engine_preset(engine, options)
    return preset.build(model, preset.make_config(options, model.config.max_position_embeddings))


def is_int(value: object) -> bool:
    """An int (or numpy/torch-style integer scalar), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
