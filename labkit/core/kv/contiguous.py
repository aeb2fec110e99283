"""A contiguous KV cache for a static batch: one (B, n_kv_heads, max_len, head_dim) tensor per layer.

Every row reserves room for its longest possible sequence up front, prompts are left-padded so
all rows write their next token at the same column, and a boolean mask hides the padding. Simple
and fast for one batch; wasteful in memory (notebook 06 measures how wasteful). A learner's cache is a
subclass passed as ``LLM(..., engine="kvcache", kv_cache_cls=MyCache)``: notebook 03's tasks replace ``write``
and ``attend``, notebook 05's ``attention_mask``. Introduced in notebook 03 (``03_kv_cache``).
"""

from __future__ import annotations

import torch

from labkit.core.model.attention import sdpa
from labkit.core.model.config import ModelConfig


def write_kv(cache: torch.Tensor, new: torch.Tensor, start: int) -> torch.Tensor:
    """Write this step's K (or V) into columns [start, start + T) and return every column so far.

    cache: (B, n_kv_heads, max_len, head_dim); new: (B, T, n_kv_heads, head_dim)
    returns (B, start + T, n_kv_heads, head_dim), a view of the cache. Task 1 of notebook 03 mirrors it.
    """
    end = start + new.shape[1]
    cache[:, :, start:end] = new.transpose(1, 2)
    return cache[:, :, :end].transpose(1, 2)


class ContiguousKVCache:
    """Per-layer K/V tensors plus the padding mask; an ``AttentionBackend`` for prefill and decode. Notebook 03.

    Each step the engine calls ``begin_step`` (declare this step's columns: the mask), runs the model, whose every
    layer calls ``attend``, then ``end_step`` (the columns are written). ``write`` is the cache update.
    """

    write = staticmethod(write_kv)

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (batch_size, config.num_key_value_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.max_len = max_len
        self.valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)  # real (non-pad) columns
        self.length = 0  # columns written so far (the same for every row: prompts are left-padded)
        self.mask: torch.Tensor | None = None  # (B, 1, T, length + T) for the step being run

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin_step(self, token_valid: torch.Tensor) -> None:
        """Declare this step's T new columns; token_valid: (B, T), False for left padding."""
        t = token_valid.shape[1]
        end = self.length + t
        if end > self.max_len:
            raise RuntimeError(f"KV cache full: {end} columns needed, {self.max_len} reserved")
        self.valid[:, self.length : end] = token_valid
        self.mask = self.attention_mask(self.valid[:, :end], self.length)

    def attention_mask(self, valid: torch.Tensor, start: int) -> torch.Tensor:
        """Which columns each of this step's queries may attend to. Notebook 05's Task 3.

        valid: (B, S), False for padding, over every column so far (S = start + T); this step's T queries are
        columns start .. S-1. Returns (B, 1, T, S) bool, True where query t may attend to column j.
        """
        q_pos = torch.arange(start, valid.shape[1], device=valid.device)[:, None]  # (T, 1)
        k_pos = torch.arange(valid.shape[1], device=valid.device)[None, :]  # (1, S)
        causal = k_pos <= q_pos  # (T, S)
        # A padding query may only see itself, so its softmax row is never empty (its output is ignored).
        return (valid[:, None, None, :] & causal) | (k_pos == q_pos)  # (B, 1, T, S)

    def end_step(self, num_new: int) -> None:
        self.length += num_new

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this step's K/V to layer ``layer_idx``'s cache, then attend over every column written so far.
        Notebook 03's Task 2."""
        # q: (B, T, n_heads, d); k, v: (B, T, n_kv_heads, d)
        assert self.mask is not None, "begin_step must be called before the forward pass"
        keys = self.write(self.k[layer_idx], k, self.length)  # (B, S, n_kv_heads, d): cached + new
        values = self.write(self.v[layer_idx], v, self.length)
        if q.shape[1] == 1 and q.shape[2] != k.shape[2]:  # one new token per row, GQA: fold the group into T
            return folded_decode(q, keys, values, self.mask)
        return sdpa(q, keys, values, mask=self.mask, is_causal=False)  # (B, T, n_heads, d)


def folded_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A decode step's attention with the GQA group folded into the query dimension: q (B, 1, n_heads, d), keys and
    values (B, S, n_kv, d), mask (B, 1, 1, S) -> (B, 1, n_heads, d). The G query heads of one KV head become G
    queries of that head (one token: no causal order among them), so SDPA gets as many query heads as K/V heads:
    nothing is repeated, and on CUDA the fused memory-efficient kernel (which takes a mask, not GQA) runs it.
    ``labkit.core.attention.decode.folded_decode_sdpa`` does the same for the paged pool."""
    b, _, n_heads, d = q.shape
    n_kv = keys.shape[2]
    q_folded = q.view(b, n_kv, n_heads // n_kv, d)  # (B, n_kv, G, d): head kv * G + g -> (kv, g)
    out = sdpa(q_folded.transpose(1, 2), keys, values, mask=mask, is_causal=False)  # (B, G, n_kv, d)
    return out.transpose(1, 2).reshape(b, 1, n_heads, d)
