"""The ``"cpp"`` attention backend: the compiled kernel equals the split decode attention and plain SDPA; every engine
gives transformers' greedy tokens with it, mixed steps and prefix caching included, and frees every block; without a
compiler, or when the build fails, it warns once and runs the PyTorch path, never raising.

The kernel compiles once per machine (about a minute on 2 cores) into the user's cache; these tests reuse that build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from paged_tables import shuffled_tables

from labkit import ATTENTION_BACKENDS, LLM, SamplingParams
from labkit.core.attention import PagedAttentionMetadata, TorchAttentionBackend, cpp_decode, resolve_attention_backend
from labkit.core.attention.cpp_decode import CppAttentionBackend
from labkit.core.attention.decode import split_decode_attention, split_decode_blocks
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model.config import ModelConfig
from labkit.course.oracle import transformers_greedy
from labkit.measure.corpus import long_text

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    module = cpp_decode.load_extension()  # compiles on the first run on this machine
    assert module is not None, f"the C++ kernel should build here (g++, ninja): {cpp_decode.cpp_missing()}"
    return module


def test_registered_by_name_and_builds_nothing_on_import() -> None:
    assert ATTENTION_BACKENDS["cpp"] is CppAttentionBackend
    result = run_python("import labkit, labkit.core.attention, sys\n"
                        "from labkit.core.attention import cpp_decode\n"
                        "print(cpp_decode.load_result.cache_info().currsize)\n",
                        LABKIT_EXTENSIONS_DIR="/nonexistent/never-created")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0" and "compiling" not in result.stdout


def random_pool(block_size: int, n_kv: int, d: int, dtype: torch.dtype, context_lens: list[int],
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """K/V pools of random values, and a table per sequence of shuffled (not consecutive) blocks."""
    need = sum(-(-c // block_size) for c in context_lens)
    num_blocks = need + 5
    k_pool = torch.randn(num_blocks, block_size, n_kv, d, generator=gen, dtype=dtype)
    v_pool = torch.randn(num_blocks, block_size, n_kv, d, generator=gen, dtype=dtype)
    return k_pool, v_pool, shuffled_tables(num_blocks, block_size, context_lens, gen)


def sdpa_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]],
                   context_lens: list[int]) -> torch.Tensor:
    """Each sequence on its own: gather its context, repeat the KV heads for GQA, PyTorch's SDPA."""
    outs = []
    group = q.shape[1] // k_pool.shape[2]
    for i, (table, ctx) in enumerate(zip(tables, context_lens)):
        keys = k_pool[table].flatten(0, 1)[:ctx].transpose(0, 1).repeat_interleave(group, 0)  # (n_heads, ctx, d)
        values = v_pool[table].flatten(0, 1)[:ctx].transpose(0, 1).repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(q[i][:, None], keys, values)[:, 0])  # (n_heads, d)
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_equals_split_decode_and_sdpa(kernel: ModuleType, dtype: torch.dtype, group: int, block_size: int,
                                            index_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(group * 100 + block_size)
    n_kv, d = 2, 32
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, 700]  # one token, a block, a block + 1, long
    k_pool, v_pool, tables = random_pool(block_size, n_kv, d, dtype, lens, gen)
    q = torch.randn(len(lens), n_kv * group, d, generator=gen, dtype=dtype)  # (B, n_heads, d)
    width = max(len(t) for t in tables) + 2  # wider than needed: columns past a context are never read
    padded = torch.tensor([t + [10**6] * (width - len(t)) for t in tables], dtype=index_dtype)  # junk ids past the end
    got = cpp_decode.paged_decode_attention(q, k_pool, v_pool, padded, torch.tensor(lens, dtype=index_dtype))
    splits = cpp_decode.decode_splits(len(lens) * n_kv, torch.get_num_threads(), width)
    one_thread = cpp_decode.paged_decode_attention(q, k_pool, v_pool, padded, torch.tensor(lens, dtype=index_dtype),
                                                   parallel=False, num_splits=splits)
    torch.testing.assert_close(one_thread, got, rtol=0, atol=0)  # each task's arithmetic is the same on any thread
    split = split_decode_attention(q, k_pool, v_pool, split_decode_blocks(tables, lens, block_size, n_kv, dtype,
                                                                          q.device))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, split, **tol)
    torch.testing.assert_close(got, sdpa_reference(q, k_pool, v_pool, tables, lens), **tol)
    # the one-token sequence attends to its single value: the output is that value, exactly
    torch.testing.assert_close(got[0], v_pool[tables[0][0], 0].repeat_interleave(group, 0), rtol=0, atol=0)


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float32, 24), (torch.float64, 64)])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 40])  # 40: more splits than any sequence has blocks
def test_splits_merge_to_the_same_attention(kernel: ModuleType, dtype: torch.dtype, d: int, num_splits: int) -> None:
    """A sequence's blocks cut into runs, each run's (m, l, o) merged by the log-sum-exp rule: the same output as
    one run (and SDPA), on a thread team and on one thread alike; a split without blocks counts for nothing. float32
    with head_dim 64 runs the 16-lane path where the CPU has AVX-512, head_dim 24 the plain loops."""
    gen = torch.Generator().manual_seed(num_splits)
    block_size, n_kv, group = 16, 3, 3  # smollm2-135m's attention shape (head_dim 64)
    lens = [1, 17, 300, 64]
    k_pool, v_pool, tables = random_pool(block_size, n_kv, d, dtype, lens, gen)
    q = torch.randn(len(lens), n_kv * group, d, generator=gen, dtype=dtype)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    got = cpp_decode.paged_decode_attention(q, k_pool, v_pool, padded, ctx, num_splits=num_splits)
    one_thread = cpp_decode.paged_decode_attention(q, k_pool, v_pool, padded, ctx, parallel=False,
                                                   num_splits=num_splits)
    torch.testing.assert_close(one_thread, got, rtol=0, atol=0)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, sdpa_reference(q, k_pool, v_pool, tables, lens), **tol)
    whole = cpp_decode.paged_decode_attention(q, k_pool, v_pool, padded, ctx, num_splits=1)
    torch.testing.assert_close(got, whole, **tol)


