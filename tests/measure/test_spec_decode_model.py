"""Notebook 13's analytic model and workload check: Leviathan et al.'s expected tokens per verification and
speed-up, alpha per position from vLLM's per-position counters, and prompt lookup replayed offline."""

from __future__ import annotations

import math

import pytest

from labkit.measure.spec_decode import acceptance_by_position, expected_tokens, lookup_acceptance, predicted_speedup


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0.0, 3) == 1.0  # nothing kept: the target's own token
    assert expected_tokens(1.0, 3) == 4.0  # everything kept, plus the bonus
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 5) == pytest.approx((1 - 0.8 ** 6) / (1 - 0.8))


def test_predicted_speedup_divides_by_the_cost_of_a_speculative_step() -> None:
    assert predicted_speedup(0.8, 4, 0.0) == pytest.approx(expected_tokens(0.8, 4))
    assert predicted_speedup(0.0, 3, 0.1) == pytest.approx(1 / 1.3)  # proposals never kept: a loss


def test_alpha_by_position_is_conditional_on_reaching_the_position() -> None:
    # 100 drafts of 3: 80 kept position 0, 60 of those kept 1, 30 of those kept 2
    assert acceptance_by_position([80, 60, 30], 100) == pytest.approx([0.8, 0.75, 0.5])
    assert math.isnan(acceptance_by_position([0, 0], 10)[1])  # never reached


def test_lookup_acceptance_replays_prompt_lookup() -> None:
    prompt = [5, 6, 7, 8, 9, 1]
    assert lookup_acceptance(prompt, [5, 6, 7, 8, 9], k=3) == 1.0  # the answer repeats the prompt
    assert lookup_acceptance([1, 2, 3], [4, 5, 6, 7], k=3) == 0.0  # nothing recurs: nothing proposed
    assert 0.0 < lookup_acceptance(prompt, [5, 6, 2, 8, 9], k=3) < 1.0  # a miss in the middle
