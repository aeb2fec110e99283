"""The model's shape, read from a Hugging Face ``config.json`` (or a preset).

Introduced in notebook 02 (``02_naive_generation``), where the decoder is walked through
line by line; notebook 03 uses it again for the KV-memory calculator.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's frequency-dependent RoPE scaling (``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Everything labkit's decoder needs to know about an architecture.

    Taught in notebook 02 (``02_naive_generation``). Field names follow Hugging Face's so a
    learner can read a real ``config.json`` next to this class.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 puts a bias on q/k/v projections
    qk_norm: bool = False  # Qwen3 normalises q and k per head before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; labkit implements "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.attention_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the contents of a Hugging Face ``config.json`` (transformers 4 or 5 layout)."""
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"config.json has model_type {model_type!r}; labkit implements "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama, Qwen2, Qwen3 families)"
            )
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported (no Llama/Qwen checkpoint labkit targets uses it)")
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        # transformers 5 nests RoPE settings in rope_parameters; older files use rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        legacy_scaling = cfg.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type") or legacy_scaling.get("rope_type") or legacy_scaling.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; labkit implements {SUPPORTED_ROPE_TYPES}")
        scaling = None
        if rope_type == "llama3":
            src = rope if "factor" in rope else legacy_scaling
            scaling = RopeScaling(
                factor=float(src["factor"]),
                low_freq_factor=float(src["low_freq_factor"]),
                high_freq_factor=float(src["high_freq_factor"]),
                original_max_position_embeddings=int(src["original_max_position_embeddings"]),
            )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        n_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // n_heads
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama and Qwen3 say so in attention_bias.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        with open(path, encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))
