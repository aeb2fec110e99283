"""Notebook 13's checker: it passes labkit's acceptance rule and fails planted bugs, each with a useful message."""

from __future__ import annotations

import pytest
from planted_acceptance_rules import AcceptsEverything, KeepsGoingAfterRejection, NoBonusToken, ResamplesFromP

from labkit.core.spec_decode import RejectionSampler
from labkit.course.ch13_speculative_decoding import check_rejection_sampler


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
    (AcceptsEverything, "accept while equal"),
    (ResamplesFromP, "not distributed as the target"),
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
