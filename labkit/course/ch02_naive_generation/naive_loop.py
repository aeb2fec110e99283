"""What the checkers of notebook 02's Build tasks watch: the naive engine's generation loop, written by the learner.

Task 2 overrides ``NaiveEngine.next_token(seq) -> int``: one forward pass over the whole sequence, the last position's
logits, and the next token from them, greedy or sampled with the request's parameters and its seeded generator.
Task 3 writes the stop rule ``check_stop(seq)`` (``labkit.core.sched.stop.check_stop``): once a token is recorded,
whether the request is done and why; engine ``naive`` calls it from ``NaiveEngine.check_stop``. Both run inside the
real engine (``LLM(..., engine=MyEngine)``). Here: the workloads the checkers (``labkit.course.ch02_naive_generation``)
run through the harness (``labkit.course.harness``), and the watching engines they run the learner's part in (a token
must be returned, not appended; each stop decision is compared with labkit's rule at the very token it is made).
Notebook 02.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch

from labkit.core.engine.naive import NaiveEngine
from labkit.core.sched.stop import StopDecision, check_stop
from labkit.core.sequence import FinishReason, Sequence
from labkit.course.harness.runs import Mistake, Request, Setup

# Shortest prompt first, so the first request that differs is the smallest failing case.
GREEDY = Setup("3 greedy requests", (
    Request("R0", "The dog ran to the park. He saw", max_tokens=8),
    Request("R1", "Once upon a time, there was a little fox named Lily.", max_tokens=8),
    Request("R2", "One day, Tom found a red ball under the big tree. He", max_tokens=8),
), engine="naive")
SAMPLED = Setup("3 sampled requests (seeded)", (
    Request("S0", "Lily was happy.", max_tokens=8, temperature=0.8, seed=1),
    Request("S1", "The dog ran to the park. He saw", max_tokens=8, temperature=1.3, top_k=20, seed=2),
    Request("S2", "The sun was hot. Tom was happy.", max_tokens=8, temperature=0.7, top_p=0.8, seed=3),
), engine="naive")
# One request per stop rule, with max_model_len 32. Token 951 (" Finn") is R1's fourth greedy token; "One day"
# continues with "." and then the end-of-turn token <|end|>; R4's text reaches "play" at its fourth token.
STOP_MAX_MODEL_LEN = 32
STOP_RULES = Setup("6 requests, one per stop rule", (
    Request("R0", "Lily was happy.", max_tokens=5, ignore_eos=False),
    Request("R1", "The dog ran to the park. He saw", max_tokens=12, stop_token_ids=(951,)),
    Request("R2", "One day", max_tokens=10, ignore_eos=False),
    Request("R3", "One day", max_tokens=6),
    Request("R4", "Lily was happy.", max_tokens=12, stop=("play",), ignore_eos=False),
    Request("R5", "The sun was hot. Tom was happy.", max_tokens=None),
), engine="naive", max_model_len=STOP_MAX_MODEL_LEN)


def watching_next_token(cls: type[NaiveEngine]) -> type[NaiveEngine]:
    """``cls``, whose ``next_token`` must return a token id (an int in the vocabulary) and leave the sequence alone."""

    class Watched(cls):  # type: ignore[valid-type, misc]
        def next_token(self, seq: Sequence) -> int:
            before = list(seq.token_ids)
            token = super().next_token(seq)
            where = f"output token {seq.num_output_tokens}: your next_token"
            if seq.token_ids != before:
                raise Mistake(f"{where} changed the sequence ({len(before)} -> {seq.num_tokens} tokens): return the "
                              "new token; the engine appends it and then applies the stop rule")
            if isinstance(token, torch.Tensor):
                raise Mistake(f"{where} returned a tensor ({token!r}): return the token id as a Python int, "
                              "e.g. int(torch.argmax(logits))")
            if isinstance(token, bool) or not isinstance(token, numbers.Integral):
                raise Mistake(f"{where} returned {token!r} ({type(token).__name__}); it must return a token id (int)")
            if not 0 <= token < self.model.config.vocab_size:
                raise Mistake(f"{where} returned {token}, not a token id (the vocabulary has "
                              f"{self.model.config.vocab_size} tokens: 0 .. {self.model.config.vocab_size - 1})")
            return int(token)

    Watched.__name__ = Watched.__qualname__ = cls.__name__  # messages name the learner's class
    return Watched


def as_decision(returned: object) -> StopDecision | None:
    """What a learner's ``check_stop`` returned, as (FinishReason, stop reason) or None; Mistake if malformed."""
    if returned is None:
        return None
    reasons = (FinishReason.STOP, FinishReason.LENGTH)
    if isinstance(returned, tuple) and len(returned) == 2 and returned[0] in reasons:
        return FinishReason(returned[0]), returned[1]
    raise Mistake(f"your check_stop returned {returned!r}: return None to go on, or a pair (finish reason, stop "
                  "reason) such as ('length', None), ('stop', None) or ('stop', token_id)")


def explain(seq: Sequence, decision: StopDecision | None) -> str:
    """Why labkit's rule decides ``decision`` for ``seq`` at its newest token."""
    token, p = seq.output_token_ids[-1], seq.params
    if decision is None:
        why = (f"nothing says stop yet: {seq.num_output_tokens} output tokens (max_tokens {p.max_tokens}), "
               f"{seq.num_tokens} tokens in all (max_model_len {seq.max_model_len})")
        if token in seq.eos_token_ids:
            why += f"; token {token} is an end-of-sequence token, but ignore_eos is True"
        return why
    reason, stop_reason = decision
    if isinstance(stop_reason, str):
        return f"the text now contains the stop string {stop_reason!r} (seq.detokenizer.stop_reason)"
    if reason == FinishReason.STOP and stop_reason is None:
        return f"token {token} is an end-of-sequence token (seq.eos_token_ids) and ignore_eos is False"
    if reason == FinishReason.STOP:
        return f"token {token} is in params.stop_token_ids (they apply even with ignore_eos)"
    if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
        return f"{seq.num_output_tokens} output tokens reach max_tokens {p.max_tokens}"
    return f"the sequence's {seq.num_tokens} tokens fill the context (max_model_len {seq.max_model_len})"


def show(decision: StopDecision | None) -> str:
    return "None (go on)" if decision is None else repr((decision[0].value, decision[1]))


def engine_with_stop_rule(fn: Callable[[Sequence], object]) -> type[NaiveEngine]:
    """Engine ``naive`` whose stop rule is ``fn``, and whose every stop decision must be labkit's rule's decision at
    that very token."""

    class MyEngine(NaiveEngine):
        def check_stop(self, seq: Sequence) -> StopDecision | None:
            returned = fn(seq)
            got, want = as_decision(returned), check_stop(seq)
            if got != want:
                raise Mistake(f"after output token {seq.num_output_tokens - 1} (id {seq.output_token_ids[-1]}), your "
                              f"check_stop returned {show(got)}; expected {show(want)}: {explain(seq, want)}")
            return got

    return MyEngine

