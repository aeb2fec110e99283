"""The engines, one per stage of the workbook, in teaching order.

``ENGINES`` maps each name accepted by ``LLM(engine=...)`` to its class.
"""

from labkit.engine.base import Engine, EngineConfig, StepStats
from labkit.engine.kvcache import KVCacheConfig, KVCacheEngine
from labkit.engine.naive import NaiveEngine

ENGINES: dict[str, type[Engine]] = {
    "naive": NaiveEngine,
    "kvcache": KVCacheEngine,
}

__all__ = ["ENGINES", "Engine", "EngineConfig", "KVCacheConfig", "KVCacheEngine", "NaiveEngine", "StepStats"]
