"""Shapes of real architectures, to build with random weights for performance work.

The numbers are the public ``config.json`` values of each model; the weights are random, so the
text is gibberish but every FLOP and byte is real. Used from notebook 04 (``04_prefill_vs_decode``)
on, and by the benchmarks. Listed in ``PRESETS``.
"""

from __future__ import annotations

from labkit.core.model.config import ModelConfig, RopeScaling

PRESETS: dict[str, ModelConfig] = {
    # HuggingFaceTB/SmolLM2-135M (Llama architecture): the smallest "real" shape, fine on a laptop CPU.
    "smollm2-135m": ModelConfig(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), torch_dtype="bfloat16",
    ),
    # Qwen/Qwen2.5-0.5B: q/k/v bias, 14 query heads sharing 2 K/V heads.
    "qwen2.5-0.5b": ModelConfig(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, attention_bias=True, bos_token_id=151643,
        eos_token_ids=(151643,), torch_dtype="bfloat16",
    ),
    # Qwen/Qwen3-0.6B: per-head q/k RMSNorm, head_dim 128 (wider than hidden/heads).
    "qwen3-0.6b": ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=True, qk_norm=True, bos_token_id=151643, eos_token_ids=(151645,),
        torch_dtype="bfloat16",
    ),
    # meta-llama/Llama-3.2-1B: Llama 3 RoPE scaling, 4 query heads per K/V head.
    "llama3.2-1b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_word_embeddings=True, bos_token_id=128000, eos_token_ids=(128001,), torch_dtype="bfloat16",
    ),
    # meta-llama/Llama-3.1-8B: for big GPUs; 16 GB of bf16 weights.
    "llama3.1-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001,), torch_dtype="bfloat16",
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset's config, or a ValueError listing the presets that exist."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; presets are: {', '.join(PRESETS)}") from None
