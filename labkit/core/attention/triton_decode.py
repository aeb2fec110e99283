"""Launching the Triton paged decode kernel (``triton_kernels.py``), and the ``"triton"`` attention backend.

``paged_decode_attention`` runs the two stages as compiled kernels on a GPU, and on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``: each program runs in Python with NumPy, for checking, not for speed). Triton
makes that choice once per process, when it is imported; labkit picks the interpreter where there is no CUDA
device. Introduced in notebook 11 (``11_attention_kernels``).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

# Without a GPU, Triton runs kernels only under its interpreter, and the choice is made when triton is imported (its
# own library functions, tl.sum and tl.max among them, are decorated then). labkit imports triton only here, when the
# "triton" backend is first chosen (or TRITON_MISSING first read): choose the interpreter now, unless the process
# imported triton already (then ``is_interpreting`` says so, and a kernel launch explains what to do).
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

from labkit.core.attention.decode import host_to_device, split_host_ints
from labkit.core.attention.metadata import PagedAttentionBackend, PagedAttentionMetadata
from labkit.core.attention.torch_sdpa import TorchAttentionBackend
from labkit.core.attention.triton_kernels import attend_tile, merge_splits, paged_decode_stage1, paged_decode_stage2
from labkit.core.kv.paged_pool import PagedKVPool

MAX_SPLITS = 32  # a power of two: split counts are bucketed to powers of two up to it


@dataclass(frozen=True)
class KernelTuning:
    """How stage 1 is launched on a GPU: the tile width and the warps per program. Chosen so that ptxas keeps the
    accumulator and the tile in registers on sm_90, with no spills (``triton_aot.register_report`` checks it). For
    example, head_dim 128 with a 64-wide tile and 4 warps needs more than 255 registers per thread and spills; 8
    warps share the same tile and fit in about 230."""

    block_n: int
    num_warps: int


def kernel_tuning(head_dim: int, dtype: torch.dtype) -> KernelTuning:
    """The stage-1 launch for ``head_dim`` and a pool of ``dtype`` (checked at head_dim 64 and 128 with ptxas for
    sm_90). A float32 pool's dots run in IEEE float32 (``dot_precision``), on the FMA units rather than the tensor
    cores, which holds more per thread: more warps, and a narrower tile at head_dim 128."""
    ieee = dot_precision(dtype) == "ieee"
    if head_dim <= 64:
        return KernelTuning(block_n=64, num_warps=8 if ieee else 4)
    if head_dim <= 128:
        return KernelTuning(block_n=32 if ieee else 64, num_warps=8)
    return KernelTuning(block_n=16 if ieee else 32, num_warps=8)


def bucket_splits(n: int) -> int:
    """``n`` rounded down to a power of two in [1, MAX_SPLITS]: ``NUM_SPLITS`` is a compile-time constant, so each
    distinct count is a compilation; six buckets bound them (and a CUDA graph bucket keeps one count)."""
    return 1 << (max(1, min(MAX_SPLITS, n)).bit_length() - 1)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for a pool of ``dtype``. On a GPU ``tl.dot`` rounds float32 inputs to TF32 (10
    mantissa bits) unless told otherwise: a float32 pool is then no longer computed in float32 (notebook 11's float32
    check, at 1e-4, fails), so it gets ``"ieee"``. A 16-bit pool keeps TF32 where it is exact, ``q @ K^T`` (a
    bfloat16 or float16 value fits TF32), and for ``p @ V``, whose rounding of p (2^-11 relative) stays below the
    16-bit output's own (2^-8 for bfloat16)."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


_PRECISION_LOCK = threading.Lock()  # the knob below is process-wide: launches from two engines' threads take turns


@contextmanager
def default_dot_precision(precision: str) -> Iterator[None]:
    """Every ``tl.dot`` without an explicit ``input_precision`` (a learner's ``attend_tile`` too) compiles with
    ``precision`` meanwhile: Triton's ``TRITON_F32_DEFAULT`` knob, read when a kernel is traced (compiled, or run
    under the interpreter). The compiled kernel is cached by argument types, and the pool's dtype decides the
    precision, so a cached kernel always has the precision its dtype asks for."""
    with _PRECISION_LOCK:
        before = triton.knobs.language.fp32_default
        triton.knobs.language.fp32_default = precision
        try:
            yield
        finally:
            triton.knobs.language.fp32_default = before


def device_function(fn: Any, what: str) -> Any:
    """``fn`` as a Triton device function: a ``@triton.jit`` function as it is, a plain one wrapped (once)."""
    if isinstance(fn, KernelInterface):
        return fn
    if not inspect.isfunction(fn):
        raise TypeError(f"{what} must be a Python function (or a @triton.jit one), got {fn!r}")
    return _jit(fn)


@functools.cache
def _jit(fn: Any) -> Any:
    return triton.jit(fn)


def is_interpreting() -> bool:
    """Whether this process runs Triton kernels under the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return isinstance(paged_decode_stage1, InterpretedFunction)


