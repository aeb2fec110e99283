"""``kv_cache_dtype="int8"`` / ``"fp8"``: the pool holds 8-bit K/V (int8 with per-token-per-head scales), every
paged engine and attention backend reads it, the pool sizing counts the smaller blocks, bad values are named."""

from __future__ import annotations

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.core.attention import ATTENTION_BACKENDS
from labkit.core.attention.metadata import PagedAttentionMetadata
from labkit.core.attention.quantized_kv import renumber
from labkit.core.kv import quantized_pool
from labkit.core.kv.quantized_pool import (
    QuantizedKVPool,
    dequantize_int8_kv,
    kv_cache_bytes_per_token,
    quantize_int8_kv,
)
from labkit.core.model.presets import get_preset
from labkit.measure.corpus import story_prompts
from labkit.measure.kv_memory import budget_tokens

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
KV_DTYPES = ["int8", "fp8"]


def tokens(llm: LLM, n: int = 3) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(story_prompts(n, seed=7), GREEDY, use_tqdm=False)]


def agreement(got: list[list[int]], want: list[list[int]]) -> float:
    return sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(len(w) for w in want)


def test_int8_vectors_round_trip_within_half_a_step() -> None:
    x = torch.randn(5, 2, 32) * torch.logspace(-2, 1, 5)[:, None, None]
    x[1, 0] = 0.0
    q, scale = quantize_int8_kv(x)
    assert q.dtype == torch.int8 and scale.shape == (5, 2) and bool((scale > 0).all())
    assert bool(((dequantize_int8_kv(q, scale, torch.float32) - x).abs() <= scale[..., None] * 0.5001).all())


def test_renumbered_tables_and_slots_point_at_the_same_tokens() -> None:
    meta = PagedAttentionMetadata([1, 3], [5, 3], [[7, 2, 9], [4]], torch.tensor([2 * 4, 4 * 4, 4 * 4 + 1, 4 * 4 + 2]))
    blocks, step = renumber(meta, block_size=4, device=torch.device("cpu"))
    assert blocks.tolist() == [7, 2, 4]  # block 9 lies past the first sequence's 5 tokens: not read
    assert step.block_tables == [[0, 1, 0], [2]]
    assert (blocks[step.slot_mapping // 4] * 4 + step.slot_mapping % 4).tolist() == meta.slot_mapping.tolist()


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_every_backend_reads_the_8bit_pool(bundled_path, backend: str, kv_cache_dtype: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        pytest.skip("triton is not installed here")
    llm = LLM(str(bundled_path), attention_backend=backend, kv_cache_dtype=kv_cache_dtype, block_size=4)
    assert isinstance(llm.engine.pool, QuantizedKVPool)
    assert llm.engine.pool.k[0].dtype == (torch.int8 if kv_cache_dtype == "int8" else torch.float8_e4m3fn)
    got = tokens(llm)
    assert tokens(llm) == got  # deterministic
    assert agreement(got, tokens(LLM(str(bundled_path), attention_backend=backend, block_size=4))) >= 0.9
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("engine", ["paged", "continuous", "chunked"])
def test_every_paged_engine_with_prefix_caching_and_copies(bundled_path, engine: str) -> None:
    options = {} if engine == "paged" else {"enable_prefix_caching": True}
    llm = LLM(str(bundled_path), engine=engine, kv_cache_dtype="int8", block_size=4, quantization="int8", **options)
    want = tokens(LLM(str(bundled_path), engine=engine, quantization="int8", block_size=4, **options))
    assert agreement(tokens(llm), want) >= 0.9
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=3)  # n > 1 shares the prompt's blocks
    first = [c.token_ids for c in llm.generate(story_prompts(1, seed=2), sampled, use_tqdm=False)[0].outputs]
    again = [c.token_ids for c in llm.generate(story_prompts(1, seed=2), sampled, use_tqdm=False)[0].outputs]
    assert first == again
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_equal_memory_holds_more_tokens(bundled_path) -> None:
    budget = 1 << 20
    f32 = LLM(str(bundled_path), kv_cache_memory=budget)
    int8 = LLM(str(bundled_path), kv_cache_memory=budget, kv_cache_dtype="int8")
    fp8 = LLM(str(bundled_path), kv_cache_memory=budget, kv_cache_dtype="fp8")
    assert int8.engine.num_blocks >= 3.5 * f32.engine.num_blocks  # scales counted: (32 + 4) vs 4 x 32 bytes a head
    assert fp8.engine.num_blocks == 4 * f32.engine.num_blocks
    assert int8.engine.pool.num_bytes <= budget + kv_cache_bytes_per_token(int8.model_config, torch.float32, "int8") * 4
    config = f32.model_config
    assert budget_tokens(config, budget, torch.float32, "int8") == budget // (2 * 4 * 2 * (32 + 4))
    wide = get_preset("smollm2-135m")  # head_dim 64: int8's scale costs 4 bytes in 68 (32 + 4 at head_dim 32)
    assert budget_tokens(wide, budget, torch.bfloat16, "auto") * 1.8 <= budget_tokens(wide, budget, torch.float32,
                                                                                        "int8")
    assert budget_tokens(wide, budget, torch.float32, "auto") * 3.5 <= budget_tokens(wide, budget, torch.float32,
                                                                                       "int8")


def test_bad_values_are_named(bundled_path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype='int4' is not supported.*'auto', 'int8', 'fp8'"):
        LLM(str(bundled_path), kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="does not take option.*kv_cache_dtype"):
        LLM(str(bundled_path), engine="kvcache", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="float64 is for exact tests"):
        LLM(str(bundled_path), kv_cache_dtype="int8", dtype="float64")
    quantized_pool.fp8_supported.cache_clear()
    monkeypatch.setattr(quantized_pool, "fp8_supported", lambda device_type: False)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' needs float8_e4m3fn.*on cpu"):
        LLM(str(bundled_path), kv_cache_dtype="fp8")
