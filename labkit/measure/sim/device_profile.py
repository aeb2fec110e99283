"""A step-cost model for a GPU-class device, from public specifications rather than measurements.

The simulator's calibrated cost model describes this machine (a laptop CPU, a tiny model): there a prefill token
costs almost as much as a decode step, so disaggregation rarely pays. On a datacenter GPU running a real model the
balance differs: a decode step reads all the weights (bandwidth-bound, milliseconds) while a prefill token costs
microseconds of tensor-core time, and the prefill's attention grows with the square of the prompt. ``gpu_cost_model``
builds a ``StepCostModel`` from a model's shape (``labkit.core.model.presets``) and a card's datasheet figures, so the
simulator can show that regime on a laptop. The constants are documented, not measured; the efficiencies are
stated assumptions (the fraction of the peak a well-tuned engine reaches). Introduced in notebook 12
(``12_disaggregated_prefill``).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.core.model.config import ModelConfig
from labkit.measure.roofline import kv_bytes_per_token, matmul_params_per_layer
from labkit.measure.sim.cost_model import StepCostModel


@dataclass(frozen=True)
class GpuSpec:
    """A card's datasheet figures and the efficiencies assumed for it. Notebook 12."""

    name: str
    dense_flops: float  # 16-bit tensor-core FLOP/s, dense (no sparsity)
    memory_bandwidth: float  # bytes/s
    source: str  # where the figures come from
    flops_efficiency: float = 0.6  # share of the peak a prefill's matmuls reach (an assumption)
    bandwidth_efficiency: float = 0.8  # share of the bandwidth a decode step's reads reach (an assumption)
    step_overhead: float = 0.5e-3  # s per step: scheduling, launches, sampling with CUDA graphs (an assumption)


# NVIDIA H100 SXM5 datasheet: 989 TFLOPS dense BF16 tensor (1,979 with sparsity), 3.35 TB/s HBM3.
H100_SXM = GpuSpec("H100 SXM", 989e12, 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 dense, HBM3)")
# Interconnects, per direction, from their specifications: NVLink 4 (H100) 450 GB/s; InfiniBand NDR 400 Gb/s per
# port; 100 Gb Ethernet; PCIe 5.0 x16 64 GB/s (inside one host).
LINKS = {"NVLink 4 (spec)": 450e9, "InfiniBand NDR (spec)": 50e9, "PCIe 5.0 x16 (spec)": 64e9,
         "100 Gb Ethernet (spec)": 12.5e9}


def gpu_cost_model(config: ModelConfig, card: GpuSpec = H100_SXM, dtype_bytes: int = 2) -> StepCostModel:
    """Seconds per unit of each ``StepShape`` feature for ``config`` on ``card``: a step reads every weight once
    (plus its fixed overhead); a prompt token costs its matmul FLOPs, a (query, key) pair of a prompt its attention
    FLOPs; a decode row its matmul FLOPs, and each key a decode reads its KV bytes."""
    flops = card.dense_flops * card.flops_efficiency
    bandwidth = card.memory_bandwidth * card.bandwidth_efficiency
    per_token_flops = 2 * config.num_hidden_layers * matmul_params_per_layer(config)
    per_pair_flops = 4 * config.num_attention_heads * config.head_dim * config.num_hidden_layers  # QK^T and AV
    return StepCostModel.of(
        step=config.num_params * dtype_bytes / bandwidth + card.step_overhead,
        prefill_tokens=per_token_flops / flops,
        prefill_attention=per_pair_flops / flops,
        decode_rows=per_token_flops / flops,
        decode_context=kv_bytes_per_token(config, dtype_bytes) / bandwidth,
    )
