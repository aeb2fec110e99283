"""The engines, one per stage of the workbook, in teaching order, and what they share.

``ENGINES`` maps each name accepted by ``LLM(engine=...)`` to its class (``labkit.engine.registry``).
"""

from labkit.engine.base import Engine
from labkit.engine.config import EngineConfig
from labkit.engine.registry import ENGINES, create_engine, default_engine
from labkit.engine.step import StepStats

__all__ = ["ENGINES", "Engine", "EngineConfig", "StepStats", "create_engine", "default_engine"]
