"""Gates on an ``AsyncLLM``'s engine thread, so a test forces the interleaving it asserts instead of hoping the
machine's speed gives it (issue 34, item 7). They use the engine's ``fault_hook``, which the engine thread calls
inside every step, before the forward pass, with the step's sequences: a gate that waits there pauses the engine
between two tokens, and nothing else (the event loop, the clients) is held."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from labkit.core.sequence import Sequence
from labkit.serving import AsyncLLM

GUARD_S = 60.0  # only a guard against a hang


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def commands_waiting(async_llm: AsyncLLM) -> bool:
    """An add or abort has been sent to the engine thread and not yet taken."""
    return not async_llm._commands.empty()


@contextlib.contextmanager
def engine_held_after(async_llm: AsyncLLM, num_tokens: int) -> Iterator[threading.Event]:
    """Once a request has ``num_tokens`` output tokens, the engine thread pauses until the block ends (or the
    yielded event is set): no request can finish meanwhile, however fast the machine. Read the engine's state
    directly while it is held (``engine_state()`` needs the engine thread)."""
    release, held = threading.Event(), threading.Event()

    def hold(seqs: list[Sequence]) -> None:
        if any(s.num_output_tokens >= num_tokens for s in seqs):
            held.set()
            release.wait(GUARD_S)

    engine = async_llm.llm.engine
    engine.fault_hook = hold
    try:
        yield held
    finally:
        engine.fault_hook = None
        release.set()


def admit_each_arrival_before_stepping_on(async_llm: AsyncLLM, num_requests: int) -> None:
    """Until ``num_requests`` requests have been in the engine, a step with fewer pauses until the next request's
    add has been sent: requests that a client sends together then share steps on any machine."""
    engine = async_llm.llm.engine
    seen: set[int] = set()

    def hold(seqs: list[Sequence]) -> None:
        seen.update(s.seq_id for s in engine.unfinished_sequences())
        if len(seen) < num_requests:
            wait_for(lambda: commands_waiting(async_llm), "the next request's add")

    engine.fault_hook = hold
