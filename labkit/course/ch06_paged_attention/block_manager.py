"""Notebook 06's first Build task: the block manager, checked by hand and then inside the real engine.

The learner writes a ``BlockManager`` subclass with ``allocate`` (prefix hits, copy-on-write, a new block
whenever the last one is full), ``free`` (reference counts, last block first) and ``lookup_prefix`` (the hash
chain), on top of labkit's helpers. ``check_block_manager`` first tries small cases on a fresh manager (each
failure names the case, the block and what was expected), then runs engines ``paged`` and ``continuous`` with
the class (``LLM(..., block_manager_cls=...)``) on workloads with shared prefixes, parallel sampling and a pool
small enough to force preemption, through the harness (``labkit.course.harness``), and compares every run with
labkit's own block manager (tokens, prefix-cache hits, copies, preemptions, the KV blocks in use at every step) and
transformers.
Notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

from labkit.core.kv.block_manager import BlockManager
from labkit.core.metrics import RequestMetrics
from labkit.core.sampling_params import SamplingParams
from labkit.core.sequence import Sequence
from labkit.core.text.detokenizer import IncrementalDetokenizer
from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.course.ch06_paged_attention import require_block_manager
from labkit.course.harness.compare import RUN_FAILURES, check_setups
from labkit.course.harness.runs import Request, Setup, prompt

BS = 4  # block size of every by-hand case: small enough to count blocks in one's head
TOKENS = list(range(100, 112))  # a 12-token prompt the by-hand cases cut from


def new_seq(token_ids: list[int], seq_id: int = 0) -> Sequence:
    """A real engine sequence, without an engine: what the by-hand cases hand to the learner's methods."""
    no_text = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "")  # never detokenized
    return Sequence(seq_id=seq_id, prompt=None, prompt_token_ids=list(token_ids), params=SamplingParams(),
                    detokenizer=IncrementalDetokenizer(no_text, token_ids), generator=None,
                    metrics=RequestMetrics(0.0), max_model_len=10**6)


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the model runner does after a step: n more tokens' K/V are in the cache, full blocks get hashes."""
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def books(check: Check, bm: BlockManager, live: list[Sequence], case: str) -> bool:
    """labkit's invariant check of the manager's books, as a failure message instead of a traceback."""
    try:
        bm.check_invariants(live)
    except AssertionError as exc:
        check.expect(False, f"{case}: the books do not balance: {exc}", because="books")
        return False
    return True


