"""Decode-shaped products over int8 and int4 weights on a GPU: Triton kernels that read the packed bytes once.

On a CPU, labkit's C++ kernels (``csrc/gemv_cpu.cpp``) do this. On CUDA, ``QuantizedLinear`` without a kernel would
dequantize its whole weight for every call and then run ``F.linear``: it reads the int8 / int4 bytes, writes a 16-bit
copy, and reads that copy again, more bytes than the unquantized layer, the opposite of what quantization is for.
These kernels (vLLM's W8A16 / W4A16 GEMV shape) take x (M, K) with M <= 16 rows in x's own dtype, and program i
computes outputs [i * BLOCK_N, (i + 1) * BLOCK_N) for every row: it walks K, loads the weight tile as stored (int8, or
uint8 holding two int4 values), widens it in registers to x's dtype, multiplies by ``tl.dot`` (the rows padded to 16,
its smallest size) into float32, and applies the scales in float32: per output row (int8) after the whole sum, per
group (int4) after each group's sum. Nothing is written but the output.

The int4 layout is labkit's (``labkit.core.quant.int4``): byte j of a row holds element 2j in its low nibble and
element 2j + 1 in its high one, each + 8. So a group of G inputs is G / 2 bytes, and its even elements meet the low
nibbles, its odd ones the high nibbles: two dots per group (G / 2 >= 16, as ``tl.dot`` needs: groups of 32, 64, 128).

Launched by ``quantized_matmul`` for CUDA tensors; on the CPU they run only under Triton's interpreter (tests).
Checked without a GPU: under the interpreter against the dequantized reference, and compiled ahead of time for sm_80
and sm_90 (``python -m labkit.core.quant.triton_gemv`` prints ptxas's registers and spills). Their speed on a GPU is
measured by ``scripts/gpu_check.py`` when one is lent. Introduced in notebook 14.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

# First: importing triton_decode chooses Triton's interpreter where there is no CUDA device (before triton loads).
# Its dot_precision: float32 x multiplies in IEEE float32 (TF32 would round it to 10 bits), 16-bit x as it is.
from labkit.core.attention.triton_decode import dot_precision, is_interpreting

INTERPRETING = is_interpreting()  # whether the kernels below run in Python (the CPU) or compiled (a GPU)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_ROWS = 16  # rows of x per call: tl.dot's smallest M; more rows (prefill) dequantize and run one matrix product
BLOCK_N = 32  # outputs per program (small: a decode layer of a few hundred outputs still spreads over many SMs)
BLOCK_K = 64  # int8: inputs per step of the loop over K


@triton.jit
def gemv_int8_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_y, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """y (M, N) = (x (M, K) @ w (N, K) int8 ^T) * s (N,)."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)
    m_ok, n_ok = offs_m < M, offs_n < N
    rows = offs_n.to(tl.int64) * K  # each output's weight row (64-bit: a large vocabulary times K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # (BM, BK)
        w = tl.load(w_ptr + rows[None, :] + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0)  # (BK, BN)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)  # int8 values are exact in 16-bit floats
    s = tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)  # (BN,) float32
    acc = acc * s[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def gemv_int4_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_x, stride_y, GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """y (M, N) = sum over groups g of (x[:, g] @ w[:, g]^T) * s[:, g], w packed two int4 per byte (N, K / 2)."""
    HALF: tl.constexpr = GROUP // 2  # bytes of one group in a row
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_j = tl.arange(0, HALF)  # (HALF,): byte j of the group, elements 2j and 2j + 1
    m_ok, n_ok = offs_m < M, offs_n < N
    groups = K // GROUP
    rows = offs_n.to(tl.int64) * (K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        byte = tl.load(w_ptr + rows[None, :] + g * HALF + offs_j[:, None], mask=n_ok[None, :], other=0x88)  # (HALF, BN)
        x_row = x_ptr + offs_m[:, None] * stride_x + g * GROUP + 2 * offs_j[None, :]
        x_even = tl.load(x_row, mask=m_ok[:, None], other=0.0)  # (BM, HALF): elements 2j, the low nibbles'
        x_odd = tl.load(x_row + 1, mask=m_ok[:, None], other=0.0)  # elements 2j + 1, the high nibbles'
        low = ((byte & 0x0F).to(tl.int32) - 8).to(x_even.dtype)  # -8..7: exact in 16-bit floats
        high = ((byte >> 4).to(tl.int32) - 8).to(x_even.dtype)
        part = tl.dot(x_even, low, input_precision=PRECISION) + tl.dot(x_odd, high, input_precision=PRECISION)
        s = tl.load(s_ptr + offs_n.to(tl.int64) * groups + g, mask=n_ok, other=0.0)  # (BN,) the group's scales
        acc += part * s[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_y + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def gemv_quantized(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, method: str,
                   group_size: int) -> torch.Tensor:
    """x (M, K) with M <= 16, contiguous rows, float32 / bfloat16 / float16 -> (M, N) in x's dtype. ``method``
    "int8": qweight (N, K) int8, scales (N,); "int4": qweight (N, K / 2) uint8, scales (N, K / group_size), group
    32, 64 or 128. Float32 scales; every tensor on x's device (a CUDA GPU, or the CPU under the interpreter)."""
    m, k = x.shape
    if m > MAX_ROWS or x.stride(1) != 1:
        raise ValueError(f"x must be (M, K) with M <= {MAX_ROWS} rows and contiguous rows, got {tuple(x.shape)}")
    if scales.dtype != torch.float32 or not qweight.is_contiguous() or not scales.is_contiguous():
        raise ValueError("qweight and scales must be contiguous, scales float32")
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, BLOCK_N),)
    block_m = max(16, triton.next_power_of_2(m))
    if method == "int8":
        if qweight.dtype != torch.int8 or qweight.shape[1] != k or scales.numel() != n:
            raise ValueError(f"int8: qweight must be ({n}, {k}) int8 and scales ({n},)")
        gemv_int8_kernel[grid](x, qweight, scales, y, m, n, k, x.stride(0), y.stride(0), BLOCK_M=block_m,
                               BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PRECISION=dot_precision(x.dtype))
        return y
    if method != "int4":
        raise ValueError(f"method must be 'int8' or 'int4', got {method!r}")
    if group_size not in (32, 64, 128) or k % group_size:
        raise ValueError(f"int4: group_size must be 32, 64 or 128 and divide the {k} inputs, got {group_size}")
    if qweight.dtype != torch.uint8 or qweight.shape[1] * 2 != k or tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"int4: qweight must be ({n}, {k // 2}) uint8 and scales ({n}, {k // group_size})")
    gemv_int4_kernel[grid](x, qweight, scales, y, m, n, k, x.stride(0), y.stride(0), GROUP=group_size,
                           BLOCK_M=block_m, BLOCK_N=BLOCK_N, PRECISION=dot_precision(x.dtype))
    return y


