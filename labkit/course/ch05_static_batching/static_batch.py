"""What the checkers of notebook 05's Build tasks watch: a static batch, written by the learner.

Task 2 overrides ``KVCacheEngine.prepare_prefill(seqs)``: the first step's inputs, every prompt left-padded to the
longest, each token's position in its own sequence, and which columns are real. Task 3 overrides
``ContiguousKVCache.attention_mask(valid, start)``: which columns each query may attend to (its own and earlier
real tokens). They run inside engine ``kvcache`` (``LLM(..., engine=MyEngine)``, ``kv_cache_cls=MyCache``). The
checkers (``labkit.course.ch05_static_batching``) compare every call with labkit's, rows of real tokens exactly (padding
may hold anything harmless), and name the row, the column and what is wrong. Notebook 05.
"""

from __future__ import annotations

import torch

from labkit.core.engine.kvcache import KVCacheEngine
from labkit.core.kv.contiguous import ContiguousKVCache
from labkit.core.model.source import resolve_model_source
from labkit.core.sequence import Sequence
from labkit.course import Check
from labkit.course.harness.runs import Mistake


def row_problem(i: int, seq: Sequence, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                limits: tuple[int, int]) -> str | None:
    """What is wrong with row ``i`` of a prefill batch (``seq``'s prompt), or None."""
    cols, p = ids.shape[0], seq.num_prompt_tokens
    pad = cols - p
    prompt = torch.tensor(seq.prompt_token_ids)
    row = f"row {i} (a prompt of {p} tokens in a batch padded to {cols} columns)"
    if pad and torch.equal(ids[:p], prompt) and not torch.equal(ids[pad:], prompt):
        return (f"{row} holds its prompt on the left and padding on the right: pad on the LEFT, so that every row's "
                "newest token is in the last column, where the engine reads the next-token logits and after which "
                "it writes the decode steps' tokens")
    if not torch.equal(ids[pad:], prompt):
        return f"{row}: its last {p} ids are {ids[pad:].tolist()}, expected its prompt {prompt.tolist()}"
    want_valid = torch.arange(cols) >= pad
    if not torch.equal(valid, want_valid):
        if bool(valid.all()):
            return (f"{row}: valid marks its {pad} padding column(s) as real tokens, so the mask would let its "
                    "tokens attend to padding: valid is False at padding, True at the prompt")
        return f"{row}: valid is {valid.int().tolist()}, expected {want_valid.int().tolist()} (1 = a real token)"
    got = positions[pad:]
    if not torch.equal(got, torch.arange(p)):
        if torch.equal(got, torch.arange(pad, cols)):
            return (f"{row}: positions are counted from column 0 of the padded row (its first token has position "
                    f"{pad}): count from each row's first real token, 0 .. {p - 1}, so that RoPE rotates every token "
                    "as in a request alone")
        return f"{row}: the positions of its prompt tokens are {got.tolist()}, expected 0 .. {p - 1}"
    vocab, max_pos = limits
    if pad and not (bool((ids[:pad] >= 0).all()) and bool((ids[:pad] < vocab).all())
                    and bool((positions[:pad] >= 0).all()) and bool((positions[:pad] < max_pos).all())):
        return (f"{row}: its padding columns hold ids {ids[:pad].tolist()} at positions {positions[:pad].tolist()}; "
                "the model still embeds and rotates padding, so use a real id and position there (0 is fine)")
    return None


def prefill_problem(seqs: list[Sequence], got: object, limits: tuple[int, int]) -> str | None:
    """What is wrong with a learner's ``prepare_prefill(seqs)`` result, or None."""
    shape = (len(seqs), max(s.num_prompt_tokens for s in seqs))
    if not (isinstance(got, (tuple, list)) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
        return f"prepare_prefill returned {type(got).__name__}; expected three tensors (ids, positions, valid)"
    for name, t in zip(("ids", "positions", "valid"), got):
        if tuple(t.shape) != shape:
            return (f"{name} has shape {tuple(t.shape)}; expected {shape} = (B, T): a row per request, as many "
                    "columns as the longest prompt")
        if name != "valid" and (t.is_floating_point() or t.dtype == torch.bool):
            return f"{name} has dtype {t.dtype}; expected integers (torch.long)"
    if got[2].dtype != torch.bool:
        return f"valid has dtype {got[2].dtype}; expected torch.bool (True = a real token)"
    ids, positions, valid = (t.cpu() for t in got)
    for i, seq in enumerate(seqs):
        problem = row_problem(i, seq, ids[i], positions[i], valid[i], limits)
        if problem is not None:
            return problem
    return None


def watching_prepare_prefill(cls: type[KVCacheEngine]) -> type[KVCacheEngine]:
    """``cls``, whose every prefill batch must be labkit's at the real tokens (padding: any harmless value)."""

    class Watched(cls):  # type: ignore[valid-type, misc]
        def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            got = super().prepare_prefill(seqs)
            config = self.model.config
            problem = prefill_problem(seqs, got, (config.vocab_size, config.max_position_embeddings))
            if problem is not None:
                raise Mistake(f"your prepare_prefill: {problem}")
            return got

    Watched.__name__ = Watched.__qualname__ = cls.__name__  # messages name the learner's class
    return Watched


# valid (B, S) and start (this step's first column) for hand-made steps, shortest first, described for messages.
MASK_CASES: list[tuple[str, list[list[int]], int]] = [
    ("a prefill of 3 columns, one request, no padding", [[1, 1, 1]], 0),
    ("a prefill of 4 columns, row 0 left-padded by 2", [[0, 0, 1, 1], [1, 1, 1, 1]], 0),
    ("the decode step after it", [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], 4),
    ("a prefill of 5 columns, rows left-padded by 3, 0 and 1", [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]],
     0),
    ("a second decode step", [[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]], 6),
]