def case_new_and_growing(check: Check, cls: type[BlockManager]) -> None:
    for n in (1, 4, 5, 8, 9):
        bm, seq = cls(num_blocks=8, block_size=BS), new_seq(TOKENS[:n])
        copies = bm.allocate(seq, n)
        want = -(-n // BS)
        check.expect(len(seq.block_table) == want, f"a new {n}-token prompt in blocks of {BS} needs {want} "
                     f"block(s); after your allocate(seq, {n}) its block_table is {seq.block_table}",
                     because="block-count")
        check.expect(copies == [], f"allocate(seq, {n}) of a new prompt copies nothing (returns []), got {copies}",
                     because="needless-copy")
        if check.result.failures or not books(check, bm, [seq], f"after allocate(seq, {n}) of a new prompt"):
            return  # the smallest prompt that goes wrong is enough
    bm, seq = cls(num_blocks=8, block_size=BS), new_seq(TOKENS[:6])
    bm.allocate(seq, 6)
    compute(bm, seq, 6)
    for position in range(6, 13):  # decode steps: one token each, a new block every BS tokens
        seq.output_token_ids.append(7)
        table = list(seq.block_table)
        bm.allocate(seq, 1)
        want = position // BS + 1
        if len(seq.block_table) != want or seq.block_table[: len(table)] != table:
            check.expect(False, f"a decode step writing token {position} (block_size {BS}) needs {want} blocks, "
                         f"the old ones kept: block_table was {table}, after your allocate(seq, 1) it is "
                         f"{seq.block_table}", because="block-count")
            return
        compute(bm, seq, 1)
    books(check, bm, [seq], "after 7 decode steps")


def case_free(check: Check, cls: type[BlockManager]) -> None:
    bm, seq = cls(num_blocks=8, block_size=BS), new_seq(TOKENS[:10])
    bm.allocate(seq, 10)
    compute(bm, seq, 10)
    table = list(seq.block_table)
    bm.free(seq)
    check.expect(bm.num_used_blocks == 0, f"after free(seq) of a sequence with blocks {table}, "
                 f"{bm.num_used_blocks} block(s) are still in use", because="blocks-not-freed")
    check.expect(seq.block_table == [] and seq.num_computed_tokens == 0,
                 f"after free(seq) the sequence holds nothing: block_table [] and num_computed_tokens 0 (a preempted "
                 f"sequence is recomputed from scratch), got {seq.block_table} and {seq.num_computed_tokens}",
                 because="seq-not-reset")
    check.expect(list(bm.free_block_ids)[-3:] == table[::-1],
                 f"after your free(seq) of a sequence with blocks {table}, the pool's free list ends with "
                 f"{list(bm.free_block_ids)[-3:]} (yours); it should end with {table[::-1]} (the last block given "
                 "back first)", because="free-order")
    # Reference counts: a forked sibling shares the blocks, and freeing one sibling frees nothing.
    parent, child = new_seq(TOKENS[:10], 0), new_seq(TOKENS[:10], 1)
    bm.allocate(parent, 10)
    compute(bm, parent, 10)
    bm.fork(parent, child)
    bm.free(child)
    refs = [bm.blocks[b].ref_count for b in parent.block_table]
    check.expect(refs == [1, 1, 1], f"two sequences share blocks {parent.block_table} (reference count 2 each); "
                 f"after free(one of them) the other still holds them: reference counts should be [1, 1, 1], "
                 f"got {refs}", because="ref-count")
    if check.result.failures or not books(check, bm, [parent], "after freeing one of two sharing sequences"):
        return
    bm.free(parent)
    check.expect(bm.num_used_blocks == 0, f"after freeing both sharing sequences {bm.num_used_blocks} block(s) "
                 "are still in use: a reference was never given back", because="ref-count")


def case_copy_on_write(check: Check, cls: type[BlockManager]) -> None:
    for writer in ("the forked sample", "the parent"):
        bm, parent, child = cls(num_blocks=8, block_size=BS), new_seq(TOKENS[:10], 0), new_seq(TOKENS[:10], 1)
        bm.allocate(parent, 10)
        compute(bm, parent, 10)
        bm.fork(parent, child, 9)  # what parallel sampling does: the sample computes the prompt's last token
        shared = list(parent.block_table)
        seq, first = (child, 9) if writer == "the forked sample" else (parent, 10)
        if seq is parent:
            parent.output_token_ids.append(7)
        copies = bm.allocate(seq, 1)
        case = (f"parent and sample share blocks {shared} (block {shared[2]} holds tokens 8-9); {writer} writes "
                f"token {first} into block {shared[2]}")
        ok = (len(copies) == 1 and copies[0][0] == shared[2] and seq.block_table[:2] == shared[:2]
              and seq.block_table[2] == copies[0][1] != shared[2])
        check.expect(ok, f"{case}: it must first get a private copy, allocate returning [({shared[2]}, <new>)] and "
                     f"its block_table becoming [{shared[0]}, {shared[1]}, <new>]; got {copies} and "
                     f"{seq.block_table}", because="no-copy-on-write")
        if not ok:
            return
        refs = (bm.blocks[shared[2]].ref_count, bm.blocks[copies[0][1]].ref_count)
        check.expect(refs == (1, 1) and bm.num_copies == 1, f"{case}: after the copy the original and the copy "
                     f"have one holder each (reference counts (1, 1), got {refs}) and num_copies is 1 (got "
                     f"{bm.num_copies})", because="copy-refs")
        if check.result.failures or not books(check, bm, [parent, child], case):
            return
    bm, parent, child = cls(num_blocks=8, block_size=BS), new_seq(TOKENS[:9], 0), new_seq(TOKENS[:9], 1)
    bm.allocate(parent, 9)
    compute(bm, parent, 9)
    bm.fork(parent, child, 8)  # shares the two full blocks only
    copies = bm.allocate(child, 1)
    check.expect(copies == [] and len(child.block_table) == 3 and bm.num_copies == 0,
                 f"a sample sharing the full blocks {parent.block_table[:2]} writes token 8 into a new block of its "
                 f"own: nothing to copy (allocate returns [], num_copies stays 0), got {copies} and block_table "
                 f"{child.block_table}", because="needless-copy")


def forget(bm: BlockManager, block_id: int) -> None:
    """The pool reused a free cached block: it leaves the prefix cache (what eviction does)."""
    block = bm.blocks[block_id]
    bm.hash_to_block_id.pop(block.block_hash, None)  # type: ignore[arg-type]
    bm.evictable.pop(block_id, None)
    block.block_hash, block.token_ids = None, ()
    bm.free_block_ids.append(block_id)


def case_prefix(check: Check, cls: type[BlockManager]) -> None:
    other = [5, 6, 7, 8]
    check.expect(cls(num_blocks=8, block_size=BS).lookup_prefix(new_seq(TOKENS)) == [],
                 "with enable_prefix_caching=False, lookup_prefix finds nothing (returns [])",
                 because="prefix-disabled")
    bm, a = cls(num_blocks=16, block_size=BS, enable_prefix_caching=True), new_seq(TOKENS[:10])
    bm.allocate(a, 10)
    compute(bm, a, 10)  # blocks 0 and 1 of a are full: they get hashes
    table = list(a.block_table)
    bm.free(a)
    check.expect(list(bm.evictable) == table[1::-1], f"freeing a 10-token prompt with blocks {table} leaves its "
                 f"two full blocks cached, the tail first in the eviction order: {table[1::-1]}, got "
                 f"{list(bm.evictable)}", because="free-order")
    cases = [("its first 8 tokens and 3 others", TOKENS[:8] + [1, 2, 3], table[:2]),
             ("its first 4 tokens, then 4 others", TOKENS[:4] + other + [1], table[:1]),
             ("4 other tokens, then its tokens 4-7", other + TOKENS[4:8] + [1], []),
             ("exactly its first 8 tokens (2 full blocks)", TOKENS[:8], table[:1])]
    for what, token_ids, want in cases:
        got = bm.lookup_prefix(new_seq(token_ids))
        check.expect(got == want, f"after a 10-token prompt with blocks {table} was computed and freed, a prompt of "
                     f"{what} should find {want} in the cache; your lookup_prefix returned {got}",
                     because="prefix-lookup")
    if check.result.failures:
        return
    forget(bm, table[0])
    got = bm.lookup_prefix(new_seq(TOKENS[:8] + [1, 2, 3]))
    check.expect(got == [], f"the cache lost block {table[0]} (the prompt's first block) but still holds block "
                 f"{table[1]} (its second): a prefix starts at block 0, so stop at the first miss and return [], "
                 f"got {got}", because="prefix-first-miss")


def case_prefix_hits(check: Check, cls: type[BlockManager]) -> None:
    bm, a = cls(num_blocks=16, block_size=BS, enable_prefix_caching=True), new_seq(TOKENS[:10])
    bm.allocate(a, 10)
    compute(bm, a, 10)
    bm.free(a)
    b, c = new_seq(TOKENS[:8] + [1, 2, 3], 1), new_seq(TOKENS[:8] + [4, 5], 2)
    cached = BlockManager.lookup_prefix(bm, b)  # labkit's lookup: this case is about allocate
    copies = bm.allocate(b, 3, cached)
    ok = b.block_table[:2] == cached and len(b.block_table) == 3 and copies == []
    check.expect(ok, f"allocate(seq, 3, cached_blocks={cached}) for an 11-token prompt whose first 8 tokens are "
                 f"cached: block_table starts with {cached} and gets one new block, got {b.block_table}",
                 because="cached-blocks")
    check.expect((b.num_computed_tokens, b.num_cached_tokens) == (8, 8),
                 f"after allocate with cached_blocks={cached} the 8 cached tokens count as computed and cached: "
                 f"num_computed_tokens and num_cached_tokens should be 8 and 8, got {b.num_computed_tokens} and "
                 f"{b.num_cached_tokens}", because="cached-blocks")
    if check.result.failures or not books(check, bm, [b], f"after allocate with cached blocks {cached}"):
        return
    bm.allocate(c, 2, cached)
    refs = [bm.blocks[x].ref_count for x in cached]
    check.expect(refs == [2, 2], f"two running prompts use the cached blocks {cached}: reference counts [2, 2], "
                 f"got {refs}", because="ref-count")
    if check.result.failures or not books(check, bm, [b, c], "two prompts sharing cached blocks"):
        return
    bm.free(b)
    bm.free(c)
    check.expect(bm.num_used_blocks == 0 and set(bm.evictable) >= set(cached),
                 f"after both finish, no block is in use and the cached blocks {cached} are back in the cache "
                 f"(evictable); {bm.num_used_blocks} in use, evictable {list(bm.evictable)}",
                 because="blocks-not-freed")


HINTS = Hints(
    concept="A block can be held by several sequences at once (a forked sample, a shared cached prefix). What must "
            "happen before one of them writes into a block another still reads? And when a sequence lets go of its "
            "blocks, which of them may really return to the pool?",
    rule="allocate: if the block the next token goes into is shared, the writer first gets a private copy (and the "
         "copy is returned so the engine copies the K/V); then add blocks until the table covers the computed and "
         "the new tokens, no more. free: give back each block's reference, the last block first, then empty the "
         "sequence's table and reset its computed tokens; a block returns to the pool only when nobody holds it. "
         "lookup_prefix: follow the chain of full-block hashes from block 0, stop at the first miss, and never "
         "match the prompt's last token (it must be computed to get logits).",
    code="allocate: i = seq.num_computed_tokens // block_size; if i < len(table) and blocks[table[i]].ref_count > 1: "
         "replace table[i] by a fresh block, record (old, new) in copies, num_copies += 1, release the old one; then "
         "while len(table) < blocks_needed(num_computed_tokens + num_new_tokens): append a free block. free: for b "
         "in reversed(seq.block_table): self._release(b); then seq.block_table = [] and num_computed_tokens = 0. "
         "lookup_prefix: for each hash of block_hashes(prompt[:-1]): stop if not cached, else collect its block.",
    by_failure={
        **RUN_FAILURES,
        "books": "every block is either free or held, and a block's reference count is the number of tables "
                 "holding it",
        "block-count": "a table holds exactly the blocks its tokens need: one more each time the last block fills",
        "needless-copy": "only a shared block that is about to be written needs a copy",
        "blocks-not-freed": "freeing gives back every block the sequence held",
        "seq-not-reset": "a freed sequence holds nothing and has computed nothing: if preempted, it starts over",
        "free-order": "the order blocks go back to the pool decides which cached blocks are evicted first: a "
                      "prefix's tail should go before its head",
        "ref-count": "a block shared by two sequences is only free once both let go: decrement, do not discard",
        "no-copy-on-write": "before writing into a block another sequence holds, the writer needs its own copy",
        "copy-refs": "after a copy, the original and the copy each have one holder, and the copy is counted",
        "prefix-disabled": "without prefix caching nothing is ever found in the cache",
        "prefix-lookup": "a cached prefix is a run of full blocks from the prompt's start, each hash chained to the "
                         "one before; the prompt's last token is always computed",
        "prefix-first-miss": "a prefix starts at block 0: the first block not in the cache ends the match",
        "cached-blocks": "cached blocks start the table and count as computed (and cached) tokens",
    },
)


CASES = (case_new_and_growing, case_free, case_copy_on_write, case_prefix, case_prefix_hits)


@functools.lru_cache(maxsize=4)
def workloads(model: str = "labkit-tiny") -> tuple[Setup, ...]:
    """Shared prefixes with parallel sampling (paged and continuous), and a pool small enough to preempt."""
    system = prompt(model, 12, seed=1)
    other = prompt(model, 8, seed=2)
    questions = [prompt(model, 16, seed=10 + i)[-6:] for i in range(3)]
    shared = (Request("A", system + questions[0], 6),
              Request("S", prompt(model, 10, seed=3), 6, n=3, temperature=0.8, seed=7),  # forks + copy-on-write
              Request("B", system + questions[1], 6, arrival_step=3),  # hits the system prompt's 3 blocks
              Request("C", other[:4] + system[4:] + questions[2], 6, arrival_step=3),  # first block differs
              Request("D", system, 6, arrival_step=3),  # all full blocks cached: the last one is recomputed
              Request("E", system + questions[0], 6, arrival_step=3))  # A's prompt again
    tight = tuple(Request(f"R{i}", prompt(model, 9 + 3 * i, seed=20 + i), 14) for i in range(4))
    tight += (Request("T", prompt(model, 10, seed=30), 10, n=2, temperature=1.0, seed=3, arrival_step=2),)
    pool = dict(max_num_seqs=4, block_size=4)
    return (Setup("shared prefixes and n=3 sampling", shared, "paged", num_gpu_blocks=64, enable_prefix_caching=True,
                  **pool),
            Setup("shared prefixes and n=3 sampling", shared, "continuous", num_gpu_blocks=64,
                  enable_prefix_caching=True, **pool),
            Setup("a pool too small for every request (preemption)", tight, "continuous", num_gpu_blocks=12, **pool))


def check_block_manager(cls: type[BlockManager], model: str = "labkit-tiny") -> CheckResult:
    """Build task: ``cls``'s allocate, free and lookup_prefix, by hand, then inside engines paged and continuous."""

    def body(check: Check) -> None:
        cls_ = require_block_manager(cls)
        for case in CASES:
            case(check, cls_)
            if check.result.failures:
                return  # the smallest failing case is enough: the later ones build on it
        # Every problem of a run, not only the first: a missing copy-on-write also shows in the copies and the
        # blocks in use, which tells the learner where to look.
        check_setups(check, workloads(model), model, "block manager", "labkit's block manager", every=True,
                     block_manager_cls=cls_)

    return run_checker("", "", body, task_id="06.block_manager")
