"""KV-memory accounting: how much of the allocated KV memory holds tokens, under two layouts.

Pure arithmetic on prompt and output lengths (no model runs), shared by notebook 06
(``06_paged_attention``) and ``scripts/bench_paged.py``; ``budget_tokens`` turns bytes into token slots in a pool's
format (``kv_cache_dtype``: float, int8 or fp8; notebook 14):

* **contiguous reservation** (``ContiguousLayout``, what ``kvcache`` and earlier serving systems do):
  each request reserves its longest possible length up front, ``max_model_len`` token slots or
  ``prompt_len + max_tokens``, and holds all of it until it finishes. Slots reserved for tokens that
  do not exist (yet, or ever) are **reserved-but-unused**.
* **paging** (``PagedLayout``, the ``paged`` engine): blocks of ``block_size`` slots are handed out as
  the sequence grows. Only the unfilled tail of each sequence's last block is wasted: **internal
  fragmentation**, less than one block per sequence.

A request's life, counted as the engines count it: the prefill step computes the prompt's K/V
(``prompt_len`` tokens in cache), each later step computes the previous output token's K/V, and the
sequence finishes when it samples its last token, whose K/V are never computed. So during step
``s = 0 .. output_len - 1`` the cache holds ``prompt_len + s`` of its tokens, and at most
``peak_len = prompt_len + output_len - 1``. ``paged_blocks_per_step`` predicts the ``paged``
engine's ``StepStats.kv_blocks_used`` from this alone (tests/measure/test_kv_memory.py checks it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from labkit.core.kv.quantized_pool import check_kv_cache_dtype, kv_cache_bytes_per_token
from labkit.core.model.config import ModelConfig


class Request(Protocol):
    """Anything with a prompt and an output length, e.g. ``labkit.measure.workloads.WorkloadRequest``. Notebook 06."""

    prompt_len: int
    output_len: int


def peak_len(request: Request) -> int:
    """Most tokens the request ever holds in the KV cache: its last sampled token's K/V are never computed."""
    return request.prompt_len + request.output_len - 1