def default_num_splits(batch: int, n_kv: int, max_context_len: int, block_n: int, device: torch.device) -> int:
    """Enough programs to fill a GPU (4 per SM) without splits shorter than a tile, bucketed to a power of two (one
    compilation per bucket, not per count); 2 under the interpreter (the merge is still exercised, and every program
    costs Python time)."""
    max_useful = triton.cdiv(max_context_len, block_n)
    if device.type != "cuda":
        return max(1, min(2, max_useful))
    programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return bucket_splits(min(max_useful, triton.cdiv(programs, batch * n_kv)))


def tile_width(head_dim: int, dtype: torch.dtype) -> int:
    """BLOCK_N: ``kernel_tuning``'s on a GPU; 16 under the interpreter (the least tl.dot takes: least padding)."""
    return 16 if is_interpreting() else kernel_tuning(head_dim, dtype).block_n


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, max_context_len: int, *, num_splits: int | None = None,
                           block_n: int | None = None, tile_fn: Any = attend_tile,
                           merge_fn: Any = merge_splits) -> torch.Tensor:
    """One new token per sequence, K/V read in place: q (B, n_heads, D) -> (B, n_heads, D).

    k_pool, v_pool: (num_blocks, block_size, n_kv, D); block_tables (B, W) int32 (entries past a sequence's blocks
    are never read); context_lens (B,) int32, each >= 1. ``tile_fn`` and ``merge_fn`` are the kernel's two
    device functions (a learner's, in notebook 11).
    """
    b, n_heads, d = q.shape
    _, block_size, n_kv, _ = k_pool.shape
    interpret = is_interpreting()
    if q.device.type != "cuda" and not interpret:
        raise RuntimeError(f"the Triton decode kernel got tensors on {q.device}: off a GPU it runs only under Triton's "
                           "interpreter, which is chosen when triton is first imported; set TRITON_INTERPRET=1 before "
                           "anything imports triton (restart the Python process or notebook kernel)")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("the Triton decode kernel addresses the pools as flat rows of slots: k_pool and v_pool must "
                         "be contiguous (num_blocks, block_size, n_kv_heads, head_dim) tensors")
    tuning = kernel_tuning(d, k_pool.dtype)
    block_n = block_n or tile_width(d, k_pool.dtype)
    splits = num_splits or default_num_splits(b, n_kv, max_context_len, block_n, q.device)
    group = n_heads // n_kv
    q = q.contiguous()
    mid_o = torch.empty(b, n_heads, splits, d, dtype=torch.float32, device=q.device)  # partial results
    mid_m = torch.empty(b, n_heads, splits, dtype=torch.float32, device=q.device)
    mid_l = torch.empty_like(mid_m)
    out = torch.empty_like(q)
    d_pad = max(16, triton.next_power_of_2(d))  # tl.dot needs every side >= 16; tl.arange a power of two
    group_pad = max(16, triton.next_power_of_2(group))
    with default_dot_precision(dot_precision(k_pool.dtype)):
        paged_decode_stage1[(b, n_kv, splits)](
            q, k_pool, v_pool, block_tables, context_lens, mid_o, mid_m, mid_l, d ** -0.5,
            q.stride(0), block_tables.stride(0), k_pool.stride(1),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_N=block_n,
            NUM_SPLITS=splits, ATTEND_TILE=device_function(tile_fn, "tile_fn"), num_warps=tuning.num_warps)
    merge = device_function(merge_fn, "merge_fn")
    paged_decode_stage2[(b, n_kv)](mid_o, mid_m, mid_l, out, out.stride(0), GROUP=group, GROUP_PAD=group_pad,
                                   HEAD_DIM=d, D_PAD=d_pad, NUM_SPLITS=splits,
                                   SPLITS_PAD=triton.next_power_of_2(splits), MERGE=merge)
    return out


@dataclass
class TritonDecodeBatch:
    """A step's decodes as the kernel reads them, built once per step for every layer."""

    block_tables: torch.Tensor  # (B, W) int32, each table padded with block 0 to the widest
    context_lens: torch.Tensor  # (B,) int32
    max_context_len: int