@pytest.mark.parametrize("d", [64, 128, 48])
@pytest.mark.parametrize("block_size", [8, 16, 24, 32])
def test_sixteen_lane_paths_for_every_block_shape(kernel: ModuleType, d: int, block_size: int) -> None:
    """float32 blocks on 16-lane vectors: head_dim 64 and 128 take the register-blocked score and p . V loops
    (qk16, pv_chunks) on whole runs of 16 rows, the generic vector loops on shorter runs (block sizes 8 and 24, a
    context's last rows); 48 takes the generic loops throughout. Each equals SDPA on the same context."""
    gen = torch.Generator().manual_seed(d * 100 + block_size)
    n_kv, group = 2, 3
    lens = [1, 15, 16, 17, block_size * 5 + 3, 200]
    k_pool, v_pool, tables = random_pool(block_size, n_kv, d, torch.float32, lens, gen)
    q = torch.randn(len(lens), n_kv * group, d, generator=gen)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    for num_splits in (1, 2):
        got = cpp_decode.paged_decode_attention(q, k_pool, v_pool, padded, ctx, num_splits=num_splits)
        torch.testing.assert_close(got, sdpa_reference(q, k_pool, v_pool, tables, lens), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tasks,threads,max_blocks,want", [
    (3, 2, 19, 2),  # batch 1, 3 KV heads, 2 threads: 6 tasks, 3 each instead of 2 and 1
    (2, 2, 19, 1),  # already even
    (1, 2, 19, 2),  # one KV head: two halves
    (5, 4, 64, 4),  # 20 tasks: 5 each
    (3, 2, 7, 1),  # a short context: splits of fewer than MIN_SPLIT_BLOCKS blocks cost more than they save
    (3, 1, 19, 1),  # one thread
    (16, 2, 19, 1),  # a batch balances without splits
])
def test_decode_splits_share_the_tasks_evenly(tasks: int, threads: int, max_blocks: int, want: int) -> None:
    assert cpp_decode.decode_splits(tasks, threads, max_blocks) == want


