"""The small building blocks of a Llama-family decoder: RMSNorm, rotary embeddings, SwiGLU.

Walked through in notebook 02 (``02_naive_generation``) next to transformers' versions.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from labkit.core.model.config import ModelConfig
from labkit.core.model.linear import GemvKernel, Linear, LinearKernel, gemv_kernel


def wants_grad(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether autograd records this call (a compiled kernel has no backward)."""
    return torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)


def decode_kernel(x: torch.Tensor) -> GemvKernel | None:
    """labkit's C++ module (notebook 14's) for a decode-shaped step of a layer, else None: x float32 on a CPU, few rows
    (``max_rows``: a prefill's many rows run PyTorch's threaded ops), nothing for autograd to record. On a CPU each
    PyTorch op costs ~2-5 µs of dispatch from Python, more than its arithmetic on a decode's few hundred floats."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad):
        return None
    kernel = gemv_kernel()
    if kernel is None or x.numel() > kernel.max_rows * x.shape[-1]:
        return None
    return kernel


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias). Notebook 02."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.use_kernel = True  # False: always F.rms_norm (scripts/bench_quantization.py times both)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # weight * x / sqrt(mean(x^2) + eps), over the last dimension, in one op (F.rms_norm).
        if self.use_kernel and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous() \
                and not wants_grad(x, self.weight):
            # On a CPU F.rms_norm runs as six small ops (~25 µs a row, twice per layer per decode step): labkit's C++
            # kernel (notebook 14's module) makes one pass over the row instead, in the same order of operations.
            kernel = gemv_kernel()
            if kernel is not None and kernel.rms_norm is not None:
                return kernel.rms_norm(x, self.weight, self.eps)
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # 16-bit inputs: normalise in float32 (as the reference does), then scale in the model's dtype.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies theta^(-2i/d), with Llama 3's long-context scaling if configured."""
    d = config.head_dim
    # On the CPU whatever the default device: a model is built on the meta device (loader.py), where this arithmetic
    # would import torch's compiler stack; the module is moved, and its buffer recomputed, afterwards.
    positions = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (config.rope_theta ** (positions / d))  # (d/2,)
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


class MergedLinear:
    """Several ``nn.Linear`` layers that read the same input, computed as one matmul: vLLM's
    ``QKVParallelLinear`` (q, k, v) and ``MergedColumnParallelLinear`` (gate, up). Notebook 10.

    One call instead of three saves the per-operator cost the host pays for each (notebook 10 measures it).
    Each layer keeps its own parameter, so names, checkpoints and ``state_dict`` are unchanged: their weights
    become views into one merged tensor (nothing is copied twice), and loading into them fills it. If their
    tensors are replaced (``model.to(...)``, a new device or dtype), the next call merges them again.
    """

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.weight: torch.Tensor | None = None  # (sum of out_features, in_features)
        self.bias: torch.Tensor | None = None
        self.merged_addresses: tuple[int, ...] = ()  # each part's data_ptr right after the merge (weights, biases)
        self.kernel = LinearKernel()  # F.linear, or oneDNN over a repacked copy; the layout (labkit.core.model.linear)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.merged(x).split(self.sizes, dim=-1)

    def merged(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in_features) -> (..., sum of out_features): every layer's output side by side, unsplit."""
        if not self._is_merged():
            self._merge()
        return self.kernel(x, self.weight, self.bias, tuple(lin.weight for lin in self.linears))  # type: ignore

    def _is_merged(self) -> bool:
        # Asked at every call (twice per layer in each decode step), so it compares addresses recorded at the merge: a
        # part still at its recorded address is still a view of the merged tensor (which holds that memory alive).
        if self.weight is None or (self.weight.stride(0) == 1) != self.kernel.wants_gemv_layout(self.weight):
            return False
        return self._part_addresses() == self.merged_addresses

    def _part_addresses(self) -> tuple[int, ...]:
        # lin._parameters[...] is lin.weight without nn.Module.__getattr__'s slow path (~0.5 µs a lookup)
        weights = tuple(lin._parameters["weight"].data_ptr() for lin in self.linears)  # type: ignore[union-attr]
        if self.bias is None:
            return weights
        return weights + tuple(lin._parameters["bias"].data_ptr() for lin in self.linears)  # type: ignore[union-attr]

    def _merge(self) -> None:
        # Plain tensors even if the first call comes inside torch.inference_mode().
        with torch.inference_mode(False), torch.no_grad():
            weights = [lin.weight for lin in self.linears]  # (out_i, in) each
            if self.kernel.wants_gemv_layout(weights[0]):  # (in, sum of out) memory: labkit.core.model.linear
                self.weight = torch.cat([w.t() for w in weights], dim=1).t()
            else:
                self.weight = torch.cat(weights)
            for lin, part in zip(self.linears, self.weight.split(self.sizes)):
                lin.weight.data = part
            self.bias = None
            if all(lin.bias is not None for lin in self.linears):
                self.bias = torch.cat([lin.bias for lin in self.linears])  # type: ignore[misc]
                for lin, part in zip(self.linears, self.bias.split(self.sizes)):
                    lin.bias.data = part  # type: ignore[union-attr]
            self.merged_addresses = self._part_addresses()


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Notebook 02."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, i, bias=False)
        self.up_proj = Linear(h, i, bias=False)
        self.down_proj = Linear(i, h, bias=False)
        self.gate_up = MergedLinear(self.gate_proj, self.up_proj)  # both in one matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up.merged(x)  # (..., 2 * intermediate): self.gate_proj(x), self.up_proj(x) side by side
        kernel = decode_kernel(gate_up)
        if kernel is not None and kernel.silu_mul is not None:  # the same in one C++ pass (float32 CPU decode)
            rows = gate_up.reshape(-1, gate_up.shape[-1])  # (rows, 2 * intermediate), a view
            return self.down_proj(kernel.silu_mul(rows).view(*gate_up.shape[:-1], -1))
        gate, up = gate_up.split(self.gate_up.sizes, dim=-1)
        return self.down_proj(F.silu(gate) * up)
