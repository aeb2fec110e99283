"""Checkers for notebook 06 (``06_paged_attention``).

Both tasks are ``BlockManager`` subclasses that the real engine runs (``LLM(..., block_manager_cls=...)``):

* Task 1 overrides ``BlockManager.slot``: where token ``position`` of a sequence lives in the paged pool.
  Checked on hand-made block tables, then inside the ``paged`` engine with ``prepare_inputs="loop"`` (the
  per-token input preparation, which calls ``slot`` for every new token of every step): the greedy tokens
  must be those of labkit's own block manager.
* Task 2 overrides ``BlockManager.block_hashes``: the prefix cache's chained hash of every full block, which
  ``lookup_prefix`` and ``cache_full_blocks`` both call. Checked on small token lists, then inside the
  ``paged`` engine with prefix caching on: on prompts that share prefixes, every request must find as
  many prompt tokens in the cache as with labkit's block manager, and produce the same tokens.

The notebook's two Build tasks have their own modules: the block manager (``block_manager``) and paged attention
(``attention``), both run inside the engine by the harness (``labkit.course.harness``).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import TYPE_CHECKING

from labkit.core.kv.block_manager import BlockManager, hash_block
from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.course.harness.compare import require_subclass

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from labkit.core.llm import LLM

PROMPTS = ["Once upon a time, there was a little fox named Lily.", "The dog ran to the park.", "One day"]


def require_block_manager(cls: object) -> type[BlockManager]:
    """The learner's class, or a clear error if it is not a BlockManager subclass."""
    return require_subclass(cls, BlockManager, "class MyBlockManager(BlockManager): ...", "labkit.BlockManager")


def table(block_table: list[int]) -> SimpleNamespace:
    """A stand-in sequence for the by-hand checks: ``slot`` only reads its ``block_table``."""
    return SimpleNamespace(block_table=list(block_table))


def greedy_tokens(llm: LLM, prompts: list[str], max_tokens: int) -> list[list[int]]:
    from labkit import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


SLOT_HINTS = Hints(
    concept="The KV pool is one long row of slots cut into blocks; a sequence's block table lists its blocks in "
            "order, scattered anywhere in the pool. Which entry of the table holds token `position`, and where "
            "inside that block?",
    rule="A token's block is the table entry at its position divided by the block size; inside it, the offset is "
         "the remainder. A block is block_size slots wide, so its first slot is its id times block_size.",
    code="seq.block_table[position // self.block_size] * self.block_size + position % self.block_size",
    by_failure={
        "slot": "the table entry comes from the integer quotient of the position, the offset from the remainder, "
                "and a block's first slot is its id times the block size",
        "not-called": "override slot(self, seq, position) in your BlockManager subclass",
        "engine-tokens": "in the engine a wrong slot stores a token's K/V where another token's belong",
    },
)

BLOCK_HASH_HINTS = Hints(
    concept="Two prompts may share a block of tokens and still differ before it. What must a block's hash depend "
            "on, besides its own tokens, so that a cached block is reused only after the same prefix? And which "
            "blocks are worth hashing at all?",
    rule="Hash the full blocks only, in order. Each block's hash combines the previous block's hash (none for the "
         "first) with its own tokens, so a hash names the whole prefix up to that block.",
    code="parent = None; for i in range(len(token_ids) // self.block_size): parent = hash_block(parent, "
         "tuple(token_ids[i * bs:(i + 1) * bs])); collect parent.",
    by_failure={
        "return-type": "block_hashes returns a list with one hash per full block",
        "block-count": "only full blocks are hashed: a partial last block can still change",
        "first-block": "the first block has no parent; its tokens are hashed as a tuple",
        "not-chained": "each hash must include its parent's, so the same tokens after a different prefix hash "
                       "differently",
        "engine-prefix": "the prefix cache finds a block by its hash: your hashes decide which prompt tokens are "
                         "found",
        "engine-tokens": "a block reused after a different prefix gives the model the wrong K/V",
    },
)


