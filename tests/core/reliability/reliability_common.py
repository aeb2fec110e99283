"""What the reliability tests share: the engines under test, the prompts, the ``Fault`` hook, and small helpers.

Reliability is checked through ``LLM``, for every engine. Outputs are compared in float64 with a reference that
runs one request at a time over a contiguous cache (the ``reference`` fixture in this folder's conftest), so any
corruption left behind by a fault, an interrupt, an abort or a preemption shows up as a changed token. Here:
``ALL`` and ``PAGED`` (the engines to parametrize over), ``PROMPTS``, the ``Reference`` type, ``batch_options``
(small batches, so a fault hits some requests and not others), ``tokens`` and ``greedy`` (to compare outputs),
``make`` (a float64 ``LLM`` on the tiny checkpoint) and ``Fault`` (an engine fault hook that raises at one step).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from labkit import ENGINES, LLM, RequestOutput, SamplingParams
from labkit.core.sequence import Sequence

ALL = list(ENGINES)
PAGED = ["paged", "continuous", "chunked"]
PROMPTS = ["Once upon a time", "The little fox ran to the", "One day, Lily went to the park with her mom",
           "There once was a kind seal", "A big red"]

Reference = Callable[[list, list[SamplingParams]], list[list[list[int]]]]


def batch_options(engine: str) -> dict[str, object]:
    """Small batches, so a fault or an interrupt hits some requests and not others."""
    return {} if engine == "naive" else {"max_num_seqs": 2}


def tokens(outs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def make(tiny: Path, engine: str, **options: object) -> LLM:
    return LLM(str(tiny), engine=engine, dtype="float64", **{**batch_options(engine), **options})


class Fault:
    """Fault hook: raises ``error`` at the ``at``-th step (counting from 1), remembering that step's sequences."""

    def __init__(self, at: int, error: BaseException) -> None:
        self.at, self.error, self.calls = at, error, 0
        self.hit: list[Sequence] = []

    def __call__(self, seqs: list[Sequence]) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.hit = list(seqs)
            raise self.error
