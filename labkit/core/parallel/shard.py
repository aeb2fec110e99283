"""Shard a whole ``CausalLM`` in place for one tensor-parallel rank (Megatron-style).

In every decoder layer: q/k/v keep this rank's heads (column-parallel; the merged q/k/v matmul is rebuilt over the
shards), o_proj becomes row-parallel with its all-reduce; gate/up keep this rank's intermediate features
(column-parallel), down_proj becomes row-parallel. Two all-reduces per layer, each of (tokens, hidden) values.
Everything else (embeddings, norms, q/k norms, RoPE, lm_head) stays whole on every rank. The model's ``config``
becomes the rank's local one (``heads.local_config``), so a KV pool built from it holds this rank's heads only.
The model code itself is unchanged: its forward pass reads the head counts from the attention module, and the
sharded layers sit where the whole ones were. Introduced in notebook 15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.core.model import CausalLM
from labkit.core.model.attention import Attention
from labkit.core.model.layers import MLP, MergedLinear
from labkit.core.parallel.group import TPGroup
from labkit.core.parallel.heads import HeadShard, head_rows, head_shard, local_config
from labkit.core.parallel.layers import RowParallelLinear, shard_columns_


def shard_attention_(attn: Attention, shard: HeadShard, group: TPGroup) -> None:
    """q/k/v column-parallel by head, o_proj row-parallel; the module computes ``shard.num_heads`` heads."""
    d = attn.head_dim
    shard_columns_(attn.q_proj, head_rows(shard.q_heads, d))  # (H/N * d, hidden)
    shard_columns_(attn.k_proj, head_rows(shard.kv_heads, d))  # (KV/N * d, hidden), or one replicated head
    shard_columns_(attn.v_proj, head_rows(shard.kv_heads, d))
    attn.qkv_proj = MergedLinear(attn.q_proj, attn.k_proj, attn.v_proj)  # one matmul over the shards again
    attn.o_proj = RowParallelLinear(attn.o_proj, group)  # type: ignore[assignment]  # rows = this rank's heads
    attn.n_heads, attn.n_kv_heads = shard.num_heads, shard.num_kv_heads


def shard_mlp_(mlp: MLP, shard: HeadShard, group: TPGroup) -> None:
    """gate/up column-parallel by intermediate feature, down_proj row-parallel."""
    rows = torch.arange(*shard.intermediate)
    shard_columns_(mlp.gate_proj, rows)  # (I/N, hidden)
    shard_columns_(mlp.up_proj, rows)
    mlp.gate_up = MergedLinear(mlp.gate_proj, mlp.up_proj)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, group)  # type: ignore[assignment]


def check_shardable(model: CausalLM) -> None:
    """A clear error unless every projection is a plain ``nn.Linear`` (a quantized layer's packing is not cut)."""
    layer = model.model.layers[0]
    for name, part in (("q_proj", layer.self_attn.q_proj), ("down_proj", layer.mlp.down_proj)):
        if not isinstance(part, nn.Linear):  # e.g. a quantized layer (notebook 14)
            raise ValueError(f"tensor_parallel_size > 1 shards nn.Linear layers; {name} is a {type(part).__name__} "
                             "(quantization is not supported with tensor parallelism)")


def shard_model_(model: CausalLM, group: TPGroup) -> HeadShard:
    """Shard ``model`` in place for ``group.rank`` of ``group.world_size``; returns the rank's share. A clear error
    (before anything changes) if the model does not split evenly."""
    shard = head_shard(model.config, group.world_size, group.rank)
    if group.world_size == 1:
        return shard
    check_shardable(model)
    for layer in model.model.layers:
        shard_attention_(layer.self_attn, shard, group)
        shard_mlp_(layer.mlp, shard, group)
    model.config = local_config(model.config, shard)
    return shard
