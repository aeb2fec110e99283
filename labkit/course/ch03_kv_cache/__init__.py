"""Checkers for notebook 03 (``03_kv_cache``).

Task 1 mirrors ``labkit.core.kv.contiguous.write_kv``: the cache update. Checked directly on tensors,
then end to end inside the real engine: ``LLM(..., engine="kvcache", kv_cache_cls=cache_with(fn))`` runs
a ``ContiguousKVCache`` subclass whose update is the learner's, and must produce the same greedy tokens
as the ``naive`` engine, which recomputes everything and needs no cache at all.

Task 2 is a ``ContiguousKVCache`` subclass that overrides ``attend``: append this step's keys and values to the
cache, then attend over every cached column with the cache's mask. Its checker runs engine ``kvcache`` with the
learner's cache, compares every ``attend`` call with labkit's (``labkit.course.ch03_kv_cache.cache_attend``), then the
tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.core.kv.contiguous import ContiguousKVCache
from labkit.course import Check, CheckResult, run_checker
from labkit.course.ch03_kv_cache.cache_attend import watching_attend
from labkit.course.harness.engine_runs import (
    KV_ALONE,
    KV_BATCHES,
    KV_MAX_NUM_SEQS,
    KV_SAMPLED,
    check_runs,
    make_llm,
    require_subclass,
)

WriteKV = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
PROMPTS = ["Once upon a time, there was a little fox named Lily.", "The dog ran to the park.", "One day"]


def cache_with(fn: WriteKV) -> type[ContiguousKVCache]:
    """A ContiguousKVCache whose update is ``fn``: plug it in with ``LLM(..., kv_cache_cls=cache_with(fn))``."""
    return type("LearnerKVCache", (ContiguousKVCache,), {"write": staticmethod(fn)})


def check_write_kv(fn: WriteKV, model: str = "labkit-tiny", max_tokens: int = 12) -> CheckResult:
    """Task 1: ``fn(cache, new, start)`` writes new K/V at columns [start, start+T) and returns all so far."""
    from labkit import LLM, SamplingParams  # late import: labkit.core.llm imports the engines

    def body(check: Check) -> None:
        cache = torch.zeros(2, 3, 10, 4)  # (B, n_kv_heads, max_len, head_dim)
        first = torch.randn(2, 5, 3, 4)  # (B, T, n_kv_heads, head_dim): a 5-token prefill
        out = fn(cache, first, 0)
        check.expect(tuple(out.shape) == (2, 5, 3, 4), f"after a 5-token prefill: shape {tuple(out.shape)}, "
                     "expected (2, 5, 3, 4) = (B, tokens so far, n_kv_heads, head_dim)")
        check.expect(torch.equal(out, first), "after prefill the returned keys must equal the new ones")
        step = torch.randn(2, 1, 3, 4)  # one decode token
        out = fn(cache, step, 5)
        check.expect(tuple(out.shape) == (2, 6, 3, 4), f"after one decode step: shape {tuple(out.shape)}, "
                     "expected (2, 6, 3, 4)")
        check.expect(torch.equal(out[:, :5], first) and torch.equal(out[:, 5:], step),
                     "the decode step must return the cached prefill followed by the new token")
        check.expect(torch.equal(cache[:, :, 5], step[:, 0]) and bool((cache[:, :, 6:] == 0).all()),
                     "the cache tensor itself must hold the new token at column 5, and nothing beyond it")
        if not check.result.failures:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            naive = LLM(model, engine="naive", device="cpu")
            cached = LLM(model, engine="kvcache", device="cpu", max_num_seqs=len(PROMPTS), kv_cache_cls=cache_with(fn))
            want = [o.outputs[0].token_ids for o in naive.generate(PROMPTS, params, use_tqdm=False)]
            got = [o.outputs[0].token_ids for o in cached.generate(PROMPTS, params, use_tqdm=False)]
            check.expect(got == want, "with your update, the kvcache engine's greedy tokens differ from "
                         "the naive engine's")

    return run_checker(
        "Task 1 (write_kv)",
        "cache is (B, heads, max_len, d) but new is (B, T, heads, d): transpose before writing into "
        "cache[:, :, start:start+T], and return cache[:, :, :start+T] transposed back.",
        body,
    )


def check_attend(cls: type[ContiguousKVCache], model: str = "labkit-tiny") -> CheckResult:
    """Task 2: ``cls`` (a ``ContiguousKVCache`` subclass) appends each step's K/V and attends over the cache."""

    def body(check: Check) -> None:
        cache = watching_attend(require_subclass(cls, ContiguousKVCache, "class MyKVCache(ContiguousKVCache): ..."))
        llm = make_llm("kvcache", model, max_num_seqs=KV_MAX_NUM_SEQS, kv_cache_cls=cache)
        check_runs(check, llm, (KV_ALONE, KV_BATCHES, KV_SAMPLED), "attend", model, "kvcache",
                   (("max_num_seqs", KV_MAX_NUM_SEQS),))

    return run_checker(
        "Task 2 (attend)",
        "write first (self.write(self.k[layer_idx], k, self.length) returns every column so far, cached and new; "
        "the same for v), then attend over what it returned with sdpa and the cache's mask: mask=self.mask, "
        "is_causal=False. The mask already says which columns each query may see.",
        body,
    )
