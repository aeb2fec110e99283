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
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _positive_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    """``cfg[key]`` as an int >= 1 (an integral float such as 4096.0 too), or a ValueError naming it."""
    value = cfg.get(key)
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ValueError(f"config.json: {key} must be an integer >= 1, got {json.dumps(value)}")
    return int(value)


def _number(src: dict[str, Any], key: str, where: str) -> float:
    value = src.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json: {where} needs a number {key}, got {json.dumps(value)}")
    return float(value)


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
            values = {k: _number(src, k, "rope_type llama3") for k in LLAMA3_ROPE_KEYS}
            scaling = RopeScaling(values["factor"], values["low_freq_factor"], values["high_freq_factor"],
                                  int(values["original_max_position_embeddings"]))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        missing = [k for k in REQUIRED_KEYS if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json has no {', '.join(missing)}; a {model_type} config needs "
                             f"{', '.join(REQUIRED_KEYS)}")
        n_heads = _positive_int(cfg, "num_attention_heads")
        hidden_size = _positive_int(cfg, "hidden_size")
        return cls(
            model_type=model_type,
            vocab_size=_positive_int(cfg, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_positive_int(cfg, "intermediate_size"),
            num_hidden_layers=_positive_int(cfg, "num_hidden_layers"),
            num_attention_heads=n_heads,
            num_key_value_heads=_positive_int(cfg, "num_key_value_heads", n_heads),
            head_dim=_positive_int(cfg, "head_dim", max(1, hidden_size // n_heads)),
            max_position_embeddings=_positive_int(cfg, "max_position_embeddings", 2048),
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
        """Read a ``config.json``; every error names the file."""
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(cfg).__name__}")
        try:
            return cls.from_hf_dict(cfg)
        except ValueError as exc:  # "config.json has no vocab_size" -> "/path/to/config.json has no vocab_size"
            message = str(exc)
            named = str(path) + message.removeprefix("config.json") if message.startswith("config.json") else None
            raise ValueError(named or f"{path}: {message}") from None
