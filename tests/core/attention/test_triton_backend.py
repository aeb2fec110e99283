"""The ``"triton"`` attention backend: on a mixed step it writes and attends exactly as the PyTorch backend does; the
engines give transformers' greedy tokens with it (kernel under Triton's interpreter); the kernel compiles ahead of
time for sm_80 and sm_90 with no GPU; without the triton package, labkit works and says why "triton" is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# labkit's Triton module first: on a machine without a GPU it chooses Triton's interpreter, which must happen
# before triton itself is imported.
pytest.importorskip("labkit.core.attention.triton_decode")

from labkit import ATTENTION_BACKENDS, LLM, SamplingParams  # noqa: E402
from labkit.core.attention import PagedAttentionMetadata, TorchAttentionBackend, resolve_attention_backend  # noqa: E402
from labkit.core.attention.triton_decode import TritonAttentionBackend  # noqa: E402
from labkit.core.kv.paged_pool import PagedKVPool  # noqa: E402
from labkit.core.model.config import ModelConfig  # noqa: E402
from labkit.course.oracle import transformers_greedy  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


def test_registered_by_name_and_never_the_default() -> None:
    from labkit.core.engine.config import PagedConfig

    assert ATTENTION_BACKENDS["triton"] is TritonAttentionBackend
    assert PagedConfig().attention_backend == "auto"  # "cpp" on a CPU where it builds; "torch" on CUDA until measured
    for device in ("cuda", "mps"):
        assert resolve_attention_backend("auto", device, torch.float16) is TorchAttentionBackend


@pytest.mark.parametrize("query_lens,context_lens", [
    ([1, 3, 1, 5], [9, 12, 1, 5]),  # decodes beside a prefill chunk on a cache and a whole prompt
    ([1, 1, 1], [17, 4, 33]),  # decodes only
    ([4, 6], [10, 6]),  # prefills only
])
def test_a_step_equals_the_torch_backend(query_lens: list[int], context_lens: list[int]) -> None:
    config = ModelConfig(model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(len(query_lens))
    pools = []
    for _ in range(2):
        pool = PagedKVPool(config, 24, 4, torch.device("cpu"), torch.float32)
        pools.append(pool)
    for t in pools[0].k + pools[0].v:
        t.copy_(torch.randn(t.shape, generator=gen))
    for mine, theirs in zip(pools[1].k + pools[1].v, pools[0].k + pools[0].v):
        mine.copy_(theirs)
    free = list(range(24))[::-1]
    tables = [[free.pop() for _ in range(-(-c // 4))] for c in context_lens]
    slots = [t[p // 4] * 4 + p % 4 for n, c, t in zip(query_lens, context_lens, tables) for p in range(c - n, c)]
    meta = PagedAttentionMetadata(query_lens, context_lens, tables, torch.tensor(slots))
    n = len(slots)
    q = torch.randn(1, n, 8, 32, generator=gen)
    k, v = torch.randn(1, n, 2, 32, generator=gen), torch.randn(1, n, 2, 32, generator=gen)
    want = TorchAttentionBackend(pools[0], meta).attend(1, q, k, v)
    got = TritonAttentionBackend(pools[1], meta).attend(1, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pools[1].k[1], pools[0].k[1]) and torch.equal(pools[1].v[1], pools[0].v[1])
    assert torch.equal(pools[1].k[0], pools[0].k[0])  # layer 0 untouched


PROMPTS = ["Once upon a time", "The dog ran to the park and", "One day, Lily went"]


@pytest.mark.parametrize("engine,options", [
    ("chunked", dict(max_num_batched_tokens=8, block_size=8)),  # chunks beside decodes
    ("continuous", dict(max_num_seqs=3, num_gpu_blocks=9, block_size=4, enable_prefix_caching=True)),  # preemption
])
def test_engine_tokens_equal_transformers(engine: str, options: dict, bundled_path: Path, tokenizer) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    llm = LLM(str(bundled_path), engine=engine, device="cpu", attention_backend="triton", **options)
    assert llm.engine.runner.attention_backend is TritonAttentionBackend
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == transformers_greedy(bundled_path, prompts, 8)


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def test_without_triton_labkit_works_and_says_why_triton_is_missing() -> None:
    """As on macOS (no triton wheel): importing triton fails; "torch" still runs, "triton" gets a clear error."""
    result = run_python(
        "import sys; sys.modules['triton'] = None\n"  # every `import triton` now raises ImportError
        "from labkit import LLM, SamplingParams, ATTENTION_BACKENDS\n"
        "assert sorted(ATTENTION_BACKENDS) == ['cpp', 'torch'], ATTENTION_BACKENDS\n"
        "llm = LLM(engine='continuous', device='cpu')\n"
        "out = llm.generate(['Once upon'], SamplingParams(max_tokens=3), use_tqdm=False)[0]\n"
        "print(len(out.outputs[0].token_ids))\n"
        "try:\n"
        "    LLM(engine='continuous', device='cpu', attention_backend='triton')\n"
        "except ValueError as e:\n"
        "    print(e)\n")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0] == "3"
    assert "attention_backend 'triton' needs the triton package" in lines[1] and "Linux" in lines[1]
    assert "registered backends: torch, cpp" in lines[1]


AOT = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from labkit.core.attention import triton_kernels as K

assert not triton.knobs.runtime.interpret
types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", table_ptr="*i32", lens_ptr="*i32", mid_o="*fp32",
             mid_m="*fp32", mid_l="*fp32", out_ptr="*bf16", scale="fp32", stride_q_seq="i32", stride_table="i32",
             stride_slot="i32", stride_out_seq="i32")
constants = dict(GROUP=7, GROUP_PAD=16, HEAD_DIM=64, D_PAD=64, BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=8, SPLITS_PAD=8,
                 ATTEND_TILE=triton.jit(K.attend_tile), MERGE=triton.jit(K.merge_splits))
report = {}
for arch in (80, 90):
    for fn in (K.paged_decode_stage1, K.paged_decode_stage2):
        const = {name: constants[name] for name in fn.arg_names if name in constants}
        signature = {name: "constexpr" if name in const else types[name] for name in fn.arg_names}
        compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=const),
                                  target=GPUTarget("cuda", arch, 32))
        report[f"{fn.__name__}@sm_{arch}"] = dict(cubin=len(compiled.asm["cubin"]),
                                                  target=f".target sm_{arch}" in compiled.asm["ptx"])
print(json.dumps(report))
"""


def test_compiles_ahead_of_time_for_sm80_and_sm90() -> None:
    """bfloat16, Qwen2.5-0.5B's shape (GQA group 7, head_dim 64), compiled to PTX and, with the ptxas the triton wheel
    ships, to a cubin: no GPU and no driver needed. A fresh process: this one runs Triton's interpreter."""
    result = run_python(AOT, TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(report) == ["paged_decode_stage1@sm_80", "paged_decode_stage1@sm_90",
                              "paged_decode_stage2@sm_80", "paged_decode_stage2@sm_90"]
    assert all(r["cubin"] > 1000 and r["target"] for r in report.values()), report
