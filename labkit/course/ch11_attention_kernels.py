"""Notebook 11's Build tasks: the split-KV decode kernel's inner loop (``attend_tile``) and its merge
(``merge_splits``), written in Triton (checked under Triton's interpreter) or, where Triton has no wheel (macOS,
Windows), in PyTorch (``labkit.course.ch11_torch_twin``: the same kernel's grid in Python loops), with the same
probe cases and the same checker, then run inside the real engine.

Each checker runs labkit's kernel with the learner's part in place of labkit's (the other part stays labkit's),
on probe cases from the smallest up, each built to expose one mistake: one tile; several tiles of one split (the
running sum and output must be rescaled when the max grows); a bfloat16 pool (the interpreter computes bfloat16
arithmetic wrongly: work in float32); several splits, an empty one and scores hundreds apart (the merge). Outputs
are compared with a float64 softmax over each sequence's context. Then engine ``continuous`` runs with the part
(``LLM(..., attention_backend=...)``, float32 on every device: on a GPU ``tl.dot`` may round float32 to TF32) and its
greedy tokens must equal transformers'. A failure names the probe case and, in words, the likely mistake; the
staged hints (``TILE_HINTS``, ``MERGE_HINTS``) hold the rest. Notebook 11 (``11_attention_kernels``).
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
from labkit.course.hints import Hints

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
    hint: str  # the likely mistake, in words
    because: str  # its failure class (a key of the task's Hints.by_failure)
    score_scale: float = 1.0


TILE_HINTS = Hints(
    concept=("A tile of positions arrives with a running max m, a running sum l of exp(score - m) and an "
             "unnormalised output acc. Where does position pos's K live in the paged pool? And when this tile holds a "
             "score above m, what happens to everything summed so far under the old m?"),
    rule=("Each position's block is entry pos // block_size of the sequence's table, its slot block * block_size + "
          "pos % block_size; load K and V there (nothing for positions that are not valid) in float32; score "
          "q · K / sqrt(d), -inf where not valid; the new max is the larger of m and the tile's max; scale the old "
          "sum and output by exp(m - new max), then add exp(score - new max) and its product with V."),
    code=("Triton: block = tl.load(table_row + pos // BLOCK_SIZE, mask=valid, other=0); slot = block.to(tl.int64) * "
          "BLOCK_SIZE + pos % BLOCK_SIZE; k = tl.load(k_head + slot[:, None] * stride_slot + offs_d[None, :], "
          "mask=valid[:, None] & d_valid[None, :], other=0.0).to(tl.float32) (v alike); scores = tl.where(valid[None, "
          ":], tl.dot(q, tl.trans(k)) * scale, float('-inf')); m_new = tl.maximum(m_i, tl.max(scores, 1)); alpha = "
          "tl.exp(m_i - m_new); p = tl.exp(scores - m_new[:, None]); return m_new, l_i * alpha + tl.sum(p, 1), acc * "
          "alpha[:, None] + tl.dot(p, v). PyTorch twin: block = table[torch.where(valid, pos // block_size, 0)]; k = "
          "k_pool[block, pos % block_size].float(); the rest with torch.where, .max(1).values, .sum(1) and @."),
    by_failure={
        "one-tile": "A position's K sits in block table[pos // block_size] at offset pos % block_size.",
        "block-table": "Position pos is in the table's entry pos // block_size, not the one after it.",
        "mask": "A position past the end must add nothing to the sum: its score must be -inf, not 0.",
        "rescale": "Sums taken under an old max are too large by exp(new max - old max): shrink them first.",
        "float32": "Convert what you load to float32 before any arithmetic.",
        "ragged": "Each sequence attends to its own context length and its own table row only.",
        "nan": "inf or nan: an exp of a large positive number, or a 0 / 0 somewhere.",
        "raised": "Read the error: a shape, a dtype or an index out of range in your tile.",
        "engine": "The probes passed but the engine's tokens differ: compare a case with your own small example.",
    },
)
MERGE_HINTS = Hints(
    concept=("Each split kept its own max m_s, sum l_s and unnormalised output o_s. They were computed under "
             "different maxima: what common scale makes them addable, and which split sets it?"),
    rule=("Take M, the largest m over the splits; weigh each split by exp(m_s - M) (at most 1, 0 for an empty "
          "split); the output is the weighted sum of the o_s divided by the weighted sum of the l_s."),
    code=("M = tl.max(m_parts, 0); w = tl.exp(m_parts - M[None, :]); return tl.sum(o_parts * w[:, :, None], 0) / "
          "tl.sum(l_parts * w, 0)[:, None] (PyTorch twin: m_parts.max(0).values, torch.exp, .sum(0))."),
    by_failure={
        "weights": "Weigh the sums exactly like the outputs, each by exp(its max - the largest max).",
        "empty-split": "An empty split has m = -inf and l = 0: exp(-inf - M) = 0 weighs it out; never divide by its "
                       "own l.",
        "overflow": "exp of a positive number in the hundreds is inf: subtract the largest max first.",
        "nan": "inf or nan: an exp of a large positive number, or a 0 / 0 somewhere.",
        "raised": "Read the error: a shape or a reduction over the wrong axis.",
        "engine": "The probes passed but the engine's tokens differ: compare a case with your own small example.",
    },
)
TILE_PROBES = (
    Probe("one tile: a 12-token context, blocks scattered through the pool", 4, 32, 8, (12,), torch.float32, 1,
          "with a single tile: check how a position finds its slot (which table entry, which offset in the "
          "block), the scale of the scores, and that positions which are not valid count for nothing", "one-tile"),
    Probe("three tiles in one split: a 45-token context", 4, 32, 8, (45,), torch.float32, 1,
          "one tile passes, three do not: when the running max grows, everything summed under the old max (the "
          "sum and the output alike) must shrink by the same factor before this tile is added", "rescale"),
    Probe("a bfloat16 pool, three tiles", 4, 32, 8, (45,), torch.bfloat16, 1,
          "float32 passes, bfloat16 does not: do the arithmetic in float32 (convert K and V right after loading "
          "them); Triton's interpreter computes bfloat16 arithmetic wrongly, and the sums need the range",
          "float32"),
    Probe("a ragged batch [1, 8, 9, 30], GQA group 3 (padded to 16), 2 splits", 3, 64, 8, (1, 8, 9, 30),
          torch.float32, 2, "the result must be softmax(q · Kᵀ / sqrt(d)) · V over each sequence's own positions, "
          "query head h reading KV head h // group, whatever the batch, the group and the split", "ragged"),
)
MERGE_PROBES = (
    Probe("two splits of a 40-token context", 4, 32, 8, (40,), torch.float32, 2,
          "each split's output and sum were computed under its own max: bring them to a common max before "
          "adding them up, and normalise by the merged sum", "weights"),
    Probe("an empty split: contexts [5, 70] split 4 ways", 4, 32, 8, (5, 70), torch.float32, 4,
          "the 5-token sequence's splits 1-3 are empty (m = -inf, l = 0): they must weigh nothing, and nothing "
          "may divide by a split's own sum", "empty-split"),
    Probe("scores hundreds apart across splits", 2, 32, 8, (40, 33), torch.float32, 3,
          "exp of a score in the hundreds overflows: exponentiate only differences that are at most 0",
          "overflow", score_scale=30.0),
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


def run_probe(probe: Probe, seed: int, twin: bool = False, **parts: Any
              ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], tuple]:
    """Run one probe through labkit's Triton kernel, or (``twin``) its PyTorch twin, with ``parts`` in place."""
    q, k_pool, v_pool, tables = probe_case(probe, seed)
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    lens = torch.tensor(probe.context_lens, dtype=torch.int32)
    dev = device()
    if twin:
        from labkit.course.ch11_torch_twin import paged_decode_twin

        out = paged_decode_twin(q.to(dev), k_pool.to(dev), v_pool.to(dev), padded.to(dev), lens,
                                num_splits=probe.num_splits, block_n=16, **parts)
    else:
        from labkit.core.attention.triton_decode import paged_decode_attention

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


