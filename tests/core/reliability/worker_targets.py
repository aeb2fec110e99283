"""Entry points for the worker-process tests (importable in a spawned process)."""

from __future__ import annotations

import sys
import time


def serve_forever() -> None:
    """Stays up until killed (a stand-in for a worker serving its link)."""
    while True:
        time.sleep(0.1)


def raise_at_once() -> None:
    print("worker: about to fail", file=sys.stderr, flush=True)
    raise ValueError("planted start-up fault in the worker")


def exit_cleanly() -> None:
    return None