def columns(xs: torch.Tensor) -> list[int]:
    return [int(j) for j in torch.nonzero(xs).flatten()]


def mask_problem(valid: torch.Tensor, start: int, got: object, want: torch.Tensor) -> str | None:
    """What is wrong with a learner's mask for one step, or None. Rows of real queries must be labkit's exactly;
    a padding query may see anything, but not nothing."""
    b, s = valid.shape
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        shape = f"shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else repr(got)
        return f"attention_mask returned {shape}; expected a tensor of shape {tuple(want.shape)} = (B, 1, T, S)"
    if got.dtype != torch.bool:
        return (f"attention_mask returned dtype {got.dtype}; expected torch.bool (True = may attend): a float mask "
                "is added to the attention scores instead")
    got, valid = got.cpu(), valid.cpu()
    for r in range(b):
        for t in range(s - start):
            col = start + t
            mine, right = got[r, 0, t], want[r, 0, t].cpu()
            if not bool(valid[r, col]):
                if not bool(mine.any()):
                    return (f"row {r}, query in column {col} (padding) may attend to no column: let a padding query "
                            "see at least itself. Its output is ignored, but an empty softmax row is NaN on some "
                            "attention kernels, and a NaN in a padding column's keys and values spreads to every "
                            "real token after it")
                continue
            if torch.equal(mine, right):
                continue
            extra, missing = columns(mine & ~right), columns(right & ~mine)
            why = []
            if [j for j in extra if not bool(valid[r, j])]:
                why.append(f"columns {[j for j in extra if not bool(valid[r, j])]} are padding")
            if [j for j in extra if j > col]:
                why.append(f"columns {[j for j in extra if j > col]} come after it (the future)")
            if missing:
                why.append(f"columns {missing} are real tokens at or before it, which it must see")
            return (f"row {r}, query in column {col} (a real token) may attend to columns {columns(mine)}; expected "
                    f"{columns(right)}: {'; '.join(why)}")
    return None


def watching_attention_mask(cls: type[ContiguousKVCache]) -> type[ContiguousKVCache]:
    """``cls``, whose every step's mask must be labkit's for the real queries."""

    class Watched(cls):  # type: ignore[valid-type, misc]
        def attention_mask(self, valid: torch.Tensor, start: int) -> torch.Tensor:
            got = super().attention_mask(valid, start)
            problem = mask_problem(valid, start, got, ContiguousKVCache.attention_mask(self, valid, start))
            if problem is not None:
                step = "a prefill" if start == 0 else f"a decode step (after {start} columns)"
                raise Mistake(f"in {step}, your attention_mask: {problem}")
            return got

    Watched.__name__ = Watched.__qualname__ = cls.__name__
    return Watched


def expect_mask_cases(check: Check, cls: type[ContiguousKVCache], model: str) -> bool:
    """The hand-made steps of ``MASK_CASES``, on a cache of ``cls``; False at the first wrong mask."""
    config = resolve_model_source(model).config
    for what, rows, start in MASK_CASES:
        valid = torch.tensor(rows, dtype=torch.bool)
        cache = cls(config, valid.shape[0], valid.shape[1], torch.device("cpu"), torch.float32)
        want = ContiguousKVCache.attention_mask(cache, valid, start)
        problem = mask_problem(valid, start, cache.attention_mask(valid.clone(), start), want)
        if problem is not None:
            check.expect(False, f"valid = {rows}, start = {start} ({what}): {problem}", because="mask")
            return False
    return True
