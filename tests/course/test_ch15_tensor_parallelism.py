"""Notebook 15's checkers: each passes labkit's reference and fails every planted bug, with the failure class whose
hint addresses it. Task (a) is simulated in one process; task (b)'s planted bugs are caught by its in-process stage
(ranks as threads); only the reference's run inside the two-process engine starts processes (marked integration)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from labkit.core.parallel.heads import head_rows, head_shard
from labkit.core.parallel.weights import shard_attention_weights
from labkit.course.ch15_tensor_parallelism import check_column_then_row, check_shard_attention, column_then_row
from labkit.course.ch15_tensor_parallelism.costs import LINKS, SCALES, decode_step, ring_all_reduce_seconds

# ---- Task (a): planted bugs ----


def all_reduce_after_column(x, w1, w2, b2, n, all_reduce):  # type: ignore[no-untyped-def]
    per = w1.shape[0] // n
    hs = all_reduce([F.silu(x @ w1[r * per : (r + 1) * per].T) for r in range(n)])
    parts = [h @ w2[:, r * per : (r + 1) * per].T for r, h in enumerate(hs)]
    return [y + b2 for y in all_reduce(parts)]


def missing_all_reduce(x, w1, w2, b2, n, all_reduce):  # type: ignore[no-untyped-def]
    per = w1.shape[0] // n
    return [F.silu(x @ w1[r * per : (r + 1) * per].T) @ w2[:, r * per : (r + 1) * per].T + b2 for r in range(n)]


def wrong_shard_order(x, w1, w2, b2, n, all_reduce):  # type: ignore[no-untyped-def]
    per = w1.shape[0] // n
    parts = [F.silu(x @ w1[r * per : (r + 1) * per].T) @ w2[:, (n - 1 - r) * per : (n - r) * per].T for r in range(n)]
    return [y + b2 for y in all_reduce(parts)]


def bias_on_every_rank(x, w1, w2, b2, n, all_reduce):  # type: ignore[no-untyped-def]
    per = w1.shape[0] // n
    return all_reduce([F.silu(x @ w1[r * per : (r + 1) * per].T) @ w2[:, r * per : (r + 1) * per].T + b2
                       for r in range(n)])


def test_task_a_passes_the_reference() -> None:
    result = check_column_then_row(column_then_row)
    assert result.passed, result.message()


def test_task_a_fails_each_planted_bug_with_its_class() -> None:
    for bug, because in ((all_reduce_after_column, "column-all-reduce"), (missing_all_reduce, "missing-all-reduce"),
                         (wrong_shard_order, "shard-order"), (bias_on_every_rank, "bias-every-rank")):
        result = check_column_then_row(bug)
        assert result.status == "failed", bug.__name__
        assert because in result.because, (bug.__name__, result.because, result.failures)


# ---- Task (b): planted bugs ----


def kv_not_split(weights, config, n, rank):  # type: ignore[no-untyped-def]
    out = shard_attention_weights(weights, config, n, rank)
    for name in ("k_proj.weight", "v_proj.weight"):
        out[name] = weights[name]  # every rank keeps all K/V heads
    return out


def kv_not_replicated(weights, config, n, rank):  # type: ignore[no-untyped-def]
    d, shard = config.head_dim, head_shard(config, n, rank)
    out = shard_attention_weights(weights, config, n, rank)
    rows = torch.arange(rank * d, (rank + 1) * d)  # K/V head `rank`, as if there were one per rank
    for name in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
        if name in weights and shard.kv_replicated:
            out[name] = weights[name][rows[rows < weights[name].shape[0]]]
    return out


def o_proj_by_rows(weights, config, n, rank):  # type: ignore[no-untyped-def]
    out = shard_attention_weights(weights, config, n, rank)
    shard = head_shard(config, n, rank)
    out["o_proj.weight"] = weights["o_proj.weight"][head_rows(shard.q_heads, config.head_dim)]
    return out


def heads_interleaved(weights, config, n, rank):  # type: ignore[no-untyped-def]
    out = shard_attention_weights(weights, config, n, rank)
    rows = torch.arange(rank, config.num_attention_heads * config.head_dim, n)  # every n-th row, not whole heads
    out["q_proj.weight"] = weights["q_proj.weight"][rows]
    if "q_proj.bias" in weights:
        out["q_proj.bias"] = weights["q_proj.bias"][rows]
    out["o_proj.weight"] = weights["o_proj.weight"][:, rows]
    return out


def bias_not_cut(weights, config, n, rank):  # type: ignore[no-untyped-def]
    out = shard_attention_weights(weights, config, n, rank)
    if "q_proj.bias" in weights:
        out["q_proj.bias"] = weights["q_proj.bias"]
    return out


def test_task_b_passes_the_reference_in_process() -> None:
    result = check_shard_attention(shard_attention_weights, in_engine=False)
    assert result.passed, result.message()


def test_task_b_fails_each_planted_bug_with_its_class() -> None:
    for bug, classes in ((kv_not_split, {"shapes"}), (kv_not_replicated, {"replicated"}),
                         (o_proj_by_rows, {"shapes"}), (heads_interleaved, {"values"}),
                         (bias_not_cut, {"replicated", "shapes"})):
        result = check_shard_attention(bug, in_engine=False)
        assert result.status == "failed", bug.__name__
        assert set(result.because) & classes, (bug.__name__, result.because, result.failures)


def test_task_b_reference_passes_inside_the_two_process_engine() -> None:  # integration: starts a rank
    result = check_shard_attention(shard_attention_weights)
    assert result.passed, result.message()


# ---- the cost model ----


def test_the_step_model_prices_links_and_scales() -> None:
    nvlink, pcie4 = LINKS["NVLink 4 (H100)"], LINKS["PCIe 4.0 x16"]
    assert ring_all_reduce_seconds(1e6, 1, pcie4) == 0.0
    assert ring_all_reduce_seconds(1e6, 2, pcie4) == 2 / 2 * 1e6 / 32e9 + 20e-6
    small, big = decode_step(SCALES["8B"], 1, 8, pcie4), decode_step(SCALES["70B"], 1, 8, pcie4)
    assert big.compute_s > small.compute_s and big.comm_s > small.comm_s
    assert decode_step(SCALES["70B"], 64, 8, nvlink).comm_share < decode_step(SCALES["70B"], 64, 8, pcie4).comm_share