def check_slot(cls: type[BlockManager], model: str = "labkit-tiny", max_tokens: int = 8) -> CheckResult:
    """Task 1: ``cls(...).slot(seq, position)`` is the pool slot of token ``position`` of ``seq``."""
    from labkit import LLM  # late import: labkit.core.llm imports the engines

    def body(check: Check) -> None:
        cls_ = require_block_manager(cls)
        bm = cls_(num_blocks=40, block_size=4)
        for position, want in ((0, 28), (3, 31), (4, 8), (9, 37)):
            got = bm.slot(table([7, 2, 9]), position)  # type: ignore[arg-type]
            check.expect(got == want, f"block_table [7, 2, 9], block_size 4: token {position} should be in slot "
                         f"{want}, got {got}", because="slot")
        rng = random.Random(0)
        for _ in range(50):
            bs = rng.choice([1, 2, 3, 16])
            t = rng.sample(range(40), rng.randint(1, 6))
            p = rng.randrange(len(t) * bs)
            got = cls_(num_blocks=40, block_size=bs).slot(table(t), p)  # type: ignore[arg-type]
            want = BlockManager(num_blocks=40, block_size=bs).slot(table(t), p)  # type: ignore[arg-type]
            if got != want:
                check.expect(False, f"block_table {t}, block_size {bs}, token {p}: slot {want} expected, got {got}",
                             because="slot")
                break
        bm = cls_(num_blocks=6, block_size=3)
        slots = [bm.slot(table([5, 0, 3]), p) for p in range(9)]  # type: ignore[arg-type]
        check.expect(sorted(slots) == [0, 1, 2, 9, 10, 11, 15, 16, 17],
                     f"the 9 tokens of block_table [5, 0, 3] (block_size 3) must fill blocks 5, 0 and 3 exactly: "
                     f"slots {slots}", because="slot")
        if check.result.failures:
            return
        # Inside the engine: "loop" input preparation maps every new token through the block manager's slot.
        options = dict(engine="paged", device="cpu", block_size=4, num_gpu_blocks=64, debug_checks=True)
        want_ids = greedy_tokens(LLM(model, **options), PROMPTS, max_tokens)  # type: ignore[arg-type]
        calls: list[int] = []

        class Counting(cls_):  # type: ignore[valid-type, misc]
            def slot(self, seq, position):  # type: ignore[no-untyped-def]
                calls.append(position)
                return super().slot(seq, position)

        mine = LLM(model, block_manager_cls=Counting, prepare_inputs="loop", **options)  # type: ignore[arg-type]
        got_ids = greedy_tokens(mine, PROMPTS, max_tokens)
        check.expect(bool(calls), "the engine never called your slot (did you override `slot(self, seq, position)`?)",
                     because="not-called")
        for prompt, want, got in zip(PROMPTS, want_ids, got_ids):
            if got != want:
                check.expect(False, f"with your slot mapping the paged engine's greedy tokens for {prompt!r} differ "
                             f"from labkit's at output token {first_difference(got, want)}: K/V went to the wrong "
                             "slots", because="engine-tokens")
                break

    return run_checker("Task 1 (slot mapping)", "", body, task_id="06.slot")


