"""Timing device work honestly: warm up, synchronise, then read the clock (CUDA events on GPU).

Introduced in notebook 00 (``00_setup_and_hardware``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from labkit.device import synchronize


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
