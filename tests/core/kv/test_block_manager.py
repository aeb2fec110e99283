"""Property-based tests of the BlockManager: random allocate / append / fork / free never break its books."""

from __future__ import annotations

from bare_sequences import make_seq
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.core.kv.block_manager import BlockManager
from labkit.core.sequence import Sequence


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the model runner does after a step: n more tokens' K/V are in the cache."""
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


operation = st.one_of(
    # few token values: many shared prefixes
    st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=20)),
    st.tuples(st.just("append"), st.integers(0, 50)),
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.tuples(st.just("free"), st.integers(0, 50)),
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 5), caching=st.booleans(),
       ops=st.lists(operation, max_size=60))
def test_random_operations_keep_the_invariants(num_blocks: int, block_size: int, caching: bool, ops) -> None:  # type: ignore[no-untyped-def]
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    live: list[Sequence] = []
    next_id = 0
    for kind, arg in ops:
        if kind == "add":
            seq = make_seq(next_id, arg)
            next_id += 1
            cached = bm.lookup_prefix(seq)
            for i, block_id in enumerate(cached):  # a hit never hands out a block holding other tokens
                assert bm.blocks[block_id].token_ids == tuple(arg[i * block_size : (i + 1) * block_size])
            n = seq.num_tokens - len(cached) * block_size
            if bm.can_allocate(seq, n, cached):
                free_before = bm.num_free_blocks
                bm.allocate(seq, n, cached)
                assert bm.num_free_blocks <= free_before
                compute(bm, seq, n)
                live.append(seq)
        elif kind == "append" and live:
            seq = live[arg % len(live)]
            seq.output_token_ids.append(arg % 4)
            if bm.can_allocate(seq, 1):
                copies = bm.may_append(seq)
                for src, dst in copies:  # copy-on-write hands the writer a private block
                    assert bm.blocks[dst].ref_count == 1 and src != dst
                last = seq.block_table[seq.num_computed_tokens // block_size]
                assert bm.blocks[last].ref_count == 1, "about to write into a shared block"
                compute(bm, seq, 1)
            else:
                seq.output_token_ids.pop()
        elif kind == "fork" and live:
            parent = live[arg % len(live)]
            child = make_seq(next_id, parent.prompt_token_ids)
            child.output_token_ids = list(parent.output_token_ids)
            next_id += 1
            bm.fork(parent, child)
            live.append(child)
        elif kind == "free" and live:
            bm.free(live.pop(arg % len(live)))
        bm.check_invariants(live)
        assert bm.num_free_blocks + bm.num_used_blocks == num_blocks
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == num_blocks  # every block returns when its last owner is done


def test_prefix_hit_reuses_blocks_and_lru_evicts_oldest() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq(0, [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    compute(bm, a, 5)
    bm.free(a)  # its two full blocks stay cached, evictable
    b = make_seq(1, [1, 2, 3, 4, 9])
    cached = bm.lookup_prefix(b)
    assert len(cached) == 2
    bm.allocate(b, 1, cached)
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 4
    c = make_seq(2, [1, 2, 7, 7, 7])  # shares only the first block
    assert bm.lookup_prefix(c) == cached[:1]
    d = make_seq(3, [5, 5])  # whole prompt never counts as cached: its last token must be computed
    bm.allocate(d, 2)
    compute(bm, d, 2)
    assert bm.lookup_prefix(make_seq(4, [5, 5])) == []
    bm.free(b)
    bm.free(d)
    bm.check_invariants([])


def test_a_readmitted_sequence_counts_only_its_new_prefix_hits() -> None:
    """A preempted request admitted again without hits must not count its first admission's hits twice."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 10))
    first = make_seq(0, prompt)
    bm.allocate(first, first.num_tokens)
    compute(bm, first, first.num_tokens)
    second = make_seq(1, prompt)
    cached = bm.lookup_prefix(second)
    assert len(cached) == 2
    bm.allocate(second, second.num_tokens - 8, cached)
    bm.record_prefix_query(second)
    assert (bm.num_queried_tokens, bm.num_hit_tokens, second.num_cached_tokens) == (9, 8, 8)
    bm.free(second)  # preempted; admitted again, this time without using the prefix cache
    bm.allocate(second, second.num_tokens)
    bm.record_prefix_query(second)
    assert (bm.num_queried_tokens, bm.num_hit_tokens, second.num_cached_tokens) == (18, 8, 0)
