"""Checkers for notebook 06 (``06_paged_attention``).

Task 1 mirrors ``BlockManager.block_table_slot``: the slot mapping, where token ``position`` of a
sequence lives in the paged pool. Checked on hand-made block tables, then end to end: the ``paged``
engine with the learner's slot mapping must produce the same greedy tokens as with labkit's.

Task 2 mirrors ``labkit.analysis.kv_memory.block_hashes``: the prefix cache's chained hash of every full block,
as ``BlockManager.cache_full_blocks`` computes it. Checked on small token lists, then against a real
engine: the learner's hashes must be the ones the block manager registered, and must predict how
many prompt tokens the next request finds in the cache.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from labkit.cache.block_manager import BlockManager, hash_block
from labkit.exercises import Check, CheckResult, run_checker
from labkit.analysis.kv_memory import block_hashes

SlotFn = Callable[[list[int], int, int], int]
BlockHashesFn = Callable[[list[int], int], list[int]]
PROMPTS = ["Once upon a time, there was a little fox named Lily.", "The dog ran to the park.", "One day"]


def reference_slot(block_table: list[int], position: int, block_size: int) -> int:
    """labkit's slot mapping as a plain function (what ``BlockManager.block_table_slot`` computes)."""
    return BlockManager(max(block_table) + 1, block_size).block_table_slot(block_table, position)


def use_slot(llm: object, fn: SlotFn | None) -> None:
    """Make a paged engine map tokens to slots with ``fn`` (None: back to labkit's own)."""
    bm = llm.engine.block_manager  # type: ignore[attr-defined]
    if fn is None:
        bm.__dict__.pop("block_table_slot", None)
    else:
        bm.block_table_slot = lambda table, position: fn(list(table), position, bm.block_size)


def check_slot(fn: SlotFn, model: str = "labkit-tiny", max_tokens: int = 8) -> CheckResult:
    """Task 1: ``fn(block_table, position, block_size)`` is the pool slot of token ``position``."""
    from labkit import LLM, SamplingParams  # late import: labkit.llm imports the engines

    def body(check: Check) -> None:
        table = [7, 2, 9]
        for position, want in ((0, 28), (3, 31), (4, 8), (9, 37)):
            got = fn(list(table), position, 4)
            check.expect(got == want, f"block_table {table}, block_size 4: token {position} should be in slot "
                         f"{want}, got {got}")
        rng = random.Random(0)
        for _ in range(50):
            bs = rng.choice([1, 2, 3, 16])
            t = rng.sample(range(40), rng.randint(1, 6))
            p = rng.randrange(len(t) * bs)
            got, want = fn(list(t), p, bs), reference_slot(t, p, bs)
            if got != want:
                check.expect(False, f"block_table {t}, block_size {bs}, token {p}: slot {want} expected, got {got}")
                break
        slots = [fn([5, 0, 3], p, 3) for p in range(9)]
        check.expect(sorted(slots) == [0, 1, 2, 9, 10, 11, 15, 16, 17],
                     f"the 9 tokens of block_table [5, 0, 3] (block_size 3) must fill blocks 5, 0 and 3 exactly: "
                     f"slots {slots}")
        if not check.result.failures:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            llm = LLM(model, engine="paged", device="cpu", block_size=4, num_gpu_blocks=64)
            want_ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            use_slot(llm, fn)
            got_ids = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            check.expect(got_ids == want_ids, "with your slot mapping, the paged engine's greedy tokens differ from "
                         "its tokens with labkit's")

    return run_checker(
        "Task 1 (slot mapping)",
        "the token sits in block block_table[position // block_size], at offset position % block_size within it; "
        "a block is block_size slots wide, so block b starts at slot b * block_size.",
        body,
    )


def check_block_hashes(fn: BlockHashesFn, model: str = "labkit-tiny") -> CheckResult:
    """Task 2: ``fn(token_ids, block_size)`` is the chained hash of every full block of ``token_ids``."""
    from labkit import LLM, SamplingParams

    def body(check: Check) -> None:
        tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
        h0 = hash_block(None, (1, 2, 3, 4))
        got = fn(list(tokens), 4)
        check.expect(isinstance(got, list) and len(got) == 2,
                     f"9 tokens in blocks of 4 make 2 full blocks (the 9th token's block is not full): "
                     f"expected 2 hashes, got {got!r}")
        check.expect(list(got[:1]) == [h0], "the first block's hash is hash_block(None, (1, 2, 3, 4)): "
                     "no parent, and its tokens as a tuple")
        check.expect(got == [h0, hash_block(h0, (5, 6, 7, 8))],
                     "the second block's hash is hash_block(<first block's hash>, (5, 6, 7, 8))")
        check.expect(fn([1, 2, 3], 4) == [], "fewer tokens than one block: no hash at all")
        check.expect(len(fn(list(range(8)), 4)) == 2, "8 tokens in blocks of 4: both blocks are full")
        a, b = fn([1, 2, 3, 4, 5, 6, 7, 8], 4), fn([0, 2, 3, 4, 5, 6, 7, 8], 4)
        check.expect(len(a) == len(b) == 2 and a[1] != b[1],
                     "the same tokens after a different prefix must hash differently: chain each hash to its parent")
        rng = random.Random(0)
        for _ in range(20):
            ids, bs = [rng.randrange(2048) for _ in range(rng.randrange(40))], rng.choice([1, 3, 16])
            if fn(list(ids), bs) != block_hashes(ids, bs):
                check.expect(False, f"{len(ids)} random tokens, block_size {bs}: hashes differ from labkit's")
                break
        if not check.result.failures:
            bs = 4
            llm = LLM(model, engine="paged", device="cpu", block_size=bs, num_gpu_blocks=64, enable_prefix_caching=True)
            params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            first = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
            computed = first.prompt_token_ids + first.outputs[0].token_ids[:-1]
            registered = llm.engine.block_manager.hash_to_block_id
            mine = fn(list(computed), bs)
            check.expect(set(mine) == set(registered), "after one request, the block manager registered other "
                         "hashes than yours for its prompt + output tokens")
            follow_up = computed[:10] + [7, 8, 9, 10, 11]  # shares the first 10 tokens: 2 full blocks
            predicted = 0
            for h in fn(follow_up[:-1], bs):  # the prompt's last token is always computed (it gives the logits)
                if h not in registered:
                    break
                predicted += bs
            second = llm.generate([follow_up], params, use_tqdm=False)[0]
            check.expect(predicted == second.num_cached_tokens == 8,
                         f"your hashes predict {predicted} cached prompt tokens for a follow-up sharing 10 tokens; "
                         f"the engine found {second.num_cached_tokens} (expected 8: two full blocks of 4)")

    return run_checker(
        "Task 2 (chained block hash)",
        "loop over the full blocks only (len(token_ids) // block_size of them); hash each with "
        "hash_block(parent, tuple(block_tokens)) where parent is the previous block's hash (None for the first).",
        body,
    )
