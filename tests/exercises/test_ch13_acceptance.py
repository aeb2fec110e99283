"""Notebook 13's checker: it passes labkit's acceptance rule and fails planted bugs, each with a useful message."""

from __future__ import annotations

import pytest

from labkit.exercises.ch13_acceptance import check_rejection_sampler
from labkit.spec_decode import RejectionSampler
from labkit.spec_decode.rejection_sampler import draw_from, uniform


class NoBonusToken(RejectionSampler):
    """Planted bug: when every proposal is accepted, no token of the target's own is added."""

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        out = super().verify(target_probs, draft_token_ids, draft_probs, generator)
        return out[:-1] if len(out) == len(draft_token_ids) + 1 else out


class KeepsGoingAfterRejection(RejectionSampler):
    """Planted bug: after a rejection, goes on checking later proposals (they assumed the rejected token)."""

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        out = []
        for i, x in enumerate(draft_token_ids):
            p, q = target_probs[i], draft_probs[i]
            if uniform(generator, p.device) * float(q[x]) < float(p[x]):
                out.append(x)
            else:
                out.append(draw_from((p - q).clamp(min=0), generator))
        return out + [draw_from(target_probs[len(draft_token_ids)], generator)]


class AcceptsEverything(RejectionSampler):
    """Planted bug: no ratio test; greedy cases catch it first."""

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        return list(draft_token_ids) + [draw_from(target_probs[len(draft_token_ids)], generator)]


class ResamplesFromP(RejectionSampler):
    """Planted bug: at a rejection, draw from p, not from the residual: right for greedy, wrong in distribution."""

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        out = []
        for i, x in enumerate(draft_token_ids):
            p, q = target_probs[i], draft_probs[i]
            if uniform(generator, p.device) * float(q[x]) < float(p[x]):
                out.append(x)
                continue
            return out + [draw_from(p, generator)]
        return out + [draw_from(target_probs[len(draft_token_ids)], generator)]


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
    assert result.status == "failed" and "subclass of labkit.spec_decode.RejectionSampler" in result.failures[0]
