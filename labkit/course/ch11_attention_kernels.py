"""Notebook 11's Build tasks: the Triton decode kernel's inner loop (``attend_tile``) and its merge
(``merge_splits``), checked under Triton's interpreter and then inside the real engine.

Each checker runs labkit's kernel with the learner's part in place of labkit's (the other part stays labkit's),
on probe cases from the smallest up, each built to expose one mistake: one tile; several tiles of one split (the
running sum and output must be rescaled when the max grows); a bfloat16 pool (the interpreter computes bfloat16
arithmetic wrongly: work in float32); several splits, an empty one and scores hundreds apart (the merge). Outputs
are compared with a float64 softmax over each sequence's context. Then engine ``continuous`` runs with the part
(``LLM(..., attention_backend=...)``) and its greedy tokens must equal transformers'. Notebook 11
(``11_attention_kernels``).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from labkit.course import Check, CheckResult, run_checker

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # bfloat16: the output is rounded once (steps of 2^-8)
N_KV = 2


@dataclass(frozen=True)
class Probe:
    """One direct kernel case and what it exposes when it is the first to fail."""

    what: str
    group: int
    head_dim: int
    block_size: int
    context_lens: tuple[int, ...]
    dtype: torch.dtype
    num_splits: int
    hint: str
    score_scale: float = 1.0


TILE_PROBES = (
    Probe("one tile: a 12-token context, blocks scattered through the pool", 4, 32, 8, (12,), torch.float32, 1,
          "one tile: block = table[pos // BLOCK_SIZE], slot = block * BLOCK_SIZE + pos % BLOCK_SIZE; scores = "
          "q · kᵀ · scale, -inf where not valid; p = exp(scores - m_new)"),
    Probe("three tiles in one split: a 45-token context", 4, 32, 8, (45,), torch.float32, 1,
          "one tile passes, three do not: when the max grows, what was summed under the old max must shrink by "
          "alpha = exp(m_i - m_new): l = l_i * alpha + sum(p), acc = acc * alpha[:, None] + p @ v"),
    Probe("a bfloat16 pool, three tiles", 4, 32, 8, (45,), torch.bfloat16, 1,
          "float32 passes, bfloat16 does not: convert K and V to float32 right after tl.load (.to(tl.float32)); "
          "Triton's interpreter computes bfloat16 arithmetic wrongly, and on a GPU the sums need the range"),
    Probe("a ragged batch [1, 8, 9, 30], GQA group 3 (padded to 16), 2 splits", 3, 64, 8, (1, 8, 9, 30),
          torch.float32, 2, "compare with softmax(q · Kᵀ / sqrt(d)) · V over each sequence's own positions"),
)
MERGE_PROBES = (
    Probe("two splits of a 40-token context", 4, 32, 8, (40,), torch.float32, 2,
          "weight each split by w = exp(m - M), M the largest m; output = sum(w * o) / sum(w * l)"),
    Probe("an empty split: contexts [5, 70] split 4 ways", 4, 32, 8, (5, 70), torch.float32, 4,
          "the 5-token sequence's splits 1-3 are empty (m = -inf, l = 0): their weight exp(-inf - M) is 0; "
          "take M over all splits, never divide by a split's own l"),
    Probe("scores hundreds apart across splits", 2, 32, 8, (40, 33), torch.float32, 3,
          "exp of a score in the hundreds overflows: subtract the largest max M before exp", score_scale=30.0),
)


def unwrap_not_implemented(exc: BaseException) -> None:
    """A stub's NotImplementedError reaches us wrapped (the interpreter's InterpreterError, or a compile error on a
    GPU): raise it again as itself, so the checker reports "not started"."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, NotImplementedError) or "NotImplementedError" in str(seen):
            raise NotImplementedError from exc
        seen = seen.__cause__ or seen.__context__


