"""Attention path selection (``labkit.core.model.attention.sdpa_plan``): on CUDA every call stays on a fused SDPA kernel
(masked GQA repeats K/V: flash rejects a mask, the memory-efficient and cuDNN kernels reject GQA), and the math
kernel is never allowed, so a fallback raises instead of crawling; on the CPU nothing changes. The selection logic
and the repeated-K/V path are checked here on the CPU; the ``cuda`` test runs the real kernels where a GPU exists."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend

import labkit.core.model.attention as attention
from labkit.core.model.attention import SdpaPlan, flash_supported, only_backends, run_sdpa, sdpa, sdpa_plan

FLASH, EFFICIENT, CUDNN = SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION


@pytest.mark.parametrize(("has_mask", "is_gqa", "flash_ok", "want"), [
    (True, True, True, SdpaPlan(True, (EFFICIENT, CUDNN))),  # masked GQA: repeat K/V, a kernel that takes the mask
    (False, True, True, SdpaPlan(False, (FLASH,))),  # flash takes GQA as it is
    (False, True, False, SdpaPlan(True, (EFFICIENT, CUDNN))),  # float32 or pre-Ampere: no flash, so repeat
    (True, False, True, SdpaPlan(False, (EFFICIENT, CUDNN))),
    (False, False, True, SdpaPlan(False, (FLASH, EFFICIENT, CUDNN))),
    (False, False, False, SdpaPlan(False, (EFFICIENT, CUDNN))),
])
def test_cuda_plans_stay_on_fused_kernels(has_mask: bool, is_gqa: bool, flash_ok: bool, want: SdpaPlan) -> None:
    plan = sdpa_plan("cuda", has_mask, is_gqa, flash_ok)
    assert plan == want
    assert SDPBackend.MATH not in plan.backends  # never the slow path
    if has_mask:
        assert FLASH not in plan.backends  # flash rejects an explicit mask
    if is_gqa and not plan.repeat_kv:
        assert plan.backends == (FLASH,)  # the only fused kernel with enable_gqa


def test_head_sizes_no_fused_kernel_takes_keep_pytorchs_choice() -> None:
    assert sdpa_plan("cuda", True, True, flash_ok=False, fused_ok=False) == SdpaPlan(repeat_kv=False, backends=())


@pytest.mark.parametrize("device_type", ["cpu", "mps"])
def test_other_devices_keep_pytorchs_choice(device_type: str) -> None:
    for has_mask in (False, True):
        for is_gqa in (False, True):
            assert sdpa_plan(device_type, has_mask, is_gqa) == SdpaPlan(repeat_kv=False, backends=())


def qkv(t: int, s: int, n_heads: int = 8, n_kv: int = 2, d: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, n, h, d, generator=gen, dtype=torch.float64)
                 for n, h in ((t, n_heads), (s, n_kv), (s, n_kv)))


def test_cpu_outputs_are_unchanged() -> None:
    """On the CPU sdpa is exactly PyTorch's SDPA with enable_gqa, masked or causal."""
    q, k, v = qkv(5, 9)
    mask = torch.rand(2, 1, 5, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True  # every query sees something
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          enable_gqa=True).transpose(1, 2)
    assert torch.equal(sdpa(q, k, v, mask=mask, is_causal=False), want)
    q, k, v = qkv(7, 7)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                          enable_gqa=True).transpose(1, 2)
    assert torch.equal(sdpa(q, k, v, mask=None, is_causal=True), want)


@pytest.mark.parametrize("masked", [True, False])
def test_repeated_kv_path_gives_the_same_attention(masked: bool) -> None:
    """The CUDA path's repeat_kv, run on the CPU (no backend restriction there), matches enable_gqa."""
    q, k, v = qkv(4, 10)
    mask = (torch.arange(10)[None, :] <= torch.arange(6, 10)[:, None]) if masked else None  # (4, 10) causal
    gqa = run_sdpa(SdpaPlan(repeat_kv=False, backends=()), q, k, v, mask, is_causal=False)
    repeated = run_sdpa(SdpaPlan(repeat_kv=True, backends=()), q, k, v, mask, is_causal=False)
    torch.testing.assert_close(repeated, gqa, rtol=1e-12, atol=1e-12)


def test_only_backends_restricts_and_restores() -> None:
    flags = (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled,
             torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.math_sdp_enabled)
    before = [f() for f in flags]
    with only_backends((EFFICIENT, CUDNN)):
        assert [f() for f in flags] == [False, True, True, False]
    assert [f() for f in flags] == before
    with pytest.raises(ZeroDivisionError), only_backends((FLASH,)):
        1 / 0  # noqa: B018
    assert [f() for f in flags] == before


def test_flash_needs_16_bits_and_ampere(monkeypatch: pytest.MonkeyPatch) -> None:
    flash_supported.cache_clear()
    cuda = torch.device("cuda")
    assert not flash_supported(torch.device("cpu"), torch.bfloat16, 64)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert flash_supported(cuda, torch.bfloat16, 64) and flash_supported(cuda, torch.float16, 128)
    assert not flash_supported(cuda, torch.float32, 64)  # flash has no float32 kernel
    assert not flash_supported(cuda, torch.bfloat16, 36)  # head_dim must be a multiple of 8
    flash_supported.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))  # a T4
    assert not flash_supported(cuda, torch.float16, 64)
    flash_supported.cache_clear()


def test_cuda_calls_go_through_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """sdpa on a CUDA tensor asks sdpa_plan with the call's mask and head counts (recorded here on CPU tensors
    that claim to be on CUDA)."""
    seen = []

    class CudaLike(torch.Tensor):
        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cuda")

    monkeypatch.setattr(attention, "flash_supported", lambda device, dtype, head_dim: dtype == torch.bfloat16)
    monkeypatch.setattr(attention, "run_sdpa", lambda plan, *args: seen.append(plan))
    q, k, v = qkv(3, 3)
    sdpa(q.as_subclass(CudaLike), k, v, mask=torch.ones(3, 3, dtype=torch.bool), is_causal=False)
    sdpa(q.as_subclass(CudaLike), k, v, mask=None, is_causal=True)
    assert seen == [sdpa_plan("cuda", True, True, False), sdpa_plan("cuda", False, True, False)]  # head_dim 16
    assert all(p.repeat_kv for p in seen)  # float64 here: no flash, so K/V are repeated for a fused kernel


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_masked_gqa_runs_fused_on_cuda(dtype: torch.dtype) -> None:
    """On a GPU the restricted call must find a fused kernel (else it raises) and agree with the math kernel."""
    q, k, v = (t.to("cuda", dtype) for t in qkv(16, 48, d=64))
    mask = (torch.arange(48)[None, :] <= torch.arange(32, 48)[:, None]).cuda()  # prefill onto a cached prefix
    got = sdpa(q, k, v, mask=mask, is_causal=False)
    want = F.scaled_dot_product_attention(q.transpose(1, 2).double(), k.transpose(1, 2).double(),
                                          v.transpose(1, 2).double(), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    sdpa(q, k, v, mask=None, is_causal=False)  # decode-like, unmasked
