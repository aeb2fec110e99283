"""Turning logits into next tokens: greedy, temperature, top-k, top-p, per-request generators.

Each sequence carries its own ``torch.Generator``, so a seeded request draws the same tokens
whether it runs alone or in a batch. Introduced in notebook 02 (``02_naive_generation``).
"""

from __future__ import annotations

import torch

from labkit.sampling_params import SamplingParams


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of a (V,) row, set the rest to -inf."""
    if k < 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering of a (V,) row: keep the smallest set of tokens whose probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    # A token is dropped when the tokens before it already reach p (so the top token is always kept).
    drop_sorted = (probs.cumsum(-1) - probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One (V,) row of logits -> one token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """(B, V) logits -> B token ids. Greedy rows are batched; sampled rows use their own generator."""
    tokens = torch.argmax(logits, dim=-1).tolist()  # one sync for the whole batch
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[i] = sample_row(logits[i], p, g)
    return tokens
