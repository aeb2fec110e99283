"""The acceptance rule: keep a proposed token or replace it, so the output is distributed exactly as the target's.

For each proposed token x, in order, with the target's distribution p and the proposer's q at that position:
accept x with probability min(1, p(x) / q(x)); at the first rejection emit a token drawn from the residual
norm(max(0, p - q)) and stop; when all k are accepted, emit a bonus token drawn from the target's p at position
k + 1. Each emitted token is then distributed as p (Leviathan et al. 2023; Chen et al. 2023), whatever q is.

Greedy requests need no rule of their own: their p is a point mass on the target's argmax, and the n-gram
proposer's q a point mass on its token, so "accept while equal, then emit the target's argmax" falls out of the
same formula with no randomness left. Introduced in notebook 13 (``13_speculative_decoding``).
"""

from __future__ import annotations

import torch

from labkit.core.attention.decode import host_to_device
from labkit.core.sampler import draw, filtered_probs
from labkit.core.sampling_params import SamplingParams
from labkit.core.sequence import Sequence


def one_hot(token_ids: list[int], vocab_size: int, like: torch.Tensor) -> torch.Tensor:
    """(n,) ids -> (n, V) point masses, in ``like``'s dtype and device."""
    index = host_to_device(torch.tensor(token_ids, dtype=torch.long), like.device)
    return torch.zeros(len(token_ids), vocab_size, dtype=like.dtype, device=like.device).scatter_(
        1, index[:, None], 1.0)


def probs_under_params(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(n, V) logits of one request -> (n, V) the distribution its sampling parameters draw from: a point mass on
    the argmax for a greedy request; temperature, top-k and top-p applied as ``labkit.core.sampler`` does."""
    if params.greedy:  # a point mass on each row's argmax, built on the device (no wait for the argmax)
        return torch.zeros_like(logits).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    n, vocab = logits.shape
    k = params.top_k if 0 <= params.top_k < vocab else 0
    full = lambda v: torch.full((n,), v, dtype=logits.dtype, device=logits.device)  # noqa: E731
    return filtered_probs(logits, full(params.temperature), full(k).long(), full(params.top_p), k,
                          params.top_p < 1.0)


def uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """One draw from U[0, 1) with the request's own generator."""
    return float(torch.rand((), generator=generator, device=device, dtype=torch.float64))


def draw_from(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from (V,) non-negative weights, normalised here."""
    return int(draw(weights / weights.sum(), generator))


def verify_on_device(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor,
                     generator: torch.Generator | None) -> torch.Tensor:
    """``RejectionSampler.verify``'s rule without a host round trip per proposal: (2,) on the device, the number n of
    proposals accepted and the token emitted after them. target_probs (k + 1, V), draft_token_ids (k,) long,
    draft_probs (k, V).

    All k acceptance tests at once: u_i * q_i(x_i) < p_i(x_i) with k uniforms from the request's generator; n is
    the length of the run of passes from the start (a test after the first failure is never used, so drawing it is
    harmless). Then one draw, from the residual norm(max(0, p_n - q_n)) at the first rejection, or from p_k (the
    bonus) when all passed: q is padded with a zero row, so the residual at n = k is p_k itself."""
    k, vocab = draft_probs.shape
    rows = torch.arange(k, device=target_probs.device)
    p_x = target_probs[rows, draft_token_ids]  # (k,)
    q_x = draft_probs[rows, draft_token_ids]
    u = torch.rand(k, generator=generator, device=target_probs.device, dtype=torch.float64)
    passed = (u * q_x.double() < p_x.double()).long()  # (k,)
    n = passed.cumprod(0).sum()  # () accepted: the run of passes from the start
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(1, vocab)])  # (k + 1, V)
    p_n = target_probs.index_select(0, n[None])[0]  # (V,): index_select, as t[n] would read n on the host
    q_n = q_padded.index_select(0, n[None])[0]
    residual = (p_n - q_n).clamp(min=0)
    weights = torch.where(residual.sum() > 0, residual, p_n)  # p itself if p <= q everywhere (never in exact math)
    token = draw(weights / weights.sum(), generator)  # (1,)
    return torch.cat([n[None], token])


class RejectionSampler:
    """Verifies one request's proposals against the target (vLLM's ``RejectionSampler``). Notebook 13.

    ``verify`` is the rule; notebook 13's Build task rewrites it in a subclass passed as
    ``speculative_config={..., "rejection_sampler_cls": MySampler}``, and the engine runs it for every request.
    """

    def verify(self, target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor,
               generator: torch.Generator | None) -> list[int]:
        """target_probs: (k + 1, V), the target's p at each proposed position and one past the last;
        draft_token_ids: the k proposals; draft_probs: (k, V), the proposer's q. Returns the 1..k+1 tokens to emit:
        the accepted proposals, then one more (the residual's draw at a rejection, else the bonus token)."""
        emitted: list[int] = []
        for i, x in enumerate(draft_token_ids):
            p, q = target_probs[i], draft_probs[i]  # (V,) each
            # Accept with probability min(1, p(x)/q(x)), written without a division (q(x) > 0: x was proposed).
            if uniform(generator, p.device) * float(q[x]) < float(p[x]):
                emitted.append(x)
                continue
            residual = (p - q).clamp(min=0)  # (V,) where the target wants more than the proposer offered
            emitted.append(draw_from(residual if float(residual.sum()) > 0 else p, generator))
            return emitted
        emitted.append(draw_from(target_probs[len(draft_token_ids)], generator))  # all accepted: a bonus token
        return emitted

    def verify_batch(self, logits: torch.Tensor, seqs: list[Sequence],
                     draft_probs: dict[int, torch.Tensor | None]) -> list[list[int]]:
        """(R, V) logits of a step's sampled rows, 1 + len(seq.spec_token_ids) consecutive rows per sequence ->
        each sequence's emitted tokens. ``draft_probs[id(seq)]``: its q, or None for point masses (n-gram).

        labkit's own rule runs on the device (``verify_on_device``) and the whole step's outcomes come back to the
        host in one copy; a subclass's ``verify`` (notebook 13's Build task) is called as written."""
        on_device = type(self).verify is RejectionSampler.verify
        results: list[list[int] | torch.Tensor] = []
        row = 0
        for seq in seqs:
            proposed = seq.spec_token_ids
            rows = logits[row : row + 1 + len(proposed)]  # (k + 1, V)
            row += 1 + len(proposed)
            p = probs_under_params(rows, seq.params)
            q = draft_probs.get(id(seq))
            if q is None:
                q = one_hot(proposed, rows.shape[-1], p)  # (k, V)
            if on_device:
                ids = host_to_device(torch.tensor(list(proposed), dtype=torch.long), p.device)
                results.append(verify_on_device(p, ids, q.to(p.dtype), seq.generator))
            else:
                results.append(self.verify(p, list(proposed), q.to(p.dtype), seq.generator))
        pending = [r for r in results if isinstance(r, torch.Tensor)]
        outcomes = iter(torch.stack(pending).tolist() if pending else [])  # the step's one device -> host copy
        emitted = []
        for seq, r in zip(seqs, results):
            if isinstance(r, torch.Tensor):
                n, token = next(outcomes)
                r = [*seq.spec_token_ids[:n], token]
            emitted.append(r)
        return emitted
