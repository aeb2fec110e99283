"""Fixtures for the reliability tests: the tiny random Llama checkpoint, its float64 reference, one shared
``LLM`` per engine for the bad-input tests, and Python's default Ctrl-C handler for the signal tests.

The module-scoped fixtures are built once per test module. The root conftest (``tests/conftest.py``) still
runs paged engines with per-step invariant checks and provides ``random_checkpoint``.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from labkit import LLM, SamplingParams

from .reliability_common import Reference, batch_options, tokens


@pytest.fixture(scope="module")
def tiny(random_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return random_checkpoint("llama")


@pytest.fixture(scope="module")
def reference(tiny: Path) -> Reference:
    """Each prompt's completions from the simplest schedule: one request at a time, contiguous cache, float64."""
    ref = LLM(str(tiny), engine="kvcache", dtype="float64", max_num_seqs=1)

    def run(prompts: list, params: list[SamplingParams]) -> list[list[list[int]]]:  # type: ignore[type-arg]
        return tokens(ref.generate(prompts, params, use_tqdm=False))

    return run


@pytest.fixture(scope="module")
def llms(tiny: Path) -> Callable[[str], LLM]:
    """One float64 LLM per engine with a 64-token context, shared by the bad-input tests."""
    made: dict[str, LLM] = {}

    def get(engine: str) -> LLM:
        if engine not in made:
            made[engine] = LLM(str(tiny), engine=engine, dtype="float64", max_model_len=64, **batch_options(engine))
        return made[engine]

    return get


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own Ctrl-C handler, as in a terminal or a notebook kernel. A process started in the background by
    a script (``cmd &``) inherits SIGINT ignored, and there the engine rightly leaves Ctrl-C alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
