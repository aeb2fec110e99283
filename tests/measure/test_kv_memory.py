"""KV-memory accounting (labkit.measure.kv_memory): hand-computed cases, and the real ``paged`` engine agrees."""

from __future__ import annotations

import pytest

from labkit import LLM, SamplingParams
from labkit.measure.kv_memory import (
    ContiguousLayout,
    PagedLayout,
    kv_memory_usage,
    lens_in_cache,
    max_concurrent_seqs,
    paged_blocks_per_step,
    peak_len,
)
from labkit.measure.workloads import WorkloadRequest, load_workload

A = WorkloadRequest(prompt_len=5, output_len=4)  # in cache during its 4 steps: 5, 6, 7, 8 tokens
B = WorkloadRequest(prompt_len=10, output_len=3)  # 10, 11, 12


def test_a_requests_life_in_the_cache() -> None:
    assert list(lens_in_cache(A)) == [5, 6, 7, 8]
    assert peak_len(A) == 8 and peak_len(B) == 12
    assert list(lens_in_cache(WorkloadRequest(7, 1))) == [7]  # one output token: only the prefill step


def test_paged_waste_is_the_tail_of_the_last_block() -> None:
    life = kv_memory_usage([A], PagedLayout(block_size=4))
    # 2 blocks (8 slots) in every step; empty slots 3, 2, 1, 0
    assert (life.used, life.reserved_unused, life.internal) == (26, 0, 6)
    assert life.allocated == 32 and life.waste_fraction == pytest.approx(6 / 32)
    peak = kv_memory_usage([A], PagedLayout(block_size=4), at="peak")
    assert (peak.used, peak.internal) == (8, 0)
    both = kv_memory_usage([A, B], PagedLayout(block_size=4), at="peak")
    assert (both.used, both.internal) == (20, 0)
    # block_size 1 wastes nothing; block_size 16 holds each sequence in one block
    assert kv_memory_usage([A, B], PagedLayout(block_size=1)).wasted == 0
    assert kv_memory_usage([A, B], PagedLayout(block_size=16), at="peak").internal == (16 - 8) + (16 - 12)


def test_contiguous_waste_is_the_reservation_not_yet_or_never_used() -> None:
    by_max_len = kv_memory_usage([A], ContiguousLayout("max_model_len", max_model_len=16))
    assert (by_max_len.used, by_max_len.reserved_unused, by_max_len.internal) == (26, 11 + 10 + 9 + 8, 0)
    assert by_max_len.allocated == 4 * 16
    exact = kv_memory_usage([A], ContiguousLayout("max_tokens", max_model_len=16))  # reserves 5 + 4 = 9
    assert exact.reserved_unused == 4 + 3 + 2 + 1
    assert kv_memory_usage([A], ContiguousLayout("max_tokens", max_model_len=16), at="peak").reserved_unused == 1
    budget = kv_memory_usage([A], ContiguousLayout("max_tokens", max_model_len=16, max_tokens=10), at="peak")
    assert budget.reserved_unused == 15 - 8
    capped = ContiguousLayout("max_tokens", max_model_len=12, max_tokens=10)
    assert capped.reserved_len(A) == 12  # prompt + max_tokens, but never beyond max_model_len
    with pytest.raises(ValueError, match="reserves only"):
        ContiguousLayout("max_model_len", max_model_len=10).reserved_len(B)


def test_fractions_add_up() -> None:
    wl = load_workload("heterogeneous_small_16")
    for layout in (ContiguousLayout("max_model_len", 512), ContiguousLayout("max_tokens", 512, 64), PagedLayout(16)):
        u = kv_memory_usage(wl.requests, layout)
        assert u.used_fraction + u.reserved_unused_fraction + u.internal_fraction == pytest.approx(1.0)


def test_paging_wastes_less_than_a_block_per_sequence_on_the_heterogeneous_workload() -> None:
    wl = load_workload("heterogeneous_64")
    paged = kv_memory_usage(wl.requests, PagedLayout(16))
    contiguous = kv_memory_usage(wl.requests, ContiguousLayout("max_model_len", 2048))
    assert paged.waste_fraction <= 0.04 < 0.5 < contiguous.waste_fraction
    peak = kv_memory_usage(wl.requests, PagedLayout(16), at="peak")
    assert peak.internal < 16 * len(wl)


def test_sequences_that_fit_a_budget() -> None:
    # A holds 8 slots at most (2 blocks of 4), B 12 (3 blocks); FCFS, cycling A, B, A, B, ...
    assert max_concurrent_seqs([A, B], 20, PagedLayout(4)) == 2
    assert max_concurrent_seqs([A, B], 30, PagedLayout(4)) == 3  # 7 blocks: A, B, A
    assert max_concurrent_seqs([A, B], 7, PagedLayout(4)) == 0  # 7 slots is one block; A needs two
    assert max_concurrent_seqs([A, B], 30, ContiguousLayout("max_model_len", 16)) == 1
    assert max_concurrent_seqs([A, B], 32, ContiguousLayout("max_model_len", 16)) == 2
    assert max_concurrent_seqs([A, B], 30, ContiguousLayout("max_tokens", 16)) == 2  # 9 + 13 = 22, then 31 > 30
    wl = load_workload("heterogeneous_64")
    budget = 8 * 2048
    assert max_concurrent_seqs(wl.requests, budget, ContiguousLayout("max_model_len", 2048)) == 8
    assert max_concurrent_seqs(wl.requests, budget, PagedLayout(16)) > 4 * 8


def test_paged_blocks_per_step_by_hand() -> None:
    # step 0: A 5 tokens (2 blocks) + B 10 (3); step 1: A 6 (2) + B 11 (3); step 2: A 7 (2) + B 12 (3), the
    # step where B samples its third and last token (it frees its blocks after); step 3: A alone, 8 tokens (2).
    assert paged_blocks_per_step([A, B], 4) == [5, 5, 5, 2]
    assert paged_blocks_per_step([WorkloadRequest(7, 1)], 4) == [2]


def test_paged_blocks_per_step_matches_the_engine(bundled_path) -> None:
    requests = [WorkloadRequest(5, 4), WorkloadRequest(10, 3), WorkloadRequest(17, 9), WorkloadRequest(3, 1),
                WorkloadRequest(8, 6)]
    llm = LLM(str(bundled_path), engine="paged", block_size=4, max_num_seqs=8, num_gpu_blocks=64, debug_checks=True)
    # distinct prompts of exact lengths (token ids), so nothing is shared
    prompts = [[1] + [10 + i * 37 + j for j in range(r.prompt_len - 1)] for i, r in enumerate(requests)]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0, ignore_eos=True) for r in requests]
    llm.generate(prompts, params, use_tqdm=False)
    used = [s.kv_blocks_used for s in llm.engine.step_stats]
    assert used == paged_blocks_per_step(requests, 4)
    peak_blocks = max(used)
    assert peak_blocks * 4 <= kv_memory_usage(requests, PagedLayout(4), at="peak").allocated
