"""Checkers for notebook 03 (``03_kv_cache``).

Task 1 mirrors ``labkit.core.kv.contiguous.write_kv``: the cache update. Checked directly on tensors,
then end to end inside the real engine: ``LLM(..., engine="kvcache", kv_cache_cls=cache_with(fn))`` runs
a ``ContiguousKVCache`` subclass whose update is the learner's, and must produce the same greedy tokens
as the ``naive`` engine, which recomputes everything and needs no cache at all.

Task 2 is a ``ContiguousKVCache`` subclass that overrides ``attend``: append this step's keys and values to the
cache, then attend over every cached column with the cache's mask. Its checker runs engine ``kvcache`` with the
learner's cache (the harness, ``labkit.course.harness``), compares every ``attend`` call with labkit's
(``labkit.course.ch03_kv_cache.cache_attend``), then the tokens with transformers' and labkit's cache's.
``KV_SETUPS`` are engine kvcache's workloads, run by notebook 05's checkers too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.core.kv.contiguous import ContiguousKVCache
from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.course.ch03_kv_cache.cache_attend import watching_attend
from labkit.course.harness.compare import RUN_FAILURES, check_setups, require_subclass
from labkit.course.harness.runs import Request, Setup

# Engine kvcache's workloads, for notebook 03's cache and notebook 05's static batch alike: one request alone (no
# padding), then static batches of 3 whose prompts and outputs differ in length (padding, finished rows still
# computed, a second batch with a fresh cache), then seeded sampling.
KV_MAX_NUM_SEQS = 3
KV_SETUPS = (
    Setup("1 greedy request alone", (Request("R0", "The dog ran to the park. He saw", max_tokens=8),),
          engine="kvcache", max_num_seqs=KV_MAX_NUM_SEQS),
    Setup("4 greedy requests in static batches of 3", (
        Request("R0", "Lily was happy.", max_tokens=6),
        Request("R1", "The dog ran to the park. He saw", max_tokens=4),
        Request("R2", "One day, Tom found a red ball under the big tree. He", max_tokens=8),
        Request("R3", "Once upon a time, there was a little fox named Lily.", max_tokens=5),
    ), engine="kvcache", max_num_seqs=KV_MAX_NUM_SEQS),
    Setup("3 sampled requests (seeded) in one static batch", (
        Request("S0", "Lily was happy.", max_tokens=8, temperature=0.8, seed=1),
        Request("S1", "The dog ran to the park. He saw", max_tokens=6, temperature=1.3, top_k=20, seed=2),
        Request("S2", "One day, Tom found a red ball under the big tree. He", max_tokens=8, temperature=0.7,
                top_p=0.8, seed=3),
    ), engine="kvcache", max_num_seqs=KV_MAX_NUM_SEQS),
)

WriteKV = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
PROMPTS = ["Once upon a time, there was a little fox named Lily.", "The dog ran to the park.", "One day"]


def cache_with(fn: WriteKV) -> type[ContiguousKVCache]:
    """A ContiguousKVCache whose update is ``fn``: plug it in with ``LLM(..., kv_cache_cls=cache_with(fn))``."""
    return type("LearnerKVCache", (ContiguousKVCache,), {"write": staticmethod(fn)})


WRITE_KV_HINTS = Hints(
    concept="The cache holds every column computed so far; a step brings T new ones that start at column `start`. "
            "Where do they go, and what does attention need back: the new columns only, or everything so far?",
    rule="Write the new keys (or values) into the cache's columns start to start + T, in the cache's own layout "
         "(heads before columns), and return every column up to start + T, in the layout the model uses "
         "(columns before heads).",
    code="cache is (B, heads, max_len, d) but new is (B, T, heads, d): cache[:, :, start:start + T] = "
         "new.transpose(1, 2); return cache[:, :, :start + T].transpose(1, 2) (a view of the cache: no copy "
         "needed).",
    by_failure={
        "shape": "the result holds every token so far, laid out as (batch, tokens, heads, head_dim)",
        "returned": "the result is the cached columns followed by the new ones, in order",
        "cache-not-written": "the cache tensor itself must keep the new columns, at start and after, for the next "
                             "step",
        "engine-tokens": "inside the engine every decode step reads the columns earlier steps wrote: a wrong column "
                         "changes the next token",
    },
)

ATTEND_HINTS = Hints(
    concept="A decode step's query must see every earlier token and itself. Where are those keys and values when "
            "the step starts, and in which order must writing and attending happen?",
    rule="Store this step's keys and values in the cache first (columns self.length onwards), then attend over "
         "everything the cache now holds, with the cache's mask saying which columns each query may see (the mask, "
         "not a causal flag, knows where the new columns sit). Leave self.length alone: the engine advances it.",
    code="k_all = self.write(self.k[layer_idx], k, self.length); v_all = self.write(self.v[layer_idx], v, "
         "self.length); return sdpa(q, k_all, v_all, mask=self.mask, is_causal=False) (sdpa takes and returns "
         "(B, T, heads, head_dim) tensors).",
    by_failure={
        **RUN_FAILURES,
        "stopped": "attend stores this step's K/V before attending, and attends over everything cached so far",
        "transformers": "a wrong token means a query saw the wrong columns: all earlier tokens and itself, nothing "
                        "later, nothing missing",
    },
)


def check_write_kv(fn: WriteKV, model: str = "labkit-tiny", max_tokens: int = 12) -> CheckResult:
    """Task 1: ``fn(cache, new, start)`` writes new K/V at columns [start, start+T) and returns all so far."""
    from labkit import LLM, SamplingParams  # late import: labkit.core.llm imports the engines

    def body(check: Check) -> None:
        cache = torch.zeros(2, 3, 10, 4)  # (B, n_kv_heads, max_len, head_dim)
        first = torch.randn(2, 5, 3, 4)  # (B, T, n_kv_heads, head_dim): a 5-token prefill
        out = fn(cache, first, 0)
        check.expect(tuple(out.shape) == (2, 5, 3, 4), f"after a 5-token prefill: shape {tuple(out.shape)}, "
                     "expected (2, 5, 3, 4) = (B, tokens so far, n_kv_heads, head_dim)", because="shape")
        check.expect(torch.equal(out, first), "after prefill the returned keys must equal the new ones",
                     because="returned")
        step = torch.randn(2, 1, 3, 4)  # one decode token
        out = fn(cache, step, 5)
        check.expect(tuple(out.shape) == (2, 6, 3, 4), f"after one decode step: shape {tuple(out.shape)}, "
                     "expected (2, 6, 3, 4)", because="shape")
        check.expect(torch.equal(out[:, :5], first) and torch.equal(out[:, 5:], step),
                     "the decode step must return the cached prefill followed by the new token", because="returned")
        check.expect(torch.equal(cache[:, :, 5], step[:, 0]) and bool((cache[:, :, 6:] == 0).all()),
                     "the cache tensor itself must hold the new token at column 5, and nothing beyond it",
                     because="cache-not-written")
        if not check.result.failures:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            naive = LLM(model, engine="naive", device="cpu")
            cached = LLM(model, engine="kvcache", device="cpu", max_num_seqs=len(PROMPTS), kv_cache_cls=cache_with(fn))
            want = [o.outputs[0].token_ids for o in naive.generate(PROMPTS, params, use_tqdm=False)]
            got = [o.outputs[0].token_ids for o in cached.generate(PROMPTS, params, use_tqdm=False)]
            check.expect(got == want, "with your update, the kvcache engine's greedy tokens differ from "
                         "the naive engine's", because="engine-tokens")

    return run_checker("Task 1 (write_kv)", "", body, task_id="03.write_kv")


def check_attend(cls: type[ContiguousKVCache], model: str = "labkit-tiny") -> CheckResult:
    """Task 2: ``cls`` (a ``ContiguousKVCache`` subclass) appends each step's K/V and attends over the cache."""

    def body(check: Check) -> None:
        cache = watching_attend(require_subclass(cls, ContiguousKVCache, "class MyKVCache(ContiguousKVCache): ..."))
        check_setups(check, KV_SETUPS, model, "attend", "labkit's own cache", kv_cache_cls=cache)

    return run_checker("Task 2 (attend)", "", body, task_id="03.attend")