def raise_if_stub(fn: Callable[..., Any]) -> None:
    """A stub raises NotImplementedError before touching its arguments: call it with None for each, in plain Python.
    Written code fails on the Nones with some other error, which is ignored here (the kernel runs it for real)."""
    params = inspect.signature(getattr(fn, "fn", fn)).parameters
    try:
        getattr(fn, "fn", fn)(*[None] * len(params))
    except NotImplementedError:
        raise
    except Exception:  # noqa: BLE001  real code meeting None: not a stub
        return


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def probe_case(probe: Probe, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """q, pools of random values (a slot read by mistake shows) and shuffled tables, each with one spare block."""
    gen = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-c // probe.block_size) + 1 for c in probe.context_lens) + 1
    shape = (n_blocks, probe.block_size, N_KV, probe.head_dim)
    k_pool, v_pool = torch.randn(shape, generator=gen) * probe.score_scale, torch.randn(shape, generator=gen) * 3
    order = torch.randperm(n_blocks, generator=gen).tolist()
    tables = []
    for c in probe.context_lens:
        n = -(-c // probe.block_size) + 1
        tables.append(order[:n])
        order = order[n:]
    q = torch.randn(len(probe.context_lens), probe.group * N_KV, probe.head_dim, generator=gen) * probe.score_scale
    return q.to(probe.dtype), k_pool.to(probe.dtype), v_pool.to(probe.dtype), tables


def softmax_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]],
                      context_lens: tuple[int, ...]) -> torch.Tensor:
    """float64, one sequence and head at a time: its first context_len slots, query head h on KV head h // group."""
    group = q.shape[1] // k_pool.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (table, ctx) in enumerate(zip(tables, context_lens)):
        keys = k_pool[table].flatten(0, 1)[:ctx].double()  # (ctx, n_kv, d)
        values = v_pool[table].flatten(0, 1)[:ctx].double()
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[i, h].double() / math.sqrt(q.shape[-1])
            out[i, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


def run_probe(probe: Probe, seed: int, **parts: Any) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], tuple]:
    from labkit.core.attention.triton_decode import paged_decode_attention

    q, k_pool, v_pool, tables = probe_case(probe, seed)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(probe.context_lens, dtype=torch.int32)
    dev = device()
    out = paged_decode_attention(q.to(dev), k_pool.to(dev), v_pool.to(dev), padded.to(dev), lens.to(dev),
                                 max(probe.context_lens), num_splits=probe.num_splits, block_n=16, **parts)
    return out.cpu(), softmax_reference(q, k_pool, v_pool, tables, probe.context_lens), tables, (q, k_pool, v_pool)


