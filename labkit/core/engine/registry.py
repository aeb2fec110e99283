"""The engines by name, in teaching order, and how an engine is built from ``LLM``'s options.

``ENGINES`` maps each name accepted by ``LLM(engine=...)`` to its class; ``create_engine`` checks the
options against the engine's config (vLLM's names) and builds it. Introduced in notebook 01.
"""

from __future__ import annotations

import dataclasses
import numbers

from labkit.core.disagg import DisaggregatedEngine
from labkit.core.engine.base import Engine
from labkit.core.engine.continuous import ChunkedEngine, ContinuousEngine
from labkit.core.engine.kvcache import KVCacheEngine
from labkit.core.engine.naive import NaiveEngine
from labkit.core.engine.paged import PagedEngine
from labkit.core.model import CausalLM

ENGINES: dict[str, type[Engine]] = {
    "naive": NaiveEngine,
    "kvcache": KVCacheEngine,
    "paged": PagedEngine,
    "continuous": ContinuousEngine,
    "chunked": ChunkedEngine,
    "disaggregated": DisaggregatedEngine,  # two processes (notebook 12): listed after the default, never it
}
DEFAULT_ENGINE = "chunked"  # the most complete single-process engine


def default_engine() -> str:
    """``LLM``'s engine when none is named: ``chunked``, the most complete engine in one process (``disaggregated``,
    after it in teaching order, starts a second process and is chosen by name)."""
    return DEFAULT_ENGINE


def engine_class(engine: str | type[Engine], options: dict[str, object]) -> type[Engine]:
    """The engine class for a name in ``ENGINES`` or an ``Engine`` subclass (a learner's engine, notebooks 02 and 05);
    a clear error for an unknown engine or option, before anything is loaded."""
    if isinstance(engine, type) and issubclass(engine, Engine):
        cls = engine
        name = f"{cls.__name__} (engine {getattr(cls, 'name', '?')!r})"
    elif isinstance(engine, str) and engine in ENGINES:
        cls, name = ENGINES[engine], repr(engine)
    else:
        raise ValueError(f"unknown engine {engine!r}; engines are (in teaching order): {', '.join(ENGINES)}, "
                         "or a subclass of labkit.core.engine.Engine")
    accepted = [f.name for f in dataclasses.fields(cls.config_class)]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"engine {name} does not take option(s) {', '.join(unknown)}; "
                         f"it accepts: {', '.join(accepted)}")
    return cls


def create_engine(engine: str | type[Engine], model: CausalLM, **options: object) -> Engine:
    """Build ``engine`` (a name in ``ENGINES`` or an ``Engine`` subclass) over ``model``; ``max_model_len`` defaults
    to the model's limit."""
    cls = engine_class(engine, options)
    config = cls.config_class(**options)  # type: ignore[arg-type]  # checked by the config's __post_init__
    limit = model.config.max_position_embeddings
    if config.max_model_len is None:
        config.max_model_len = limit
    elif not is_int(config.max_model_len) or not 1 < config.max_model_len <= limit:
        raise ValueError(f"max_model_len must be in [2, {limit}] (the model's max_position_embeddings), "
                         f"got {config.max_model_len!r}")
    return cls(model, config)


def is_int(value: object) -> bool:
    """An int (or numpy/torch-style integer scalar), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
