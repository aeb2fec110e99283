"""Notebook 14's measurements: bytes per decode step by format, one layer's matmul by batch size, greedy agreement.

Arithmetic where it is arithmetic (bytes from a ``ModelConfig``), timed calls where it is time (through
``labkit.measure.rounds``). Introduced in notebook 14 (``14_quantization``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.core.kv.quantized_pool import kv_cache_bytes_per_token
from labkit.core.model.config import ModelConfig
from labkit.core.model.linear import Linear
from labkit.core.quant import QuantizationConfig, QuantizedLinear

WEIGHT_FORMATS: dict[str, float] = {"float32": 32.0, "bfloat16": 16.0, "int8": 8.0 + 32.0 / 4096,
                                    "int4-g32": 4.0 + 32.0 / 32, "int4-g64": 4.0 + 32.0 / 64}  # bits per weight
KV_FORMATS: dict[str, tuple[torch.dtype, str]] = {  # the pool's format: (model dtype, kv_cache_dtype)
    "float32": (torch.float32, "auto"), "bfloat16": (torch.bfloat16, "auto"), "int8": (torch.float32, "int8"),
    "fp8": (torch.float32, "fp8")}


def linear_params(config: ModelConfig) -> int:
    """Weights of every linear layer a decode step reads (q, k, v, o, gate, up, down per layer, and lm_head)."""
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    attn = h * d * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    return config.num_hidden_layers * (attn + 3 * h * i) + h * config.vocab_size


def bytes_per_step(config: ModelConfig, weight_format: str, kv_format: str, context: int) -> float:
    """Bytes one batch-1 decode step reads: every linear weight once (int8 rows: one float32 scale per row, counted
    approximately as 32 bits per 4096 weights), and the K/V of ``context`` tokens."""
    dtype, kv = KV_FORMATS[kv_format]
    weights = linear_params(config) * WEIGHT_FORMATS[weight_format] / 8
    return weights + context * kv_cache_bytes_per_token(config, dtype, kv)


def layer_contenders(batch: int, out_features: int = 2048, in_features: int = 2048, layers: int = 8,
                     seed: int = 0) -> dict[str, Callable[[], None]]:
    """One decode-shaped call per format over ``layers`` different (out, in) layers (more bytes than the caches
    hold), ``batch`` rows each: labkit's float32 Linear (its C++ GEMV kernel up to 16 rows, oneDNN beyond; oneDNN or
    MKL without a compiler), and the int8 and int4 layers (their GEMV kernel up to 16 rows, dequantize + matmul
    beyond)."""
    gen = torch.Generator().manual_seed(seed)
    floats = []
    for _ in range(layers):
        lin = Linear(in_features, out_features, bias=False)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02, generator=gen)
        floats.append(lin)
    quantized = {name: [QuantizedLinear.from_linear(lin, config) for lin in floats]
                 for name, config in (("int8", QuantizationConfig("int8")), ("int4-g32", QuantizationConfig("int4")))}
    x = torch.randn(batch, in_features, generator=gen)

    def runner(mods: list[torch.nn.Module]) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                for m in mods:
                    m(x)
        return run

    return {"float32": runner(floats), **{name: runner(mods) for name, mods in quantized.items()}}


def greedy_agreement(got: list[list[int]], want: list[list[int]]) -> float:
    """Share of positions where two greedy runs chose the same token, up to each pair's first disagreement (after
    it the contexts differ, and so would anything compared)."""
    same = total = 0
    for g, w in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        same, total = same + n, total + len(w)
    return same / total if total else 1.0
