"""Ctrl-C (the notebook's ■ button) during an engine step: held until the step ends, so it never lands half-way
through the block manager's books; pressed a second time, it interrupts at once. Notebook 07.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) until the block ends, then raise KeyboardInterrupt; a second Ctrl-C raises at once.

    Only in the main thread, and only over Python's default handler (as in a notebook cell); two signal
    calls per step, a few microseconds.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if pending:  # pressed twice: the user wants out now (e.g. a step that never ends)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        pending.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    if previous is not signal.default_int_handler:  # Ctrl-C is handled (or ignored) by someone else: leave it so
        signal.signal(signal.SIGINT, previous)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if pending:
            raise KeyboardInterrupt  # now that the step is over (this also wins over a StepFailedError)
