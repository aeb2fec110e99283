"""The acceptance rule alone: greedy is "accept while equal", and sampled output follows the target's distribution
(chi-square, fixed seeds, false alarm rate 1e-6 per position); planted bugs fail the same test."""

from __future__ import annotations

import pytest
import torch
from planted_acceptance_rules import AcceptsByP, AcceptsEverything, ResamplesFromP

from labkit.core.spec_decode.rejection_sampler import RejectionSampler
from labkit.course.ch13_speculative_decoding import (
    DRAFT_Q,
    TARGET_P,
    chi_square_pvalue,
    distribution_problems,
    emitted_counts,
    greedy_problems,
)


def test_chi_square_pvalue_matches_known_values() -> None:
    # 4 degrees of freedom: P(X >= 9.488) = 0.05 and P(X >= 13.277) = 0.01 (standard tables).
    probs = torch.full((5,), 0.2, dtype=torch.float64)
    assert chi_square_pvalue(torch.tensor([20.0, 20, 20, 20, 20], dtype=torch.float64), probs) == pytest.approx(1.0)
    # counts 100 * 0.2 = 20 expected each; one deviation pattern with statistic 9.488 / 13.277
    stat = lambda d: d * d / 20 * 2  # noqa: E731  (+d and -d in two cells)
    for target, pval in ((9.488, 0.05), (13.277, 0.01)):
        d = (target * 10) ** 0.5
        counts = torch.tensor([20 + d, 20 - d, 20, 20, 20], dtype=torch.float64)
        assert stat(d) == pytest.approx(target)
        assert chi_square_pvalue(counts, probs) == pytest.approx(pval, rel=1e-3)


def test_greedy_is_accept_while_equal() -> None:
    assert greedy_problems(RejectionSampler()) == []


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_output_follows_the_target(seed: int) -> None:
    assert distribution_problems(RejectionSampler(), seed=seed) == []


def test_a_point_mass_proposal_keeps_the_distribution() -> None:
    """n-gram proposals have q = a point mass: accept x with probability p(x), else draw from p without x."""
    sampler, gen = RejectionSampler(), torch.Generator().manual_seed(7)
    p = TARGET_P[:2]
    counts = torch.zeros(6, dtype=torch.float64)
    for _ in range(4000):
        q = torch.zeros(1, 6, dtype=torch.float64)
        q[0, 0] = 1.0  # always propose token 0
        counts[sampler.verify(p, [0], q, gen)[0]] += 1
    assert chi_square_pvalue(counts, p[0]) > 1e-6


@pytest.mark.parametrize("bug", [AcceptsEverything, ResamplesFromP, AcceptsByP])
def test_planted_bugs_fail_the_distribution_test(bug: type[RejectionSampler]) -> None:
    problems = distribution_problems(bug())
    assert problems and "not distributed as the target" in problems[0]


def test_counts_cover_every_position() -> None:
    counts = emitted_counts(RejectionSampler(), num_trials=500)
    assert counts[0].sum() == 500  # every verification emits at least one token
    assert 0 < counts[2].sum() < counts[1].sum() < 500  # later positions only after acceptances
    assert DRAFT_Q.shape[0] + 1 == TARGET_P.shape[0]
