"""The analytical roofline model: exact counts for a tiny config, GQA savings, intensity trends, MBU/MFU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from labkit.core.model import PRESETS, CausalLM, ModelConfig
from labkit.measure.hardware import DeviceRoof
from labkit.measure.roofline import (
    StepCost,
    attended_keys,
    decode_cost,
    kv_bytes_per_token,
    kv_cache_bytes,
    matmul_params_per_layer,
    mbu,
    mfu,
    prefill_cost,
    step_cost,
)

# vocab 32, hidden 8, intermediate 16, 2 layers, 4 query heads sharing 2 K/V heads of dim 2.
TINY = ModelConfig(
    model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=2, max_position_embeddings=64,
    tie_word_embeddings=True,
)
# Per layer: q 8x8=64, k 8x4=32, v 32, o 64 -> 192 attention; gate/up/down 3x8x16=384; two norms 16.
TINY_MATMUL_PER_LAYER = 576  # 192 + 384
TINY_PARAMS = 1448  # 2 layers x (576 + 16) + embeddings 32x8=256 (tied: once) + final norm 8
TINY_KV_PER_TOKEN_BF16 = 32  # 2 (K,V) x 2 layers x 2 kv heads x 2 head_dim x 2 bytes


def roof(bandwidth: float = 1e11, flops: float = 1e12) -> DeviceRoof:
    return DeviceRoof(device="cpu", device_name="test", dtype="float32", memory_bandwidth=bandwidth,
                      read_bandwidth=bandwidth, copy_bandwidth=bandwidth, matmul_flops=flops, matmul_size=0,
                      buffer_bytes=0, num_threads=1)


def test_tiny_config_counts() -> None:
    assert TINY.num_params == TINY_PARAMS
    assert matmul_params_per_layer(TINY) == TINY_MATMUL_PER_LAYER
    assert kv_bytes_per_token(TINY, 2) == TINY_KV_PER_TOKEN_BF16
    assert kv_cache_bytes(TINY, 100, 2) == 3200
    assert attended_keys(1, 10) == 11  # a decode query sees the 10 cached keys and itself
    assert attended_keys(5, 0) == 15  # causal prefill: 1 + 2 + 3 + 4 + 5, about half of 5 x 5


def test_decode_cost_by_hand() -> None:
    # batch 3, 10 tokens cached, bf16 (2 bytes)
    cost = decode_cost(TINY, batch_size=3, context_len=10, dtype_bytes=2)
    linear = 2 * 2 * 576 * 3  # 2 FLOP/MAC x 2 layers x 576 weights x 3 tokens = 6912
    lm_head = 2 * 8 * 32 * 3  # one logit row per sequence = 1536
    attention = 2 * 2 * 4 * 2 * 11 * 3 * 2  # (QK^T + AV) x heads x head_dim x 11 keys x 3 seqs x 2 layers = 2112
    assert cost == StepCost(flops=linear + lm_head + attention, weight_bytes=1448 * 2, kv_read_bytes=3 * 10 * 32,
                            kv_write_bytes=3 * 32)
    assert cost.flops == 10560
    assert cost.total_bytes == 2896 + 960 + 96 == 3952
    assert cost.arithmetic_intensity == 10560 / 3952


def test_prefill_cost_by_hand() -> None:
    # 2 prompts of 5 tokens, float32 (4 bytes), empty cache
    cost = prefill_cost(TINY, batch_size=2, prompt_len=5, dtype_bytes=4)
    assert cost == step_cost(TINY, 2, 5, 0, 4)
    assert cost.flops == 2 * 2 * 576 * 10 + 2 * 8 * 32 * 2 + 2 * 2 * 4 * 2 * 15 * 2 * 2 == 25984
    assert cost.weight_bytes == 1448 * 4
    assert cost.kv_read_bytes == 0  # nothing cached yet; the prompt's own K/V are written
    assert cost.kv_write_bytes == 10 * 64
    assert cost.activation_bytes == 0


def test_untied_embedding_table_counts_only_gathered_rows() -> None:
    untied = dataclasses.replace(TINY, tie_word_embeddings=False)
    assert untied.num_params == TINY_PARAMS + 256  # a separate (32, 8) lm_head
    # decode, batch 3: lm_head's full 256 weights are read, of the input table only 3 rows of 8.
    assert decode_cost(untied, 3, 10, 1).weight_bytes == 1448 + 3 * 8
    # a prefill of 40 positions gathers at most all 32 rows: every parameter once.
    assert prefill_cost(untied, 1, 40, 1).weight_bytes == untied.num_params


def test_gqa_divides_kv_bytes() -> None:
    mha = dataclasses.replace(TINY, num_key_value_heads=4)
    gqa2 = dataclasses.replace(TINY, num_key_value_heads=2)
    gqa4 = dataclasses.replace(TINY, num_key_value_heads=1)
    assert kv_bytes_per_token(mha, 2) == 2 * kv_bytes_per_token(gqa2, 2) == 4 * kv_bytes_per_token(gqa4, 2)
    assert kv_cache_bytes(mha, 1000, 2) == 4 * kv_cache_bytes(gqa4, 1000, 2)
    for cfg, ratio in ((gqa2, 2), (gqa4, 4)):
        assert decode_cost(mha, 4, 500, 2).kv_read_bytes == ratio * decode_cost(cfg, 4, 500, 2).kv_read_bytes
    # Llama-3.1-8B: 32 query heads, 8 K/V heads -> 128 KiB per token in bf16 (vs 512 KiB with MHA).
    assert kv_bytes_per_token(PRESETS["llama3.1-8b"], 2) == 128 * 1024


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_weight_bytes_match_the_model(name: str) -> None:
    cfg = PRESETS[name]
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = CausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params  # parameters() skips the tied duplicate
    layer = model.model.layers[0]
    assert sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear)) == matmul_params_per_layer(cfg)
    for batch in (1, 8):
        cost = decode_cost(cfg, batch, 128, 2)
        unread = 0 if cfg.tie_word_embeddings else (cfg.vocab_size - batch) * cfg.hidden_size
        assert cost.weight_bytes == (cfg.num_params - unread) * 2
        if cfg.tie_word_embeddings:
            assert cost.weight_bytes == cfg.num_params * 2


def test_decode_intensity_is_about_the_batch_size() -> None:
    cfg = PRESETS["smollm2-135m"]
    # bf16: FLOPs ~ 2 x params x B, bytes ~ params x 2, so FLOP/byte ~ B while weights dominate the bytes.
    intensities = {b: decode_cost(cfg, b, 16, 2).arithmetic_intensity for b in (1, 2, 4, 8, 16, 32)}
    for b, ai in intensities.items():
        assert 0.8 * b < ai < 1.05 * b, (b, ai)
    assert all(intensities[2 * b] / intensities[b] > 1.8 for b in (1, 2, 4, 8, 16))  # ~linear in the batch
    # Long contexts add KV reads that scale with the batch too, so intensity stops growing with B.
    assert decode_cost(cfg, 32, 4096, 2).arithmetic_intensity < 0.5 * intensities[32]
    # Prefill reuses every weight for every prompt token: hundreds of FLOPs per byte.
    prefill = prefill_cost(cfg, 1, 512, 2).arithmetic_intensity
    assert prefill > 100 * intensities[1]
    assert prefill_cost(cfg, 1, 1, 2).flops == pytest.approx(decode_cost(cfg, 1, 0, 2).flops)


def test_mbu_and_mfu() -> None:
    cost = StepCost(flops=2_000_000_000, weight_bytes=900_000_000, kv_read_bytes=90_000_000,
                    kv_write_bytes=10_000_000)
    # 1 GB in 20 ms = 50 GB/s on a 100 GB/s roof; 2 GFLOP in 20 ms = 100 GFLOP/s on a 1 TFLOP/s roof.
    assert mbu(cost, 0.02, roof()) == pytest.approx(0.5)
    assert mfu(cost, 0.02, roof()) == pytest.approx(0.1)
    assert mbu(cost, 0.01, roof(bandwidth=5e10)) == pytest.approx(2.0)  # above 1: the roof was mis-measured


def test_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        step_cost(TINY, 0, 1, 0, 2)
    with pytest.raises(ValueError, match="context_len"):
        decode_cost(TINY, 1, -1, 2)
