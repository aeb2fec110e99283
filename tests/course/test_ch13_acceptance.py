"""Notebook 13's checker: it passes labkit's acceptance rule and fails planted bugs, each with a message naming the
bug; a learner's naive first attempt is told its actual mistake, without the reference code."""

from __future__ import annotations

import pytest
from planted_acceptance_rules import (
    AcceptsByP,
    AcceptsEverything,
    FirstAttempt,
    IgnoresGenerator,
    KeepsGoingAfterRejection,
    NoBonusToken,
    OwnGenerator,
    ResamplesFromP,
)

from labkit.core.spec_decode import RejectionSampler
from labkit.course.ch13_speculative_decoding import ACCEPTANCE_HINTS, check_rejection_sampler


class ReturnsTensors(RejectionSampler):
    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        return [target_probs[0].argmax()]


class Stub(RejectionSampler):
    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def test_checker_passes_labkits_rule() -> None:
    result = check_rejection_sampler(RejectionSampler)
    assert result.passed, result.message()


@pytest.mark.parametrize("bug, message", [
    (NoBonusToken, "then the target's own token"),
    (KeepsGoingAfterRejection, "accept while equal"),
    (AcceptsEverything, "ratio of the target's p to the proposer's q"),
    (AcceptsByP, "min(1, p(x) / q(x))"),
    (ResamplesFromP, "residual max(0, p - q)"),
    (IgnoresGenerator, "request's generator"),
    (OwnGenerator, "request's generator"),
    (ReturnsTensors, "must return a list of ints"),
])
def test_checker_fails_planted_bugs(bug: type[RejectionSampler], message: str) -> None:
    result = check_rejection_sampler(bug)
    assert result.status == "failed"
    assert any(message in f for f in result.failures), result.message()


def test_checker_reports_a_stub_and_a_non_subclass() -> None:
    assert check_rejection_sampler(Stub).status == "not started"
    result = check_rejection_sampler(int)  # type: ignore[arg-type]
    assert result.status == "failed" and "subclass of labkit.core.spec_decode.RejectionSampler" in result.failures[0]


def test_a_learners_first_attempt_is_told_its_actual_mistake_and_no_code() -> None:
    """Issue 32's learner's trial: a plausible first attempt (q forgotten in the acceptance test, a rejection drawn
    from p) fails first on the missing ratio, and the printed message holds neither the rule nor the code."""
    result = check_rejection_sampler(FirstAttempt)
    assert result.status == "failed"
    first = result.failures[0]
    assert "min(1, p(x) / q(x))" in first and "q(" in first, first
    printed = result.message()
    assert ACCEPTANCE_HINTS.by_failure["no-ratio"] in printed  # the words for this failure class, and no other
    assert ACCEPTANCE_HINTS.by_failure["residual"] not in printed
    for code in (ACCEPTANCE_HINTS.code, ACCEPTANCE_HINTS.rule, "clamp(min=0)", "draw_from((p", "* q[i][x] <",
                 "for i, x in"):
        assert code not in printed, printed
