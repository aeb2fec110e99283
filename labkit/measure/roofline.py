"""Bytes moved and FLOPs done by one forward step, computed from the model config alone.

A step can go no faster than moving its bytes at the memory-bandwidth roof or doing its FLOPs at
the compute roof (``labkit.measure.hardware``). Which roof binds depends on the step's *arithmetic
intensity*, FLOPs per byte: a decode step multiplies every weight by one vector per sequence
(~2·B FLOPs per weight read, so intensity ≈ batch size), while a prefill step multiplies every
weight by a whole prompt (~2·B·T FLOPs per weight). Introduced in notebook 04
(``04_prefill_vs_decode``); ``kv_bytes_per_token`` is notebook 03's KV-memory calculator.

What is counted (an analytical model, not a trace of what the kernels do):

- weights: every parameter is read once per step, including ``lm_head`` and the norms. With tied
  embeddings the one (vocab, hidden) matrix is counted once: ``lm_head`` reads all of it (every logit
  needs every row) and the embedding lookup's B·T rows come from that same matrix. An *untied*
  input-embedding table is counted only for the rows the lookup gathers (B·T rows, at most vocab):
  nobody reads the rest. So ``weight_bytes == num_params * dtype_bytes`` for tied models and is
  slightly less for untied ones.
- linear FLOPs: 2 per multiply-add, for every weight matrix in the decoder layers, at every one of
  the B·T positions (padding included: it is computed). Biases and norms are elementwise: ignored.
- lm_head FLOPs: only for the positions whose logits are computed, one per sequence (the engines
  call ``compute_logits`` on the last position only).
- attention FLOPs: QKᵀ and AV, each 2·n_heads·head_dim FLOPs per (query, attended key) pair. Query
  i of a step (0-based) after ``context_len`` cached tokens attends to context_len + i + 1 keys, so a
  causal prefill counts about half of the T×T square (what FlashAttention-style kernels do; a masked
  dense kernel computes the full square and throws half away).
- KV read: every cached key and value (``context_len`` tokens) read once per layer per sequence.
  This step's own new K/V are produced in the step, so they count as writes, not reads.
- KV write: the new tokens' K/V, once per layer.
- activations: not modelled (0). For decode they are tiny next to the weights; prefill is
  compute-bound, where bytes matter less.
"""

from __future__ import annotations

from dataclasses import dataclass

# The engine sizes its KV pool with the same formula, so it lives in core; notebooks import it from here.
from labkit.core.kv.paged_pool import kv_bytes_per_token
from labkit.core.model.config import ModelConfig
from labkit.measure.hardware import DeviceRoof


@dataclass(frozen=True)
class StepCost:
    """FLOPs and bytes of one forward step (all sequences of the batch). Notebook 04."""

    flops: int
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    activation_bytes: int = 0  # not modelled by step_cost; kept so a measured value can be added

    @property
    def total_bytes(self) -> int:
        """Every byte the step moves to or from memory."""
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes

    @property
    def arithmetic_intensity(self) -> float:
        """FLOP per byte moved: below the device's ridge point the step is bandwidth-bound."""
        return self.flops / self.total_bytes


def kv_cache_bytes(config: ModelConfig, num_tokens: int, dtype_bytes: int) -> int:
    """Bytes of KV cache holding ``num_tokens`` tokens (summed over sequences). Notebook 03."""
    return num_tokens * kv_bytes_per_token(config, dtype_bytes)


def matmul_params_per_layer(config: ModelConfig) -> int:
    """Weights of one decoder layer that take part in matmuls: q, k, v, o and the three MLP matrices."""
    h = config.hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size


def attended_keys(num_query_tokens: int, context_len: int) -> int:
    """(query, key) pairs of one sequence's causal attention: query i sees context_len + i + 1 keys."""
    t = num_query_tokens
    return t * context_len + t * (t + 1) // 2


def step_cost(
    config: ModelConfig,
    batch_size: int,
    num_query_tokens: int,
    context_len: int,
    dtype_bytes: int,
) -> StepCost:
    """FLOPs and bytes of one step running ``num_query_tokens`` new tokens for each of ``batch_size``
    sequences that already hold ``context_len`` tokens in the KV cache. Notebook 04.

    Prefill: num_query_tokens = prompt length, context_len = 0. Decode: num_query_tokens = 1,
    context_len = tokens already cached. See the module docstring for exactly what is counted.
    """
    if batch_size < 1 or num_query_tokens < 1 or context_len < 0 or dtype_bytes <= 0:
        raise ValueError(f"need batch_size >= 1, num_query_tokens >= 1, context_len >= 0, dtype_bytes > 0; got "
                         f"{batch_size}, {num_query_tokens}, {context_len}, {dtype_bytes}")
    b, t, layers = batch_size, num_query_tokens, config.num_hidden_layers
    h, v = config.hidden_size, config.vocab_size
    num_tokens = b * t  # positions run through the decoder layers

    # Weights: every parameter once; an untied input-embedding table only for the rows gathered.
    embed_rows_read = min(num_tokens, v)
    weight_params = config.num_params if config.tie_word_embeddings else config.num_params - (v - embed_rows_read) * h

    linear_flops = 2 * layers * matmul_params_per_layer(config) * num_tokens
    lm_head_flops = 2 * h * v * b  # logits for the last position of each sequence only
    # QK^T and AV: each 2 * n_heads * head_dim FLOPs per (query, key) pair, per layer.
    attn_flops = 2 * 2 * config.num_attention_heads * config.head_dim * attended_keys(t, context_len) * b * layers

    per_token_kv = kv_bytes_per_token(config, dtype_bytes)
    return StepCost(
        flops=linear_flops + lm_head_flops + attn_flops,
        weight_bytes=weight_params * dtype_bytes,
        kv_read_bytes=b * context_len * per_token_kv,
        kv_write_bytes=num_tokens * per_token_kv,
    )


def prefill_cost(config: ModelConfig, batch_size: int, prompt_len: int, dtype_bytes: int) -> StepCost:
    """One prefill step: ``batch_size`` prompts of ``prompt_len`` tokens, empty cache. Notebook 04."""
    return step_cost(config, batch_size, prompt_len, 0, dtype_bytes)


def decode_cost(config: ModelConfig, batch_size: int, context_len: int, dtype_bytes: int) -> StepCost:
    """One decode step: one new token per sequence, ``context_len`` tokens already cached. Notebook 04."""
    return step_cost(config, batch_size, 1, context_len, dtype_bytes)


def achieved_bandwidth(cost: StepCost, seconds: float) -> float:
    """Bytes per second the step moved, if it took ``seconds``."""
    return cost.total_bytes / seconds


def achieved_flops(cost: StepCost, seconds: float) -> float:
    """FLOP per second the step did, if it took ``seconds``."""
    return cost.flops / seconds


def mbu(cost: StepCost, seconds: float, roof: DeviceRoof) -> float:
    """Model bandwidth utilisation: achieved bytes/s over the measured bandwidth roof. Notebook 04.

    The figure of merit for decode (bandwidth-bound): 1.0 means the step moved its bytes as fast
    as this device can stream memory.
    """
    return achieved_bandwidth(cost, seconds) / roof.memory_bandwidth


def mfu(cost: StepCost, seconds: float, roof: DeviceRoof) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the measured matmul roof. Notebook 04.

    The figure of merit for prefill (compute-bound).
    """
    return achieved_flops(cost, seconds) / roof.matmul_flops
