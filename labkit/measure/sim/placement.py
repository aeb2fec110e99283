"""The placement search: which unit of prefill and decode workers to replicate, under SLOs, for the most goodput per
device (DistServe's placement, in miniature).

A deployment is built from replicas of one *unit*: ``n`` colocated engines (``(0, n)``), or ``P`` prefill workers
and ``D`` decode workers (``(P, D)``, both at least 1). Each unit has DistServe's goodput, the highest request rate at
which the attainment target holds (``labkit.measure.sim.goodput.distserve_goodput``); replicas add up, so the unit
to choose is the one with the most goodput **per device**, among those that fit the devices available. Notebook 12's
second Build task writes ``choose_placement``. Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

Goodput = Callable[[int, int], float]  # (num_prefill, num_decode) -> the unit's goodput in req/s; P = 0: colocated


def units(max_devices: int) -> Iterator[tuple[int, int]]:
    """Every unit of at most ``max_devices`` devices: colocated (0, n), then (P, D) with P, D >= 1."""
    if max_devices < 1:
        raise ValueError(f"a unit needs at least one device, got max_devices={max_devices}")
    yield from ((0, n) for n in range(1, max_devices + 1))
    yield from ((p, d) for total in range(2, max_devices + 1) for p in range(1, total) for d in [total - p])


def choose_placement(max_devices: int, goodput: Goodput) -> tuple[int, int]:
    """The unit (P, D) of at most ``max_devices`` devices with the highest goodput per device (P = 0: D colocated
    engines); on a tie, the one with fewer devices (cheaper to replicate), then the first listed."""
    best, best_key = (0, 1), (float("-inf"), 0)
    for p, d in units(max_devices):
        key = (goodput(p, d) / (p + d), -(p + d))
        if key > best_key:
            best, best_key = (p, d), key
    return best
