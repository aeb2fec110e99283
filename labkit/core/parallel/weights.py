"""Each rank's weights, cut in the driver: ``shard_state_dict`` slices a whole model's state dict for one rank.

The driver cuts every rank's share from the whole model it loaded and hands it to the rank (shared memory, no
copy on the way); a rank builds its sharded modules on the meta device (no memory for the whole model), then
loads its share (``build_rank_model``). The attention part is a function, ``shard_attention_weights`` by default,
so a learner's version (notebook 15's Build task) runs inside the engine: ``TensorParallelEngineCore`` calls its
``shard_attention`` for every rank, in the driver's process. Introduced in notebook 15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.core.model import CausalLM, ModelConfig
from labkit.core.model.loader import _materialise
from labkit.core.parallel.group import TPGroup
from labkit.core.parallel.heads import head_rows, head_shard
from labkit.core.parallel.shard import shard_model_

# (one layer's attention weights by short name, the whole model's config, world size, rank) -> the rank's slices
AttentionSharder = Callable[[dict[str, torch.Tensor], ModelConfig, int, int], dict[str, torch.Tensor]]
ATTENTION_KEYS = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
                  "o_proj.weight")
ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")  # held as RowParallelLinear.linear.weight


def shard_attention_weights(weights: dict[str, torch.Tensor], config: ModelConfig, world_size: int,
                            rank: int) -> dict[str, torch.Tensor]:
    """labkit's attention shard: q/k/v rows of this rank's heads (with their biases), o_proj's matching columns."""
    shard, d = head_shard(config, world_size, rank), config.head_dim
    q_rows, kv_rows = head_rows(shard.q_heads, d), head_rows(shard.kv_heads, d)
    out = {}
    for name, tensor in weights.items():
        if name.startswith("q_proj"):
            out[name] = tensor[q_rows]  # (H/N * d, hidden) or (H/N * d,)
        elif name.startswith(("k_proj", "v_proj")):
            out[name] = tensor[kv_rows]  # (KV/N * d, hidden): split, or the one replicated head
        else:  # o_proj: the input features its heads produce
            out[name] = tensor[:, q_rows]  # (hidden, H/N * d)
    return out


def shard_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, world_size: int, rank: int,
                     shard_attention: AttentionSharder = shard_attention_weights) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state dict, named as its sharded model's parameters: attention by ``shard_attention``, the
    MLP by intermediate feature, everything else whole (the same tensors, not copies)."""
    shard = head_shard(config, world_size, rank)
    features = torch.arange(*shard.intermediate)
    out: dict[str, torch.Tensor] = {}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.self_attn."
        weights = {k: state[prefix + k] for k in ATTENTION_KEYS if prefix + k in state}
        for k, v in shard_attention(weights, config, world_size, rank).items():
            out[prefix + k] = v
        mlp = f"model.layers.{i}.mlp."
        out[mlp + "gate_proj.weight"] = state[mlp + "gate_proj.weight"][features]  # (I/N, hidden)
        out[mlp + "up_proj.weight"] = state[mlp + "up_proj.weight"][features]
        out[mlp + "down_proj.weight"] = state[mlp + "down_proj.weight"][:, features]  # (hidden, I/N)
    for name, tensor in state.items():
        if name not in out and ".self_attn." not in name and ".mlp." not in name:
            out[name] = tensor  # embeddings, norms, lm_head: replicated
        elif ".self_attn." in name and name.split(".self_attn.")[1] not in ATTENTION_KEYS:
            out[name] = tensor  # q/k norms
    return {rename(k): v.contiguous() for k, v in out.items()}


def rename(name: str) -> str:
    """A whole model's parameter name -> the sharded model's (row-parallel layers wrap their shard)."""
    for suffix in ROW_PARALLEL:
        if name.endswith(suffix):
            return name[: -len("weight")] + "linear.weight"
    return name


def load_rank_state(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    """Load a rank's share into its sharded model; a clear error naming the first tensor whose shape is wrong."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in state.items():
        if name in params and params[name].shape != tensor.shape:
            raise ValueError(f"{name}: the shard has shape {tuple(tensor.shape)}, this rank's model expects "
                             f"{tuple(params[name].shape)} (its heads' rows of q/k/v, its heads' columns of o_proj)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"a rank's state dict does not match its sharded model: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")


def build_rank_model(config: ModelConfig, state: dict[str, torch.Tensor], group: TPGroup, device: torch.device,
                     dtype: torch.dtype) -> CausalLM:
    """A rank's sharded model: modules built on the meta device and sharded (shapes only), then its share loaded."""
    model = _materialise(config, device, dtype, reshape=lambda m: shard_model_(m, group))
    load_rank_state(model, state)
    return model.eval()