def test_write_kv_equals_indexed_assignment_and_checks_slots(kernel: ModuleType) -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        k_pool, v_pool = torch.zeros(6, 4, 2, 8, dtype=dtype), torch.zeros(6, 4, 2, 8, dtype=dtype)
        merged = torch.randn(8, 3, 2, 8, generator=gen, dtype=dtype)  # (tokens, [q, k, v], n_kv, d)
        k, v = merged[:5, 1], merged[:5, 2]  # strided views, as a merged q/k/v output's
        slots = torch.tensor([3, 0, 23, 9, 10])
        kernel.write_kv(k_pool, v_pool, k, v, slots)
        want_k, want_v = torch.zeros_like(k_pool), torch.zeros_like(v_pool)
        want_k.flatten(0, 1)[slots] = k
        want_v.flatten(0, 1)[slots] = v
        assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    pool = torch.zeros(6, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\] = 24 is outside the pool's 24 slots"):
        kernel.write_kv(pool, pool.clone(), torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), torch.tensor([0, 24]))
    with pytest.raises(RuntimeError, match="slot_mapping must be a contiguous"):
        kernel.write_kv(pool, pool.clone(), torch.zeros(1, 2, 8), torch.zeros(1, 2, 8),
                        torch.tensor([0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="same dtype"):
        kernel.write_kv(pool, pool.clone(), torch.zeros(1, 2, 8, dtype=torch.float64), torch.zeros(1, 2, 8),
                        torch.tensor([0]))
    with pytest.raises(RuntimeError, match="with the pool's n_kv_heads 2 and d 8"):
        kernel.write_kv(pool, pool.clone(), torch.zeros(1, 3, 8), torch.zeros(1, 3, 8), torch.tensor([0]))
    assert not pool.any()  # nothing written by a rejected call


def test_kernel_rejects_a_table_that_does_not_fit(kernel: ModuleType) -> None:
    q, pool = torch.randn(1, 4, 8), torch.randn(3, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"block_tables\[0, 1\] = 7 is outside the pool's 3 blocks"):
        kernel.paged_decode(q, pool, pool, torch.tensor([[0, 7]]), torch.tensor([6]), 1.0, 1, 1)
    with pytest.raises(RuntimeError, match="context_lens\\[0\\] = 9 needs 3 blocks of 4 but block_tables has 2"):
        kernel.paged_decode(q, pool, pool, torch.tensor([[0, 1]]), torch.tensor([9]), 1.0, 1, 1)
    with pytest.raises(RuntimeError, match="grain_size must be at least 1, got 0"):
        kernel.paged_decode(q, pool, pool, torch.tensor([[0]]), torch.tensor([1]), 1.0, 0, 1)
    with pytest.raises(RuntimeError, match="num_splits must be between 1 and 1024, got 0"):
        kernel.paged_decode(q, pool, pool, torch.tensor([[0]]), torch.tensor([1]), 1.0, 1, 0)
    with pytest.raises(RuntimeError, match="float32 or float64"):
        kernel.paged_decode(q.half(), pool.half(), pool.half(), torch.tensor([[0]]), torch.tensor([1]), 1.0, 1, 1)


def test_kernel_rejects_an_empty_block_or_no_kv_heads(kernel: ModuleType) -> None:
    """Both were integer divisions by zero inside the kernel's checks: SIGFPE, the whole process killed."""
    q, table, lens = torch.randn(1, 4, 8), torch.tensor([[0]]), torch.tensor([1])
    for pool in (torch.randn(3, 0, 2, 8), torch.randn(3, 4, 0, 8)):  # block_size 0; n_kv_heads 0
        with pytest.raises(RuntimeError, match="the pools need block_size >= 1 and n_kv_heads >= 1"):
            kernel.paged_decode(q, pool, pool, table, lens, 1.0, 1, 1)


@pytest.mark.parametrize("query_lens,context_lens", [
    ([1, 3, 1, 5], [9, 12, 1, 5]),  # decodes beside a prefill chunk on a cache and a whole prompt
    ([1, 1, 1], [17, 4, 33]),  # decodes only, ragged
    ([1, 1], [8, 8]),  # equal lengths (the torch backend's one-gather case)
])
def test_a_step_equals_the_torch_backend(kernel: ModuleType, query_lens: list[int], context_lens: list[int]) -> None:
    config = ModelConfig(model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    gen = torch.Generator().manual_seed(len(query_lens))
    pools = [PagedKVPool(config, 24, 4, torch.device("cpu"), torch.float32) for _ in range(2)]
    for mine, theirs in zip(pools[1].k + pools[1].v, pools[0].k + pools[0].v):
        theirs.copy_(torch.randn(theirs.shape, generator=gen))
        mine.copy_(theirs)
    free = list(range(24))[::-1]
    tables = [[free.pop() for _ in range(-(-c // 4))] for c in context_lens]
    slots = [t[p // 4] * 4 + p % 4 for n, c, t in zip(query_lens, context_lens, tables) for p in range(c - n, c)]
    meta = PagedAttentionMetadata(query_lens, context_lens, tables, torch.tensor(slots))
    q = torch.randn(1, len(slots), 8, 32, generator=gen)
    k, v = torch.randn(1, len(slots), 2, 32, generator=gen), torch.randn(1, len(slots), 2, 32, generator=gen)
    want = TorchAttentionBackend(pools[0], meta).attend(1, q, k, v)
    backend = CppAttentionBackend(pools[1], meta)
    assert backend.cpp_decode is not None  # the kernel, not the fallback, serves the decodes
    assert backend.writes_kv == all(n == 1 for n in query_lens)  # a decode-only step writes K/V in C++ too
    torch.testing.assert_close(backend.attend(1, q, k, v), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pools[1].k[1], pools[0].k[1]) and torch.equal(pools[1].v[1], pools[0].v[1])


def test_a_dtype_the_kernel_lacks_takes_the_pytorch_path(kernel: ModuleType) -> None:
    config = ModelConfig(model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    pool = PagedKVPool(config, 4, 4, torch.device("cpu"), torch.bfloat16)
    meta = PagedAttentionMetadata([1], [3], [[2]], torch.tensor([10]))
    cpp_decode.fallback_warning.cache_clear()
    with pytest.warns(RuntimeWarning, match="takes float32 or float64, this pool holds torch.bfloat16: attention_"
                                            "backend 'cpp' falls back to the PyTorch path 'torch'"):
        backend = CppAttentionBackend(pool, meta)
    assert backend.cpp_decode is None
    q, kv = torch.randn(1, 1, 4, 16).bfloat16(), torch.randn(1, 1, 2, 16).bfloat16()
    want = TorchAttentionBackend(pool, meta).attend(0, q, kv, kv)
    assert torch.equal(backend.attend(0, q, kv, kv), want)


PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """A shared system prompt (prefix caching hits) and suffixes of different lengths (ragged contexts)."""
    system = tokenizer.encode(long_text(40, seed=3))
    tails = ["The cat", "A dog ran to the park and saw", "Then Lily said", long_text(25, seed=4)]
    return [system + tokenizer.encode(t) for t in tails]


@pytest.fixture(scope="module")
def reference(bundled_path: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(bundled_path, prompts, PARAMS.max_tokens)


@pytest.mark.parametrize("engine,options", [
    ("paged", dict(block_size=8, max_num_seqs=4)),
    ("continuous", dict(block_size=8, max_num_seqs=2, enable_prefix_caching=True)),  # admissions beside decodes
    ("chunked", dict(block_size=8, max_num_batched_tokens=24, enable_prefix_caching=True)),  # chunks beside decodes
])
def test_engine_tokens_equal_transformers(kernel: ModuleType, engine: str, options: dict, bundled_path: Path,
                                          prompts: list[list[int]], reference: list[list[int]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[tuple[bool, bool]] = []  # per decode call: (the step also had prefills, the kernel ran)
    original = CppAttentionBackend._attend_decodes

    def recording(self: CppAttentionBackend, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor
                  ) -> torch.Tensor:
        steps.append((bool(self.prefills), self.cpp_decode is not None))
        return original(self, q, k_pool, v_pool)

    monkeypatch.setattr(CppAttentionBackend, "_attend_decodes", recording)
    llm = LLM(str(bundled_path), engine=engine, device="cpu", attention_backend="cpp", **options)
    assert llm.engine.runner.attention_backend is CppAttentionBackend
    first = llm.generate(prompts[:1], PARAMS, use_tqdm=False)  # fills the prefix cache where it is on
    lengths = [10, 3, 6]  # one finishes early: the next prompt is admitted beside running decodes
    rest = llm.generate(prompts[1:], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths],
                        use_tqdm=False)
    want = reference[:1] + [r[:n] for r, n in zip(reference[1:], lengths)]
    assert [o.outputs[0].token_ids for o in first + rest] == want
    assert steps and all(ran for _, ran in steps)
    if engine != "paged":  # static batching never mixes; the others put prefills beside decodes
        assert any(mixed for mixed, _ in steps)
    if options.get("enable_prefix_caching"):
        assert all(o.num_cached_tokens > 0 for o in rest)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # no KV block leaked


FALLBACK = """
import json, os, sys, warnings
from pathlib import Path
warnings.simplefilter("always")  # a repeated warning would show: "once" must come from labkit itself
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from labkit import LLM, SamplingParams
    from labkit.core.attention import cpp_decode
    if len(sys.argv) > 3:
        cpp_decode.SOURCE = Path(sys.argv[3])
    prompts = json.loads(sys.argv[2])
    params = SamplingParams(max_tokens=int(sys.argv[1]), temperature=0, ignore_eos=True)
    outs, ran = [], []
    backend = dict(attention_backend="cpp") if os.environ.get("TEST_BACKEND") != "auto" else {}  # else the default
    for engine, options in (("continuous", {}), ("chunked", dict(max_num_batched_tokens=24))):
        llm = LLM(engine=engine, device="cpu", block_size=8, **backend, **options)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        ran.append(llm.engine.runner.attention_backend.__name__)
ours = [str(w.message) for w in caught if "attention_backend 'cpp'" in str(w.message)]
print(json.dumps(dict(outs=outs, warnings=ours, missing=cpp_decode.cpp_missing(), ran=ran)))
"""


def run_python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


def run_fallback(prompts: list[list[int]], *args: str, **env: str) -> tuple[dict, str]:
    result = run_python(FALLBACK, str(PARAMS.max_tokens), json.dumps(prompts), *args, **env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stdout


def test_without_a_compiler_it_warns_once_and_runs_the_pytorch_path(tmp_path: Path, prompts: list[list[int]],
                                                                    reference: list[list[int]]) -> None:
    """A machine with no C++ compiler and no earlier build: nothing compiles, one warning, transformers' tokens."""
    build_root = tmp_path / "extensions"  # empty: the build this machine cached elsewhere is not found
    report, stdout = run_fallback(prompts, CXX="/nonexistent/c++", LABKIT_EXTENSIONS_DIR=str(build_root))
    message = ("no C++ compiler found (CXX=/nonexistent/c++ is not an executable): attention_backend 'cpp' falls "
               "back to the PyTorch path 'torch'")
    assert report["warnings"] == [message]  # two engines, many steps: one warning
    assert report["missing"] == message.split(": attention_backend")[0]
    assert report["outs"] == [reference, reference]
    assert "compiling" not in stdout and not build_root.exists()


def test_auto_without_a_compiler_quietly_runs_the_pytorch_backend(tmp_path: Path, prompts: list[list[int]],
                                                                  reference: list[list[int]]) -> None:
    """The default ("auto") on a machine with no compiler: "torch", with no warning (nobody asked for "cpp")."""
    report, stdout = run_fallback(prompts, CXX="/nonexistent/c++", LABKIT_EXTENSIONS_DIR=str(tmp_path / "ext"),
                                  TEST_BACKEND="auto")
    assert report["warnings"] == [] and report["missing"].startswith("no C++ compiler found")
    assert report["ran"] == ["TorchAttentionBackend", "TorchAttentionBackend"]
    assert report["outs"] == [reference, reference] and "compiling" not in stdout


def test_auto_is_cpp_on_a_cpu_where_the_kernel_builds(kernel: ModuleType) -> None:
    assert resolve_attention_backend("auto", "cpu", torch.float32) is CppAttentionBackend
    assert resolve_attention_backend("auto", "cpu", torch.float64) is CppAttentionBackend
    assert resolve_attention_backend("auto", "cpu", torch.bfloat16) is TorchAttentionBackend  # the kernel lacks it
    assert resolve_attention_backend("auto", "cuda", torch.float32) is TorchAttentionBackend
    with LLM(engine="continuous", device="cpu", max_model_len=64) as llm:
        assert llm.engine.runner.attention_backend is CppAttentionBackend


def test_a_failed_build_warns_once_and_runs_the_pytorch_path(tmp_path: Path, prompts: list[list[int]],
                                                             reference: list[list[int]]) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error a broken kernel source (labkit's test)\n")
    report, stdout = run_fallback(prompts, str(broken), LABKIT_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    assert len(report["warnings"]) == 1, report["warnings"]
    warning = report["warnings"][0]
    assert warning.startswith("building the C++ kernel failed (")
    assert warning.endswith("attention_backend 'cpp' falls back to the PyTorch path 'torch'")
    assert str(tmp_path / "extensions") in warning  # where to look
    assert report["outs"] == [reference, reference]
    assert stdout.count("compiling labkit's C++ paged decode attention") == 1


def test_a_warning_is_raised_per_reason_not_per_step() -> None:
    cpp_decode.fallback_warning.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            cpp_decode.fallback_warning("reason A")
        cpp_decode.fallback_warning("reason B")
    assert [str(w.message).split(":")[0] for w in caught] == ["reason A", "reason B"]


def test_decodes_run_on_one_thread_while_another_process_holds_a_core(kernel: ModuleType,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """After oneDNN's threads kept stalling (labkit.core.model.linear.StallWatch), the kernel's threads would
    wait too."""
    from labkit.core.model.linear import STALL_WATCH

    seen: list[bool] = []
    original = cpp_decode.paged_decode_attention

    def spy(*args: object, parallel: bool = True, num_splits: int | None = None) -> torch.Tensor:
        seen.append(parallel)
        assert parallel or num_splits == 1  # one thread: nothing to share out
        return original(*args, parallel=parallel, num_splits=num_splits)  # type: ignore[arg-type]

    monkeypatch.setattr(cpp_decode, "paged_decode_attention", spy)
    # The watch's verdict is injected: left to the clock, a loaded machine (CI, a sanitizer build) trips it for real
    # during the quiet half and the first assertion fails
    stalled = [False]
    monkeypatch.setattr(STALL_WATCH, "recent", lambda: stalled[0])
    with LLM(engine="continuous", device="cpu", attention_backend="cpp", max_model_len=64) as llm:
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert seen and all(seen)  # a quiet machine: threads
        seen.clear()
        stalled[0] = True  # as if stalls had just been seen
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert seen and not any(seen)


def test_an_edited_header_gets_its_own_build(tmp_path: Path) -> None:
    """The build's name hashes the labkit headers a source includes (exp_f32.h is shared by both kernels): editing
    one must not reuse a build of the old code."""
    source, header = tmp_path / "kernel.cpp", tmp_path / "shared.h"
    source.write_text('#include <torch/extension.h>\n#include "shared.h"\n')
    header.write_text("inline float f() { return 1.0f; }\n")
    before = cpp_decode.build_name(source)
    header.write_text("inline float f() { return 2.0f; }\n")
    assert cpp_decode.build_name(source) != before
    assert cpp_decode.build_name(cpp_decode.SOURCE) != cpp_decode.build_name(cpp_decode.SOURCE, "other")  # prefix


def test_a_header_included_by_an_included_file_is_hashed_too(tmp_path: Path) -> None:
    """The decode step's source includes both kernels' sources, which include exp_f32.h: an edit two levels down must
    give a new build as well (and a cycle of includes must not loop)."""
    (tmp_path / "sub").mkdir()
    source, middle, inner = tmp_path / "step.cpp", tmp_path / "sub" / "kernel.cpp", tmp_path / "inner.h"
    source.write_text('#include "sub/kernel.cpp"\n')
    middle.write_text('#include "../inner.h"\n#include "../step.cpp"\n')
    inner.write_text("inline float f() { return 1.0f; }\n")
    before = cpp_decode.build_name(source)
    inner.write_text("inline float f() { return 2.0f; }\n")
    assert cpp_decode.build_name(source) != before
    assert sorted(cpp_decode.included_sources(source)) == sorted(p.resolve() for p in (source, middle, inner))
