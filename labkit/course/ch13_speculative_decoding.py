"""Checker for notebook 13 (``13_speculative_decoding``): the acceptance rule.

The Build task is a ``RejectionSampler`` subclass whose ``verify`` keeps or replaces each proposed token. The
checker asks three things of it, the same assertions tests/core/spec_decode and tests/course make:

1. greedy (point masses): accept while the proposal is the target's argmax, then emit the target's argmax;
2. the distribution: on a 6-token vocabulary, with proposals drawn from a q far from the target's p, the tokens it
   emits at each position follow p (a chi-square test per position, fixed seeds, false alarm rate 1e-6 each);
3. inside the engine: ``LLM(..., speculative_config={..., "rejection_sampler_cls": cls})`` gives plain greedy
   decoding's tokens, and every KV block comes back.
"""

from __future__ import annotations

import torch

from labkit.core.sampler import draw
from labkit.core.spec_decode.rejection_sampler import RejectionSampler, one_hot
from labkit.course import Check, CheckResult, run_checker

ALPHA = 1e-6  # false alarm rate of each chi-square test: a correct rule fails about once in a million seeds
NUM_TRIALS = 6000
# The target's p at positions 1, 2 and the bonus position 3, and a proposer's q far from it (6-token vocabulary).
TARGET_P = torch.tensor([[0.50, 0.20, 0.10, 0.10, 0.05, 0.05],
                         [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
                         [0.10, 0.30, 0.10, 0.30, 0.10, 0.10]], dtype=torch.float64)
DRAFT_Q = torch.tensor([[0.10, 0.10, 0.20, 0.20, 0.20, 0.20],
                        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]], dtype=torch.float64)


def chi_square_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """P(chi-square >= the statistic) for counts ``observed`` (V,) against a distribution ``probs`` (V,) with no
    zero entry; V - 1 degrees of freedom (the chi-square survival function is the upper regularised gamma)."""
    n = float(observed.sum())
    expected = n * probs
    stat = float(((observed - expected) ** 2 / expected).sum())
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def emitted_counts(sampler: RejectionSampler, num_trials: int = NUM_TRIALS, seed: int = 0) -> torch.Tensor:
    """(3, V) how often each token was emitted at positions 1, 2, 3, over ``num_trials`` verifications of two
    proposals drawn from ``DRAFT_Q``."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(TARGET_P.shape, dtype=torch.float64)
    for _ in range(num_trials):
        proposed = [int(draw(q, gen)) for q in DRAFT_Q]
        emitted = sampler.verify(TARGET_P.clone(), proposed, DRAFT_Q.clone(), gen)
        for pos, token in enumerate(emitted[:3]):
            counts[pos, int(token)] += 1
    return counts


def distribution_problems(sampler: RejectionSampler, seed: int = 0) -> list[str]:
    """What the chi-square tests reject, position by position (empty: the emitted tokens follow the target)."""
    counts = emitted_counts(sampler, seed=seed)
    problems = []
    for pos in range(TARGET_P.shape[0]):
        n = int(counts[pos].sum())
        if n < 100:
            problems.append(f"only {n} of {NUM_TRIALS} verifications emitted a token at position {pos + 1}: "
                            "accepted proposals must be emitted, then one token more")
            continue
        pvalue = chi_square_pvalue(counts[pos], TARGET_P[pos])
        if pvalue < ALPHA:
            freq = ", ".join(f"{c / n:.2f}" for c in counts[pos].tolist())
            want = ", ".join(f"{p:.2f}" for p in TARGET_P[pos].tolist())
            problems.append(f"tokens emitted at position {pos + 1} have frequencies [{freq}] where the target's p is "
                            f"[{want}] (chi-square p-value {pvalue:.1e} < {ALPHA:g}): the output is not distributed "
                            "as the target")
    return problems


def greedy_problems(sampler: RejectionSampler) -> list[str]:
    """Point masses (greedy): accept while the proposal is the target's argmax, then emit the target's argmax."""
    vocab, problems = 6, []
    target = [3, 1, 4, 0]  # the target's argmax at positions 1..4
    p = one_hot(target, vocab, torch.zeros(1, dtype=torch.float64))
    for proposed, want in (([3, 1, 4], [3, 1, 4, 0]), ([3, 5, 4], [3, 1]), ([2, 1, 4], [3]), ([3, 1, 2], [3, 1, 4])):
        q = one_hot(proposed, vocab, p)
        got = sampler.verify(p.clone(), list(proposed), q, torch.Generator().manual_seed(0))
        if not isinstance(got, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in got):
            problems.append(f"verify must return a list of ints, got {got!r}")
            break
        if got != want:
            problems.append(f"greedy: target argmax {target}, proposals {proposed}: emit {want} (accept while equal, "
                            f"then the target's own token), got {got}")
    return problems


ENGINE_PROMPTS = ["Once upon a time, there was a proud boy. His name was Harry. Every day, Nora would play the drum "
                  "with his mom. One foggy morning, He saw a basket of cookies to the water. Soon, Once upon a time",
                  "The little dog"]


def engine_problems(cls: type[RejectionSampler], model: str = "labkit-tiny") -> list[str]:
    """The rule inside engine ``chunked`` with prompt lookup: plain greedy tokens, every block back."""
    from labkit import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    with LLM(model, engine="chunked", block_size=4) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(ENGINE_PROMPTS, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "rejection_sampler_cls": cls}
    with LLM(model, engine="chunked", block_size=4, speculative_config=spec) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)]
        bm, stats = llm.engine.block_manager, llm.engine.spec_decoding_stats
        problems = []
        if got != want:
            problems.append(f"inside the engine, greedy speculative decoding gave {got} where plain decoding gives "
                            f"{want}")
        if stats.num_accepted_tokens == 0:
            problems.append("inside the engine no proposal was ever accepted (prompt lookup proposes the quoted story)")
        if bm.num_free_blocks != bm.num_blocks:
            problems.append(f"{bm.num_used_blocks} KV blocks still in use after every request finished")
    return problems


def check_rejection_sampler(cls: type[RejectionSampler], model: str = "labkit-tiny") -> CheckResult:
    """Task 1: ``cls`` (a ``RejectionSampler`` subclass) keeps the target's distribution, exactly."""

    def body(check: Check) -> None:
        if not (isinstance(cls, type) and issubclass(cls, RejectionSampler)):
            check.expect(False, f"expected a subclass of labkit.core.spec_decode.RejectionSampler, got {cls!r}")
            return
        sampler = cls()
        for problem in greedy_problems(sampler):
            check.expect(False, problem)
        if not check.result.failures:
            for problem in distribution_problems(sampler):
                check.expect(False, problem)
        if not check.result.failures:
            for problem in engine_problems(cls, model):
                check.expect(False, problem)

    return run_checker(
        "Task 1 (the acceptance rule)",
        "for each proposal x at position i: u = uniform(generator, p.device); accept if u * q[i][x] < p[i][x]; at the "
        "first rejection emit draw_from((p[i] - q[i]).clamp(min=0), generator) and stop; if all are accepted emit "
        "draw_from(p[k], generator), the bonus token.",
        body,
    )
