"""Timing device work honestly: warm up, synchronise, then read the clock (CUDA events on GPU).

Introduced in notebook 00 (``00_setup_and_hardware``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from labkit.core.device import synchronize


def time_fn(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn``, one entry per repeat, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        # Events are recorded on the stream, so they time the kernels, not the Python that queued them.
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def wrap_timed(owner: object, name: str, into: list[float]) -> Callable[[], None]:
    """Replace ``owner.name`` by a wrapper that adds each call's wall time to ``into[0]`` (on the CPU calls are
    synchronous, so that is the time they take); returns a function that puts the original back."""
    original = getattr(owner, name)

    def wrapper(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[0] += time.perf_counter() - start

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, original)


@contextmanager
def timing_calls(owner: object, name: str, into: list[float]) -> Iterator[None]:
    """``wrap_timed`` for the duration of a ``with`` block (the original is back even if the block raises)."""
    restore = wrap_timed(owner, name, into)
    try:
        yield
    finally:
        restore()