def unmasked_tail(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: list[list[int]],
                  probe: Probe) -> torch.Tensor:
    """What a tile without the -inf mask computes (one split): the last tile's positions past the end score
    0 with V = 0 (masked loads), so each adds exp(0 - m) to the sum and nothing to the output."""
    group, out = q.shape[1] // N_KV, torch.empty(q.shape, dtype=torch.float64)
    for i, (table, ctx) in enumerate(zip(tables, probe.context_lens)):
        extra = -(-ctx // 16) * 16 - ctx
        keys = k_pool[table].flatten(0, 1)[:ctx].double()
        values = v_pool[table].flatten(0, 1)[:ctx].double()
        for h in range(q.shape[1]):
            scores = keys[:, h // group] @ q[i, h].double() / math.sqrt(q.shape[-1])
            scores = torch.cat([scores, scores.new_zeros(extra)])
            out[i, h] = torch.softmax(scores, 0)[:ctx] @ values[:, h // group]
    return out


def diagnose_tile(probe: Probe, out: torch.Tensor, tables: list[list[int]], tensors: tuple) -> str:
    """Name the mistake where a plain rewrite of the reference reproduces the output exactly."""
    q, k_pool, v_pool = tensors
    tol = TOL[probe.dtype]
    shifted = softmax_reference(q, k_pool, v_pool, [t[1:] + t[:1] for t in tables], probe.context_lens)
    if torch.allclose(out.double(), shifted, rtol=tol, atol=tol):
        return ("it matches reading block table[pos // BLOCK_SIZE + 1]: position pos sits in the table's entry "
                "pos // BLOCK_SIZE (an off-by-one in the block-table lookup)")
    if probe.num_splits == 1 and torch.allclose(out.double(), unmasked_tail(q, k_pool, v_pool, tables, probe),
                                                rtol=tol, atol=tol):
        return ("it matches positions past the context's end scoring 0 (their masked loads give K = 0): set their "
                "scores to -inf (tl.where(valid[None, :], scores, float('-inf')))")
    if not torch.isfinite(out).all():
        return "the output holds inf or nan"
    return probe.hint


def probe_part(check: Check, probes: tuple[Probe, ...], part: str, fn: Any) -> None:
    for index, probe in enumerate(probes):
        try:
            with warnings.catch_warnings():  # NumPy's overflow warnings from a wrong part: the failure says it
                warnings.simplefilter("ignore", RuntimeWarning)
                out, want, tables, tensors = run_probe(probe, seed=11 + index, **{part: fn})
        except Exception as exc:  # the learner's code runs inside the interpreter: report, do not crash
            unwrap_not_implemented(exc)
            check.expect(False, f"{probe.what}: the kernel raised {type(exc).__name__}: {str(exc)[:300]}")
            return
        tol = TOL[probe.dtype]
        if torch.allclose(out.double(), want, rtol=tol, atol=tol):
            continue
        why = diagnose_tile(probe, out, tables, tensors) if part == "tile_fn" else (
            "the output holds inf or nan; " + probe.hint if not torch.isfinite(out).all() else probe.hint)
        error = float((out.double() - want).abs().nan_to_num(float("inf")).max())
        check.expect(False, f"{probe.what} (group {probe.group}, head_dim {probe.head_dim}, block_size "
                     f"{probe.block_size}, {probe.dtype}): off by up to {error:.3g} (tolerance {tol}); {why}")
        return


def kernel_backend(tile_fn: Callable[..., Any] | None = None, merge_fn: Callable[..., Any] | None = None) -> type:
    """labkit's ``"triton"`` backend with the learner's kernel parts in it (``LLM(..., attention_backend=...)``)."""
    from labkit.core.attention.triton_decode import TritonAttentionBackend

    parts = {k: staticmethod(v) for k, v in (("tile_fn", tile_fn), ("merge_fn", merge_fn)) if v is not None}
    return type("LearnersTritonAttention", (TritonAttentionBackend,), parts)


def engine_tokens(backend: type, model: str = "labkit-tiny", max_tokens: int = 6) -> tuple[list[list[int]], list]:
    """Engine ``continuous`` with ``backend``: two ragged prompts (one spans several blocks), greedy tokens."""
    from labkit import LLM, SamplingParams
    from labkit.course.harness.runs import prompt

    prompts = [list(prompt(model, 21, seed=5)), list(prompt(model, 6, seed=6))]
    with LLM(model, engine="continuous", device=str(device()), block_size=8, num_gpu_blocks=16,
             attention_backend=backend) as llm:  # a small pool: the interpreter copies its arguments per launch
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], prompts


def compare_engine(check: Check, backend: type, model: str) -> None:
    from labkit.course.oracle import first_difference, transformers_greedy

    try:
        got, prompts = engine_tokens(backend, model)
    except Exception as exc:
        unwrap_not_implemented(exc)
        check.expect(False, f"engine 'continuous' with your part raised {type(exc).__name__}: {str(exc)[:300]}")
        return
    diff = first_difference(got, transformers_greedy(model, prompts, 6))
    check.expect(diff is None, f"engine 'continuous' with your part, against transformers' greedy tokens: {diff}")


def require_triton() -> None:
    from labkit.core.attention import TRITON_MISSING

    if TRITON_MISSING is not None:
        raise RuntimeError(f"this task needs the triton package (Linux wheels only), which did not import: "
                           f"{TRITON_MISSING}")


def check_attend_tile(fn: Callable[..., Any], model: str = "labkit-tiny") -> CheckResult:
    """Build task: the kernel's inner loop, on probe cases under the interpreter, then inside engine continuous."""

    def body(check: Check) -> None:
        require_triton()
        raise_if_stub(fn)
        probe_part(check, TILE_PROBES, "tile_fn", fn)
        if not check.result.failures:
            compare_engine(check, kernel_backend(tile_fn=fn), model)

    return run_checker("Build: the kernel's inner loop (attend_tile)",
                       "block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0); load K, V at the slots "
                       "and convert to float32; scores -inf where not valid; m_new = max(m_i, row max); rescale l_i "
                       "and acc by exp(m_i - m_new) before adding this tile's p and p @ v.", body)


def check_merge_splits(fn: Callable[..., Any], model: str = "labkit-tiny") -> CheckResult:
    """Build task: stage 2's merge, on probe cases under the interpreter, then inside engine continuous."""

    def body(check: Check) -> None:
        require_triton()
        raise_if_stub(fn)
        probe_part(check, MERGE_PROBES, "merge_fn", fn)
        if not check.result.failures:
            compare_engine(check, kernel_backend(merge_fn=fn), model)

    return run_checker("Build: the merge of the splits (merge_splits)",
                       "M = tl.max(m_parts, 0); w = tl.exp(m_parts - M[None, :]); return tl.sum(o_parts * "
                       "w[:, :, None], 0) / tl.sum(l_parts * w, 0)[:, None].", body)
