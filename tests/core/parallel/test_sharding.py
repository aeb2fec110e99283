"""Tensor-parallel sharding in one process (ranks as threads, ``run_ranks``): every rank's output equals the unsharded
model's, in float64 to rounding and in float32 within 1e-5 (relative to the output's scale); the shares of heads,
K/V heads (split or replicated) and features; the step message; the options' errors. Fast: no process starts."""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.core.attention.metadata import PagedAttentionMetadata
from labkit.core.engine.config import PagedConfig
from labkit.core.model import ModelConfig, random_model
from labkit.core.model.linear import Linear
from labkit.core.parallel.executor import check_devices
from labkit.core.parallel.heads import check_tensor_parallel, head_shard
from labkit.core.parallel.layers import RowParallelLinear
from labkit.core.parallel.local_group import run_ranks
from labkit.core.parallel.messages import pack_step, payload_len, unpack_step
from labkit.core.parallel.shard import shard_model_
from labkit.core.parallel.weights import build_rank_model, shard_state_dict
from labkit.core.presets import engine_preset


def config(kind: str, heads: int = 4, kv: int = 2) -> ModelConfig:
    return ModelConfig(model_type=kind, vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, max_position_embeddings=128,
                       attention_bias=kind == "qwen2", qk_norm=kind == "qwen3")


def model_with_biases(cfg: ModelConfig, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    model = random_model(cfg, torch.device("cpu"), dtype, seed=1)
    with torch.no_grad():  # random (not zero) q/k/v biases, so a misplaced bias shard would show
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


def sharded_outputs(model, world_size: int, ids: torch.Tensor) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    positions = torch.arange(ids.shape[1])[None]

    def rank(group):  # type: ignore[no-untyped-def]
        mine = copy.deepcopy(model)
        shard_model_(mine, group)
        return mine.compute_logits(mine(ids, positions))

    return run_ranks(world_size, rank)


@pytest.mark.parametrize(("kind", "heads", "kv", "n"), [
    ("llama", 4, 2, 2),  # K/V heads split: one per rank
    ("qwen2", 4, 1, 2),  # fewer K/V heads than ranks: replicated; q/k/v biases sharded with their heads
    ("qwen3", 8, 2, 4),  # q/k norms, 4 ranks, K/V replicated on 2 ranks each
    ("llama", 8, 8, 4),  # plain multi-head attention
])
def test_every_rank_computes_the_unsharded_logits_in_float64(kind: str, heads: int, kv: int, n: int) -> None:
    model = model_with_biases(config(kind, heads, kv), torch.float64)
    ids = torch.randint(0, 96, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = model.compute_logits(model(ids, torch.arange(11)[None]))
    outs = sharded_outputs(model, n, ids)
    for out in outs:
        torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)
    assert all(torch.equal(out, outs[0]) for out in outs)  # the all-reduce gives every rank the same sums


def test_float32_within_tolerance() -> None:
    model = model_with_biases(config("qwen2", 4, 2), torch.float32)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        reference = model.compute_logits(model(ids, torch.arange(9)[None]))
    out = sharded_outputs(model, 2, ids)[0]
    scale = reference.abs().max()
    assert (out - reference).abs().max() <= 1e-5 * scale  # the stated float32 tolerance: sums in another order


def test_shares_of_heads_features_and_kv() -> None:
    split = head_shard(config("llama", 8, 4), 2, 1)
    assert (split.q_heads, split.kv_heads, split.kv_replicated, split.intermediate) == ((4, 8), (2, 4), False,
                                                                                        (48, 96))
    replicated = [head_shard(config("llama", 8, 2), 4, r) for r in range(4)]
    assert [s.kv_heads for s in replicated] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert all(s.kv_replicated and s.num_heads == 2 for s in replicated)


def test_a_sharded_model_holds_its_share_and_its_pool_shape() -> None:
    model = random_model(config("llama", 4, 2), torch.device("cpu"), torch.float32)

    def rank(group):  # type: ignore[no-untyped-def]
        mine = copy.deepcopy(model)
        shard_model_(mine, group)
        attn = mine.model.layers[0].self_attn
        return mine.config.num_key_value_heads, attn.q_proj.weight.shape, attn.o_proj.linear.weight.shape

    assert run_ranks(2, rank) == [(1, (32, 64), (64, 32))] * 2


def test_row_parallel_adds_its_bias_once() -> None:
    full = Linear(8, 3, bias=True)
    with torch.no_grad():
        full.bias.fill_(1.0)
    x = torch.randn(2, 8)
    outs = run_ranks(2, lambda g: RowParallelLinear(full, g)(x[:, 4 * g.rank : 4 * g.rank + 4]))
    torch.testing.assert_close(outs[0], full(x))


@pytest.mark.parametrize(("heads", "kv", "n", "message"), [
    (6, 2, 4, "must divide num_attention_heads=6"),
    (12, 6, 4, "must divide num_key_value_heads=6"),
    (12, 4, 6, "larger than num_key_value_heads=4 but not a multiple"),
    (8, 2, 0, "tensor_parallel_size must be an int >= 1"),
])
def test_uneven_splits_are_named(heads: int, kv: int, n: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config("llama", heads, kv), n)


def test_options_and_devices_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="does not take option.*tensor_parallel_size"):
        engine_preset("paged", {"tensor_parallel_size": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        PagedConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="enforce_eager=False .* not supported with tensor_parallel_size"):
        PagedConfig(tensor_parallel_size=2, enforce_eager=False).use_cuda_graphs("cuda")
    assert not PagedConfig(tensor_parallel_size=2).use_cuda_graphs("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 CUDA devices .* has 1"):
        check_devices(torch.device("cuda:0"), 2)


def test_the_step_message_round_trips() -> None:
    meta = PagedAttentionMetadata(query_lens=[3, 1], context_lens=[3, 18], block_tables=[[4], [0, 2, 7]],
                                  slot_mapping=torch.tensor([64, 65, 66, 113]))
    head, payload = pack_step(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 1, 2, 17]]), meta, [(2, 9)])
    assert payload.numel() == payload_len(head)
    step = unpack_step(head, payload, torch.device("cpu"))
    assert step.input_ids.tolist() == [5, 6, 7, 8] and step.positions.tolist() == [0, 1, 2, 17]
    assert (step.meta.query_lens, step.meta.context_lens, step.meta.block_tables) == ([3, 1], [3, 18],
                                                                                      [[4], [0, 2, 7]])
    assert step.meta.slot_mapping.tolist() == [64, 65, 66, 113] and step.copies == [(2, 9)]


