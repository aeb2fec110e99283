"""Tensor parallelism in the simulator: a worker of TP degree t computes each step in 1/t of the time and adds the
all-reduces of its row-parallel layers (two per decoder layer, each of (tokens, hidden) values, ring-priced).

A ``ClusterSpec`` takes a degree per phase (``prefill_tp``, ``decode_tp``; colocated engines use ``decode_tp``) and
counts every rank as a device, so goodput per device compares TP x P:D layouts on equal hardware (DistServe picks
a parallelism per phase this way). Perfect 1/t scaling of the fitted compute is an idealisation: it holds for
memory-bound decode (each rank streams 1/t of the weights) better than for small prefills. Introduced in notebook
15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from labkit.measure.sim.cost_model import StepCostModel, StepShape


@dataclass(frozen=True)
class TensorParallelSpec:
    """What tensor parallelism costs per step: the all-reduces and the link between a worker's ranks. Notebook 15."""

    num_all_reduces: int = 0  # per step: 2 x decoder layers
    bytes_per_token: int = 0  # per all-reduce: hidden_size x bytes per value
    link_bandwidth: float = math.inf  # bytes/s per direction between a worker's ranks
    link_latency: float = 0.0  # s per all-reduce

    def all_reduce_time(self, num_tokens: int, degree: int) -> float:
        """One step's all-reduces at TP degree ``degree`` for ``num_tokens`` tokens (0 at degree 1)."""
        if degree <= 1:
            return 0.0
        ring = 2 * (degree - 1) / degree * num_tokens * self.bytes_per_token / self.link_bandwidth
        return self.num_all_reduces * (self.link_latency + ring)


class TensorParallelCost:
    """A fitted ``StepCostModel`` at TP degree ``degree``: compute / degree + the all-reduces. Notebook 15."""

    def __init__(self, cost: StepCostModel, degree: int, spec: TensorParallelSpec) -> None:
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise ValueError(f"a tensor-parallel degree must be an int >= 1, got {degree!r}")
        self.cost = cost
        self.degree = degree
        self.spec = spec

    def step_time(self, shape: StepShape) -> float:
        tokens = shape.num_prefill_tokens + shape.num_decode_rows
        return self.cost.step_time(shape) / self.degree + self.spec.all_reduce_time(tokens, self.degree)
