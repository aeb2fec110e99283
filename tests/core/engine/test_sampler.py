"""Sampling: temperature, top-k, top-p on known distributions; seeded generators."""

from __future__ import annotations

import math

import torch

from labkit.core.sampler import apply_top_k, apply_top_p, sample, sample_row
from labkit.core.sampling_params import SamplingParams

PROBS = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
LOGITS = PROBS.log()


def draw(params: SamplingParams, n: int = 2000, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor([sample_row(LOGITS, params, gen) for _ in range(n)])


def test_greedy_takes_the_argmax() -> None:
    assert sample(torch.stack([LOGITS, LOGITS.flip(0)]), [SamplingParams(temperature=0)] * 2, [None, None]) == [0, 4]


def test_top_k_keeps_exactly_k_tokens() -> None:
    kept = apply_top_k(LOGITS, 2)
    assert torch.isfinite(kept).tolist() == [True, True, False, False, False]
    assert set(draw(SamplingParams(temperature=1.0, top_k=2)).tolist()) == {0, 1}
    assert set(draw(SamplingParams(temperature=1.0, top_k=1)).tolist()) == {0}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed to reach 0.8.
    assert torch.isfinite(apply_top_p(LOGITS, 0.8)).tolist() == [True, True, True, False, False]
    assert torch.isfinite(apply_top_p(LOGITS, 0.75)).tolist() == [True, True, False, False, False]
    assert torch.isfinite(apply_top_p(LOGITS, 0.1)).tolist() == [True, False, False, False, False]
    assert set(draw(SamplingParams(temperature=1.0, top_p=0.8)).tolist()) == {0, 1, 2}


def test_top_p_works_on_unsorted_logits() -> None:
    perm = torch.tensor([3, 0, 4, 2, 1])
    kept = torch.isfinite(apply_top_p(LOGITS[perm], 0.8))
    assert kept.tolist() == [False, True, False, True, True]


def test_temperature_one_follows_the_distribution() -> None:
    counts = torch.bincount(draw(SamplingParams(temperature=1.0), n=4000), minlength=5).float() / 4000
    assert torch.allclose(counts, PROBS, atol=0.03)


def test_low_temperature_sharpens_high_temperature_flattens() -> None:
    def share_of_top(t: float) -> float:
        return float((draw(SamplingParams(temperature=t)) == 0).float().mean())

    assert share_of_top(0.3) > 0.85 > share_of_top(1.0) > share_of_top(3.0)
    # At T=3 the top token's probability is 0.5^(1/3) / sum p_i^(1/3).
    expected = 0.5 ** (1 / 3) / float((PROBS ** (1 / 3)).sum())
    assert math.isclose(share_of_top(3.0), expected, abs_tol=0.04)


def test_same_generator_seed_same_draws() -> None:
    p = SamplingParams(temperature=1.0)
    assert draw(p, 50, seed=5).tolist() == draw(p, 50, seed=5).tolist()
    assert draw(p, 50, seed=5).tolist() != draw(p, 50, seed=6).tolist()
