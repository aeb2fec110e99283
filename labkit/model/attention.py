"""Grouped-query self-attention, with the attention computation itself delegated to a backend.

The projection, q/k normalisation and RoPE are the same in every engine; what changes from
notebook to notebook is *where K/V come from*: recomputed (notebook 02), a contiguous cache
(03), a paged pool (06). So the model asks an ``AttentionBackend`` passed in explicitly
(never a global) to store K/V and attend. Introduced in notebook 02 (``02_naive_generation``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from labkit.model.config import ModelConfig
from labkit.model.layers import MergedLinear, RMSNorm, RotaryEmbedding


class AttentionBackend(Protocol):
    """Stores this step's K/V (if it caches) and returns attention outputs."""

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (B, T, n_heads, head_dim); k, v: (B, T, n_kv_heads, head_dim) -> (B, T, n_heads, head_dim)."""
        ...


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv_heads, S, head_dim) -> (B, n_kv_heads * n_rep, S, head_dim): each K/V head serves n_rep query heads."""
    if n_rep == 1:
        return x
    b, n_kv, s, d = x.shape
    return x[:, :, None, :, :].expand(b, n_kv, n_rep, s, d).reshape(b, n_kv * n_rep, s, d)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """Scaled dot-product attention over (B, T, heads, head_dim) tensors, with grouped K/V heads (GQA).

    mask, if given, is boolean and broadcastable to (B, n_heads, T, S): True where attention is allowed.
    ``enable_gqa`` lets each K/V head serve its group of query heads without copying it (``repeat_kv``
    shows what that saves: materialising the copies cost more than the attention itself on a CPU).
    """
    qh = q.transpose(1, 2)  # (B, n_heads, T, d)
    kh = k.transpose(1, 2)  # (B, n_kv_heads, S, d)
    vh = v.transpose(1, 2)  # (B, n_kv_heads, S, d)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal and mask is None,
                                         enable_gqa=qh.shape[1] != kh.shape[1])
    return out.transpose(1, 2)  # (B, T, n_heads, d)


class CausalAttention:
    """No cache: every query attends to the keys of the same forward pass, causally.

    This is all the naive engine needs: it recomputes the whole sequence for every token.
    """

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa(q, k, v, mask=None, is_causal=True)


class Attention(nn.Module):
    """Projections + (Qwen3) q/k norm + RoPE around a pluggable attention backend. Notebook 02."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, h, bias=False)
        self.qkv_proj = MergedLinear(self.q_proj, self.k_proj, self.v_proj)  # all three in one matmul
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        b, t, _ = x.shape  # (B, T, hidden)
        q, k, v = self.qkv_proj(x)  # = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, t, self.n_heads, self.head_dim)  # (B, T, n_heads, head_dim)
        k = k.view(b, t, self.n_kv_heads, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        v = v.view(b, t, self.n_kv_heads, self.head_dim)  # (B, T, n_kv_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        out = backend.attend(self.layer_idx, q, k, v)  # (B, T, n_heads, head_dim)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))
