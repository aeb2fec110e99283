"""labkit's own model code: config, layers, attention, decoder, loading, presets."""

from labkit.model.attention import AttentionBackend, CausalAttention
from labkit.model.config import ModelConfig
from labkit.model.decoder import CausalLM
from labkit.model.loader import load_checkpoint, random_model
from labkit.model.presets import PRESETS, get_preset

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
