"""A single-token decode folds the GQA group into the query dimension, in the CUDA-graph decode path
(``DecodeOnlyAttention``) and in ``ContiguousKVCache``: SDPA sees as many query heads as K/V heads, so on CUDA nothing
is repeated and the fused memory-efficient kernel (mask, no GQA) is eligible. Checked on the CPU: the calls' shapes,
the plan CUDA would take, and token-identical greedy outputs against transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend

import labkit.core.attention.decode as decode
import labkit.core.kv.contiguous as contiguous
from labkit import LLM, SamplingParams
from labkit.core.attention.decode import DecodeOnlyAttention, decode_mask
from labkit.core.kv.contiguous import ContiguousKVCache
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model.attention import repeat_kv, sdpa, sdpa_plan
from labkit.core.model.config import ModelConfig
from labkit.course.oracle import transformers_greedy

CONFIG = ModelConfig(model_type="llama", vocab_size=16, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(query positions, query heads, K/V heads) of every SDPA call the two decode paths make."""
    seen: list[tuple[int, int, int]] = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            is_causal: bool) -> torch.Tensor:
        seen.append((q.shape[1], q.shape[2], k.shape[2]))
        return sdpa(q, k, v, mask=mask, is_causal=is_causal)

    monkeypatch.setattr(decode, "sdpa", spy)
    monkeypatch.setattr(contiguous, "sdpa", spy)
    return seen


def unfolded(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What the decode computed before: K/V heads repeated to every query head, one query position.
    q (B, 1, H, d); keys, values (B, S, n_kv, d) -> (B, 1, H, d)."""
    n_rep = q.shape[2] // keys.shape[2]
    k = repeat_kv(keys.transpose(1, 2), n_rep)  # (B, H, S, d)
    v = repeat_kv(values.transpose(1, 2), n_rep)
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
    return out.transpose(1, 2)


def test_the_folded_call_is_what_cuda_runs_on_a_fused_kernel() -> None:
    gqa = sdpa_plan("cuda", has_mask=True, is_gqa=True)  # the unfolded masked decode: K/V repeated
    folded = sdpa_plan("cuda", has_mask=True, is_gqa=False)
    assert gqa.repeat_kv and not folded.repeat_kv
    assert SDPBackend.EFFICIENT_ATTENTION in folded.backends and SDPBackend.MATH not in folded.backends


def test_graph_decode_attention_folds_the_group(calls: list[tuple[int, int, int]]) -> None:
    gen = torch.Generator().manual_seed(0)
    pool = PagedKVPool(CONFIG, 12, 4, torch.device("cpu"), torch.float32)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=gen))
    tables = torch.tensor([[3, 5, 7], [1, 11, 11], [11, 11, 11]])  # block 11: the scratch block of padded rows
    lens = torch.tensor([10, 5, 1])
    slots = torch.tensor([7 * 4 + 1, 1 * 4 + 0, 11 * 4])  # each row's newest token
    q = torch.randn(1, 3, 8, 16, generator=gen)
    k, v = torch.randn(1, 3, 2, 16, generator=gen), torch.randn(1, 3, 2, 16, generator=gen)
    out = DecodeOnlyAttention(pool, slots, tables, lens).attend(0, q, k, v)  # (1, B, H, d)
    assert calls == [(4, 2, 2)]  # the group of 4 as query positions, 2 heads each side: no GQA left
    keys, values = pool.k[0][tables].flatten(1, 2), pool.v[0][tables].flatten(1, 2)  # (B, S, n_kv, d)
    want = unfolded(q[0][:, None], keys, values, decode_mask(tables, 4, lens))[:, 0]
    torch.testing.assert_close(out[0], want, rtol=1e-6, atol=1e-6)


def test_contiguous_cache_folds_decodes_and_not_prefills(calls: list[tuple[int, int, int]]) -> None:
    gen = torch.Generator().manual_seed(1)
    cache = ContiguousKVCache(CONFIG, 2, 8, torch.device("cpu"), torch.float32)
    cache.begin_step(torch.tensor([[False, True, True], [True, True, True]]))  # row 0 left-padded
    q, k, v = torch.randn(2, 3, 8, 16, generator=gen), torch.randn(2, 3, 2, 16, generator=gen), torch.randn(
        2, 3, 2, 16, generator=gen)
    cache.attend(0, q, k, v)
    cache.end_step(3)
    cache.begin_step(torch.ones(2, 1, dtype=torch.bool))
    q, k, v = torch.randn(2, 1, 8, 16, generator=gen), torch.randn(2, 1, 2, 16, generator=gen), torch.randn(
        2, 1, 2, 16, generator=gen)
    assert cache.mask is not None
    out = cache.attend(0, q, k, v)
    assert calls == [(3, 8, 2), (4, 2, 2)]  # the prefill as before (GQA); the decode folded
    want = unfolded(q, cache.k[0][:, :, :4].transpose(1, 2), cache.v[0][:, :, :4].transpose(1, 2), cache.mask)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


PROMPTS = ["Once upon a time", "The dog ran to the park and", "One day, Lily went"]


@pytest.mark.parametrize("engine,options", [
    ("kvcache", {}),  # ContiguousKVCache: left-padded rows, folded decodes
    ("chunked", dict(block_size=4, max_num_seqs=3, graph_decode=True)),  # the graph decode path, run eagerly
])
def test_tokens_equal_transformers(engine: str, options: dict[str, Any], bundled_path: Path,
                                   tokenizer: Any) -> None:  # type: ignore[no-untyped-def]
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    graph_decode = options.pop("graph_decode", False)
    with LLM(str(bundled_path), engine=engine, device="cpu", **options) as llm:
        if graph_decode:  # DecodeGraphs without capture: the same padded, folded decode, eagerly on the CPU
            graphs = llm.engine.runner.use_decode_graphs((1, 2, 4), max_blocks=16, capture=False)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0,
                                                                                    ignore_eos=True), use_tqdm=False)]
        if graph_decode:
            assert graphs.num_runs > 0
    assert got == transformers_greedy(bundled_path, prompts, 8)
