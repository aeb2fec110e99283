"""The Triton decode kernel compiled ahead of time for a GPU that is not here: PTX from Triton, then ``ptxas -v`` (the
one the triton wheel ships) for the registers each thread uses and the bytes it spills to local memory.

A kernel that spills reads and writes its own state through the cache instead of registers: on a memory-bound decode
that costs bandwidth the K/V reads need. ``kernel_tuning`` (``triton_decode``) picks the launch per head_dim so that
stage 1 does not spill on sm_90; this module checks it without a GPU or a driver. Triton must not be interpreting in
the process (``TRITON_INTERPRET=0`` before it is imported): ``python -m labkit.core.attention.triton_aot`` prints the
report as JSON. Notebook 11 (``11_attention_kernels``) ; run by the tests and by ``scripts/gpu_check.py --dry-run``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from labkit.core.attention import triton_kernels as kernels
from labkit.core.attention.triton_decode import MAX_SPLITS, default_dot_precision, dot_precision, kernel_tuning

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class RegisterReport:
    """ptxas's account of one compiled kernel: registers per thread and local-memory spill traffic."""

    kernel: str
    arch: int
    head_dim: int
    dtype: str
    num_warps: int
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    tf32_mma: bool  # whether the PTX rounds float32 inputs to TF32 on the tensor cores

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def ptxas_usage(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill-store bytes, spill-load bytes) that ``ptxas -v`` reports for ``ptx``."""
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"  # Triton's own target name for Hopper and later
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx, encoding="utf-8")
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", str(src), "-o",
                               str(Path(tmp) / "kernel.cubin")], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed for {gpu}: {done.stderr[-2000:]}")
    regs = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", done.stderr)
    if regs is None or spills is None:
        raise RuntimeError(f"unexpected ptxas -v output: {done.stderr[-2000:]}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def register_report(head_dim: int, dtype: torch.dtype, arch: int = 90, group: int = 7) -> list[RegisterReport]:
    """Both stages for ``head_dim`` and a pool of ``dtype``, launched as ``paged_decode_attention`` launches them on a
    GPU (its tile width, warps and dot precision), compiled for ``sm_<arch>``; ``group`` query heads per KV head
    (Qwen2.5-0.5B's 7, padded to 16)."""
    if triton.knobs.runtime.interpret:
        raise RuntimeError("Triton is interpreting in this process: run with TRITON_INTERPRET=0 (a fresh process)")
    ty = TRITON_TYPES[dtype]
    tuning = kernel_tuning(head_dim, dtype)
    types = dict(q_ptr=f"*{ty}", k_ptr=f"*{ty}", v_ptr=f"*{ty}", table_ptr="*i32", lens_ptr="*i32", mid_o="*fp32",
                 mid_m="*fp32", mid_l="*fp32", out_ptr=f"*{ty}", scale="fp32", stride_q_seq="i32",
                 stride_table="i32", stride_slot="i32", stride_out_seq="i32")
    d_pad = max(16, triton.next_power_of_2(head_dim))
    constants = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, D_PAD=d_pad,
                     BLOCK_SIZE=16, BLOCK_N=tuning.block_n, NUM_SPLITS=MAX_SPLITS // 4, SPLITS_PAD=MAX_SPLITS // 4,
                     ATTEND_TILE=triton.jit(kernels.attend_tile), MERGE=triton.jit(kernels.merge_splits))
    reports = []
    for fn, warps in ((kernels.paged_decode_stage1, tuning.num_warps), (kernels.paged_decode_stage2, 4)):
        const = {name: constants[name] for name in fn.arg_names if name in constants}
        signature = {name: "constexpr" if name in const else types[name] for name in fn.arg_names}
        with default_dot_precision(dot_precision(dtype)):
            compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=const),
                                      target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        ptx = compiled.asm["ptx"]
        regs, stores, loads = ptxas_usage(ptx, arch)
        reports.append(RegisterReport(fn.__name__, arch, head_dim, str(dtype).removeprefix("torch."), warps, regs,
                                      stores, loads, bool(re.search(r"mma\S*\.tf32", ptx))))
    return reports


def main() -> None:
    """Print the reports for head_dim 64 and 128, bfloat16 and float32 pools, sm_90, as one JSON list."""
    rows = [asdict(r) | {"spills": r.spills} for d in (64, 128) for dtype in (torch.bfloat16, torch.float32)
            for r in register_report(d, dtype)]
    print(json.dumps(rows))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=0: the interpreter compiles nothing")
    main()
