"""labkit's own model code: config, layers, attention, decoder, loading, presets."""

from labkit.core.model.attention import AttentionBackend, CausalAttention
from labkit.core.model.config import ModelConfig
from labkit.core.model.decoder import CausalLM
from labkit.core.model.loader import load_checkpoint, random_model
from labkit.core.model.presets import PRESETS, get_preset

__all__ = [
    "PRESETS",
    "AttentionBackend",
    "CausalAttention",
    "CausalLM",
    "ModelConfig",
    "get_preset",
    "load_checkpoint",
    "random_model",
]
