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
from labkit.course.hints import Hints

ALPHA = 1e-6  # false alarm rate of each chi-square test: a correct rule fails about once in a million seeds
# Staged hints (labkit.course.hints): a question, the rule in words, code-level (printed only when asked).
ACCEPTANCE_HINTS = Hints(
    concept=("A token y can come out two ways: proposed and kept, or drawn after a rejection. With what probability "
             "must a proposal x be kept so that the two ways together give y exactly the target's p(y)? And what "
             "must the rule return when the proposer and the target agree on every token?"),
    rule=("Keep proposal x with probability min(1, p(x) / q(x)), from one uniform draw made with the request's "
          "generator; at the first rejection emit a draw from the residual max(0, p - q), normalised, and stop; "
          "when all k are kept, emit one more token drawn from the target's last row (the bonus)."),
    code=("for i, x in enumerate(draft_token_ids): keep x if uniform(generator, p.device) * q[i][x] < p[i][x]; "
          "else return emitted + [draw_from((p[i] - q[i]).clamp(min=0), generator)]; after the loop append "
          "draw_from(target_probs[k], generator)."),
    by_failure={
        "returns": "verify returns a plain list of Python ints (int(t) of a tensor element).",
        "greedy": "With point masses the rule reduces to: keep while the proposal is the target's argmax, then "
                  "the target's own token; a bonus when everything was kept.",
        "no-ratio": "How likely a proposal is to be kept depends on both distributions: the target's p(x) and the "
                    "proposer's q(x).",
        "generator": "Every random number of a request comes from its own generator (the `generator` argument).",
        "residual": "After a rejection, which tokens still need probability? Those where the target wants more "
                    "than the proposer offered.",
        "distribution": "Count how each token can come out (kept, or drawn after a rejection) and add the two up.",
        "engine": "The engine keeps what verify returns and rolls back the rest: return only the emitted tokens.",
    },
)
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


def verifications(sampler: RejectionSampler, num_trials: int = NUM_TRIALS, seed: int = 0
                  ) -> list[tuple[list[int], list[int]]]:
    """(proposed, emitted) of ``num_trials`` verifications of two proposals drawn from ``DRAFT_Q``."""
    gen = torch.Generator().manual_seed(seed)
    runs = []
    for _ in range(num_trials):
        proposed = [int(draw(q, gen)) for q in DRAFT_Q]
        runs.append((proposed, [int(t) for t in sampler.verify(TARGET_P.clone(), proposed, DRAFT_Q.clone(), gen)]))
    return runs


