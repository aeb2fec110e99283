"""SwiGLU's gate and RoPE on labkit's C++ module (``silu_mul_f32``, ``rope_f32``, registered with the GEMV kernel):
the same values as PyTorch's ops to float32 rounding, on contiguous and strided rows; used by ``MLP`` and
``Attention`` exactly where they apply (float32 on a CPU, a decode's few rows, no autograd), and refused with the
reason where the inputs are wrong."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch.nn import functional as F

from labkit.core.model import linear
from labkit.core.model.attention import Attention, CausalAttention
from labkit.core.model.config import ModelConfig
from labkit.core.model.layers import MLP, RotaryEmbedding
from labkit.core.quant import gemv

CONFIG = ModelConfig(model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Which of the two kernels ran, in order."""
    seen: list[str] = []
    kernel = linear.GEMV_KERNEL[0]

    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        seen.append("silu_mul")
        return gemv.silu_mul_f32(gate_up)

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int) -> torch.Tensor:
        seen.append("rope")
        return gemv.rope_f32(x, cos, sin, n_rot)
    monkeypatch.setattr(linear, "GEMV_KERNEL", [dataclasses.replace(kernel, silu_mul=silu_mul, rope=rope)])
    yield seen


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up  # float64: the exact value, rounded once


@pytest.mark.parametrize("rows,width", [(1, 3072), (3, 96), (16, 2), (2, 34)])
def test_silu_mul_matches_pytorch(rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    gate_up = torch.randn(rows, width, generator=gen) * 6  # gates from -25 to 25: both tails of the sigmoid
    gate_up[0, 0], gate_up[-1, width // 2 - 1] = -100.0, 100.0  # past exp's float32 range
    strided = torch.randn(width, rows, generator=gen).t()  # (rows, width), columns rows apart (the GEMV's output)
    for x in (gate_up, strided):
        got = gemv.silu_mul_f32(x)
        assert got.shape == (rows, width // 2) and got.is_contiguous()
        torch.testing.assert_close(got.double(), reference_silu_mul(x), rtol=3e-6, atol=1e-6)
        gate, up = x.chunk(2, dim=-1)
        torch.testing.assert_close(got, F.silu(gate) * up, rtol=3e-6, atol=1e-6)


def rope_inputs(rows: int, heads: int, d: int, strided: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows * heads * d)
    x = torch.randn(heads * d, rows, generator=gen).t() if strided else torch.randn(rows, heads * d, generator=gen)
    rope = RotaryEmbedding(dataclasses.replace(CONFIG, head_dim=d))
    cos, sin = rope.cos_sin(torch.randint(0, 4000, (1, rows), generator=gen), torch.float32)  # (1, rows, 1, d)
    return x, cos.reshape(rows, d), sin.reshape(rows, d)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("rows,heads,n_rot,d", [(1, 15, 12, 64), (4, 6, 4, 16), (3, 2, 2, 2), (2, 5, 0, 8)])
def test_rope_matches_rotary_embedding(rows: int, heads: int, n_rot: int, d: int, strided: bool) -> None:
    x, cos, sin = rope_inputs(rows, heads, d, strided)
    got = gemv.rope_f32(x, cos, sin, n_rot)
    assert got.shape == (rows, n_rot * d) and got.is_contiguous()
    heads_view = x.reshape(rows, 1, heads, d)[:, :, :n_rot]  # (rows, T=1, n_rot, d)
    want = RotaryEmbedding.apply(heads_view, cos[:, None, None], sin[:, None, None]).reshape(rows, n_rot * d)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(x, rope_inputs(rows, heads, d, strided)[0])  # out of place: the input is untouched


@pytest.mark.parametrize("call,message", [
    (lambda: gemv.silu_mul_f32(torch.randn(2, 5)), "an even width"),
    (lambda: gemv.silu_mul_f32(torch.randn(2, 4).double()), "gu must be a \\(rows, n\\) float32 tensor"),
    (lambda: gemv.silu_mul_f32(torch.randn(2, 2, 4)), "gu must be a \\(rows, n\\) float32 tensor"),
    (lambda: gemv.rope_f32(torch.randn(2, 32), torch.randn(2, 8), torch.randn(2, 8), 5),
     "n_rot = 5 heads of 8 do not fit in x's 32 columns"),
    (lambda: gemv.rope_f32(torch.randn(2, 32), torch.randn(3, 8), torch.randn(3, 8), 1), "one row per row of x"),
    (lambda: gemv.rope_f32(torch.randn(2, 30), torch.randn(2, 5), torch.randn(2, 5), 1), "head_dim must be even"),
])
def test_bad_inputs_are_refused_with_the_reason(call: object, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        call()  # type: ignore[operator]


def test_mlp_uses_the_kernel_for_decode_rows_only(calls: list[str]) -> None:
    torch.manual_seed(0)
    mlp = MLP(CONFIG)
    with torch.inference_mode():
        decode = torch.randn(1, 3, 64)  # 3 rows: a decode step's tokens
        got = mlp(decode)
        gate, up = F.linear(decode, mlp.gate_proj.weight), F.linear(decode, mlp.up_proj.weight)
        torch.testing.assert_close(got, F.linear(F.silu(gate) * up, mlp.down_proj.weight), rtol=1e-5, atol=1e-5)
        assert calls == ["silu_mul"]
        mlp(torch.randn(1, 40, 64))  # a prefill's 40 rows: PyTorch's threaded ops
        mlp.double()(decode.double())  # float64: PyTorch's ops
    assert calls == ["silu_mul"]
    x = torch.randn(1, 2, 64, requires_grad=True)
    mlp.float()(x).sum().backward()  # autograd wants a backward
    assert calls == ["silu_mul"] and x.grad is not None


def test_attention_uses_the_kernel_for_decode_rows_only(calls: list[str]) -> None:
    torch.manual_seed(1)
    attn = Attention(CONFIG, 0)
    rope = RotaryEmbedding(CONFIG)
    positions = torch.tensor([[5, 6, 7]])
    x = torch.randn(1, 3, 64)
    with torch.inference_mode():
        cos, sin = rope.cos_sin(positions, torch.float32)
        got = attn(x, cos, sin, CausalAttention())
        assert calls == ["rope"]
        qkv = F.linear(x, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        q, k, v = qkv.view(1, 3, 10, 16).split([6, 2, 2], dim=2)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        want = F.linear(CausalAttention().attend(0, q, k, v).reshape(1, 3, 96), attn.o_proj.weight)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        long_positions = torch.arange(40)[None]
        attn(torch.randn(1, 40, 64), *rope.cos_sin(long_positions, torch.float32), CausalAttention())  # a prefill
    assert calls == ["rope"]


def test_without_the_kernels_mlp_and_attention_run_pytorch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(2)
    mlp, attn, rope = MLP(CONFIG), Attention(CONFIG, 0), RotaryEmbedding(CONFIG)
    x = torch.randn(1, 2, 64)
    with torch.inference_mode():
        cos, sin = rope.cos_sin(torch.tensor([[3, 4]]), torch.float32)
        with_kernels = mlp(x), attn(x, cos, sin, CausalAttention())
        kernel = linear.GEMV_KERNEL[0]
        monkeypatch.setattr(linear, "GEMV_KERNEL", [dataclasses.replace(kernel, silu_mul=None, rope=None)])
        without = mlp(x), attn(x, cos, sin, CausalAttention())
        monkeypatch.setattr(linear, "GEMV_KERNEL", [])  # no compiler: nothing registered
        no_module = mlp(x), attn(x, cos, sin, CausalAttention())
    for got in (with_kernels, no_module):
        for a, b in zip(got, without):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
