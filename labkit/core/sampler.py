"""Turning logits into next tokens: greedy, temperature, top-k, top-p, per-request generators.

Each sequence carries its own ``torch.Generator``, so a seeded request draws the same tokens
whether it runs alone or in a batch. Introduced in notebook 02 (``02_naive_generation``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.core.attention.decode import host_to_device
from labkit.core.sampling_params import SamplingParams


def pinned_like(t: torch.Tensor) -> torch.Tensor:
    """An empty host buffer shaped like ``t`` in pinned (page-locked) memory, which a non-blocking copy needs."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


@dataclass
class SamplerOutput:
    """One step's sampled tokens, kept on the device; the host's copy is made without waiting and read only when
    asked for. Async scheduling (notebook 10) feeds ``token_ids`` to the next step's input ids on the device and
    launches that step before it reads ``tolist()``; the synchronous engine reads it at once (``sample``).

    ``token_ids``: (B,) int64 on the logits' device, one per sampling sequence in batch order.
    """

    token_ids: torch.Tensor  # (B,)
    _host: torch.Tensor | None = field(default=None, repr=False)  # the host copy, once started
    _ready: torch.cuda.Event | None = field(default=None, repr=False)  # CUDA: recorded right after the copy
    _list: list[int] | None = field(default=None, repr=False)

    def copy_to_host(self) -> SamplerOutput:
        """Start the device -> host copy now, without waiting for it: on CUDA a non-blocking copy into pinned memory
        queued right behind the sampling kernels, with an event that marks when it is done. On the CPU the tokens
        are host memory already."""
        if self._host is None:
            if self.token_ids.device.type == "cuda":
                self._host = pinned_like(self.token_ids)
                self._host.copy_(self.token_ids, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record()
            else:
                self._host = self.token_ids
        return self

    def tolist(self) -> list[int]:
        """The tokens as ints. The one place the host waits for the step (CUDA: for the copy's event)."""
        if self._list is None:
            self.copy_to_host()
            if self._ready is not None:
                self._ready.synchronize()
            assert self._host is not None
            self._list = self._host.tolist()
        return self._list


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of a (V,) row, set the rest to -inf."""
    if k < 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filtering of a (V,) row: keep the smallest set of tokens whose probability reaches p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    # A token is dropped when the tokens before it already reach p (so the top token is always kept).
    drop_sorted = (probs.cumsum(-1) - probs) >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One (V,) row of logits -> one token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    logits = apply_top_k(logits, params.top_k)
    logits = apply_top_p(logits, params.top_p)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token from a (V,) distribution, left on the device: ``torch.multinomial(probs, 1, generator=generator)``'s
    own method (divide by Exp(1) noise drawn from the generator, take the argmax), so the same generator draws the
    same token, without multinomial's two checks that each wait for the device."""
    noise = torch.empty_like(probs).exponential_(1, generator=generator)  # (V,)
    return (probs / noise).argmax(-1, keepdim=True)  # (1,)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   k_max: int, any_top_p: bool) -> torch.Tensor:
    """(B, V) logits of sampled rows -> (B, V) probabilities after temperature, top-k and top-p, for the whole batch
    at once: per row the same operations, in the same order, as ``sample_row`` does, so the same numbers.

    temperature, top_p: (B,) in the logits' dtype; top_k: (B,) long, 0 for a row without top-k. ``k_max`` (the
    largest k) and ``any_top_p`` come from the host, so no step waits for the device to know them.
    """
    logits = logits / temperature[:, None]  # (B, V)
    if k_max:  # the k-th largest logit of each row with top-k; -inf (keep every token) for the others
        kth = torch.topk(logits, k_max, dim=-1).values  # (B, k_max)
        kth = kth.gather(1, (top_k - 1).clamp(min=0)[:, None])  # (B, 1)
        kth = kth.masked_fill(top_k[:, None] == 0, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if not any_top_p:
        return logits.softmax(-1)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    probs = sorted_logits.softmax(-1)
    # As apply_top_p: a token is dropped when the tokens before it already reach p (the top token is always kept).
    drop_sorted = ((probs.cumsum(-1) - probs) >= top_p[:, None]) & (top_p < 1.0)[:, None]  # (B, V)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf")).softmax(-1)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """(B, V) logits -> B token ids on the host: ``sample_tokens``, then its one device -> host transfer (read at
    once: the synchronous engines need the tokens before their next step)."""
    return sample_tokens(logits, params, generators).token_ids.tolist()


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> SamplerOutput:
    """(B, V) logits -> B token ids left on the device (``SamplerOutput``). Greedy rows: one argmax over the batch.
    Sampled rows: filtered together (``filtered_probs``), then each draws with its own generator (so a seeded
    request draws the same tokens alone or in any batch), on the device. Nothing here waits for the device."""
    tokens = torch.argmax(logits, dim=-1)  # (B,)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        vocab = logits.shape[-1]
        ks = [params[i].top_k if 0 <= params[i].top_k < vocab else 0 for i in rows]  # 0: no top-k (as apply_top_k)
        # One host -> device copy of every sampled row's index and parameters.
        host = torch.tensor([[i, params[i].temperature, k, params[i].top_p] for i, k in zip(rows, ks)],
                            dtype=torch.float64)  # (B_sampled, 4)
        row, temperature, top_k, top_p = host_to_device(host, logits.device).unbind(1)  # (B_sampled,) each
        every_row = len(rows) == len(params)
        sub = logits if every_row else logits.index_select(0, row.long())  # (B_sampled, V)
        k_max = max(ks)
        probs = filtered_probs(sub, temperature.to(logits.dtype), top_k.long(), top_p.to(logits.dtype), k_max,
                               any(params[i].top_p < 1.0 for i in rows))
        drawn = torch.cat([draw(probs[j], generators[i]) for j, i in enumerate(rows)])  # (B_sampled,)
        tokens = drawn if every_row else tokens.index_copy(0, row.long(), drawn)
    return SamplerOutput(tokens)