def counts_of(runs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    counts = torch.zeros(TARGET_P.shape, dtype=torch.float64)
    for _, emitted in runs:
        for pos, token in enumerate(emitted[:3]):
            counts[pos, token] += 1
    return counts


def emitted_counts(sampler: RejectionSampler, num_trials: int = NUM_TRIALS, seed: int = 0) -> torch.Tensor:
    """(3, V) how often each token was emitted at positions 1, 2, 3, over ``num_trials`` verifications of two
    proposals drawn from ``DRAFT_Q``."""
    return counts_of(verifications(sampler, num_trials, seed))


def step_problems(runs: list[tuple[list[int], list[int]]]) -> list[str]:
    """Name the step that is wrong, from position 1 alone: how often each proposal x was kept, against
    min(1, p(x) / q(x)) (a binomial z-score above 6: no false alarm in practice), and whether a replacement after
    a rejection ever lies outside the residual max(0, p - q)."""
    p, q = TARGET_P[0], DRAFT_Q[0]
    problems = []
    for x in range(p.numel()):
        kept = [emitted[0] == x for proposed, emitted in runs if proposed[0] == x]
        want = min(1.0, float(p[x] / q[x]))
        if len(kept) < 50:
            continue
        freq = sum(kept) / len(kept)
        spread = max((want * (1 - want) / len(kept)) ** 0.5, 1 / len(kept))
        if abs(freq - want) / spread > 6:
            problems.append(f"at position 1 you kept proposal {x} in {freq:.0%} of the {len(kept)} times it was "
                            f"proposed, where the target's p({x}) = {float(p[x]):.2f} and the proposer's q({x}) = "
                            f"{float(q[x]):.2f}: a proposal must be kept with probability min(1, p(x) / q(x)) = "
                            f"{want:.2f}, the ratio of the two")
            return problems
    outside = sorted({emitted[0] for proposed, emitted in runs if emitted[0] != proposed[0] and p[emitted[0]] <=
                      q[emitted[0]]})
    if outside:
        problems.append(f"after a rejection at position 1 you emitted token(s) {outside}, where p <= q: the "
                        "replacement must come from the residual max(0, p - q) (normalised), which is 0 there; "
                        "drawing from p counts those tokens twice")
    return problems


def generator_problems(sampler: RejectionSampler, num_trials: int = 200) -> list[str]:
    """The request's generator must drive every draw: the same seed gives the same tokens whatever the global RNG
    holds, and another seed other tokens."""
    def emitted(request_seed: int, global_seed: int) -> list[list[int]]:
        torch.manual_seed(global_seed)  # a rule that draws from the global RNG changes with it
        gen = torch.Generator().manual_seed(request_seed)  # the only randomness: proposals are fixed (kept half
        return [sampler.verify(TARGET_P.clone(), [2, 0], DRAFT_Q.clone(), gen)  # the time at position 1)
                for _ in range(num_trials)]

    state = torch.get_rng_state()
    try:
        first, again, other = emitted(1, 101), emitted(1, 202), emitted(2, 101)
    finally:
        torch.set_rng_state(state)
    if first != again:
        return ["the same request seed gave different tokens when the global RNG changed: draw every random number "
                "with the request's generator (the `generator` argument: uniform(generator, ...), "
                "draw_from(..., generator)), not with None or torch's global RNG, so a seeded request is "
                "reproducible whatever else runs"]
    if first == other:
        return ["two different request seeds gave the very same tokens: your rule does not draw its random numbers "
                "from the request's generator (the `generator` argument)"]
    return []


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
            why = "accept while equal, then the target's own token"
            wrong = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
            if wrong < len(proposed) and got[wrong:wrong + 1] == [proposed[wrong]] != [target[wrong]]:
                x = proposed[wrong]
                why = (f"you kept proposal {x} at position {wrong + 1}, where the target's p({x}) = 0 and the "
                       f"proposer's q({x}) = 1: keep a proposal only with probability min(1, p(x) / q(x)), the "
                       "ratio of the target's p to the proposer's q (here 0)")
            problems.append(f"greedy: target argmax {target}, proposals {proposed}: emit {want}, got {got} ({why})")
    return problems


ENGINE_PROMPTS = ["Once upon a time, there was a proud boy. His name was Harry. Every day, Nora would play the drum "
                  "with his mom. One foggy morning, He saw a basket of cookies to the water. Soon, Once upon a time",
                  "The little dog"]


def engine_problems(cls: type[RejectionSampler], model: str = "labkit-tiny") -> list[str]:
    """The rule inside engine ``chunked`` with prompt lookup: plain greedy tokens, every block back."""
    from labkit import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # float32 on every device: exactness holds up to the numerics, and bfloat16 near-ties can flip on a GPU.
    with LLM(model, engine="chunked", block_size=4, dtype="float32") as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(ENGINE_PROMPTS, params, use_tqdm=False)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "rejection_sampler_cls": cls}
    with LLM(model, engine="chunked", block_size=4, dtype="float32", speculative_config=spec) as llm:
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
            because = "returns" if "list of ints" in problem else "no-ratio" if "p(x) / q(x)" in problem else "greedy"
            check.expect(False, problem, because=because)
        stages = ((generator_problems, "generator"), (lambda s: step_problems(verifications(s)), "step"),
                  (distribution_problems, "distribution"))
        for problems_of, because in stages:  # each stage only once the ones before it pass
            if check.result.failures:
                return
            for problem in problems_of(sampler):
                check.expect(False, problem, because=("residual" if "residual" in problem else "no-ratio")
                             if because == "step" else because)
        if not check.result.failures:
            for problem in engine_problems(cls, model):
                check.expect(False, problem, because="engine")

    return run_checker("", "", body, task_id="13.verify")
