"""Prompt lookup (vLLM's ``method="ngram"``): guess that the text repeats itself.

Find the most recent earlier place where the sequence's last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``, the longest first) occurred, and propose the tokens that followed them there. No model, no
KV: a few array comparisons on the host. It pays on text that repeats names and phrases (stories, code edits,
summaries that quote). Implementations differ in which occurrence they take when the n-gram recurs: labkit the most
recent one (the copy the text is following now), vLLM's ``NgramProposer`` the longest match at the earliest
position, Hugging Face's prompt lookup decoding the first one. Introduced in notebook 13
(``13_speculative_decoding``).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from labkit.core.sched.output import SchedulerOutput
from labkit.core.sequence import Sequence
from labkit.core.spec_decode.proposer import DraftProposal, Proposer


def ngram_lookup(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (n in
    [min_n, max_n]); [] when no suffix recurs."""
    tokens = np.asarray(token_ids, dtype=np.int64)  # (L,)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # (L - n, n): every n-gram that ends before the last token
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the token after the latest match
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Proposals by prompt lookup over each sequence's own tokens. Notebook 13."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int], out: SchedulerOutput) -> list[DraftProposal]:
        return [DraftProposal(ngram_lookup(s.token_ids, k, self.min_n, self.max_n)) for s, k in zip(seqs, num_tokens)]
