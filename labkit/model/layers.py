"""The small building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, SwiGLU.

Walked through in notebook 02 (``02_naive_generation``) next to transformers' versions.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from labkit.model.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias). Notebook 02."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # weight * x / sqrt(mean(x^2) + eps), over the last dimension, in one fused op (F.rms_norm).
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # 16-bit inputs: normalise in float32 (as the reference does), then scale in the model's dtype.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies theta^(-2i/d), with Llama 3's long-context scaling if configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # (d/2,)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoPE), rotating halves of each head. Notebook 02.

    cos/sin are computed from the positions at every call: positions are passed explicitly,
    so the same module serves naive recomputation, KV-cached decode and ragged batches.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (B, T) -> cos, sin: (B, T, 1, head_dim), computed in float32 like the reference.
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)  # (B, T, d/2)
        cos, sin = freqs.cos(), freqs.sin()
        # Coordinate i pairs with i + d/2, both rotated by freqs[i]. The reference's rotate_half(x) is
        # (-x2, x1); we roll x to (x2, x1) instead and keep the minus sign in sin: (-sin, sin).
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)  # (B, T, d)
        return cos.to(dtype)[:, :, None, :], sin.to(dtype)[:, :, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (B, T, n_heads, head_dim); the same as the reference's x * cos + rotate_half(x) * sin
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin

    def _init_buffers(self) -> None:
        """Recompute inv_freq after the module was materialised from the meta device."""
        self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Notebook 02."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
