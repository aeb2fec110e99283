"""The engines, one per stage of the workbook, in teaching order.

``ENGINES`` maps each name accepted by ``LLM(engine=...)`` to its class.
"""

from labkit.engine.base import Engine, EngineConfig, StepStats
from labkit.engine.continuous import ChunkedEngine, ContinuousConfig, ContinuousEngine
from labkit.engine.kvcache import KVCacheConfig, KVCacheEngine
from labkit.engine.naive import NaiveEngine
from labkit.engine.paged import PagedConfig, PagedEngine

ENGINES: dict[str, type[Engine]] = {
    "naive": NaiveEngine,
    "kvcache": KVCacheEngine,
    "paged": PagedEngine,
    "continuous": ContinuousEngine,
    "chunked": ChunkedEngine,
}

__all__ = ["ENGINES", "ChunkedEngine", "ContinuousConfig", "ContinuousEngine", "Engine", "EngineConfig", "KVCacheConfig", "KVCacheEngine", "NaiveEngine", "PagedConfig", "PagedEngine",
           "StepStats"]
