"""Grouped-query self-attention, with the attention computation itself delegated to a backend.

The projection, q/k normalisation and RoPE are the same in every engine; what changes from
notebook to notebook is *where K/V come from*: recomputed (notebook 02), a contiguous cache
(03), a paged pool (06). So the model asks an ``AttentionBackend`` passed in explicitly
(never a global) to store K/V and attend. Introduced in notebook 02 (``02_naive_generation``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend

from labkit.core.model.config import ModelConfig
from labkit.core.model.layers import MergedLinear, RMSNorm, RotaryEmbedding, decode_kernel
from labkit.core.model.linear import Linear


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


@dataclass(frozen=True)
class SdpaPlan:
    """How one attention call runs: with K/V heads repeated or shared (GQA), and which of PyTorch's SDPA kernels
    may run it (empty: PyTorch's own choice, as on the CPU). Notebook 02 (``sdpa``); its CUDA side, notebook 10."""

    repeat_kv: bool
    backends: tuple[SDPBackend, ...]


FLASH = SDPBackend.FLASH_ATTENTION
MASKED_FUSED = (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)  # fused kernels that take a mask


def sdpa_plan(device_type: str, has_mask: bool, is_gqa: bool, flash_ok: bool = True, fused_ok: bool = True) -> SdpaPlan:
    """Pick a path that stays on a fused kernel. On CUDA, flash attention is the only fused kernel that takes grouped
    K/V heads (``enable_gqa``), and it rejects an explicit mask (and float32, and pre-Ampere cards: ``flash_ok``);
    the memory-efficient and cuDNN kernels take a mask but not GQA. So a masked (or non-flash) GQA call repeats K/V
    and runs on those; anything else would fall back to the math kernel, which materialises the whole score matrix.
    Off CUDA, or where no fused kernel takes the head size (``fused_ok``: a multiple of 8, at most 256): ``enable_gqa``
    and PyTorch's choice, as always (on a CPU faster than repeating, and exact)."""
    if device_type != "cuda" or not fused_ok:
        return SdpaPlan(repeat_kv=False, backends=())
    use_flash = flash_ok and not has_mask
    if is_gqa and use_flash:
        return SdpaPlan(repeat_kv=False, backends=(FLASH,))
    return SdpaPlan(repeat_kv=is_gqa, backends=((FLASH,) if use_flash else ()) + MASKED_FUSED)


@functools.lru_cache(maxsize=64)
def flash_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether PyTorch's flash kernel can run attention here: 16-bit, head_dim a multiple of 8 up to 256, sm80+."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or head_dim > 256:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


_SDP_FLAGS = (  # (backend, is it enabled?, enable it) -- the switches torch.nn.attention.sdpa_kernel flips
    (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp),
    (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled,
     torch.backends.cuda.enable_mem_efficient_sdp),
    (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
    (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.enable_math_sdp),
)
_SDP_LOCK = threading.Lock()  # the switches are process-wide: two engines' threads take turns


@contextmanager
def only_backends(backends: tuple[SDPBackend, ...]) -> Iterator[None]:
    """``torch.nn.attention.sdpa_kernel(backends)``, at a tenth of its cost (~3 µs instead of ~30 µs per call, once
    per layer per step): if none of them accepts the call, SDPA raises instead of crawling on the math kernel."""
    with _SDP_LOCK:
        before = [enabled() for _, enabled, _ in _SDP_FLAGS]
        for backend, _, enable in _SDP_FLAGS:
            enable(backend in backends)
        try:
            yield
        finally:
            for was, (_, _, enable) in zip(before, _SDP_FLAGS):
                enable(was)


def run_sdpa(plan: SdpaPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             is_causal: bool) -> torch.Tensor:
    """``sdpa`` along a given plan; q: (B, T, n_heads, d), k, v: (B, S, n_kv_heads, d) -> (B, T, n_heads, d)."""
    qh = q.transpose(1, 2)  # (B, n_heads, T, d)
    kh = k.transpose(1, 2)  # (B, n_kv_heads, S, d)
    vh = v.transpose(1, 2)  # (B, n_kv_heads, S, d)
    n_rep = qh.shape[1] // kh.shape[1]
    if plan.repeat_kv:
        kh, vh = repeat_kv(kh, n_rep), repeat_kv(vh, n_rep)  # (B, n_heads, S, d)
    causal = is_causal and mask is None
    gqa = kh.shape[1] != qh.shape[1]
    if not plan.backends:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    else:
        with only_backends(plan.backends):
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    return out.transpose(1, 2)  # (B, T, n_heads, d)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
    """Scaled dot-product attention over (B, T, heads, head_dim) tensors, with grouped K/V heads (GQA).

    mask, if given, is boolean and broadcastable to (B, n_heads, T, S): True where attention is allowed.
    ``enable_gqa`` lets each K/V head serve its group of query heads without copying it (``repeat_kv``
    shows what that saves: materialising the copies cost more than the attention itself on a CPU). On CUDA,
    ``sdpa_plan`` picks the path that keeps the call on a fused kernel.
    """
    if q.device.type != "cuda":  # the CPU path, unchanged: PyTorch's choice with enable_gqa
        return run_sdpa(CPU_PLAN, q, k, v, mask, is_causal)
    head_dim = q.shape[3]
    plan = sdpa_plan("cuda", mask is not None, q.shape[2] != k.shape[2], flash_supported(q.device, q.dtype, head_dim),
                     fused_ok=head_dim % 8 == 0 and head_dim <= 256)
    return run_sdpa(plan, q, k, v, mask, is_causal)


CPU_PLAN = sdpa_plan("cpu", has_mask=False, is_gqa=False)


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
        self.q_proj = Linear(h, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(h, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=False)
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
        # = self.q_proj(x), self.k_proj(x), self.v_proj(x) side by side, each head's head_dim values together
        merged = self.qkv_proj.merged(x)  # (B, T, (n_heads + 2 * n_kv_heads) * head_dim)
        qkv = merged.view(b, t, self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        heads = [self.n_heads, self.n_kv_heads, self.n_kv_heads]
        rotated = self.n_heads + self.n_kv_heads
        kernel = decode_kernel(merged) if self.q_norm is None and cos.shape[:2] == (b, t) else None
        if self.q_norm is not None and self.k_norm is not None:  # (Qwen3) each has its own norm first
            q, k, v = qkv.split(heads, dim=2)
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        elif kernel is not None and kernel.rope is not None:  # the same in one C++ pass (float32 CPU decode)
            qk = kernel.rope(merged.reshape(b * t, -1), cos.reshape(b * t, -1), sin.reshape(b * t, -1), rotated)
            q, k = qk.view(b, t, rotated, self.head_dim).split(heads[:2], dim=2)
            v = qkv[:, :, rotated:]  # (B, T, n_kv_heads, head_dim)
        else:  # q's and k's heads sit side by side: rotate them in one go (3 ops instead of 6)
            qk = RotaryEmbedding.apply(qkv[:, :, :rotated], cos, sin)
            q, k = qk.split(heads[:2], dim=2)  # (B, T, n_heads, head_dim), (B, T, n_kv_heads, head_dim)
            v = qkv[:, :, rotated:]  # (B, T, n_kv_heads, head_dim)
        out = backend.attend(self.layer_idx, q, k, v)  # (B, T, n_heads, head_dim)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))
