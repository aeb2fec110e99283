"""labkit's CPU GEMV kernels (float32, int8, int4): one C++ kernel shape that streams a weight once.

``csrc/gemv_cpu.cpp`` is compiled like the ``"cpp"`` attention kernel (``labkit.core.attention.cpp_decode``: -O3,
OpenMP, ``-march=native``; kept in the same cache), the first time a quantized layer runs on a CPU. Without a
compiler the quantized layers dequantize and call ``F.linear`` instead (correct, slower), after one warning.
``stream_read_bandwidth`` measures the roof these kernels are held to: one large tensor summed by the same threads.
The float32 kernel also runs every decode-shaped float32 linear layer on a CPU: this module registers it with
``labkit.core.model.linear`` (``register_gemv_kernel``), which cannot import it (this package imports that one);
there, without a compiler, the layers fall back silently to oneDNN / MKL. Its RMSNorm (``rms_norm_f32``), SwiGLU gate
(``silu_mul_f32``) and RoPE (``rope_f32``) are registered with it and run those steps of a float32 decode layer on a
CPU (``labkit.core.model.layers``, ``labkit.core.model.attention``). Introduced in notebook 14
(``14_quantization``).
"""

from __future__ import annotations

import functools
import time
import warnings
from pathlib import Path
from types import ModuleType

import torch

from labkit.core.attention.cpp_decode import CppExtension, compile_extension
from labkit.core.model.linear import STALL_WATCH, GemvKernel, register_gemv_kernel

SOURCE = Path(__file__).resolve().parent / "csrc" / "gemv_cpu.cpp"
MAX_KERNEL_ROWS = 16  # calls with more rows (prefill) dequantize once and run a matrix-matrix product instead
MIN_TASK_BYTES = 1 << 16  # weight bytes per thread task: below, threads cost more than they save


@functools.cache
def load_result() -> CppExtension:
    return compile_extension(SOURCE, prefix="labkit_gemv", what="C++ GEMV kernels (float32, int8, int4)")


def load_gemv(warn: bool = True) -> ModuleType | None:
    """The compiled module, or None (with one warning per process saying why, if ``warn``)."""
    result = load_result()
    if result.missing is not None and warn:
        _fallback_warning(result.missing)
    return result.module


@functools.cache
def _fallback_warning(reason: str) -> None:
    warnings.warn(f"{reason}: quantized layers dequantize and run F.linear instead of labkit's GEMV kernel",
                  RuntimeWarning, stacklevel=4)


def task_rows(row_bytes: int) -> int:
    """Output rows per thread task on a thread team: at least MIN_TASK_BYTES of weight each."""
    return max(1, -(-MIN_TASK_BYTES // max(1, row_bytes)))


def grain(rows: int, row_bytes: int) -> int:
    """``task_rows``, or all rows on one thread while another process holds a core (StallWatch in
    labkit.core.model.linear: a thread team would wait for it every call)."""
    if STALL_WATCH.recent():
        return max(1, rows)
    return task_rows(row_bytes)


def gemv_f32(x: torch.Tensor, weight: torch.Tensor, threads: bool = True) -> torch.Tensor:
    """x (B, in) float32, weight (out, in) float32 contiguous -> (B, out); ``threads`` False: all rows on one thread
    (what ``grain`` does while another process holds a core: the caller, ``LinearKernel``, has just asked)."""
    module = _module()
    rows = weight.shape[0]
    return module.gemv_f32(x.contiguous(), weight, task_rows(weight.shape[1] * 4) if threads else max(1, rows))


def gemv_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (B, in) float32, q (out, in) int8, scales (out,) float32 -> (B, out)."""
    module = _module()
    return module.gemv_int8(x.contiguous(), q, scales, grain(q.shape[0], q.shape[1]))


def gemv_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """x (B, in) float32, packed (out, in / 2) uint8, scales (out, in / group_size) float32 -> (B, out)."""
    module = _module()
    row_bytes = packed.shape[1] + scales.shape[1] * 4
    return module.gemv_int4(x.contiguous(), packed, scales, group_size, grain(packed.shape[0], row_bytes))


def gemv_int4_a8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """As ``gemv_int4``, with x rounded to int8 inside the call (one float32 scale, amax / 127, per 32 inputs) and
    the products summed as integers (AVX-512 VNNI where the CPU has it); group_size 32, 64 or 128."""
    module = _module()
    row_bytes = packed.shape[1] + scales.shape[1] * 4
    return module.gemv_int4_a8(x.contiguous(), packed, scales, group_size, grain(packed.shape[0], row_bytes))


def gemv_int8_a16(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """As ``gemv_int8``, with x rounded to int16 inside the call (one float32 scale, amax / 32767, per 32 inputs) and
    the products summed as integers (AVX-512 VNNI's vpdpwssd where the CPU has it)."""
    module = _module()
    return module.gemv_int8_a16(x.contiguous(), q, scales, grain(q.shape[0], q.shape[1]))


def gemv_int4_a16(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """As ``gemv_int4``, with x rounded to int16 inside the call (one float32 scale per 32 inputs), the products
    summed as integers."""
    module = _module()
    row_bytes = packed.shape[1] + scales.shape[1] * 4
    return module.gemv_int4_a16(x.contiguous(), packed, scales, group_size, grain(packed.shape[0], row_bytes))


LOADED: list[ModuleType] = []  # the module once loaded: every decode layer's calls ask for it


def _module() -> ModuleType:
    if LOADED:
        return LOADED[0]
    module = load_gemv()
    if module is None:
        raise RuntimeError(f"labkit's C++ GEMV kernels are not available: {load_result().missing}")
    LOADED.append(module)
    return module


def stream_read_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second at which this process's threads read memory: the fastest of ``repeats`` sums of one
    ``num_bytes`` float32 tensor (at least 256 MB: far past the caches), rows split as the kernels split them. The
    roof of batch-1 decode: no kernel reads weights faster than this."""
    if num_bytes < 256 << 20:
        raise ValueError(f"the read roof needs a tensor of at least 256 MB (past every cache), got {num_bytes} bytes")
    cols = 4096
    t = torch.ones(num_bytes // (4 * cols), cols)  # (rows, 4096) float32, written once (pages touched)
    module = load_gemv(warn=False)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        if module is not None:
            module.stream_sum(t, grain(t.shape[0], cols * 4))
        else:
            t.sum()
        best = min(best, time.perf_counter() - start)
    return t.numel() * 4 / best


def _float32_kernel_built() -> bool:
    return load_gemv(warn=False) is not None  # no warning: float32 layers fall back to oneDNN / MKL as before


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in one pass per row: x (..., d) contiguous float32, weight (d,) -> (..., d)."""
    return _module().rms_norm_f32(x, weight, eps)


def silu_mul_f32(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate in one pass: gate_up (rows, 2 * I) float32, gate then up side by side (strides free) ->
    silu(gate) * up (rows, I)."""
    return _module().silu_mul_f32(gate_up)


def rope_f32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int) -> torch.Tensor:
    """RoPE on the first ``n_rot`` heads of x (rows, heads * d) float32 (strides free), cos and sin (rows, d) as
    ``RotaryEmbedding.cos_sin`` makes them -> (rows, n_rot * d), contiguous."""
    return _module().rope_f32(x, cos, sin, n_rot)


register_gemv_kernel(GemvKernel(run=gemv_f32, max_rows=MAX_KERNEL_ROWS, available=_float32_kernel_built,
                                rms_norm=rms_norm_f32, silu_mul=silu_mul_f32, rope=rope_f32))
