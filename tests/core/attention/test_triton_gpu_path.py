"""The Triton decode kernel's GPU path, checked on the CPU: the dot precision it compiles with (Triton's interpreter,
with TF32 rounding emulated as a GPU's tensor cores do it), the split count bucketed to powers of two (CUDA device
properties mocked), the launch per head_dim without register spills on sm_90 (ptxas from the triton wheel, ahead of
time), and CUDA-graph decode steps that capture the kernel itself (capture mocked) with transformers' tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from paged_tables import shuffled_tables

pytest.importorskip("labkit.core.attention.triton_decode")  # first: it chooses Triton's interpreter off a GPU

import labkit.core.attention.triton_decode as triton_decode  # noqa: E402
import labkit.core.engine.cuda_graphs as cuda_graphs  # noqa: E402
import labkit.core.engine.model_runner as model_runner  # noqa: E402
from labkit import LLM, SamplingParams  # noqa: E402
from labkit.core.attention.metadata import captures_own_decode  # noqa: E402
from labkit.core.attention.torch_sdpa import TorchAttentionBackend  # noqa: E402
from labkit.core.attention.triton_decode import (  # noqa: E402
    MAX_SPLITS,
    TritonAttentionBackend,
    TritonGraphDecode,
    bucket_splits,
    default_num_splits,
    dot_precision,
    is_interpreting,
    kernel_tuning,
    paged_decode_attention,
)
from labkit.core.engine.config import PagedConfig  # noqa: E402
from labkit.course.oracle import transformers_greedy  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def make_case(context_lens: list[int], dtype: torch.dtype, seed: int, group: int = 4, d: int = 32, block_size: int = 8,
              n_kv: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """q and pools of random values at notebook 11's scales (K ~ 2 N(0, 1), V ~ 3 N(0, 1)), shuffled tables."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    k_pool = (torch.randn(num_blocks, block_size, n_kv, d, generator=gen) * 2).to(dtype)
    v_pool = (torch.randn(num_blocks, block_size, n_kv, d, generator=gen) * 3).to(dtype)
    tables = shuffled_tables(num_blocks, block_size, context_lens, gen)
    return torch.randn(len(context_lens), group * n_kv, d, generator=gen).to(dtype), k_pool, v_pool, tables


def reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]],
              context_lens: list[int]) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in float64 over each sequence's context, query head h on KV head h // group."""
    group = q.shape[1] // k_pool.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (table, ctx) in enumerate(zip(tables, context_lens)):
        keys = k_pool[table].flatten(0, 1)[:ctx].double()  # (ctx, n_kv, d)
        values = v_pool[table].flatten(0, 1)[:ctx].double()
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[i, h].double() / q.shape[-1] ** 0.5  # (ctx,)
            out[i, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


def tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest TF32 value (10 mantissa bits, round to nearest even), still stored as float32."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return rounded.view(np.float32)


@pytest.fixture
def dots(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every tl.dot's input precision under the interpreter, and round its inputs to TF32 when that is the
    precision, as a GPU does (the interpreter itself computes every dot in full float32)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    original = builder.create_dot
    seen: list[str] = []

    def create_dot(a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        name = str(input_precision).rsplit(".", 1)[-1].lower()
        seen.append(name)
        if name == "tf32" and a.data.dtype == np.float32:
            a = interpreter.TensorHandle(tf32(a.data), a.dtype.scalar)
            b = interpreter.TensorHandle(tf32(b.data), b.dtype.scalar)
        return original(a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "create_dot", create_dot)
    return seen


def run(dtype: torch.dtype, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on a float32 or bfloat16 case (notebook 11's scale: V ~ 3 x N(0, 1)) and the float64 reference."""
    context_lens = [45, 30]
    q, k_pool, v_pool, tables = make_case(context_lens, dtype, seed)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = paged_decode_attention(q, k_pool, v_pool, padded, torch.tensor(context_lens, dtype=torch.int32),
                                 max(context_lens), num_splits=2)
    return out.double(), reference(q, k_pool, v_pool, tables, context_lens)


def test_a_float32_pool_dots_in_ieee_and_a_16_bit_pool_in_tf32(dots: list[str]) -> None:
    assert is_interpreting()
    assert dot_precision(torch.float32) == "ieee" and dot_precision(torch.bfloat16) == "tf32"
    out, want = run(torch.float32)
    assert dots and set(dots) == {"ieee"}
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)  # notebook 11's float32 tolerance, with TF32 emulated
    dots.clear()
    out, want = run(torch.bfloat16)
    assert dots and set(dots) == {"tf32"}  # q @ K^T exact in TF32; p @ V rounded below bfloat16's own step
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)


def test_tf32_on_a_float32_pool_would_fail_notebook_11s_tolerance(dots: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug: Triton's default precision (TF32) on a float32 pool, as before this fix."""
    monkeypatch.setattr(triton_decode, "dot_precision", lambda dtype: "tf32")
    out, want = run(torch.float32)
    assert set(dots) == {"tf32"}
    assert float((out - want).abs().max()) > 1e-4


def test_split_counts_are_powers_of_two(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [bucket_splits(n) for n in (0, 1, 2, 3, 5, 8, 9, 31, 32, 33, 1000)] == [1, 1, 2, 2, 4, 8, 8, 16, 32, 32,
                                                                                   32]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda")  # an H100 / H200 has 132 SMs: 528 programs fill it
    counts = {default_num_splits(b, 8, c, 64, cuda) for b in range(1, 65) for c in range(1, 8193, 97)}
    assert counts <= {1 << i for i in range(MAX_SPLITS.bit_length())}
    assert default_num_splits(1, 8, 4096, 64, cuda) == 32 and default_num_splits(3, 8, 4096, 64, cuda) == 16
    assert default_num_splits(1, 8, 100, 64, cuda) == 2  # never more splits than tiles


def test_tuning_per_head_dim() -> None:
    assert kernel_tuning(64, torch.bfloat16).num_warps == 4
    assert kernel_tuning(128, torch.bfloat16).num_warps == 8  # 4 warps spill at head_dim 128
    assert kernel_tuning(128, torch.float32).block_n < kernel_tuning(128, torch.bfloat16).block_n


def test_no_register_spills_on_sm90_at_head_dim_64_and_128() -> None:
    """Both stages compiled ahead of time for sm_90 as a GPU launch compiles them (tile, warps, dot precision);
    ``ptxas -v`` (shipped in the triton wheel) reports the registers and spills. A fresh process: this one
    interprets."""
    done = subprocess.run([sys.executable, "-m", "labkit.core.attention.triton_aot"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert {(r["kernel"], r["head_dim"], r["dtype"]) for r in rows} == {
        (k, d, t) for k in ("paged_decode_stage1", "paged_decode_stage2") for d in (64, 128)
        for t in ("bfloat16", "float32")}
    assert all(r["arch"] == 90 and 0 < r["registers"] <= 255 for r in rows), rows
    assert not [r for r in rows if r["spills"]], rows
    stage1 = {(r["head_dim"], r["dtype"]): r for r in rows if r["kernel"] == "paged_decode_stage1"}
    assert stage1[(128, "bfloat16")]["num_warps"] == 8
    assert stage1[(64, "bfloat16")]["tf32_mma"] and not stage1[(64, "float32")]["tf32_mma"]  # IEEE: no TF32 MMA


class FakeGraph:
    """torch.cuda.CUDAGraph's stand-in: replay() reruns the captured forward pass into the static output."""

    def __init__(self, forward: Callable[[], torch.Tensor], output: torch.Tensor) -> None:
        self.forward, self.output = forward, output

    def replay(self) -> None:
        self.output.copy_(self.forward())


def test_cuda_graphs_capture_the_triton_kernel(monkeypatch: pytest.MonkeyPatch, bundled_path: Path,
                                               tokenizer: Any) -> None:  # type: ignore[no-untyped-def]
    """With "triton", graph decode steps run the Triton kernel (not labkit's PyTorch path) with one split count per
    bucket, and the tokens are transformers' greedy ones; a learner's backend without a graph_decode of its own
    still runs eagerly."""
    launches: list[tuple[int, int | None]] = []
    real = triton_decode.paged_decode_attention

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        launches.append((q.shape[0], kwargs.get("num_splits")))
        return real(q, *args, **kwargs)

    def fake_capture(forward: Callable[[], torch.Tensor], state: object) -> tuple[FakeGraph, torch.Tensor, object]:
        output = forward()
        return FakeGraph(forward, output), output, state or "pool"

    monkeypatch.setattr(triton_decode, "paged_decode_attention", spy)
    monkeypatch.setattr(cuda_graphs, "capture_cuda_graph", fake_capture)
    monkeypatch.setattr(model_runner, "capture_supported", lambda device: True)
    monkeypatch.setattr(PagedConfig, "use_cuda_graphs", lambda self, device_type: True)
    assert captures_own_decode(TritonAttentionBackend) and not captures_own_decode(TorchAttentionBackend)
    prompts = [tokenizer.encode(p) for p in ("Once upon a time", "The dog ran to the park and")]
    with LLM(str(bundled_path), engine="continuous", device="cpu", attention_backend="triton", max_num_seqs=2,
             max_model_len=48, block_size=16, num_gpu_blocks=8) as llm:
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.num_captures == 2 * 3  # sizes (1, 2) x widths (1, 2, 4)
        launches.clear()
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
        assert graphs.num_runs > 0
        built = TritonGraphDecode(TritonAttentionBackend, llm.engine.pool, torch.zeros(2, dtype=torch.long),
                                  torch.zeros(2, 4, dtype=torch.long), torch.ones(2, dtype=torch.long))
        assert built.max_context_len == 4 * 16 and built.num_splits == 2  # the interpreter's two splits, per bucket
    assert [o.outputs[0].token_ids for o in outs] == transformers_greedy(bundled_path, prompts, 6)
    assert launches and all(splits is not None for _, splits in launches)  # every decode in a graph: fixed splits
    assert not captures_own_decode(type("Mine", (TorchAttentionBackend,), {}))
    assert captures_own_decode(type("Learners", (TritonAttentionBackend,), {}))  # a learner's kernel parts, captured
