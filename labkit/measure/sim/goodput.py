"""Goodput two ways, on the simulator: vLLM's (SLO-meeting requests per second at one rate) and DistServe's.

``goodput_at_rate`` is what notebook 09 measures: the requests that met every SLO, per second of the run, at the
rate offered. DistServe (Zhong et al., OSDI 2024) defines a deployment's per-GPU goodput differently: the highest
request rate at which a given share of requests (the attainment target, e.g. 90%) meets the SLOs, divided by the
number of GPUs. ``distserve_goodput`` finds that rate by bisection on the simulator (attainment falls as the rate
rises, up to the noise of one Poisson draw; the search brackets the first crossing). Introduced in notebook 12
(``12_disaggregated_prefill``).
"""

from __future__ import annotations

from collections.abc import Callable

from labkit.measure.loadgen.metrics import count_good_requests
from labkit.measure.sim.cluster import ClusterSpec, SimRequest, SimResult, simulate
from labkit.measure.sim.cost_model import StepCostModel

Workload = Callable[[float], list[SimRequest]]  # a request rate (req/s) -> the requests offered at that rate


def attainment(result: SimResult, slos_ms: dict[str, float]) -> float:
    """The share of requests that met every SLO."""
    return count_good_requests(result.records, slos_ms) / len(result.records)


def goodput_at_rate(result: SimResult, slos_ms: dict[str, float]) -> float:
    """vLLM's and notebook 09's goodput: SLO-meeting requests per second of the run, per device."""
    return result.goodput_per_device(slos_ms)


def distserve_goodput(workload: Workload, cost: StepCostModel, spec: ClusterSpec, slos_ms: dict[str, float],
                      target: float = 0.9, low: float = 0.01, high: float = 100.0, steps: int = 12) -> float:
    """DistServe's per-device goodput: the highest rate (req/s) at which ``attainment >= target``, over the
    cluster's devices; 0 when even ``low`` misses the target. ``high`` is raised until attainment misses it."""
    if not 0 < target <= 1:
        raise ValueError(f"the attainment target is a share in (0, 1], got {target}")

    def meets(rate: float) -> bool:
        return attainment(simulate(workload(rate), cost, spec, slos_ms), slos_ms) >= target

    if not meets(low):
        return 0.0
    for _ in range(8):  # find a rate that misses the target
        if not meets(high):
            break
        low, high = high, high * 4
    else:
        return high / spec.num_devices
    for _ in range(steps):  # geometric bisection: rates span orders of magnitude
        mid = (low * high) ** 0.5
        low, high = (mid, high) if meets(mid) else (low, mid)
    return low / spec.num_devices