@dataclass(frozen=True)
class CompileReport:
    """One kernel compiled ahead of time: its registers per thread and spilled bytes (``ptxas -v``)."""

    kernel: str
    arch: int
    dtype: str
    group: int  # int4's group size (0: int8)
    registers: int
    spill_stores: int
    spill_loads: int


def compile_report(arch: int) -> list[CompileReport]:
    """Both kernels for bfloat16 and float16 inputs (int4 at each group size), compiled for ``sm_<arch>`` as a
    launch compiles them (4 warps), without a GPU: Triton's PTX, then the wheel's ptxas. Needs a process that is not
    interpreting (``TRITON_INTERPRET=0`` before triton is imported)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from labkit.core.attention.triton_aot import TRITON_TYPES, ptxas_usage

    if triton.knobs.runtime.interpret:
        raise RuntimeError("Triton is interpreting in this process: run with TRITON_INTERPRET=0 (a fresh process)")
    reports = []
    for dtype in (torch.bfloat16, torch.float16):
        ty = TRITON_TYPES[dtype]
        for fn, group in ((gemv_int8_kernel, 0), (gemv_int4_kernel, 32), (gemv_int4_kernel, 64),
                          (gemv_int4_kernel, 128)):
            types = dict(x_ptr=f"*{ty}", w_ptr="*i8" if group == 0 else "*u8", s_ptr="*fp32", y_ptr=f"*{ty}",
                         M="i32", N="i32", K="i32", stride_x="i32", stride_y="i32")
            const = dict(BLOCK_M=16, BLOCK_N=BLOCK_N, PRECISION=dot_precision(dtype))
            const.update(dict(GROUP=group) if group else dict(BLOCK_K=BLOCK_K))
            signature = {name: "constexpr" if name in const else types[name] for name in fn.arg_names}
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=const),
                                      target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
            regs, stores, loads = ptxas_usage(compiled.asm["ptx"], arch)
            reports.append(CompileReport(fn.__name__, arch, str(dtype).removeprefix("torch."), group, regs, stores,
                                         loads))
    return reports


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=0: the interpreter compiles nothing")
    print(json.dumps([asdict(r) for arch in (80, 90) for r in compile_report(arch)]))
