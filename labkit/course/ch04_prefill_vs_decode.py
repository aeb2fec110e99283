"""Checkers for notebook 04 (``04_prefill_vs_decode``).

Task 1 mirrors ``labkit.measure.roofline.decode_cost``: the FLOPs and bytes of one decode step, from the
model config, the batch size and the context length. Checked on tiny configs small enough to count
by hand (see ``DECODE_CASES``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from labkit.core.model.config import ModelConfig
from labkit.course import Check, CheckResult, Hints, run_checker

# vocab 32, hidden 8, intermediate 16, 2 layers, 4 query heads sharing 2 K/V heads of dim 2, tied embeddings.
# Per layer: q 8x8 + k 8x4 + v 8x4 + o 8x8 = 192, MLP 3 x 8x16 = 384 -> 576 matmul weights; + 2 norms of 8.
# Parameters: 2 x (576 + 16) + embeddings 32x8 (tied: counted once) + final norm 8 = 1448.
# KV per token: 2 (K, V) x 2 layers x 2 kv heads x 2 head_dim = 16 elements.
TINY_GQA = ModelConfig(
    model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=2, max_position_embeddings=256,
    tie_word_embeddings=True,
)
# The same with one K/V head per query head (classic multi-head attention): k and v are 8x8 too.
# Per layer 640 matmul weights; parameters 2 x (640 + 16) + 256 + 8 = 1576; KV per token 32 elements.
TINY_MHA = ModelConfig(
    model_type="llama", vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, head_dim=2, max_position_embeddings=256,
    tie_word_embeddings=True,
)

# (name, config, batch_size, context_len, dtype_bytes) -> (flops, bytes), counted by hand:
#   flops = 2 x layers x matmul weights x B          (every decoder weight, once per sequence)
#         + 2 x hidden x vocab x B                   (lm_head: one row of logits per sequence)
#         + 4 x heads x head_dim x (ctx + 1) x B x layers   (QK^T and AV over the cached keys and itself)
#   bytes = params x dtype_bytes                     (every weight read once, whatever B is)
#         + B x ctx x KV-per-token x dtype_bytes     (the cache read)
#         + B x KV-per-token x dtype_bytes           (this step's K/V written)
DECODE_CASES: list[tuple[str, ModelConfig, int, int, int, tuple[int, int]]] = [
    # 6912 + 1536 + 2112 FLOPs; 1448x2 + 3x10x32 + 3x32 bytes
    ("GQA, batch 3, 10 cached tokens, bf16", TINY_GQA, 3, 10, 2, (10560, 3952)),
    # 2304 + 512 + 64 FLOPs; 1448x4 + 0 + 64 bytes: an empty cache still writes the new token's K/V
    ("GQA, batch 1, empty cache, fp32", TINY_GQA, 1, 0, 4, (2880, 5856)),
    # 5120 + 1024 + 768 FLOPs; 1576x4 + 2x5x128 + 2x128 bytes
    ("MHA, batch 2, 5 cached tokens, fp32", TINY_MHA, 2, 5, 4, (6912, 7840)),
    # 18432 + 4096 + 51712 FLOPs; 1448x2 + 8x100x32 + 8x32 bytes: at long context the KV read dominates
    ("GQA, batch 8, 100 cached tokens, bf16", TINY_GQA, 8, 100, 2, (74240, 28752)),
]


def flops_and_bytes(result: Any) -> tuple[int, int]:
    """(FLOPs, total bytes) from what a decode-cost function returned.

    Accepts a ``labkit.measure.roofline.StepCost`` (``flops``, ``total_bytes``), a dict with ``flops`` and
    ``bytes`` (or ``total_bytes``), an object with ``flops`` and ``bytes``, or a (flops, bytes) pair.
    """
    if isinstance(result, Mapping):
        if "flops" in result and ("bytes" in result or "total_bytes" in result):
            return result["flops"], result["bytes"] if "bytes" in result else result["total_bytes"]
        raise TypeError(f"a dict result needs keys 'flops' and 'bytes'; got keys {sorted(result)}")
    if hasattr(result, "flops") and (hasattr(result, "total_bytes") or hasattr(result, "bytes")):
        return result.flops, result.total_bytes if hasattr(result, "total_bytes") else result.bytes
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result[0], result[1]
    raise TypeError(f"return a StepCost, a dict with 'flops' and 'bytes', or a (flops, bytes) pair; "
                    f"got {type(result).__name__}")


HINTS = Hints(
    concept="In one decode step every sequence computes one token, but the weights are shared by the whole batch. "
            "What is read once per step and what once per sequence? And with grouped-query attention, how many "
            "heads does the KV cache store?",
    rule="FLOPs: two per weight per sequence, plus the LM head, plus attention over each sequence's context. Bytes: "
         "every weight once per step, the KV cache each sequence reads, and the new token's K/V written; K/V use the "
         "key-value heads, not the query heads.",
    code="FLOPs: 2 x decoder weights x batch + 2 x hidden x vocab x batch + 4 x heads x head_dim x (context_len + 1) x "
         "layers x batch. Bytes: weights x dtype_bytes once + batch x context_len x kv_bytes_per_token + batch x "
         "kv_bytes_per_token.",
    by_failure={"cost": "compare what scales with the batch (FLOPs, KV reads) with what does not (the weights read "
                        "once per step), and count K/V with the key-value heads"},
)


def check_decode_cost(fn: Callable[[ModelConfig, int, int, int], Any]) -> CheckResult:
    """Task 1: ``fn(config, batch_size, context_len, dtype_bytes)`` gives the FLOPs and bytes of a decode step."""

    def body(check: Check) -> None:
        for name, config, batch, ctx, dtype_bytes, (want_flops, want_bytes) in DECODE_CASES:
            flops, nbytes = flops_and_bytes(fn(config, batch, ctx, dtype_bytes))
            for what, got, want in (("FLOPs", flops, want_flops), ("bytes", nbytes, want_bytes)):
                ok = isinstance(got, (int, float)) and not isinstance(got, bool) and got == want
                check.expect(ok, f"{name}: {what} = {got!r}, expected {want:,}", because="cost")

    return run_checker("Task 1 (decode_cost)", "", body, task_id="04.decode_cost")