def test_rank_models_built_from_the_drivers_cut_equal_the_whole_model() -> None:
    model = model_with_biases(config("qwen2", 4, 1), torch.float64)  # biases; one K/V head, replicated
    whole = {k: v.detach() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(7)[None]
    with torch.inference_mode():
        reference = model.compute_logits(model(ids, positions))

    def rank(group):  # type: ignore[no-untyped-def]
        state = shard_state_dict(whole, model.config, 2, group.rank)
        mine = build_rank_model(model.config, state, group, torch.device("cpu"), torch.float64)
        assert mine.config.num_key_value_heads == 1 and mine.config.intermediate_size == 48
        return mine.compute_logits(mine(ids, positions))

    for out in run_ranks(2, rank):
        torch.testing.assert_close(out, reference, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("options", "message"), [
    ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 must divide num_attention_heads=8"),
    ({"tensor_parallel_size": 2, "async_scheduling": True}, "async_scheduling=True is not supported"),
    ({"tensor_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "speculative_config is not supported"),
    ({"tensor_parallel_size": 2, "quantization": "int8"}, "quantization is not supported with tensor parallelism"),
])
def test_llm_refuses_what_it_cannot_shard_before_starting_a_rank(bundled_path, options, message) -> None:  # type: ignore[no-untyped-def]
    from labkit import LLM

    with pytest.raises(ValueError, match=message):
        LLM(str(bundled_path), engine="continuous", device="cpu", **options)
