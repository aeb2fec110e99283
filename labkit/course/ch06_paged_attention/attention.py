"""Notebook 06's second Build task: paged attention, checked on a hand-built pool and then inside the real engine.

The learner writes ``attend`` in a subclass of labkit's ``TorchAttentionBackend``: write the step's new K/V into
their slots, then let every new token attend to its own sequence's context, read through the block table.
``check_paged_attention`` first calls ``attend`` directly on a small float64 pool full of garbage (so a slot read
by mistake shows), on a single decode, a ragged batch of decodes and a batch mixing prefill chunks with decodes,
and compares with a plain per-sequence softmax; a mismatch is diagnosed (new K/V not written, attended before
writing, slots past the context, wrong KV head). Then it runs engines ``continuous`` and ``chunked`` with
``LLM(..., attention_backend=...)`` through the harness (``labkit.course.harness``) and compares the greedy tokens
with transformers and every run with labkit's backend.
Notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import SimpleNamespace

import torch

from labkit.core.attention import PagedAttentionBackend, PagedAttentionMetadata
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.course.harness.compare import RUN_FAILURES, check_setups, require_subclass
from labkit.course.harness.runs import Request, Setup, prompt

N_HEADS, N_KV, D, BS = 8, 2, 8, 4  # GQA: query heads 0-3 read KV head 0, heads 4-7 read KV head 1
LAYER = 1  # attend is called for layer 1: layer 0 of the pool must stay untouched

# (what the case is, query_lens, context_lens, block tables): from the smallest case to the hardest.
CASES = (
    ("one decode, context of 6 tokens", [1], [6], [[5, 2]]),
    ("a batch of decodes with ragged context lengths [5, 1, 8, 13]", [1, 1, 1, 1], [5, 1, 8, 13],
     [[3, 9], [7], [0, 11], [4, 12, 1, 6]]),
    ("a prefill chunk of 3 tokens after 6 cached ones, a whole 5-token prompt and two decodes",
     [3, 5, 1, 1], [9, 5, 6, 2], [[8, 2, 13], [10, 5], [3, 14], [7]]),
)
NUM_BLOCKS = 16  # the hand-built pool; block 16 is the scratch block (never in a table)

# float64 pools: any correct order of operations (a loop, einsum, a float32 detour) lands well inside this
TOL = 1e-5


def require_backend(cls: object) -> type[PagedAttentionBackend]:
    """The learner's class, or a clear error if it is not an attention backend."""
    return require_subclass(cls, PagedAttentionBackend, "class MyAttention(TorchAttentionBackend): ... with an attend "
                            "method", "labkit's TorchAttentionBackend")


def hand_pool(seed: int) -> PagedKVPool:
    """Two layers of float64 garbage, large enough that any slot read by mistake changes the result."""
    config = SimpleNamespace(num_key_value_heads=N_KV, head_dim=D, num_hidden_layers=2)
    pool = PagedKVPool(config, NUM_BLOCKS + 1, BS, torch.device("cpu"), torch.float64)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float64) * 3)
    pool.k[LAYER][NUM_BLOCKS] *= 30  # the scratch block: scores far above the others
    return pool


