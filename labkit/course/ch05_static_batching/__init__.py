"""Checkers for notebook 05 (``05_static_batching``).

Task 1 mirrors ``labkit.measure.batching.static_batch_tokens``: how many token positions one static batch
computes, and how many of them were useful. Checked on hand-counted batches, then on random batches
against a cell-by-cell count of the slot-occupancy grid (``labkit.measure.batching.static_batch_occupancy``).

Tasks 2 and 3 build the static batch inside engine ``kvcache``: a ``KVCacheEngine`` subclass overriding
``prepare_prefill`` (left padding, positions, which columns are real; ``LLM(..., engine=MyEngine)``) and a
``ContiguousKVCache`` subclass overriding ``attention_mask`` (padding and the future hidden; ``kv_cache_cls=``).
Their checkers run notebook 03's workloads (``labkit.course.ch03_kv_cache.KV_SETUPS``) through the harness
(``labkit.course.harness``), compare every call with labkit's (``labkit.course.ch05_static_batching.static_batch``),
then the tokens with transformers' and labkit's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from labkit.core.engine.kvcache import KVCacheEngine
from labkit.core.kv.contiguous import ContiguousKVCache
from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.course.ch03_kv_cache import KV_SETUPS
from labkit.course.ch05_static_batching.static_batch import (
    expect_mask_cases,
    watching_attention_mask,
    watching_prepare_prefill,
)
from labkit.course.harness.compare import RUN_FAILURES, check_setups, require_subclass
from labkit.measure.batching import static_batch_occupancy

# (prompt_lens, output_lens) of one static batch -> (computed, useful), counted by hand:
# computed = B x (max prompt + max output - 1); useful = sum of (prompt + output - 1).
BATCH_CASES: list[tuple[list[int], list[int], tuple[int, int]]] = [
    ([5], [3], (7, 7)),  # one request: nothing to pad, nobody to wait for
    ([3, 3, 3], [2, 2, 2], (12, 12)),  # identical requests: no waste either
    ([4, 2], [1, 3], (12, 8)),  # 2 padding positions (row 1) + 2 idle decode steps (row 0)
    ([10, 1, 6], [1, 8, 2], (51, 25)),  # 13 padding + 13 idle: half the batch's work is waste
    ([2, 5], [1, 1], (10, 7)),  # every output is 1 token: the prefill is the only step
]


def _pair(result: Any) -> tuple[Any, Any]:
    computed, useful = result  # a tuple, a list or a NamedTuple of two
    return computed, useful


def check_static_batch_tokens(fn: Callable[[Sequence[int], Sequence[int]], Any], num_random: int = 25
                              ) -> CheckResult:
    """Task 1: ``fn(prompt_lens, output_lens)`` returns (computed, useful) token positions of one static batch."""

    def body(check: Check) -> None:
        for prompts, outputs, want in BATCH_CASES:
            got = _pair(fn(list(prompts), list(outputs)))
            check.expect(tuple(got) == want, f"prompt_lens={prompts}, output_lens={outputs}: "
                         f"(computed, useful) = {tuple(got)!r}, expected {want}", because="count")
        rng = random.Random(5)
        for _ in range(num_random if not check.result.failures else 0):
            n = rng.randint(1, 8)
            prompts = [rng.randint(1, 40) for _ in range(n)]
            outputs = [rng.randint(1, 30) for _ in range(n)]
            totals = static_batch_occupancy(prompts, outputs, max_num_seqs=n).totals()
            want = (totals.computed, totals.useful)
            got = _pair(fn(list(prompts), list(outputs)))
            check.expect(tuple(got) == want, f"prompt_lens={prompts}, output_lens={outputs}: "
                         f"(computed, useful) = {tuple(got)!r}, expected {want} (counted slot by slot)",
                         because="count")
            if check.result.failures:
                break

    return run_checker("Task 1 (static_batch_tokens)", "", body, task_id="05.static_batch_tokens")


STATIC_BATCH_HINTS = Hints(
    concept="A static batch runs every row for as long as its longest prompt and its longest output. Which positions "
            "does each row compute, and which of them did its request need?",
    rule="Every row computes the padded prefill (the longest prompt) and every decode step of the batch (the longest "
         "output less one: the prefill samples the first token). A request needs its own prompt plus its output "
         "less one (the last token is sampled, never fed back). Return (computed, useful).",
    code="computed = len(prompts) * (max(prompts) + max(outputs) - 1); useful = sum(p + o - 1 for p, o in "
         "zip(prompts, outputs)); return computed, useful",
    by_failure={"count": "count padding and finished rows as computed; count only each request's own prompt and "
                         "output, less the last token, as useful"},
)

PREPARE_PREFILL_HINTS = Hints(
    concept="Prompts of different lengths share one rectangular batch, and each row's next token is read from its "
            "last column. Where must the padding go so that every row's last column is a real token, and what "
            "position does a real token have when padding comes before it?",
    rule="The batch is as wide as the longest prompt. Each row holds its prompt in its last columns (padding on the "
         "left), marked valid exactly there; a real token's position counts from the row's first real token, so "
         "padding never shifts positions. Padding columns hold a harmless id and position and are not valid.",
    code="T = max prompt length; for a row with p tokens: ids[b, T - p:] = prompt, valid[b, T - p:] = True, "
         "positions[b, T - p:] = arange(p); padding: id 0, position 0, valid False.",
    by_failure={
        **RUN_FAILURES,
        "stopped": "each row's real tokens sit at its end (left padding), valid exactly there, positions from 0",
        "transformers": "a wrong token means the model saw padding as text, or the wrong positions: the real "
                        "tokens' positions start at 0 in every row",
    },
)

ATTENTION_MASK_HINTS = Hints(
    concept="In a padded batch with a cache, a query may look at some columns and not others. Which columns hold "
            "real tokens, which lie in the query's future, and what happens to a softmax row that may look at "
            "nothing?",
    rule="Query t of a step sits at column start + t. It may see a column when that column holds a real token and "
         "is not later than itself; a padding query must still see at least its own column, so its softmax is "
         "defined.",
    code="cols = arange(S), rows = start + arange(T); allowed = valid[:, None, None, :] & (cols[None, :] <= "
         "rows[:, None]); OR in cols == rows so a padding query sees itself.",
    by_failure={
        **RUN_FAILURES,
        "mask": "a query sees real tokens up to and including its own column, never later ones, never padding; a "
                "padding query sees at least itself",
        "stopped": "the mask is (B, 1, T, S): True where a query may look",
        "transformers": "a wrong token means a real token looked at padding, at its future, or not at its past",
    },
)


def check_prepare_prefill(cls: type[KVCacheEngine], model: str = "labkit-tiny") -> CheckResult:
    """Task 2: ``cls`` (a ``KVCacheEngine`` subclass) builds a static batch's prefill inputs as engine kvcache must."""

    def body(check: Check) -> None:
        engine = watching_prepare_prefill(require_subclass(cls, KVCacheEngine, "class MyEngine(KVCacheEngine): ..."))
        check_setups(check, KV_SETUPS, model, "prepare_prefill", "labkit's own engine", engine=engine)

    return run_checker("Task 2 (prepare_prefill)", "", body, task_id="05.prepare_prefill")


def check_attention_mask(cls: type[ContiguousKVCache], model: str = "labkit-tiny") -> CheckResult:
    """Task 3: ``cls`` (a ``ContiguousKVCache`` subclass) masks padding and the future as a static batch needs."""

    def body(check: Check) -> None:
        cache = require_subclass(cls, ContiguousKVCache, "class MyCache(ContiguousKVCache): ...")
        if expect_mask_cases(check, cache, model):
            check_setups(check, KV_SETUPS, model, "attention_mask", "labkit's own cache",
                         kv_cache_cls=watching_attention_mask(cache))

    return run_checker("Task 3 (attention_mask)", "", body, task_id="05.attention_mask")
