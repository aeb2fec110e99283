"""When each request is sent: Poisson or gamma (bursty) arrivals at a request rate, as vLLM draws them.

Real users do not arrive on a metronome. ``vllm bench serve`` draws the gap before each request
from a gamma distribution with shape ``burstiness`` and mean ``1 / request_rate``:

* ``burstiness = 1``: exponential gaps, a Poisson process (independent users);
* ``burstiness < 1``: the same mean rate in bursts separated by lulls (what breaks servers);
* ``burstiness > 1``: more even gaps; ``inf``: a fixed gap of exactly ``1 / request_rate``;
* ``request_rate = inf``: every request at once (a throughput test: the queue is full from the start).

Like vLLM, the cumulative times are then scaled so the last request goes out at ``n / request_rate``:
the offered load is exactly the rate asked for, whatever the seed.

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``num_requests`` requests is sent (non-decreasing)."""
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests/s (inf: all at once), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1: Poisson; < 1: burstier; inf: fixed gaps), got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (num_requests / request_rate) / times[-1]
    return [float(t) for t in times]