def lens_in_cache(request: Request) -> range:
    """Tokens in the cache during each of the request's steps: prompt_len, prompt_len + 1, ..., peak_len."""
    return range(request.prompt_len, peak_len(request) + 1)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (the last one may be partly empty)."""
    return -(-num_tokens // block_size)


# ---- the two layouts ----

@dataclass(frozen=True)
class ContiguousLayout:
    """Reserve each request's longest possible length up front. Notebook 06.

    ``reserve="max_model_len"``: every request reserves ``max_model_len`` slots (the engine cannot
    know how long it will get). ``reserve="max_tokens"``: ``prompt_len + max_tokens`` slots (capped at
    ``max_model_len``), where ``max_tokens`` is the client's output budget; ``max_tokens=None`` means
    each request's exact ``output_len``, a perfect guess and the best contiguous reservation can do.
    """

    reserve: Literal["max_model_len", "max_tokens"] = "max_model_len"
    max_model_len: int = 2048
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.reserve not in ("max_model_len", "max_tokens"):
            raise ValueError(f"reserve must be 'max_model_len' or 'max_tokens', got {self.reserve!r}")
        if self.max_model_len < 1 or (self.max_tokens is not None and self.max_tokens < 1):
            raise ValueError(f"need max_model_len >= 1 and max_tokens >= 1, got {self.max_model_len} and "
                             f"{self.max_tokens}")

    @property
    def name(self) -> str:
        if self.reserve == "max_model_len":
            return f"contiguous, max_model_len {self.max_model_len}"
        if self.max_tokens is None:
            return "contiguous, prompt + exact output"
        return f"contiguous, prompt + max_tokens {self.max_tokens}"

    def reserved_len(self, request: Request) -> int:
        """Token slots the request holds from admission to finish."""
        if self.reserve == "max_model_len":
            need = self.max_model_len
        else:
            budget = request.output_len if self.max_tokens is None else self.max_tokens
            need = min(self.max_model_len, request.prompt_len + budget)
        if need < peak_len(request):
            raise ValueError(f"a request of {request.prompt_len} prompt + {request.output_len} output tokens needs "
                             f"{peak_len(request)} slots but {self.name} reserves only {need}")
        return need

    def allocated(self, request: Request, num_tokens: int) -> int:
        """Slots held while ``num_tokens`` tokens are in the cache: the whole reservation, always."""
        return self.reserved_len(request)

    def peak_allocated(self, request: Request) -> int:
        return self.reserved_len(request)


@dataclass(frozen=True)
class PagedLayout:
    """Blocks of ``block_size`` slots, taken as the sequence grows. Notebook 06."""

    block_size: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    @property
    def name(self) -> str:
        return f"paged, block_size {self.block_size}"

    def allocated(self, request: Request, num_tokens: int) -> int:
        """Slots held while ``num_tokens`` tokens are in the cache: whole blocks."""
        return blocks_for(num_tokens, self.block_size) * self.block_size

    def peak_allocated(self, request: Request) -> int:
        return self.allocated(request, peak_len(request))


Layout = ContiguousLayout | PagedLayout


# ---- waste ----

@dataclass(frozen=True)
class KVMemoryUsage:
    """Token slots of KV memory by what they hold. Notebook 06.

    ``used``: slots holding a token's K/V. ``reserved_unused``: slots reserved ahead for tokens not
    in the cache (contiguous reservation). ``internal``: the empty tail of a sequence's last block
    (paging). Summed over requests and, for ``at="lifetime"``, over every step of each request's life
    (slot-steps: memory held x time held). Multiply by ``kv_bytes_per_token`` for bytes.
    """

    layout: str
    used: int
    reserved_unused: int
    internal: int

    @property
    def allocated(self) -> int:
        return self.used + self.reserved_unused + self.internal

    @property
    def wasted(self) -> int:
        return self.reserved_unused + self.internal

    def _share(self, part: int) -> float:
        return part / self.allocated if self.allocated else 0.0

    @property
    def waste_fraction(self) -> float:
        """Share of allocated KV memory that holds no token."""
        return self._share(self.wasted)

    @property
    def reserved_unused_fraction(self) -> float:
        return self._share(self.reserved_unused)

    @property
    def internal_fraction(self) -> float:
        return self._share(self.internal)

    @property
    def used_fraction(self) -> float:
        return self._share(self.used)


def kv_memory_usage(requests: Iterable[Request], layout: Layout,
                    at: Literal["lifetime", "peak"] = "lifetime") -> KVMemoryUsage:
    """Used and wasted KV slots of ``requests`` under ``layout``. Notebook 06.

    ``at="lifetime"``: every step of every request's life counts (a request holding 100 wasted
    slots for 50 steps wastes 5000 slot-steps), which is what the memory is really doing while the
    requests run. ``at="peak"``: one snapshot per request at its longest, the kindest moment for
    contiguous reservation (every reserved token has arrived).
    """
    if at not in ("lifetime", "peak"):
        raise ValueError(f"at must be 'lifetime' or 'peak', got {at!r}")
    used = reserved_unused = internal = 0
    for r in requests:
        lens = lens_in_cache(r) if at == "lifetime" else (peak_len(r),)
        for n in lens:
            slack = layout.allocated(r, n) - n
            used += n
            if isinstance(layout, PagedLayout):
                internal += slack
            else:
                reserved_unused += slack
    return KVMemoryUsage(layout.name, used, reserved_unused, internal)


# ---- how many sequences fit ----

def max_concurrent_seqs(requests: Sequence[Request], budget_tokens: int, layout: Layout) -> int:
    """How many sequences fit at once in ``budget_tokens`` token slots of KV memory. Notebook 06.

    Requests are taken first come, first served (cycling through ``requests`` if the budget holds
    them all), each counted at the most memory it will ever hold under ``layout``: its whole
    reservation (contiguous) or the blocks of its longest length (paged). So every admitted sequence
    can run to its end without preemption. A paged budget is whole blocks: ``budget_tokens //
    block_size`` of them.
    """
    if not requests:
        raise ValueError("need at least one request")
    if isinstance(layout, PagedLayout):
        budget_tokens = budget_tokens // layout.block_size * layout.block_size
    held = count = 0
    for r in itertools.islice(itertools.cycle(requests), budget_tokens + 1):
        need = layout.peak_allocated(r)
        if held + need > budget_tokens:
            break
        held += need
        count += 1
    return count


def budget_tokens(config: ModelConfig, budget_bytes: int, dtype: torch.dtype = torch.float32,
                  kv_cache_dtype: str = "auto") -> int:
    """Token slots a KV budget of ``budget_bytes`` holds in the pool's format, scales counted (the same bytes per
    token the engine sizes its pool with): feed it to ``max_concurrent_seqs``. Notebook 14 compares the formats at
    equal memory; an int8 token costs head_dim + 4 bytes per head for K and for V, against 4 x head_dim in float32."""
    return budget_bytes // kv_cache_bytes_per_token(config, dtype, check_kv_cache_dtype(kv_cache_dtype))


def paged_blocks_per_step(requests: Sequence[Request], block_size: int) -> list[int]:
    """Blocks held during each step when ``requests`` run as one static batch on the ``paged`` engine.

    All sequences are prefilled in step 0; during step ``s`` a live sequence holds the blocks of
    ``prompt_len + s`` tokens; it frees them all at the end of the step that samples its last token
    (step ``output_len - 1``; the engine records the count before that). Assumes distinct prompts, no prefix
    caching, ``n = 1`` and a pool big enough that nobody is preempted: then it equals the engine's
    ``[s.kv_blocks_used for s in engine.step_stats]``.
    """
    num_steps = max((r.output_len for r in requests), default=0)
    return [sum(blocks_for(r.prompt_len + s, block_size) for r in requests if s < r.output_len)
            for s in range(num_steps)]

