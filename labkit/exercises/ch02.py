"""Checkers for notebook 02 (``02_naive_generation``).

Task 1 mirrors ``labkit.engine.sampler.apply_top_p``: nucleus (top-p) filtering of one row of logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.exercises import Check, CheckResult, run_checker

_PROBS = [0.5, 0.25, 0.15, 0.07, 0.03]
# (probabilities in vocabulary order, p, which tokens must survive)
TOP_P_CASES: list[tuple[list[float], float, list[bool]]] = [
    (_PROBS, 0.8, [True, True, True, False, False]),  # 0.5 + 0.25 < 0.8: the third token is needed
    (_PROBS, 0.75, [True, True, False, False, False]),  # exactly reached by two tokens
    (_PROBS, 0.1, [True, False, False, False, False]),  # the top token always survives
    (_PROBS, 1.0, [True, True, True, True, True]),  # p = 1 keeps everything
    ([0.07, 0.5, 0.03, 0.15, 0.25], 0.8, [False, True, False, True, True]),  # unsorted vocabulary
]


def check_top_p(fn: Callable[[torch.Tensor, float], torch.Tensor]) -> CheckResult:
    """Task 1: ``fn(logits, p)`` returns logits with the tokens outside the nucleus set to -inf."""

    def body(check: Check) -> None:
        for probs, p, keep in TOP_P_CASES:
            logits = torch.tensor(probs).log()
            out = fn(logits.clone(), p)
            check.expect(isinstance(out, torch.Tensor) and out.shape == logits.shape,
                         f"p={p}: expected a tensor of shape {tuple(logits.shape)}, got {out!r}")
            if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
                continue
            kept = torch.isfinite(out).tolist()
            check.expect(kept == keep, f"probs={probs}, p={p}: kept {kept}, expected {keep}")
            survivors = torch.isfinite(out)
            check.expect(bool(torch.equal(out[survivors], logits[survivors])),
                         f"p={p}: surviving logits must keep their values")

    return run_checker(
        "Task 1 (apply_top_p)",
        "sort by probability, keep a token while the probability mass *before* it is still < p, "
        "then put the mask back in vocabulary order.",
        body,
    )
