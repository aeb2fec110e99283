"""KV reuse: the replay matches the real block manager (LRU), LRU evicts in order, Belady on a hand-checked trace."""

from __future__ import annotations

import random

import pytest
from bare_sequences import make_seq

from labkit.core.kv.block_manager import BlockManager
from labkit.measure.conversations import agent_calls, conversation_trace, load_conversations
from labkit.measure.kv_reuse import TraceRequest, block_trace, replay


def run_request(bm: BlockManager, seq_id: int, prompt: list[int], answer: list[int]) -> int:
    """Drive the real block manager as an engine does for one request alone: prefix lookup, prefill, one token per
    decode step, free. Returns the prompt tokens served from the cache."""
    seq = make_seq(seq_id, prompt)
    cached = bm.lookup_prefix(seq)
    assert bm.can_allocate(seq, seq.num_prompt_tokens - len(cached) * bm.block_size, cached)
    bm.allocate(seq, seq.num_prompt_tokens - len(cached) * bm.block_size, cached)
    bm.record_prefix_query(seq)
    seq.num_computed_tokens = seq.num_prompt_tokens
    seq.output_token_ids.append(answer[0])
    bm.cache_full_blocks(seq)
    for token in answer[1:]:  # each decode step computes the previous token and samples the next
        bm.may_append(seq)
        seq.num_computed_tokens += 1
        seq.output_token_ids.append(token)
        bm.cache_full_blocks(seq)
    bm.check_invariants([seq])
    hit = seq.num_cached_tokens
    bm.free(seq)
    bm.check_invariants([])
    return hit


def lru_order(bm: BlockManager) -> list[tuple[int, ...]]:
    return [bm.blocks[b].token_ids for b in bm.evictable]


def test_real_block_manager_evicts_least_recently_used_first() -> None:
    bm = BlockManager(num_blocks=7, block_size=2, enable_prefix_caching=True)
    # three finished requests, each leaving 2 full cached blocks (4 tokens computed: prompt 4 + answer 1 - 1)
    run_request(bm, 0, [1, 2, 3, 4], [50])
    run_request(bm, 1, [5, 6, 7, 8], [52])
    run_request(bm, 2, [9, 10, 11, 12], [54])
    # released last block first: each request's tail is older than its head
    assert lru_order(bm) == [(3, 4), (1, 2), (7, 8), (5, 6), (11, 12), (9, 10)]
    assert bm.num_free_blocks == 7
    # a hit on request 0's prefix makes it the most recently used (its partial third block goes to the free list)
    assert run_request(bm, 3, [1, 2, 3, 4, 99], [56]) == 4
    assert lru_order(bm) == [(7, 8), (5, 6), (11, 12), (9, 10), (3, 4), (1, 2)]
    # pressure: 4 new blocks = the one empty block, then request 1's tail, its head, and request 2's tail
    seq = make_seq(4, [20, 21, 22, 23, 24, 25, 26, 27])
    assert bm.lookup_prefix(seq) == []
    bm.allocate(seq, 8)
    assert lru_order(bm) == [(9, 10), (3, 4), (1, 2)]
    cached = {bm.blocks[b].token_ids for b in bm.hash_to_block_id.values()}
    assert cached == {(9, 10), (3, 4), (1, 2)}
    assert bm.lookup_prefix(make_seq(5, [5, 6, 7, 8, 0])) == [], "an evicted prefix must miss"
    assert len(bm.lookup_prefix(make_seq(6, [1, 2, 3, 4, 0]))) == 2


@pytest.mark.parametrize("num_blocks", [11, 13, 16, 24, 64])
def test_lru_replay_matches_the_real_block_manager(num_blocks: int) -> None:
    rng = random.Random(num_blocks)
    # few token values and shared starts: prefixes repeat, partly, at every depth
    bases = [[rng.randrange(4) for _ in range(12)] for _ in range(4)]
    calls = []
    for _ in range(40):
        prompt = bases[rng.randrange(4)][: rng.randint(1, 12)] + [rng.randrange(4) for _ in range(rng.randint(0, 5))]
        calls.append((prompt, [rng.randrange(4) for _ in range(rng.randint(1, 6))]))
    bm = BlockManager(num_blocks, block_size=2, enable_prefix_caching=True)
    real = [run_request(bm, i, p, a) for i, (p, a) in enumerate(calls)]
    result = replay(block_trace(calls, 2), num_blocks, 2, policy="lru")
    assert result.hit_tokens == real
    assert result.hit_rate == pytest.approx(bm.hit_rate)