def first_difference(got: list[int], want: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def shared_prefix_prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Prompts that share prefixes in blocks of 4: a system prompt of 3 full blocks reused by three requests,
    and two prompts that hold the same block after *different* first blocks (only a chained hash tells them apart)."""
    from labkit.measure.workloads import prompt_ids_of_length

    system = prompt_ids_of_length(tokenizer, 12, seed=1)
    other = prompt_ids_of_length(tokenizer, 24, seed=2)
    questions = [prompt_ids_of_length(tokenizer, 16, seed=10 + i)[-6:] for i in range(3)]
    return [system + questions[0], system + questions[1], system + questions[2],
            other[:4] + system[4:] + questions[0],  # blocks 2-3 hold the system prompt's tokens, after another block 1
            other[:4] + system[4:] + questions[1]]


def prefix_cache_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[int], list[list[int]]]:
    """Each prompt alone, in order (a block is reusable once computed): cached prompt tokens and greedy tokens."""
    from labkit import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    return [o.num_cached_tokens for o in outs], [o.outputs[0].token_ids for o in outs]


def count_fault(num_tokens: int, block_size: int, num_hashes: int) -> str:
    """What is wrong with returning ``num_hashes`` hashes for ``num_tokens`` tokens ('' when the count is right)."""
    want = num_tokens // block_size
    if num_hashes == want:
        return ""
    partial = num_tokens % block_size
    head = (f"{num_tokens} tokens in blocks of {block_size} make {want} full block(s): expected {want} hash(es), "
            f"got {num_hashes}. ")
    if num_hashes == want + 1 and partial:
        return head + (f"Your code also hashes the partial last block ({partial} of {block_size} tokens): a block "
                       "gets a hash only once it is full (its tokens are still arriving); loop over "
                       "len(token_ids) // self.block_size blocks")
    if num_hashes == want + 1:
        return head + ("Your code hashes an empty block after the last full one: loop over "
                       "len(token_ids) // self.block_size blocks")
    if num_hashes > want:
        return head + "Hash each full block once, in order; a partial last block gets no hash"
    return head + ("Your code misses full blocks: a block is full when it holds block_size tokens, including the "
                   "last one when len(token_ids) is a multiple of block_size")


def check_block_hashes(cls: type[BlockManager], model: str = "labkit-tiny", max_tokens: int = 6) -> CheckResult:
    """Task 2: ``cls(...).block_hashes(token_ids)`` is the chained hash of every full block of ``token_ids``."""
    from labkit import LLM

    def body(check: Check) -> None:
        cls_ = require_block_manager(cls)

        def hashes(token_ids: list[int], block_size: int) -> list[int]:
            return cls_(num_blocks=8, block_size=block_size).block_hashes(list(token_ids))

        # How many hashes first: a wrong count (the partial last block hashed, or a full one missed) would otherwise
        # show up as every later check failing, and send the learner to the chaining, which may well be right.
        for ids, bs in (([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), (list(range(8)), 4), ([1, 2, 3], 4), ([], 4),
                        (list(range(7)), 3)):
            got = hashes(ids, bs)
            if not isinstance(got, list):
                check.expect(False, f"block_hashes must return a list (one hash per full block), got {got!r}",
                             because="return-type")
                return
            fault = count_fault(len(ids), bs, len(got))
            if fault:
                check.expect(False, fault, because="block-count")
                break

        def full(token_ids: list[int], block_size: int) -> list[int]:
            """The learner's hashes of the full blocks only, so a count fault reported above is not reported again."""
            return hashes(token_ids, block_size)[: len(token_ids) // block_size]

        got = full([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
        h0 = hash_block(None, (1, 2, 3, 4))
        if got[:1] != [h0]:
            check.expect(False, "the first block's hash is hash_block(None, (1, 2, 3, 4)): no parent, and its "
                         f"tokens as a tuple; got {got[:1]!r}", because="first-block")
        elif got[1:] == [hash_block(None, (5, 6, 7, 8))]:
            check.expect(False, "the second block's hash ignores the first: chain each hash to its parent, "
                         "hash_block(<first block's hash>, (5, 6, 7, 8))", because="not-chained")
        elif got[1:] != [hash_block(h0, (5, 6, 7, 8))]:
            check.expect(False, "the second block's hash is hash_block(<first block's hash>, (5, 6, 7, 8))",
                         because="not-chained")
        a, b = full([1, 2, 3, 4, 5, 6, 7, 8], 4), full([0, 2, 3, 4, 5, 6, 7, 8], 4)
        if not check.result.failures:
            check.expect(a[1:] != b[1:], "the same tokens after a different prefix must hash differently: chain "
                         "each hash to its parent", because="not-chained")
        rng = random.Random(0)
        for _ in range(0 if check.result.failures else 20):
            ids, bs = [rng.randrange(2048) for _ in range(rng.randrange(40))], rng.choice([1, 3, 16])
            if full(ids, bs) != BlockManager(num_blocks=8, block_size=bs).block_hashes(ids):
                check.expect(False, f"{len(ids)} random tokens, block_size {bs}: hashes differ from labkit's",
                             because="not-chained")
                break
        if check.result.failures:
            return
        # Inside the engine: lookup_prefix and cache_full_blocks both hash with the learner's method.
        options = dict(engine="paged", device="cpu", block_size=4, num_gpu_blocks=64, enable_prefix_caching=True,
                       debug_checks=True)
        reference = LLM(model, **options)  # type: ignore[arg-type]
        prompts = shared_prefix_prompts(reference.tokenizer)
        want_cached, want_ids = prefix_cache_run(reference, prompts, max_tokens)
        mine = LLM(model, block_manager_cls=cls_, **options)  # type: ignore[arg-type]
        got_cached, got_ids = prefix_cache_run(mine, prompts, max_tokens)
        for i, (got_n, want_n) in enumerate(zip(got_cached, want_cached)):
            if got_n != want_n:
                check.expect(False, f"request {i} of {len(prompts)} (prompts sharing prefixes, blocks of 4) found "
                             f"{got_n} prompt tokens in the prefix cache with your hashes, {want_n} with labkit's",
                             because="engine-prefix")
                break
        for i, (got, want) in enumerate(zip(got_ids, want_ids)):
            if got != want:
                check.expect(False, f"request {i}: with your hashes the engine's greedy tokens differ from labkit's "
                             f"at output token {first_difference(got, want)}: a cached block was reused after a "
                             "different prefix", because="engine-tokens")
                break
        bm, ref_bm = mine.engine.block_manager, reference.engine.block_manager
        check.expect((bm.num_hit_tokens, bm.num_queried_tokens) == (ref_bm.num_hit_tokens, ref_bm.num_queried_tokens),
                     f"prefix-cache hits: {bm.num_hit_tokens} of {bm.num_queried_tokens} prompt tokens with your "
                     f"hashes, {ref_bm.num_hit_tokens} of {ref_bm.num_queried_tokens} with labkit's",
                     because="engine-prefix")
        registered, want_registered = set(bm.hash_to_block_id), set(ref_bm.hash_to_block_id)
        check.expect(registered == want_registered,
                     f"the engine's block manager registered {len(registered - want_registered)} block hash(es) that "
                     f"labkit's does not (of {len(registered)}): cache_full_blocks hashes with your block_hashes too",
                     because="engine-prefix")

    return run_checker("Task 2 (chained block hash)", "", body, task_id="06.block_hashes")
