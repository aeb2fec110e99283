"""The engines and what they share: the add / step / abort interface (``base``), the one engine loop over a paged
pool (``engine_core``), the teaching baselines ``naive`` and ``kvcache``, and the model runner. The presets that
name them (``ENGINES``) are ``labkit.core.presets``.
"""

from labkit.core.engine.base import Engine
from labkit.core.engine.config import EngineConfig
from labkit.core.engine.step import StepStats

__all__ = ["Engine", "EngineConfig", "StepStats"]
