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
from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.course.ch02_naive_generation.naive_loop import (
    GREEDY,
    SAMPLED,
    STOP_RULES,
    engine_with_stop_rule,
    watching_next_token,
)
from labkit.course.harness.compare import RUN_FAILURES, check_setups, require_subclass

TOP_P_HINTS = Hints(
    concept="Top-p keeps the smallest set of most likely tokens whose probability reaches p. Which token decides "
            "whether the set is complete, and where do the kept tokens sit in the vocabulary afterwards?",
    rule="Sort by probability; keep a token while the probability before it is still below p (so the token that "
         "crosses p stays); drop the rest by setting their logits to -inf, in the vocabulary's own order.",
    code="probs, order = softmax(logits).sort(descending=True); drop = probs.cumsum(0) - probs >= p; mask = drop "
         "scattered back to vocabulary order (mask[order] = drop); logits[mask] = -inf",
    by_failure={
        "shape": "the result has the logits' shape: one value per vocabulary entry",
        "nucleus": "the token that makes the kept probability reach p is kept; the set is taken in order of "
                   "probability, then put back in vocabulary order",
        "values": "kept tokens keep their logits unchanged",
    },
)

NEXT_TOKEN_HINTS = Hints(
    concept="The model returns one row of logits per position of its input. Which row predicts the token that comes "
            "after the sequence? And what must a sampled request's draw depend on, so the same seed gives the same "
            "text again?",
    rule="Run the model over the whole sequence so far, positions counted from 0. Only the last position's logits "
         "predict the next token. A greedy request takes their most likely token; a sampled one draws from them "
         "after its temperature, top-k and top-p, with its own random generator. Return the token id as a plain "
         "integer.",
    code="ids = torch.tensor([seq.token_ids]) and positions = torch.arange(T)[None] (both (1, T)); logits = "
         "self.model(ids, positions)[0, -1]; greedy: int(logits.argmax()); sampled: sample_row(logits, seq.params, "
         "seq.generator).",
    by_failure={
        **RUN_FAILURES,
        "stopped": "next_token takes a sequence and returns one token id (an int); it must not change the sequence",
        "transformers": "a wrong greedy token means the wrong logits: which position's row did you read, and were the "
                        "positions those of the tokens?",
        "sampling": "with temperature > 0 the token is drawn, not the argmax, and with the request's own generator",
        "reference": "a sampled request must draw exactly as labkit does with the same seed: the same filters "
                     "(temperature, top-k, top-p) and one draw from the request's generator",
    },
)

STOP_HINTS = Hints(
    concept="A request can end for several reasons: it has produced enough tokens, the model said it is done, the "
            "text contains a stop string, or the context is full. Which of them is the caller's wish, which the "
            "model's, and what must the answer say about which one fired?",
    rule="After each new token decide, in a fixed order: a stop string in the text stops with that string; an "
         "end-of-sequence token stops unless the request ignores it; a stop token id stops with that id; reaching "
         "max_tokens output tokens or the model's max length ends on length. Otherwise go on (None). The answer is "
         "the finish reason and what stopped it.",
    code="in this order: seq.detokenizer.stop_reason -> ('stop', the string); the last token in seq.eos_token_ids "
         "and not params.ignore_eos -> ('stop', None); the last token in params.stop_token_ids -> ('stop', the "
         "token); num_output_tokens >= max_tokens or num_tokens >= max_model_len -> ('length', None); else None.",
    by_failure={
        **RUN_FAILURES,
        "stopped": "check_stop returns None to go on, or a pair (finish reason, what stopped it)",
        "reference": "each request must stop at the same token, with the same finish reason and stop reason, as "
                     "labkit's rule: which condition did it meet first?",
        "num-steps": "a request stopped too early or too late: count the output tokens, and read max_tokens as "
                     "the number of output tokens",
    },
)

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
                         f"p={p}: expected a tensor of shape {tuple(logits.shape)}, got {out!r}", because="shape")
            if not isinstance(out, torch.Tensor) or out.shape != logits.shape:
                continue
            kept = torch.isfinite(out).tolist()
            check.expect(kept == keep, f"probs={probs}, p={p}: kept {kept}, expected {keep}", because="nucleus")
            survivors = torch.isfinite(out)
            check.expect(bool(torch.equal(out[survivors], logits[survivors])),
                         f"p={p}: surviving logits must keep their values", because="values")

    return run_checker("Task 1 (apply_top_p)", "", body, task_id="02.top_p")


def check_next_token(cls: type[NaiveEngine], model: str = "labkit-tiny") -> CheckResult:
    """Task 2: ``cls`` (a ``NaiveEngine`` subclass) picks each next token as engine ``naive`` must."""

    def body(check: Check) -> None:
        engine = watching_next_token(require_subclass(cls, NaiveEngine, "class MyEngine(NaiveEngine): ..."))
        check_setups(check, (GREEDY, SAMPLED), model, "next_token", "labkit's own engine", engine=engine)

    return run_checker("Task 2 (next_token)", "", body, task_id="02.next_token")


def check_stop_rule(fn: Callable[[Sequence], object], model: str = "labkit-tiny") -> CheckResult:
    """Task 3: ``fn(seq)`` stops every request when, and as, the stop rule says, run inside engine ``naive``."""

    def body(check: Check) -> None:
        if not callable(fn):
            raise TypeError(f"expected the stop rule as a function check_stop(seq), got {fn!r}")
        check_setups(check, (STOP_RULES,), model, "check_stop", "labkit's own engine", engine=engine_with_stop_rule(fn))

    return run_checker("Task 3 (check_stop)", "", body, task_id="02.check_stop")
