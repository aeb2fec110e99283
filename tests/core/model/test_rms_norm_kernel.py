"""RMSNorm on labkit's C++ kernel (``rms_norm_f32``, registered with the GEMV kernel): the same values as
``F.rms_norm`` to float32 rounding, used exactly where it applies (CPU, float32, contiguous, no autograd), any
thread split, and clear errors for what it does not take."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from torch.nn import functional as F

from labkit.core.model import linear
from labkit.core.model.layers import RMSNorm
from labkit.core.quant import gemv


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """The shapes RMSNorm sent to the kernel."""
    seen: list[tuple[int, ...]] = []
    kernel = linear.GEMV_KERNEL[0]
    assert kernel.rms_norm is not None

    def spy(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return gemv.rms_norm_f32(x, w, eps)
    monkeypatch.setattr(linear, "GEMV_KERNEL", [dataclasses.replace(kernel, rms_norm=spy)])
    yield seen


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1, 1, 576), (1, 1, 100), (3, 7, 64), (2, 5, 9, 17), (300, 576), (1, 1)])
def test_matches_f_rms_norm(shape: tuple[int, ...], threads: int) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(sum(shape))
        x = torch.randn(*shape, generator=gen) * 4  # (..., d)
        w = torch.randn(shape[-1], generator=gen)
        got = gemv.rms_norm_f32(x, w, 1e-6)
        want = F.rms_norm(x.double(), (shape[-1],), w.double(), 1e-6)  # the exact value, rounded once
        assert got.shape == x.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)
        torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), w, 1e-6), rtol=2e-6, atol=2e-6)
    finally:
        torch.set_num_threads(before)


def test_the_eps_counts() -> None:
    x, w = torch.full((1, 8), 1e-3), torch.ones(8)
    torch.testing.assert_close(gemv.rms_norm_f32(x, w, 1e-6), F.rms_norm(x, (8,), w, 1e-6))
    assert gemv.rms_norm_f32(x, w, 1.0).max() < 2e-3  # eps dominates mean(x^2) = 1e-6: not normalised to 1


def test_rmsnorm_uses_the_kernel_for_float32_cpu_rows_only(calls: list[tuple[int, ...]]) -> None:
    norm = RMSNorm(64, 1e-5)
    x = torch.randn(2, 3, 64)
    with torch.inference_mode():
        norm(x)  # float32, contiguous
        norm(x.double().float())  # still float32
        RMSNorm(64, 1e-5).double()(x.double())  # float64: F.rms_norm
        norm(torch.randn(2, 3, 128)[..., ::2])  # a strided view: F.rms_norm
    assert calls == [(2, 3, 64), (2, 3, 64)]
    x.requires_grad_(True)
    out = norm(x)  # autograd wants a backward: F.rms_norm
    out.sum().backward()
    assert calls == [(2, 3, 64), (2, 3, 64)] and x.grad is not None


def test_rmsnorm_without_the_kernel_is_f_rms_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(4, 64)
    monkeypatch.setattr(linear, "GEMV_KERNEL", [])  # no compiler: nothing registered
    assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))


@pytest.mark.parametrize("x,w,message", [
    (torch.randn(2, 8).double(), torch.ones(8), "x must be a contiguous float32 tensor"),
    (torch.randn(8, 2).t(), torch.ones(8), "x must be a contiguous float32 tensor"),
    (torch.randn(2, 8), torch.ones(8).double(), "w must be a non-empty contiguous"),
    (torch.randn(2, 8), torch.ones(0), "w must be a non-empty contiguous"),
    (torch.randn(2, 8), torch.ones(4), "x's last dimension is 8, the weight's 4"),
])
def test_bad_inputs_are_refused_with_the_reason(x: torch.Tensor, w: torch.Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        gemv.rms_norm_f32(x, w, 1e-6)


def test_use_kernel_false_is_f_rms_norm(calls: list[tuple[int, ...]]) -> None:
    norm = RMSNorm(64, 1e-5)
    norm.use_kernel = False  # the benchmark's "RMSNorm on F.rms_norm" contender
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5))
    assert calls == []
