"""A small model of one decode step under tensor parallelism: weight streaming against ring all-reduces.

Decode at small batches is memory-bound (notebook 04): a step costs about the time to stream the weights from
memory, and with N ranks each streams 1/N of them. Tensor parallelism adds two all-reduces per layer of
(batch, hidden) values. A ring all-reduce over N ranks sends 2 (N - 1) / N of the buffer over each link, plus a
fixed latency per all-reduce. The bandwidths are public specifications (per direction); the latencies are
assumptions of the right order for a small all-reduce among the GPUs of one node, named as such:

* PCIe 4.0 x16: 32 GB/s (PCI-SIG, 16 GT/s x 16 lanes); PCIe 5.0 x16: 64 GB/s (32 GT/s);
* NVLink 4 on H100 SXM: 450 GB/s (NVIDIA H100 datasheet: 900 GB/s total, both directions);
* H100 SXM HBM3: 3.35 TB/s (NVIDIA H100 datasheet), for every link (a PCIe card's HBM is slower: not modelled);
* latency per all-reduce (assumed): 20 µs on PCIe 4.0, 15 µs on PCIe 5.0, 5 µs on NVLink.

Model shapes are the public ``config.json`` values of Llama 3.1 8B and 70B. Notebook 15.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    """An interconnect: bandwidth per direction (bytes/s, a spec) and an assumed latency per all-reduce.
    Notebook 15."""

    name: str
    bandwidth: float
    latency_s: float


@dataclass(frozen=True)
class ModelScale:
    """What a decode step moves: parameters (bf16 here), the hidden size and the layers. Notebook 15."""

    name: str
    num_params: float
    hidden_size: int
    num_layers: int


LINKS = {
    "PCIe 4.0 x16": LinkSpec("PCIe 4.0 x16", 32e9, 20e-6),
    "PCIe 5.0 x16": LinkSpec("PCIe 5.0 x16", 64e9, 15e-6),
    "NVLink 4 (H100)": LinkSpec("NVLink 4 (H100)", 450e9, 5e-6),
}
SCALES = {
    "8B": ModelScale("Llama 3.1 8B", 8.03e9, 4096, 32),
    "70B": ModelScale("Llama 3.1 70B", 70.6e9, 8192, 80),
}
H100_HBM_BANDWIDTH = 3.35e12  # bytes/s


def all_reduce_bytes_per_token(hidden_size: int, dtype_bytes: int) -> int:
    """One all-reduce's buffer per token: the (hidden,) output of a row-parallel layer."""
    return hidden_size * dtype_bytes


def ring_all_reduce_seconds(num_bytes: float, world_size: int, link: LinkSpec) -> float:
    """A ring all-reduce of ``num_bytes`` over ``world_size`` ranks: 2 (N-1)/N of it over each link, plus the
    link's latency."""
    if world_size == 1:
        return 0.0
    return 2 * (world_size - 1) / world_size * num_bytes / link.bandwidth + link.latency_s


@dataclass(frozen=True)
class StepCost:
    """One modelled decode step: its compute (weight streaming) and its communication, in seconds. Notebook 15."""

    compute_s: float
    comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.total_s


def decode_step(scale: ModelScale, batch: int, world_size: int, link: LinkSpec,
                memory_bandwidth: float = H100_HBM_BANDWIDTH, dtype_bytes: int = 2) -> StepCost:
    """A decode step of ``batch`` tokens on ``world_size`` ranks: weights/N streamed, 2 all-reduces per layer."""
    compute = scale.num_params * dtype_bytes / world_size / memory_bandwidth
    per_all_reduce = ring_all_reduce_seconds(batch * all_reduce_bytes_per_token(scale.hidden_size, dtype_bytes),
                                             world_size, link)
    return StepCost(compute, 2 * scale.num_layers * per_all_reduce)
