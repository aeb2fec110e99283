"""Planted bugs in notebook 13's acceptance rule, each a ``RejectionSampler`` wrong in one step: tests/core/spec_decode
checks that the distribution test fails them, tests/course that notebook 13's checker does."""

from __future__ import annotations

import torch

from labkit.core.spec_decode.rejection_sampler import RejectionSampler, draw_from, uniform


class OneStepChanged(RejectionSampler):
    """The acceptance rule in steps a planted bug overrides one of: accept x with probability min(1, p(x) / q(x));
    at a rejection emit a draw from the residual max(0, p - q) and stop; after k acceptances, a bonus token."""

    stops_at_rejection = True

    def accepts(self, u: float, p: torch.Tensor, q: torch.Tensor, x: int) -> bool:
        return u * float(q[x]) < float(p[x])

    def replacement(self, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None) -> int:
        return draw_from((p - q).clamp(min=0), generator)

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        out = []
        for i, x in enumerate(draft_token_ids):
            p, q = target_probs[i], draft_probs[i]
            if self.accepts(uniform(generator, p.device), p, q, x):
                out.append(x)
                continue
            out.append(self.replacement(p, q, generator))
            if self.stops_at_rejection:
                return out
        return out + [draw_from(target_probs[len(draft_token_ids)], generator)]


class NoBonusToken(RejectionSampler):
    """Planted bug: when every proposal is accepted, no token of the target's own is added."""

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        out = super().verify(target_probs, draft_token_ids, draft_probs, generator)
        return out[:-1] if len(out) == len(draft_token_ids) + 1 else out


class KeepsGoingAfterRejection(OneStepChanged):
    """Planted bug: after a rejection, goes on checking later proposals (they assumed the rejected token)."""

    stops_at_rejection = False


class AcceptsEverything(RejectionSampler):
    """Planted bug: no ratio test (every proposal kept), so the output follows q, not p; greedy cases catch it
    first."""

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        return list(draft_token_ids) + [draw_from(target_probs[len(draft_token_ids)], generator)]


class ResamplesFromP(OneStepChanged):
    """Planted bug: at a rejection, draw from p instead of the residual max(0, p - q): right for greedy, wrong in
    distribution."""

    def replacement(self, p: torch.Tensor, q: torch.Tensor, generator: torch.Generator | None) -> int:
        return draw_from(p, generator)


class AcceptsByP(OneStepChanged):
    """Planted bug: accept with probability p(x) instead of min(1, p(x) / q(x))."""

    def accepts(self, u: float, p: torch.Tensor, q: torch.Tensor, x: int) -> bool:
        return u < float(p[x])


class IgnoresGenerator(OneStepChanged):
    """Planted bug: every draw from torch's global RNG (``uniform(None, ...)``, ``draw_from(..., None)``), not the
    request's generator: right in distribution, but a seeded request is not reproducible."""

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        return super().verify(target_probs, draft_token_ids, draft_probs, None)


class OwnGenerator(OneStepChanged):
    """Planted bug: draws from a generator of its own (the same stream for every request, whatever its seed)."""

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        return super().verify(target_probs, draft_token_ids, draft_probs, torch.Generator().manual_seed(0))


class FirstAttempt(RejectionSampler):
    """A learner's naive-but-plausible first attempt (issue 32's "learner's trial"): keep a proposal when a uniform
    draw falls under the target's p(x) (q forgotten), and at a rejection draw from p. Greedy cases pass; the first
    failure must name the missing ratio p(x) / q(x)."""

    def verify(self, target_probs, draft_token_ids, draft_probs, generator):  # type: ignore[no-untyped-def]
        emitted = []
        for i, x in enumerate(draft_token_ids):
            if uniform(generator, target_probs.device) < target_probs[i, x]:  # "keep it if the target likes it"
                emitted.append(x)
            else:
                emitted.append(draw_from(target_probs[i], generator))
                return emitted
        emitted.append(draw_from(target_probs[-1], generator))
        return emitted