def test_lru_replay_matches_the_real_block_manager_on_a_chat_trace(tokenizer) -> None:  # type: ignore[no-untyped-def]
    calls = conversation_trace(load_conversations("chat_8x4"), tokenizer)
    trace = block_trace(calls, 16)
    for num_blocks in (16, 40, 400):
        bm = BlockManager(num_blocks, block_size=16, enable_prefix_caching=True)
        real = [run_request(bm, i, p, a) for i, (p, a) in enumerate(calls)]
        assert replay(trace, num_blocks, 16).hit_tokens == real
    assert replay(trace, 400, 16).num_evictions == 0
    assert replay(trace, 400, 16).hit_rate > 0.5, "history should be reused when nothing is evicted"


def _request(prompt_blocks: list[int]) -> TraceRequest:
    """Block size 2: a prompt of the given full blocks (as hashes) plus one token, an answer of one token. It looks
    up all its full blocks and holds one more, partial block (freed, not cached, when it finishes)."""
    return TraceRequest(2 * len(prompt_blocks) + 1, 1, tuple(prompt_blocks), len(prompt_blocks))


def test_belady_on_a_hand_checked_trace() -> None:
    # Single-block prompts A B C A B C A B C (a cyclic scan) and a pool of 3 blocks: one is the running request's
    # partial block, so 2 can stay cached. LRU always evicts the block needed next: 0 hits. Belady keeps the ones
    # needed soonest: A miss, B miss, C miss (evict the one used furthest ahead: of A (next at 3) and B (4), B),
    # A hit, B miss (of A (6) and C (5), evict A), C hit, A miss (of B (7) and C (8), evict C), B hit, C miss.
    trace = [_request([h]) for h in [1, 2, 3] * 3]
    lru, belady = replay(trace, 3, 2, "lru"), replay(trace, 3, 2, "belady")
    assert lru.hit_tokens == [0] * 9
    assert belady.hit_tokens == [0, 0, 0, 2, 0, 2, 0, 2, 0]
    assert belady.hit_rate == pytest.approx(6 / 27)
    assert belady.num_evictions == 4 and lru.num_evictions == 7  # one per miss once the pool is full (from C on)
    # with room for all three, both hit every repeat
    assert replay(trace, 4, 2, "lru").hit_tokens == replay(trace, 4, 2, "belady").hit_tokens == [0] * 3 + [2] * 6


def test_belady_never_loses_to_lru_and_keeps_prefixes(tokenizer) -> None:  # type: ignore[no-untyped-def]
    calls = conversation_trace(agent_calls(4, 5, 64, (4, 24), (2, 10), seed=1), tokenizer)
    trace = block_trace(calls, 8)
    rates = []
    for num_blocks in (22, 28, 36, 50, 80, 300):
        lru, belady = replay(trace, num_blocks, 8, "lru"), replay(trace, num_blocks, 8, "belady")
        assert sum(belady.hit_tokens) >= sum(lru.hit_tokens), num_blocks
        rates.append(lru.hit_rate)
    assert rates == sorted(rates), "LRU hits should not fall as the pool grows on this trace"
    assert replay(trace, 300, 8, "lru").hit_tokens == replay(trace, 300, 8, "belady").hit_tokens


def test_bad_input_is_named() -> None:
    trace = [_request([1, 2, 3])]
    with pytest.raises(ValueError, match="policy"):
        replay(trace, 8, 2, "fifo")
    with pytest.raises(ValueError, match="needs 4 blocks"):
        replay(trace, 3, 2)
    with pytest.raises(ValueError, match="answer"):
        block_trace([([1, 2], [])], 2)
