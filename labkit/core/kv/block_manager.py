"""The block manager: who owns which fixed-size KV block, and which blocks hold a known prefix.

KV memory is a pool of ``num_blocks`` blocks of ``block_size`` token slots. A sequence's
``block_table`` lists its blocks in order, so token ``i`` lives in slot
``block_table[i // block_size] * block_size + i % block_size``. Blocks are reference counted, so
sequences can share them (a common prompt prefix, or the n samples of one prompt), and a shared
block is copied before anyone writes into it (copy-on-write).

With prefix caching, every *full* block gets a hash chained over its parent's hash and its own
tokens; a new request whose prompt starts with the same tokens reuses those blocks and skips their
prefill. Freed blocks keep their hash and stay reusable until the pool needs them (least recently
used first). Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from labkit.core.kv.free_blocks import FreeBlockQueue, LazyBlocks
from labkit.core.sequence import Sequence


@dataclass
class Block:
    """One KV block: its reference count and, once full and computed, its prefix hash. Notebook 06."""

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the tokens a hashed block holds, to rule out hash collisions


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """A block's identity: its tokens *and* everything before them (via the parent's hash)."""
    return hash((parent_hash, token_ids))


class PoolExhausted(RuntimeError):
    """Raised when a block is needed and none is free; schedulers check ``can_allocate`` first."""


class BlockManager:
    """Allocates, shares, copies and caches KV blocks for sequences. Notebook 06.

    Notebook 06's Build task rewrites the core in a subclass (``LLM(..., block_manager_cls=...)``): ``allocate``
    (prefix hits, copy-on-write, new blocks as a sequence grows), ``free`` and ``lookup_prefix``, on top of the
    small helpers kept here: ``_take_free_block`` / ``_release`` / ``_share`` (one reference more or less),
    ``blocks_needed``, ``block_hashes`` and the counters.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: LazyBlocks[Block] = LazyBlocks(num_blocks, Block)  # made as blocks are first used
        self.free_block_ids = FreeBlockQueue(num_blocks)  # free and holding nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, least recently used first
        self.hash_to_block_id: dict[int, int] = {}
        # prefix-cache statistics
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # parallel-sampling statistics
        self.num_forked_tokens = 0
        self.num_copies = 0

    # ---- accounting ----

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot(self, seq: Sequence, position: int) -> int:
        """The pool slot holding token ``position`` of ``seq``: its block's id times block_size, plus the offset
        inside the block. The model runner's per-token input preparation (``prepare_inputs="loop"``) calls it."""
        block_table = seq.block_table
        return block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, block_tables: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """``slot`` for N tokens at once (the vectorized input preparation): block_tables (N, max_blocks), each
        token's own sequence's table; positions (N,) -> slots (N,)."""
        rows = np.arange(len(positions))  # (N,)
        return block_tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size

    # ---- taking and returning blocks ----

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)  # evict the least recently used cached block
            block = self.blocks[block_id]
            if block.block_hash is not None and self.hash_to_block_id.get(block.block_hash) == block_id:
                del self.hash_to_block_id[block.block_hash]
            block.block_hash, block.token_ids = None, ()
        else:
            raise PoolExhausted(f"all {self.num_blocks} KV blocks are in use")
        self.blocks[block_id].ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released more often than taken"
        if block.ref_count == 0:
            if block.block_hash is not None and self.hash_to_block_id.get(block.block_hash) == block_id:
                self.evictable[block_id] = None  # keep its contents for a future prefix hit
            else:
                block.block_hash, block.token_ids = None, ()
                self.free_block_ids.append(block_id)

    def _share(self, block_id: int) -> None:
        """One more holder of ``block_id``: a sibling's block (fork) or a prefix-cache hit. A cached block that
        nobody held leaves the evictable list, so the pool will not hand it out again while it is in use."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1

    # ---- prefix caching ----

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """The prefix-cache hash of every *full* block of ``token_ids``, chained: block i hashes
        ``(hash of block i-1, its own block_size tokens)``, so equal hashes mean equal tokens *and* an equal
        prefix before them. A partial last block gets no hash (its tokens are still arriving)."""
        hashes: list[int] = []
        parent: int | None = None
        for i in range(len(token_ids) // self.block_size):
            parent = hash_block(parent, tuple(token_ids[i * self.block_size : (i + 1) * self.block_size]))
            hashes.append(parent)
        return hashes

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the prompt's leading full blocks, in order (no side effects).

        Never the whole prompt: its last token must still be computed to give the first output's logits.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        tokens = seq.prompt_token_ids
        num_full = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        for i, h in enumerate(self.block_hashes(tokens[: num_full * self.block_size])):
            block_id = self.hash_to_block_id.get(h)
            chunk = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register a hash for every block of ``seq`` that is now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        tokens = seq.token_ids
        # Only blocks whose token ids are all known (async scheduling computes one before it is seen).
        num_full = min(seq.num_computed_tokens, len(tokens)) // self.block_size
        first = next((i for i in range(num_full) if self.blocks[seq.block_table[i]].block_hash is None), num_full)
        if first == num_full:
            return  # every full block is registered already (the common decode step)
        hashes = self.block_hashes(tokens[: num_full * self.block_size])
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash = hashes[i]
                block.token_ids = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
                self.hash_to_block_id.setdefault(block.block_hash, block.block_id)

    # ---- the scheduler's interface ----

    def _needs_copy(self, seq: Sequence) -> bool:
        first = seq.num_computed_tokens // self.block_size  # the first block this step writes into
        return first < len(seq.block_table) and self.blocks[seq.block_table[first]].ref_count > 1

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Whether ``seq`` can get room for ``num_new_tokens`` tokens beyond those already computed.

        ``cached_blocks`` (from ``lookup_prefix``, for a sequence without blocks) count as computed.
        """
        cached = cached_blocks or []
        computed = len(cached) * self.block_size if cached else seq.num_computed_tokens
        have = len(cached) if cached else len(seq.block_table)
        needed = self.blocks_needed(computed + num_new_tokens) - have + int(self._needs_copy(seq))
        # Reusing a cached block that nobody holds takes it out of the free pool too.
        needed += sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return needed <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None
                 ) -> list[tuple[int, int]]:
        """Give ``seq`` room for ``num_new_tokens`` more tokens; check ``can_allocate`` first.

        ``cached_blocks`` become the start of the block table of a sequence that has none, and its
        computed and cached token counts advance past them. Returns (src, dst) block copies to run
        before the forward pass: copy-on-write of a shared block this step will write into.
        """
        if not seq.block_table:  # an admission (or a re-admission after preemption): only this one's hits count
            seq.num_cached_tokens = len(cached_blocks or []) * self.block_size
        if cached_blocks:
            assert not seq.block_table, "prefix hits only apply to a sequence without blocks"
            for block_id in cached_blocks:
                self._share(block_id)
            seq.block_table = list(cached_blocks)
            seq.num_computed_tokens = seq.num_cached_tokens
        copies = []
        if self._needs_copy(seq):  # this step writes into a block others hold too: write into a private copy
            self.num_copies += 1
            first = seq.num_computed_tokens // self.block_size
            src, dst = seq.block_table[first], self._take_free_block()
            self._release(src)  # the others keep the original
            seq.block_table[first] = dst
            copies.append((src, dst))
        # Append a block whenever the last one is full (a decode step needs one every block_size tokens).
        while len(seq.block_table) < self.blocks_needed(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._take_free_block())
        return copies

    def record_prefix_query(self, seq: Sequence) -> None:
        """Count a new request's prompt in the hit-rate statistics (once, when it is admitted)."""
        self.num_queried_tokens += seq.num_prompt_tokens
        self.num_hit_tokens += seq.num_cached_tokens

    def may_append(self, seq: Sequence) -> list[tuple[int, int]]:
        """Room for one more token (a decode step); same return value as ``allocate``."""
        return self.allocate(seq, 1)

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> None:
        """``child`` shares ``parent``'s blocks holding its first ``num_tokens`` tokens (all by default);
        whoever writes into a shared block later gets a copy first."""
        assert not child.block_table, "fork into a sequence that has no blocks"
        num_tokens = parent.num_computed_tokens if num_tokens is None else num_tokens
        assert num_tokens <= parent.num_computed_tokens, "can only share tokens the parent has computed"
        shared = parent.block_table[: self.blocks_needed(num_tokens)]
        for block_id in shared:
            self._share(block_id)  # the parent holds them: never evictable
        child.block_table = list(shared)
        child.num_computed_tokens = num_tokens
        self.num_forked_tokens += num_tokens

    def trim(self, seq: Sequence) -> None:
        """Return the blocks past the one the next token goes into: speculative decoding reserved them for proposals
        the target rejected (notebook 13). Last first, as ``free`` does."""
        keep = self.blocks_needed(seq.num_computed_tokens + 1)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks (last first, so a prefix's tail is evicted before its head)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)  # one holder less: the block is free only when its last holder lets go
        seq.block_table = []
        seq.num_computed_tokens = 0

    # ---- debugging ----

    def check_invariants(self, live: list[Sequence] | None = None) -> None:
        """Raise AssertionError if the books do not balance (used after every step in debug mode)."""
        queue, evictable = self.free_block_ids, set(self.evictable)
        if isinstance(queue, FreeBlockQueue) and isinstance(self.blocks, LazyBlocks):
            # Only blocks ever handed out have records: the others are the queue's never-used ids. O(used blocks).
            returned, fresh = queue.returned(), queue.first_fresh
            free = set(returned)
            assert len(free) == len(returned) and all(b < fresh for b in free), "a block is twice in the free list"
            is_free = lambda block_id: block_id >= fresh or block_id in free  # noqa: E731
            blocks = self.blocks.made()
        else:  # a subclass with lists of its own (notebook 06's Build task): check every block
            free = set(queue)
            assert len(free) == len(queue), "a block is twice in the free list"
            is_free = free.__contains__
            blocks = list(self.blocks)
        assert not any(is_free(b) for b in evictable), "a block is both free and evictable"
        for block in blocks:
            in_free = is_free(block.block_id) or block.block_id in evictable
            assert (block.ref_count == 0) == in_free, (
                f"block {block.block_id}: ref_count {block.ref_count}, free={in_free}")
        assert self.num_free_blocks + sum(b.ref_count > 0 for b in blocks) == self.num_blocks
        for h, block_id in self.hash_to_block_id.items():
            assert self.blocks[block_id].block_hash == h, f"hash table points at block {block_id} with another hash"
        if live is not None:
            owners: dict[int, int] = {}
            for seq in live:
                for block_id in seq.block_table:
                    owners[block_id] = owners.get(block_id, 0) + 1
            for block in blocks:
                assert owners.get(block.block_id, 0) == block.ref_count, (
                    f"block {block.block_id}: ref_count {block.ref_count} but {owners.get(block.block_id, 0)} owners")