class TritonGraphDecode:
    """The Triton kernel in a CUDA-graph decode step (notebook 10's graphs, notebook 11's kernel): this step's K/V
    go into their slots, then both stages run over the bucket's tables with a split count fixed for the bucket (a
    graph replays one grid; the split count cannot follow the step's longest context). Padded rows read only the
    scratch block. ``backend`` is the ``TritonAttentionBackend`` (sub)class whose kernel parts run."""

    def __init__(self, backend: type[TritonAttentionBackend], pool: PagedKVPool, slot_mapping: torch.Tensor,
                 tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        self.backend, self.pool = backend, pool
        self.slot_mapping = slot_mapping  # (B,)
        self.tables = tables  # (B, W)
        self.context_lens = context_lens  # (B,)
        k_pool = pool.k[0]  # (num_blocks, block_size, n_kv, d)
        b, w = tables.shape
        self.max_context_len = w * pool.block_size  # the bucket's longest context
        self.num_splits = backend.num_splits or default_num_splits(
            b, k_pool.shape[2], self.max_context_len, tile_width(k_pool.shape[3], k_pool.dtype), k_pool.device)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (1, B, n_heads, d); k, v: (1, B, n_kv_heads, d)
        k_pool, v_pool = self.pool.k[layer_idx], self.pool.v[layer_idx]
        k_pool.flatten(0, 1)[self.slot_mapping] = k[0]
        v_pool.flatten(0, 1)[self.slot_mapping] = v[0]
        return paged_decode_attention(q[0], k_pool, v_pool, self.tables, self.context_lens, self.max_context_len,
                                      num_splits=self.num_splits, tile_fn=self.backend.tile_fn,
                                      merge_fn=self.backend.merge_fn)[None]


class TritonAttentionBackend(PagedAttentionBackend):
    """Attention backend ``"triton"``: each decode reads its blocks in place with the Triton split-KV kernel; prefill
    (chunks) go through the PyTorch path (``TorchAttentionBackend``). Notebook 11.

    On CUDA the kernel is compiled; on the CPU it runs under Triton's interpreter, which is for checking, not speed.
    A learner's kernel parts plug in as a subclass: ``class Mine(TritonAttentionBackend): tile_fn = my_tile``.
    """

    name = "triton"
    tile_fn: ClassVar[Any] = attend_tile  # the inner loop's body: one tile of the context
    merge_fn: ClassVar[Any] = merge_splits  # stage 2: the splits' partials -> the output
    num_splits: ClassVar[int | None] = None  # None: default_num_splits

    @classmethod
    def graph_decode(cls, pool: PagedKVPool, slot_mapping: torch.Tensor, tables: torch.Tensor,
                     context_lens: torch.Tensor) -> TritonGraphDecode:
        """CUDA-graph decode steps run this kernel too (captured per bucket), so graph and eager rows compare."""
        return TritonGraphDecode(cls, pool, slot_mapping, tables, context_lens)

    def __init__(self, pool: PagedKVPool, meta: PagedAttentionMetadata) -> None:
        super().__init__(pool, meta)
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
        prefill_rows = [i for i, n in enumerate(meta.query_lens) if n != 1]
        self.decode: TritonDecodeBatch | None = None
        self.prefill: TorchAttentionBackend | None = None
        self.decode_idx = self.prefill_idx = None  # token indices of each kind, when a step mixes them
        if decode_rows and prefill_rows:
            prefill_tokens = [t for i in prefill_rows for t in range(starts[i], starts[i + 1])]
            self.decode_idx, self.prefill_idx = split_host_ints([[starts[i] for i in decode_rows], prefill_tokens],
                                                                pool.device)
        if decode_rows:
            lens = [meta.context_lens[i] for i in decode_rows]
            width = max(-(-c // pool.block_size) for c in lens)
            tables = [meta.block_tables[i][:width] + [0] * (width - len(meta.block_tables[i][:width]))
                      for i in decode_rows]
            host = torch.tensor([t + [c] for t, c in zip(tables, lens)], dtype=torch.int32)  # (B, W + 1): one copy
            both = host_to_device(host, pool.device)
            self.decode = TritonDecodeBatch(both[:, :width], both[:, width].contiguous(), max(lens))
        if prefill_rows:
            sub = meta if self.prefill_idx is None else PagedAttentionMetadata(
                [meta.query_lens[i] for i in prefill_rows], [meta.context_lens[i] for i in prefill_rows],
                [meta.block_tables[i] for i in prefill_rows], meta.slot_mapping[self.prefill_idx])
            self.prefill = TorchAttentionBackend(pool, sub)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (1, N, n_heads, d); k, v: (1, N, n_kv_heads, d)
        if self.decode is None:  # prefills only
            assert self.prefill is not None
            return self.prefill.attend(layer_idx, q, k, v)
        if self.prefill is None:  # decodes only: the common step
            return self._attend_decodes(layer_idx, q[0], k[0], v[0], self.meta.slot_mapping)[None]
        assert self.decode_idx is not None and self.prefill_idx is not None
        out = torch.empty_like(q)  # (1, N, n_heads, d)
        d = self.decode_idx
        out[0, d] = self._attend_decodes(layer_idx, q[0, d], k[0, d], v[0, d], self.meta.slot_mapping[d])
        p = self.prefill_idx
        out[:, p] = self.prefill.attend(layer_idx, q[:, p], k[:, p], v[:, p])
        return out

    def _attend_decodes(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
        # q: (B, n_heads, d); k, v: (B, n_kv_heads, d) -- one new token per sequence
        assert self.decode is not None
        k_pool, v_pool = self.pool.k[layer_idx], self.pool.v[layer_idx]
        k_pool.flatten(0, 1)[slots] = k  # write the new K/V into their slots, then attend
        v_pool.flatten(0, 1)[slots] = v
        cls = type(self)
        return paged_decode_attention(q, k_pool, v_pool, self.decode.block_tables, self.decode.context_lens,
                                      self.decode.max_context_len, num_splits=cls.num_splits, tile_fn=cls.tile_fn,
                                      merge_fn=cls.merge_fn)
