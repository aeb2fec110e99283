"""Timing device work honestly: warm up, synchronise, then read the clock (CUDA events on GPU).

``time_call`` is the one way labkit.measure times a call: synchronise the device, read ``time.perf_counter``, call,
synchronise again, read it again (``interleave``, ``time_fn`` off CUDA and the benchmarks all use it). ``time_fn``
repeats it after a warm-up. ``wrap_timed`` / ``timing_calls`` add up the time spent inside a method during a longer
run (CPU only: they do not synchronise). Introduced in notebook 00 (``00_setup_and_hardware``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

from labkit.core.device import synchronize

T = TypeVar("T")


def time_call(fn: Callable[[], T], device: str | torch.device = "cpu") -> tuple[T, float]:
    """Call ``fn`` once; its result and the seconds it took, queued device work included.

    Synchronising before the first clock read keeps work queued by earlier code out of the figure; synchronising
    before the second puts the work ``fn`` queued (and did not wait for) into it.
    """
    dev = torch.device(device)
    synchronize(dev)
    start = time.perf_counter()
    result = fn()
    synchronize(dev)
    return result, time.perf_counter() - start


def time_fn(fn: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn``, one entry per repeat, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        # Events are recorded on the stream, so they time the kernels, not the Python that queued them.
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return times
    return [time_call(fn, device)[1] for _ in range(repeats)]


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
