"""What the checker of notebook 03's Build task watches: the contiguous KV cache's ``attend``, written by the learner.

The learner's ``ContiguousKVCache`` subclass runs inside engine ``kvcache`` (``LLM(..., engine="kvcache",
kv_cache_cls=MyKVCache)``). The checker (``labkit.course.ch03_kv_cache.check_attend``) wraps it in a watching subclass
that keeps a shadow of labkit's own cache, fed the same steps: after every ``attend`` call (every layer of every
step) the learner's cache must hold this step's keys and values in the right columns and return what labkit's
returns, so a failure names the batch's step and the layer, and says what the output looks like instead (only this
step's keys, the cache read before it was written, a causal mask lined up with column 0, no mask). Notebook 03.
"""

from __future__ import annotations

import torch

from labkit.core.kv.contiguous import ContiguousKVCache
from labkit.core.model.attention import sdpa
from labkit.core.model.config import ModelConfig
from labkit.course.harness.runs import Mistake


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def wrong_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, want: torch.Tensor,
                 shadow: ContiguousKVCache, layer_idx: int, start: int) -> str:
    """What a wrong ``attend`` output looks like: the likely mistake, or where it differs most."""
    end = start + q.shape[1]
    keys = shadow.k[layer_idx][:, :, :end].transpose(1, 2)  # (B, S, n_kv_heads, d): labkit's, cached + new
    values = shadow.v[layer_idx][:, :, :end].transpose(1, 2)
    unwritten_k, unwritten_v = keys.clone(), values.clone()
    unwritten_k[:, start:], unwritten_v[:, start:] = 0, 0  # the cache as it was before this step's write
    mask = shadow.mask
    likely = [
        ("attention over this step's keys and values only: attend over every column written so far (the cached "
         "ones and this step's, what self.write returns)", sdpa(q, k, v, mask=None, is_causal=True)),
        ("attention over the cache read before this step's keys and values were written into it (its new columns "
         "still zero): write first, then attend, so that each query sees its own token",
         sdpa(q, unwritten_k, unwritten_v, mask=mask, is_causal=False)),
        ("attention with is_causal=True: over a cache it lines the causal triangle up with column 0, so a decode "
         "query sees column 0 only. Use mask=self.mask, is_causal=False", sdpa(q, keys, values, None, True)),
        ("attention with no mask: every query sees every column, later ones (and padding) included. Use "
         "mask=self.mask", sdpa(q, keys, values, None, False)),
    ]
    for why, alternative in likely:
        if close(out, alternative) and not close(want, alternative):
            return f"its output is {why}"
    diff = (out - want).abs().amax(dim=(2, 3))  # (B, T)
    row, query = divmod(int(diff.argmax()), diff.shape[1])
    return (f"its output differs from labkit's by up to {float(diff.max()):.3g} (row {row}, query {query}, the token "
            f"in column {start + query}): attend with sdpa(q, keys, values, mask=self.mask, is_causal=False) over "
            "the keys and values self.write returns")


def attend_problem(cache: ContiguousKVCache, shadow: ContiguousKVCache, layer_idx: int, start: int,
                   q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: object, want: torch.Tensor) -> str | None:
    """What is wrong with one ``attend`` call of the learner's cache, or None."""
    end = start + q.shape[1]
    if cache.length != start:
        return (f"attend changed self.length from {start} to {cache.length}: leave it alone, the engine advances it "
                "once every layer has run (end_step)")
    if not isinstance(out, torch.Tensor) or out.shape != want.shape:
        got = f"shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else repr(out)
        return f"attend returned {got}; expected a tensor of shape {tuple(want.shape)} = (B, T, n_heads, head_dim)"
    for name, tensors, new in (("k", cache.k, k), ("v", cache.v, v)):
        if not torch.equal(tensors[layer_idx][:, :, start:end], new.transpose(1, 2)):
            return (f"after attend, columns {start}..{end - 1} of self.{name}[{layer_idx}] do not hold this step's "
                    f"{'keys' if name == 'k' else 'values'}: write them there (self.write(self.{name}[layer_idx], "
                    f"{name}, self.length)) so that this step and every later one attend to them")
    if close(out, want):
        return None
    return wrong_output(q, k, v, out, want, shadow, layer_idx, start)


def watching_attend(cls: type[ContiguousKVCache]) -> type[ContiguousKVCache]:
    """``cls`` with every ``attend`` call checked against labkit's cache, fed the same steps."""

    class Watched(cls):  # type: ignore[valid-type, misc]
        def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device: torch.device,
                      dtype: torch.dtype) -> None:
            super().__init__(config, batch_size, max_len, device, dtype)
            self.labkit_cache = ContiguousKVCache(config, batch_size, max_len, device, dtype)
            self.num_steps_done = 0

        def begin_step(self, token_valid: torch.Tensor) -> None:
            super().begin_step(token_valid)
            self.labkit_cache.begin_step(token_valid)

        def end_step(self, num_new: int) -> None:
            super().end_step(num_new)
            self.labkit_cache.end_step(num_new)
            self.num_steps_done += 1

        def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            start = self.length
            out = super().attend(layer_idx, q, k, v)
            want = ContiguousKVCache.attend(self.labkit_cache, layer_idx, q, k, v)
            problem = attend_problem(self, self.labkit_cache, layer_idx, start, q, k, v, out, want)
            if problem is not None:
                step = "its prefill" if self.num_steps_done == 0 else f"its decode step {self.num_steps_done}"
                raise Mistake(f"in {step} ({q.shape[0]} row(s), {q.shape[1]} new column(s) after {start} cached), "
                              f"layer {layer_idx}: {problem}")
            return out

    Watched.__name__ = Watched.__qualname__ = cls.__name__  # messages name the learner's class
    return Watched
