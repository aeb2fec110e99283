"""The engines, one per stage of the workbook, in teaching order, and what they share.

``ENGINES`` maps each name accepted by ``LLM(engine=...)`` to its class (``labkit.core.engine.registry``).
"""

from labkit.core.engine.base import Engine
from labkit.core.engine.config import EngineConfig
from labkit.core.engine.registry import ENGINES, create_engine, default_engine
from labkit.core.engine.step import StepStats

__all__ = ["ENGINES", "Engine", "EngineConfig", "StepStats", "create_engine", "default_engine"]
