"""The Triton int8 / int4 GEMV kernels (``labkit.core.quant.triton_gemv``, what CUDA decode runs) checked on the CPU:
under Triton's interpreter against the dequantized weights, with planted layout bugs caught, and compiled ahead of
time for sm_80 and sm_90 without register spills (ptxas from the triton wheel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("labkit.core.quant.triton_gemv")  # first: it chooses Triton's interpreter off a GPU

from labkit.core.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8  # noqa: E402
from labkit.core.quant.triton_gemv import MAX_ROWS, gemv_quantized  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def case(rows: int, out: int, n_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=gen) * torch.logspace(-2, 0, out)[:, None]  # rows of unlike magnitude
    return torch.randn(rows, n_in, generator=gen), w


@pytest.mark.parametrize("rows,out,n_in", [(1, 70, 256), (3, 130, 160), (16, 64, 128)])
def test_int8_kernel_matches_the_dequantized_weight(rows: int, out: int, n_in: int) -> None:
    """Outputs that do not fill the last program, inputs that do not fill the last step of K (160 of 128 + 32)."""
    x, w = case(rows, out, n_in, seed=rows)
    q, s = quantize_int8(w)
    want = (x.double() @ dequantize_int8(q, s).double().T).float()
    torch.testing.assert_close(gemv_quantized(x, q, s, "int8", 0), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,out,n_in,group", [(1, 70, 256, 32), (5, 96, 192, 64), (16, 65, 256, 128)])
def test_int4_kernel_matches_the_dequantized_weight(rows: int, out: int, n_in: int, group: int) -> None:
    x, w = case(rows, out, n_in, seed=group)
    packed, scales = quantize_int4(w, group)
    want = (x.double() @ dequantize_int4(packed, scales, group).double().T).float()
    got = gemv_quantized(x, packed, scales, "int4", group)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # planted bugs the check must catch: the nibbles swapped, a group's scale taken from the wrong group
    swapped = ((packed & 0x0F) << 4) | (packed >> 4)
    assert not torch.allclose(gemv_quantized(x, swapped, scales, "int4", group), want, rtol=1e-3, atol=1e-3)
    shifted = scales.roll(1, dims=1).contiguous()
    assert not torch.allclose(gemv_quantized(x, packed, shifted, "int4", group), want, rtol=1e-3, atol=1e-3)


def test_sixteen_bit_inputs_give_their_dtype_within_its_rounding() -> None:
    x, w = case(2, 64, 128, seed=7)
    q, s = quantize_int8(w)
    want = x @ dequantize_int8(q, s).T
    got = gemv_quantized(x.half(), q, s, "int8", 0)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)  # float16 x: about 3 decimal digits


def test_bad_calls_are_refused_by_name() -> None:
    x, w = case(1, 64, 128, seed=1)
    q, s = quantize_int8(w)
    packed, scales = quantize_int4(w, 32)
    with pytest.raises(ValueError, match=f"M <= {MAX_ROWS} rows"):
        gemv_quantized(torch.randn(MAX_ROWS + 1, 128), q, s, "int8", 0)
    with pytest.raises(ValueError, match="group_size must be 32, 64 or 128"):
        gemv_quantized(x, packed, scales, "int4", 96)
    with pytest.raises(ValueError, match=r"int8: qweight must be \(64, 128\) int8"):
        gemv_quantized(x, packed, scales, "int8", 0)
    with pytest.raises(ValueError, match="method must be 'int8' or 'int4'"):
        gemv_quantized(x, q, s, "fp8", 0)


def test_kernels_compile_for_sm80_and_sm90_without_spills() -> None:
    """A fresh process (this one interprets): Triton's PTX for each kernel, dtype and group, then ``ptxas -v``."""
    done = subprocess.run([sys.executable, "-m", "labkit.core.quant.triton_gemv"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert {(r["kernel"], r["arch"], r["dtype"], r["group"]) for r in rows} == {
        (k, a, t, g) for a in (80, 90) for t in ("bfloat16", "float16")
        for k, g in (("gemv_int8_kernel", 0), ("gemv_int4_kernel", 32), ("gemv_int4_kernel", 64),
                     ("gemv_int4_kernel", 128))}
    assert all(0 < r["registers"] <= 255 and r["spill_stores"] == 0 and r["spill_loads"] == 0 for r in rows), rows


def test_cuda_decode_calls_take_the_triton_kernels() -> None:
    from labkit.core.quant.linear import TRITON_GEMV_ROWS, triton_gemv_applies

    assert TRITON_GEMV_ROWS == MAX_ROWS
    assert triton_gemv_applies("cuda", torch.bfloat16, 1, "int4", 32)
    assert triton_gemv_applies("cuda", torch.float16, MAX_ROWS, "int8", 0)
    assert not triton_gemv_applies("cuda", torch.bfloat16, MAX_ROWS + 1, "int8", 0)  # prefill: dequantize, one GEMM
    assert not triton_gemv_applies("cuda", torch.bfloat16, 1, "int4", 96)  # a group the kernel does not read
    assert not triton_gemv_applies("cpu", torch.float32, 1, "int8", 0)  # the C++ kernels' (or the interpreter's)
    assert not triton_gemv_applies("mps", torch.float16, 1, "int8", 0)


def test_quantized_matmul_runs_the_triton_path_with_its_bias_and_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The call as CUDA decode makes it, run here under the interpreter (no C++ kernel, the CPU let through):
    leading dimensions kept, the bias added, the same numbers as the dequantize-then-F.linear path."""
    import labkit.core.quant.linear as linear

    monkeypatch.setattr(linear.gemv, "load_gemv", lambda *a, **k: None)
    monkeypatch.setattr(linear, "triton_gemv_applies", lambda device_type, *rest: device_type == "cpu")
    calls, kernels = [], linear.triton_gemv()
    original = kernels.gemv_quantized
    monkeypatch.setattr(kernels, "gemv_quantized", lambda *args: calls.append(args[3]) or original(*args))
    x, w = case(3, 40, 64, seed=3)
    bias = torch.randn(40)
    packed, scales = quantize_int4(w, 32)
    got = linear.quantized_matmul(x[None], packed, scales, "int4", 32, bias)  # (1, 3, 64) -> (1, 3, 40)
    want = torch.nn.functional.linear(x[None], dequantize_int4(packed, scales, 32), bias)
    assert calls == ["int4"] and got.shape == (1, 3, 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 32), ("int4", 128)])
def test_on_a_gpu_decode_calls_run_the_compiled_kernels(method: str, group: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (``scripts/gpu_check.py`` runs ``pytest -m cuda``): a QuantizedLinear's decode call takes the Triton
    path, compiled, and gives x times the dequantized weight within bfloat16's rounding."""
    import labkit.core.quant.linear as linear
    from labkit.core.quant import QuantizationConfig, QuantizedLinear

    calls, kernels = [], linear.triton_gemv()
    original = kernels.gemv_quantized
    monkeypatch.setattr(kernels, "gemv_quantized", lambda *args: calls.append(args[3]) or original(*args))

    torch.manual_seed(0)
    dense = torch.nn.Linear(2048, 1000, bias=False)
    config = QuantizationConfig(method, group_size=group) if group else QuantizationConfig(method)
    layer = QuantizedLinear.from_linear(dense, config).cuda()
    x = torch.randn(2, 2048, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ layer.dequantized_weight(torch.float32).T
    got = layer(x)
    assert calls == [method] and got.dtype == torch.bfloat16 and got.is_cuda
    assert float((got.float() - want).abs().max() / want.abs().max()) < 2e-2