def diagnose_tile(probe: Probe, out: torch.Tensor, tables: list[list[int]], tensors: tuple) -> tuple[str, str]:
    """Name the mistake (and its failure class) where a plain rewrite of the reference reproduces the output."""
    q, k_pool, v_pool = tensors
    tol = TOL[probe.dtype]
    shifted = softmax_reference(q, k_pool, v_pool, [t[1:] + t[:1] for t in tables], probe.context_lens)
    if torch.allclose(out.double(), shifted, rtol=tol, atol=tol):
        return ("it matches reading block table[pos // BLOCK_SIZE + 1]: position pos sits in the table's entry "
                "pos // BLOCK_SIZE (an off-by-one in the block-table lookup)", "block-table")
    if probe.num_splits == 1 and torch.allclose(out.double(), unmasked_tail(q, k_pool, v_pool, tables, probe),
                                                rtol=tol, atol=tol):
        return ("it matches positions past the context's end scoring 0 (their masked loads give K = 0): a position "
                "that is not valid must score -inf", "mask")
    if not torch.isfinite(out).all():
        return "the output holds inf or nan", "nan"
    return probe.hint, probe.because


def probe_part(check: Check, probes: tuple[Probe, ...], part: str, fn: Any, twin: bool = False) -> None:
    for index, probe in enumerate(probes):
        try:
            with warnings.catch_warnings():  # NumPy's overflow warnings from a wrong part: the failure says it
                warnings.simplefilter("ignore", RuntimeWarning)
                out, want, tables, tensors = run_probe(probe, seed=11 + index, twin=twin, **{part: fn})
        except Exception as exc:  # the learner's code runs inside the interpreter: report, do not crash
            unwrap_not_implemented(exc)
            check.expect(False, f"{probe.what}: the kernel raised {type(exc).__name__}: {str(exc)[:300]}",
                         because="raised")
            return
        tol = TOL[probe.dtype]
        if torch.allclose(out.double(), want, rtol=tol, atol=tol):
            continue
        why, because = diagnose_tile(probe, out, tables, tensors) if part == "tile_fn" else (
            ("the output holds inf or nan; " + probe.hint if not torch.isfinite(out).all() else probe.hint),
            probe.because)
        error = float((out.double() - want).abs().nan_to_num(float("inf")).max())
        check.expect(False, f"{probe.what} (group {probe.group}, head_dim {probe.head_dim}, block_size "
                     f"{probe.block_size}, {probe.dtype}): off by up to {error:.3g} (tolerance {tol}); {why}",
                     because=because)
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
    # float32 on every device: transformers' tokens are float32 ones, and bfloat16 near-ties flip.
    with LLM(model, engine="continuous", device=str(device()), dtype="float32", block_size=8, num_gpu_blocks=16,
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
        check.expect(False, f"engine 'continuous' with your part raised {type(exc).__name__}: {str(exc)[:300]}",
                     because="raised")
        return
    diff = first_difference(got, transformers_greedy(model, prompts, 6))
    check.expect(diff is None, f"engine 'continuous' with your part, against transformers' greedy tokens: {diff}",
                 because="engine")


def require_triton() -> None:
    from labkit.core.attention import TRITON_MISSING

    if TRITON_MISSING is not None:
        raise RuntimeError(f"this task needs the triton package (Linux wheels only), which did not import: "
                           f"{TRITON_MISSING}")


def use_twin(twin: bool | None) -> bool:
    """The PyTorch twin when asked, or (``None``) when triton does not import; Triton's kernel otherwise."""
    if twin is not None:
        return twin
    from labkit.core.attention import TRITON_MISSING

    return TRITON_MISSING is not None


def part_backend(twin: bool, **parts: Any) -> type:
    from labkit.course.ch11_torch_twin import twin_backend

    return twin_backend(**parts) if twin else kernel_backend(**parts)


def check_attend_tile(fn: Callable[..., Any], model: str = "labkit-tiny", twin: bool | None = None) -> CheckResult:
    """Build task: the kernel's inner loop, on probe cases (Triton's interpreter, or the PyTorch twin with
    ``twin``; by default the twin only where triton does not import), then inside engine continuous."""

    def body(check: Check) -> None:
        twin_path = use_twin(twin)
        if not twin_path:
            require_triton()
        raise_if_stub(fn)
        probe_part(check, TILE_PROBES, "tile_fn", fn, twin_path)
        if not check.result.failures:
            compare_engine(check, part_backend(twin_path, tile_fn=fn), model)

    return run_checker("", "", body, task_id="11.attend_tile")


def check_merge_splits(fn: Callable[..., Any], model: str = "labkit-tiny", twin: bool | None = None) -> CheckResult:
    """Build task: stage 2's merge, on probe cases (Triton's interpreter or the PyTorch twin, as
    ``check_attend_tile``), then inside engine continuous."""

    def body(check: Check) -> None:
        twin_path = use_twin(twin)
        if not twin_path:
            require_triton()
        raise_if_stub(fn)
        probe_part(check, MERGE_PROBES, "merge_fn", fn, twin_path)
        if not check.result.failures:
            compare_engine(check, part_backend(twin_path, merge_fn=fn), model)

    return run_checker("", "", body, task_id="11.merge_splits")
