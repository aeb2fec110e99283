"""labkit's decoder-only transformer for the Llama, Qwen2 and Qwen3 families.

Parameter names mirror Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...), so a
checkpoint's safetensors load without renaming and a learner can compare the two line by line.
Introduced in notebook 02 (``02_naive_generation``).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.core.model.attention import Attention, AttentionBackend, CausalAttention
from labkit.core.model.config import ModelConfig
from labkit.core.model.layers import MLP, RMSNorm, RotaryEmbedding
from labkit.core.model.linear import Linear


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)). Notebook 02."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, the stack of decoder layers and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (B, T, hidden)
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)  # (B, T, 1, head_dim) each
        for layer in self.layers:
            x = layer(x, cos, sin, backend)
        return self.norm(x)


class CausalLM(nn.Module):
    """The whole language model: token ids and positions in, hidden states out; logits on demand.

    Introduced in notebook 02 (``02_naive_generation``). ``forward`` returns hidden states and
    ``compute_logits`` projects only the rows you ask for: an engine needs the last position of each
    sequence, not a (B, T, vocab) tensor.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: (B, T) -> hidden states (B, T, hidden)."""
        return self.model(input_ids, positions, backend if backend is not None else CausalAttention())

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., vocab) in float32 (float64 stays float64) for stable sampling."""
        logits = self.lm_head(hidden)
        return logits if logits.dtype == torch.float64 else logits.float()

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device  # not lm_head's: a quantized lm_head has no float weight (notebook 14)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype
