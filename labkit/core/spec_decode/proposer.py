"""What every proposer shares: which rows of a scheduled step speculate, and writing the proposals into them.

The scheduler has given each running decode ``1 + k`` tokens (its lookahead, ``Scheduler.num_lookahead_tokens``,
capped by the budget and by what the request may still emit). The proposer fills those k slots with guesses
(``Sequence.spec_token_ids``); a proposer that finds fewer guesses shrinks the row to match, and the blocks it no
longer needs go back after the step. Introduced in notebook 13 (``13_speculative_decoding``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from labkit.core.sched.output import SchedulerOutput
from labkit.core.sequence import Sequence


@dataclass
class DraftProposal:
    """One request's guesses. Notebook 13."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # (k, V) the proposer's distribution; None: a point mass on each guess


class Proposer(ABC):
    """Fills the lookahead slots of a scheduled step with proposals. Notebook 13."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], num_tokens: list[int], out: SchedulerOutput) -> list[DraftProposal]:
        """At most ``num_tokens[i]`` guesses for each decoding ``seqs[i]`` (``out``: the whole step)."""

    def propose_for_step(self, out: SchedulerOutput) -> dict[int, torch.Tensor | None]:
        """Propose for every row of ``out`` that has lookahead slots, set each sequence's ``spec_token_ids`` and
        shrink its row to ``1 + len(guesses)``. Returns each speculating sequence's q by ``id(seq)``."""
        rows = [i for i, (s, n) in enumerate(zip(out.seqs, out.num_new_tokens)) if s.num_computed_tokens + n
                > s.num_tokens]
        for seq in out.seqs:
            seq.spec_token_ids = []
        if not rows:
            return {}
        seqs = [out.seqs[i] for i in rows]
        lookahead = [s.num_computed_tokens + out.num_new_tokens[i] - s.num_tokens for i, s in zip(rows, seqs)]
        proposals = self.propose(seqs, lookahead, out)
        for i, seq, k, proposal in zip(rows, seqs, lookahead, proposals):
            seq.spec_token_ids = list(proposal.token_ids[:k])
            out.num_new_tokens[i] = seq.num_tokens - seq.num_computed_tokens + len(seq.spec_token_ids)
        return {id(s): (p.probs[: len(s.spec_token_ids)] if p.probs is not None else None)
                for s, p in zip(seqs, proposals)}
