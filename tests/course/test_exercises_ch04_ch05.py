"""Notebooks 04 and 05: each checker passes labkit's reference, fails planted bugs, and reports stubs."""

from __future__ import annotations

import dataclasses

import pytest

from labkit.course import use_or_reference
from labkit.course.ch04_prefill_vs_decode import DECODE_CASES, check_decode_cost, flops_and_bytes
from labkit.course.ch05_static_batching import BATCH_CASES, check_static_batch_tokens
from labkit.measure.batching import static_batch_tokens, static_batch_waste, static_batching_waste
from labkit.measure.roofline import decode_cost, kv_bytes_per_token, matmul_params_per_layer

# ---- notebook 04: decode_cost ----

def test_ch04_hand_counts_match_the_reference() -> None:
    for _, config, batch, ctx, dtype_bytes, want in DECODE_CASES:
        cost = decode_cost(config, batch, ctx, dtype_bytes)
        assert (cost.flops, cost.total_bytes) == want


def test_ch04_checker_passes_the_reference_in_any_return_shape() -> None:
    assert check_decode_cost(decode_cost).passed

    def as_dict(config, b, ctx, nbytes):  # type: ignore[no-untyped-def]
        cost = decode_cost(config, b, ctx, nbytes)
        return {"flops": cost.flops, "bytes": cost.total_bytes}

    def as_pair(config, b, ctx, nbytes):  # type: ignore[no-untyped-def]
        cost = decode_cost(config, b, ctx, nbytes)
        return cost.flops, cost.total_bytes

    assert check_decode_cost(as_dict).passed
    assert check_decode_cost(as_pair).passed


def _with(flops_delta=None, bytes_delta=None):  # type: ignore[no-untyped-def]
    """A decode_cost that is the reference plus a (planted) error term."""
    def fn(config, b, ctx, nbytes):  # type: ignore[no-untyped-def]
        cost = decode_cost(config, b, ctx, nbytes)
        flops = cost.flops + (flops_delta(config, b, ctx, nbytes) if flops_delta else 0)
        total = cost.total_bytes + (bytes_delta(config, b, ctx, nbytes) if bytes_delta else 0)
        return {"flops": flops, "bytes": total}
    return fn


def _kv_per_query_head(config, b, ctx, nbytes):  # type: ignore[no-untyped-def]
    """Sizes the cache as if every query head had its own K/V (ignores grouped-query attention)."""
    mha = dataclasses.replace(config, num_key_value_heads=config.num_attention_heads)
    cost = decode_cost(config, b, ctx, nbytes)
    extra = b * (ctx + 1) * (kv_bytes_per_token(mha, nbytes) - kv_bytes_per_token(config, nbytes))
    return {"flops": cost.flops, "bytes": cost.total_bytes + extra}


PLANTED_DECODE_BUGS = {
    # every sequence reads its own copy of the weights
    "weights per sequence": _with(bytes_delta=lambda c, b, ctx, n: (b - 1) * c.num_params * n),
    # forgets that decode reads the whole KV cache
    "no KV read": _with(bytes_delta=lambda c, b, ctx, n: -b * ctx * kv_bytes_per_token(c, n)),
    # sizes K/V by the query heads (ignores grouped-query attention)
    "KV per query head": _kv_per_query_head,
    # attends to the cached keys but not to itself
    "attention off by one": _with(flops_delta=lambda c, b, ctx, n: -4 * c.num_attention_heads * c.head_dim * b
                                  * c.num_hidden_layers),
    # forgets the lm_head matmul
    "no lm_head": _with(flops_delta=lambda c, b, ctx, n: -2 * c.hidden_size * c.vocab_size * b),
    # forgets to write the new token's K/V into the cache
    "no KV write": _with(bytes_delta=lambda c, b, ctx, n: -b * kv_bytes_per_token(c, n)),
    # counts the decoder's matmuls once per step, not once per sequence
    "matmuls once per step": _with(flops_delta=lambda c, b, ctx, n: -(b - 1) * 2 * c.num_hidden_layers
                                   * matmul_params_per_layer(c)),
}


