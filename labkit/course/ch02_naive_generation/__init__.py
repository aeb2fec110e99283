"""Checkers for notebook 02 (``02_naive_generation``).

Task 1 mirrors ``labkit.core.sampler.apply_top_p``: nucleus (top-p) filtering of one row of logits.

Tasks 2 and 3 build engine ``naive``'s generation loop, run as ``LLM(..., engine=MyEngine)``: a ``NaiveEngine``
subclass that overrides ``next_token`` (one forward pass over the whole sequence, then greedy or seeded sampling
from the last position's logits; Task 2), and the stop rule ``check_stop(seq)`` (mirrors
``labkit.core.sched.stop.check_stop``; the engine calls it from its ``check_stop`` method; Task 3). Their checkers run
the engine with the learner's part, watched call by call (``labkit.course.ch02_naive_generation.naive_loop``), on a few
requests of the bundled model through the harness (``labkit.course.harness``), and compare greedy tokens with
transformers', and every token, finish reason and stop reason with labkit's own engine.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.core.engine.naive import NaiveEngine
from labkit.core.sequence import Sequence
from labkit.course import Check, CheckResult, run_checker
from labkit.course.ch02_naive_generation.naive_loop import (
    GREEDY,
    SAMPLED,
    STOP_RULES,
    engine_with_stop_rule,
    watching_next_token,
)
from labkit.course.harness.compare import check_setups, require_subclass

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


def check_next_token(cls: type[NaiveEngine], model: str = "labkit-tiny") -> CheckResult:
    """Task 2: ``cls`` (a ``NaiveEngine`` subclass) picks each next token as engine ``naive`` must."""

    def body(check: Check) -> None:
        engine = watching_next_token(require_subclass(cls, NaiveEngine, "class MyEngine(NaiveEngine): ..."))
        check_setups(check, (GREEDY, SAMPLED), model, "next_token", "labkit's own engine", engine=engine)

    return run_checker(
        "Task 2 (next_token)",
        "run the model over the whole sequence (ids and positions 0 .. T-1, both (1, T)); keep the logits of the "
        "LAST position only; greedy is their argmax, sampled is sample_row(logits, seq.params, seq.generator) "
        "(temperature, top-k, top-p, then one torch.multinomial draw with the request's generator).",
        body,
    )


def check_stop_rule(fn: Callable[[Sequence], object], model: str = "labkit-tiny") -> CheckResult:
    """Task 3: ``fn(seq)`` stops every request when, and as, the stop rule says, run inside engine ``naive``."""

    def body(check: Check) -> None:
        if not callable(fn):
            raise TypeError(f"expected the stop rule as a function check_stop(seq), got {fn!r}")
        check_setups(check, (STOP_RULES,), model, "check_stop", "labkit's own engine", engine=engine_with_stop_rule(fn))

    return run_checker(
        "Task 3 (check_stop)",
        "in this order: a stop string (seq.detokenizer.stop_reason) -> ('stop', the string); an EOS token "
        "(seq.eos_token_ids) unless params.ignore_eos -> ('stop', None); a token of params.stop_token_ids -> "
        "('stop', the token); max_tokens output tokens, or max_model_len tokens in all -> ('length', None); "
        "else None.",
        body,
    )