def hand_step(case: tuple[str, list[int], list[int], list[list[int]]], seed: int
              ) -> tuple[PagedAttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The metadata of one step and its q, k, v (1, N, heads, D): the new tokens sit at the end of each context."""
    _, query_lens, context_lens, tables = case
    slots = [table[p // BS] * BS + p % BS for n, ctx, table in zip(query_lens, context_lens, tables)
             for p in range(ctx - n, ctx)]
    meta = PagedAttentionMetadata(list(query_lens), list(context_lens), [list(t) for t in tables],
                                  torch.tensor(slots, dtype=torch.long))
    gen = torch.Generator().manual_seed(seed)
    n = len(slots)
    q = torch.randn(1, n, N_HEADS, D, generator=gen, dtype=torch.float64)  # (1, N, n_heads, D)
    k = torch.randn(1, n, N_KV, D, generator=gen, dtype=torch.float64) * 3  # (1, N, n_kv_heads, D)
    v = torch.randn(1, n, N_KV, D, generator=gen, dtype=torch.float64) * 3
    return meta, q, k, v


def softmax_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta: PagedAttentionMetadata,
                      kv_head: Callable[[int], int] = lambda h: h // (N_HEADS // N_KV),
                      whole_blocks: bool = False) -> torch.Tensor:
    """The plain definition, one sequence, token and head at a time: new token j of a sequence (position
    ctx - n + j) attends to positions 0..ctx - n + j of its context. ``kv_head`` and ``whole_blocks`` (every slot
    of the table's blocks, past the context too) give the results of two typical mistakes."""
    out = torch.empty_like(q)  # (1, N, n_heads, D)
    row = 0
    for n, ctx, table in zip(meta.query_lens, meta.context_lens, meta.block_tables):
        keys = k_pool[table].flatten(0, 1)  # (len(table) * BS, n_kv, D): the sequence's slots in order
        values = v_pool[table].flatten(0, 1)
        for j in range(n):
            visible = len(keys) if whole_blocks else ctx - n + j + 1
            for h in range(q.shape[2]):
                scores = keys[:visible, kv_head(h)] @ q[0, row, h] / math.sqrt(q.shape[-1])  # (visible,)
                out[0, row, h] = torch.softmax(scores, 0) @ values[:visible, kv_head(h)]
            row += 1
    return out


def first_wrong(got: torch.Tensor, want: torch.Tensor, meta: PagedAttentionMetadata) -> str:
    """'sequence 2 (context 8, 1 new token), its new token 0, head 5: off by 3.1' for the first wrong output."""
    wrong = ~torch.isclose(got, want, rtol=TOL, atol=TOL).all(-1)[0]  # (N, n_heads)
    token, head = (int(i) for i in wrong.nonzero()[0])
    starts = [sum(meta.query_lens[:i]) for i in range(len(meta.query_lens))]
    seq = max(i for i, s in enumerate(starts) if s <= token)
    n, ctx = meta.query_lens[seq], meta.context_lens[seq]
    error = float((got - want)[0, token, head].abs().max())
    return (f"sequence {seq} (context {ctx}, {n} new token{'s' * (n != 1)}), its new token {token - starts[seq]} "
            f"(position {ctx - n + token - starts[seq]}), head {head}: off by {error:.3g}")


def direct_case(check: Check, cls: type[PagedAttentionBackend], index: int) -> None:
    case = CASES[index]
    what = case[0]
    pool = hand_pool(seed=index)
    meta, q, k, v = hand_step(case, seed=10 + index)
    before_k, before_v = pool.k[LAYER].clone(), pool.v[LAYER].clone()
    layer0 = pool.k[0].clone()
    out = cls(pool, meta).attend(LAYER, q.clone(), k.clone(), v.clone())
    shape = (1, q.shape[1], N_HEADS, D)
    if not (isinstance(out, torch.Tensor) and tuple(out.shape) == shape):
        check.expect(False, f"{what}: attend must return a tensor shaped (1, N, n_heads, head_dim) = {shape}, got "
                     f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}", because="shape")
        return
    written = before_k.clone().flatten(0, 1), before_v.clone().flatten(0, 1)
    written[0][meta.slot_mapping], written[1][meta.slot_mapping] = k[0], v[0]
    pool_k, pool_v = pool.k[LAYER].flatten(0, 1), pool.v[LAYER].flatten(0, 1)
    for i, slot in enumerate(meta.slot_mapping.tolist()):
        if not (torch.equal(pool_k[slot], k[0, i]) and torch.equal(pool_v[slot], v[0, i])):
            check.expect(False, f"{what}: new token {i}'s K and V belong in slot {slot} (block {slot // BS}, offset "
                         f"{slot % BS}) of layer {LAYER}'s pool (meta.slot_mapping[{i}]); after attend they are not "
                         "there", because="not-written")
            return
    check.expect(torch.equal(pool.k[0], layer0), f"{what}: attend({LAYER}, ...) changed layer 0's pool: use "
                 "self.pool.k[layer_idx] and self.pool.v[layer_idx]", because="wrong-layer")
    k_pool, v_pool = written[0].view_as(before_k), written[1].view_as(before_v)
    want = softmax_attention(q, k_pool, v_pool, meta)
    if torch.allclose(out, want, rtol=TOL, atol=TOL):
        return
    why, because = "compare with softmax(q · K / sqrt(head_dim)) · V over the sequence's own tokens", "wrong-output"
    if torch.allclose(out, softmax_attention(q, before_k, before_v, meta), rtol=TOL, atol=TOL):
        why = "it matches attention over the pool *before* this step's K/V were written"
        because = "attend-before-write"
    elif torch.allclose(out, softmax_attention(q, k_pool, v_pool, meta, whole_blocks=True), rtol=TOL, atol=TOL):
        why = ("it matches attention over every slot of the sequence's blocks: the slots past its context length "
               "hold garbage (another sequence's, or nothing yet)")
        because = "past-context"
    elif torch.allclose(out, softmax_attention(q, k_pool, v_pool, meta, kv_head=lambda h: h % N_KV),
                        rtol=TOL, atol=TOL):
        why = (f"it matches query head h reading KV head h % {N_KV}: with grouped-query attention, heads "
               f"0-{N_HEADS // N_KV - 1} share KV head 0, and so on")
        because = "gqa"
    check.expect(False, f"{what} ({N_HEADS} query heads, {N_KV} KV heads, block_size {BS}): wrong output for "
                 f"{first_wrong(out, want, meta)}; {why}", because=because)


@functools.lru_cache(maxsize=4)
def workloads(model: str = "labkit-tiny") -> tuple[Setup, ...]:
    """Ragged prompts with a cached prefix (continuous), and chunked prefills beside decodes (chunked)."""
    prompts = [prompt(model, n, seed=40 + i) for i, n in enumerate((17, 5, 30))]
    reqs = tuple(Request(f"R{i}", p, 8) for i, p in enumerate(prompts))
    reqs += (Request("P", prompts[0][:12] + prompt(model, 16, seed=50)[-6:], 8, arrival_step=2),)  # R0's 3 blocks
    chunked = tuple(Request(f"R{i}", prompt(model, n, seed=60 + i), 8, arrival_step=i % 2)
                    for i, n in enumerate((30, 9, 21)))
    pool = dict(max_num_seqs=4, block_size=4, num_gpu_blocks=64)
    return (Setup("ragged prompts and a cached prefix", reqs, "continuous", enable_prefix_caching=True, **pool),
            Setup("prefill chunks beside decodes", chunked, "chunked", max_num_batched_tokens=16, **pool))


HINTS = Hints(
    concept="A sequence's keys and values are scattered over the blocks of its table, and the pool's blocks past "
            "its last token hold someone else's data. What must be in the pool before a new token can attend to "
            "itself, and which slots belong to this sequence's context?",
    rule="First store this step's K/V in the slots the slot mapping names. Then, for each sequence, gather its "
         "blocks in table order, keep only its first context_len positions, let each query head read its group's "
         "KV head (grouped-query attention), and let new token j see only positions up to its own.",
    code="k_pool.flatten(0, 1)[meta.slot_mapping] = k[0] (and v); per sequence: keys = "
         "k_pool[table].flatten(0, 1)[:context_len]; query head h reads KV head h // (n_heads // n_kv_heads); new "
         "token j sits at position context_len - query_len + j (causal mask).",
    by_failure={
        **RUN_FAILURES,
        "shape": "attend returns one output per new token and query head: (1, N, n_heads, head_dim)",
        "not-written": "this step's K and V go into the pool at the slots meta.slot_mapping names, before attending",
        "wrong-layer": "each layer has its own pool: write and read the layer attend was called for",
        "attend-before-write": "a new token attends to itself: its K/V must be in the pool first",
        "past-context": "a sequence's last block is rarely full: slots past its context length are not its tokens",
        "gqa": "with grouped-query attention consecutive query heads share one KV head",
        "wrong-output": "each query attends over its own sequence's tokens, in table order, up to its own position",
    },
)


def check_paged_attention(cls: type[PagedAttentionBackend], model: str = "labkit-tiny") -> CheckResult:
    """Build task: ``cls(pool, meta).attend`` on hand-built steps, then inside engines continuous and chunked."""

    def body(check: Check) -> None:
        cls_ = require_backend(cls)
        for index in range(len(CASES)):
            with torch.inference_mode():
                direct_case(check, cls_, index)
            if check.result.failures:
                return  # the smallest failing case
        check_setups(check, workloads(model), model, "attention backend", "labkit's attention backend", every=True,
                     attention_backend=cls_)

    return run_checker("", "", body, task_id="06.paged_attention")
