"""A paged KV pool that stores K and V in 8 bits: ``kv_cache_dtype="int8"`` or ``"fp8"`` (vLLM's option).

``"int8"``: each token's K (and V) of each KV head is one int8 vector with its own float32 scale (max |x| / 127),
kept in the pool beside it (``k_scale``: (num_blocks, block_size, n_kv_heads)); per token and head, because K/V
magnitudes differ a lot between heads and positions. ``"fp8"``: float8_e4m3fn values (4 exponent bits, 3 mantissa
bits, up to +-448) divided by one scale per layer, vLLM's meaning; as in vLLM without calibration, the scale is 1.0.
Either holds a token in about a quarter of float32's bytes (int8: head_dim + 4 bytes per head for K, the same for
V). Attention backends read it through ``labkit.core.attention.quantized_kv``. Introduced in notebook 14.
"""

from __future__ import annotations

import functools

import torch

from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model.config import ModelConfig

KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # "auto": the model's dtype (vLLM's default)
INT8_MAX = 127
FP8_DTYPE = torch.float8_e4m3fn
SCALE_BYTES = 4  # an int8 scale is float32


def check_kv_cache_dtype(value: object) -> str:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={value!r} is not supported; choose one of "
                         f"{', '.join(repr(v) for v in KV_CACHE_DTYPES)} ('auto': the model's dtype)")
    return value  # type: ignore[return-value]


@functools.cache
def fp8_supported(device_type: str) -> bool:
    """Whether tensors on this kind of device can hold float8_e4m3fn (written and read back)."""
    try:
        x = torch.ones(2, device=device_type)
        return bool(torch.equal(x.to(FP8_DTYPE).to(torch.float32), x))
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def check_kv_device(kv_cache_dtype: str, device: torch.device, dtype: torch.dtype) -> None:
    """A clear error where the pool's format cannot live: fp8 on a device without float8, or a float64 model (its
    exact-test dtype: a quantized cache would make "exact" meaningless)."""
    if kv_cache_dtype == "auto":
        return
    if dtype == torch.float64:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a float32, bfloat16 or float16 model; float64 is "
                         "for exact tests (use kv_cache_dtype='auto')")
    if kv_cache_dtype == "fp8" and not fp8_supported(device.type):
        raise ValueError(f"kv_cache_dtype='fp8' needs float8_e4m3fn tensors, which this PyTorch cannot hold on "
                         f"{device.type}; use kv_cache_dtype='int8' (or 'auto')")


def kv_cache_bytes_per_token(config: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V one token leaves in the pool, over all layers, scales counted (int8: one float32 per token
    and head, for K and for V; fp8's per-layer scales are a few bytes per pool, not per token)."""
    per_head = config.head_dim * torch.empty((), dtype=dtype).element_size()
    if kv_cache_dtype == "int8":
        per_head = config.head_dim + SCALE_BYTES
    elif kv_cache_dtype == "fp8":
        per_head = config.head_dim
    return 2 * config.num_hidden_layers * config.num_key_value_heads * per_head


def kv_cache_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block across all layers, K and V, scales counted: what the engine sizes its pool with."""
    return kv_cache_bytes_per_token(config, dtype, kv_cache_dtype) * block_size


def quantize_int8_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., head_dim) float -> (int8 (..., head_dim), scale (...) float32): one scale per vector."""
    amax = x.detach().float().abs().amax(dim=-1)  # (...)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(x.float() / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


class QuantizedKVPool(PagedKVPool):
    """``PagedKVPool`` whose K/V are int8 (with per-token-per-head scales) or fp8 (with per-layer scales).
    ``write`` quantizes new tokens into their slots; ``read_blocks`` gives blocks back in the model's dtype.
    Notebook 14."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                 dtype: torch.dtype, kv_cache_dtype: str) -> None:
        check_kv_device(check_kv_cache_dtype(kv_cache_dtype), device, dtype)
        if kv_cache_dtype == "auto":
            raise ValueError("QuantizedKVPool stores 'int8' or 'fp8'; 'auto' is PagedKVPool")
        self.kv_cache_dtype, self.dtype = kv_cache_dtype, dtype
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        storage = torch.int8 if kv_cache_dtype == "int8" else FP8_DTYPE
        layers = range(config.num_hidden_layers)
        self.k = [torch.zeros(shape, device=device, dtype=storage) for _ in layers]
        self.v = [torch.zeros(shape, device=device, dtype=storage) for _ in layers]
        scale_shape = shape[:3] if kv_cache_dtype == "int8" else ()  # per token and head, or per layer
        self.k_scale = [torch.ones(scale_shape, device=device) for _ in layers]
        self.v_scale = [torch.ones(scale_shape, device=device) for _ in layers]

    @property
    def num_bytes(self) -> int:
        tensors = self.k + self.v + self.k_scale + self.v_scale
        return sum(t.numel() * t.element_size() for t in tensors)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        super().copy_blocks(copies)
        if copies and self.kv_cache_dtype == "int8":  # the scales travel with their block
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            for scales in self.k_scale + self.v_scale:
                scales[dst] = scales[src]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: (N, n_kv_heads, head_dim) in the model's dtype -> quantized into slots (N,)."""
        for pool, scales, x in ((self.k[layer], self.k_scale[layer], k), (self.v[layer], self.v_scale[layer], v)):
            if self.kv_cache_dtype == "int8":
                q, scale = quantize_int8_kv(x)  # (N, n_kv, d), (N, n_kv)
                pool.flatten(0, 1)[slots] = q
                scales.flatten(0, 1)[slots] = scale
            else:
                pool.flatten(0, 1)[slots] = (x.float() / scales).to(FP8_DTYPE)

    def read_blocks(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """blocks (U,) -> K, V of those blocks, (U, block_size, n_kv_heads, head_dim) in the model's dtype."""
        out = []
        for pool, scales in ((self.k[layer], self.k_scale[layer]), (self.v[layer], self.v_scale[layer])):
            q = pool.index_select(0, blocks)  # (U, block_size, n_kv, d)
            if self.kv_cache_dtype == "int8":
                out.append(dequantize_int8_kv(q, scales.index_select(0, blocks), self.dtype))
            else:
                out.append((q.float() * scales).to(self.dtype))
        return out[0], out[1]