@pytest.mark.parametrize("bug", PLANTED_DECODE_BUGS, ids=str)
def test_ch04_checker_fails_planted_bugs(bug: str) -> None:
    result = check_decode_cost(PLANTED_DECODE_BUGS[bug])
    assert result.status == "failed" and result.failures
    message = result.message()
    assert "Think about:" in message and "show_hint('04.decode_cost', 2)" in message  # the failure class's hint


def test_ch04_stub_is_not_started_and_falls_back(capsys: pytest.CaptureFixture[str]) -> None:
    def stub(config, batch_size, context_len, dtype_bytes):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    result = check_decode_cost(stub)
    assert result.status == "not started"
    assert use_or_reference(result, stub, decode_cost) is decode_cost
    assert "uses labkit's reference" in capsys.readouterr().out


def test_ch04_a_wrong_return_type_is_reported() -> None:
    result = check_decode_cost(lambda c, b, ctx, n: 42)
    assert result.status == "failed" and "TypeError" in result.failures[0]


def test_flops_and_bytes_accepts_every_shape() -> None:
    cost = decode_cost(DECODE_CASES[0][1], 2, 3, 2)
    want = (cost.flops, cost.total_bytes)
    assert flops_and_bytes(cost) == want
    assert flops_and_bytes({"flops": want[0], "bytes": want[1]}) == want
    assert flops_and_bytes({"flops": want[0], "total_bytes": want[1]}) == want
    assert flops_and_bytes(list(want)) == want
    with pytest.raises(TypeError, match="flops"):
        flops_and_bytes({"flop": 1})


# ---- notebook 05: static_batch_tokens ----

def test_ch05_hand_counts_match_the_reference() -> None:
    for prompts, outputs, want in BATCH_CASES:
        assert static_batch_tokens(prompts, outputs) == want
        counts = static_batch_waste(prompts, outputs)
        assert counts.computed == want[0] and counts.useful == want[1]


def test_ch05_checker_passes_the_reference() -> None:
    assert check_static_batch_tokens(static_batch_tokens).passed


PLANTED_BATCH_BUGS = {
    # feeds back the last output token too: one position per row too many
    "counts the last token": lambda p, o: (len(p) * (max(p) + max(o)), sum(p) + sum(o)),
    # forgets the left padding of the prefill
    "no padding": lambda p, o: (sum(p) + len(p) * (max(o) - 1), sum(a + b - 1 for a, b in zip(p, o))),
    # forgets that finished rows are still computed
    "no idle slots": lambda p, o: (len(p) * max(p) + sum(b - 1 for b in o), sum(a + b - 1 for a, b in zip(p, o))),
    # returns (useful, computed)
    "swapped": lambda p, o: tuple(reversed(static_batch_tokens(p, o))),
}


@pytest.mark.parametrize("bug", PLANTED_BATCH_BUGS, ids=str)
def test_ch05_checker_fails_planted_bugs(bug: str) -> None:
    result = check_static_batch_tokens(PLANTED_BATCH_BUGS[bug])
    assert result.status == "failed" and result.failures


def test_ch05_stub_is_not_started_and_falls_back(capsys: pytest.CaptureFixture[str]) -> None:
    def stub(prompt_lens, output_lens):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    result = check_static_batch_tokens(stub)
    assert result.status == "not started"
    assert use_or_reference(result, stub, static_batch_tokens) is static_batch_tokens
    assert "uses labkit's reference" in capsys.readouterr().out


def test_static_batching_waste_splits_the_workload_in_fcfs_batches() -> None:
    prompts, outputs = [4, 2, 10, 1, 6], [1, 3, 1, 8, 2]
    whole = static_batching_waste(prompts, outputs, max_num_seqs=2)
    parts = [static_batch_waste([4, 2], [1, 3]), static_batch_waste([10, 1], [1, 8]), static_batch_waste([6], [2])]
    assert whole == parts[0] + parts[1] + parts[2]
    assert static_batching_waste(prompts, outputs, max_num_seqs=1).useful_fraction == 1.0
    with pytest.raises(ValueError, match="one of each"):
        static_batch_waste([1, 2], [1])
