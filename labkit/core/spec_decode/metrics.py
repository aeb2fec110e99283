"""How well the proposals did (vLLM's ``SpecDecodingStats``): drafts, proposed and accepted tokens, per position.

Acceptance rate = accepted / proposed; mean accepted length = 1 + accepted / drafts (tokens emitted per verifying
step, counting the one the target adds). Introduced in notebook 13 (``13_speculative_decoding``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Counters an engine with ``speculative_config`` keeps over its lifetime. Notebook 13."""

    num_drafts: int = 0  # verifications of a request that had at least one proposal
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # accepted at proposal position 0, 1, ...

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        while len(self.num_accepted_tokens_per_pos) < num_proposed:
            self.num_accepted_tokens_per_pos.append(0)
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification: the accepted proposals plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
