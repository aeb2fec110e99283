"""Memory pressure, for the paged engines: KV pools from one block up. A request that cannot fit the pool even
alone is rejected with a clear error before any work; everything that fits completes, through waiting and
preemption, with the reference's tokens, and never uses more blocks than the pool has.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from labkit import SamplingParams

from .reliability_common import PAGED, Reference, greedy, make, tokens

POOLS = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (1, 4), (2, 4), (3, 5), (2, 8), (4, 8)]


def fitting_workload(rng: random.Random, block_size: int, num_blocks: int, n: int
                     ) -> tuple[list[list[int]], list[SamplingParams]]:
    """Requests that each fit the pool alone (prompt + max_tokens - 1 tokens); the first two, when the pool
    has 4+ blocks, each grow to the whole pool, so running them together needs a preemption."""
    capacity = block_size * num_blocks
    prompts: list[list[int]] = []
    params: list[SamplingParams] = []
    if num_blocks >= 4:
        filler = (num_blocks // 2) * block_size - 1 if block_size > 1 else num_blocks // 2
        for _ in range(2):
            prompts.append([1] + [rng.randrange(3, 2000) for _ in range(filler - 1)])
            params.append(greedy(capacity - filler + 1))
    while len(prompts) < n:
        total = rng.randint(2, capacity + 1)  # prompt + max_tokens
        prompt_len = rng.randint(1, total - 1)
        prompts.append([rng.randrange(3, 2000) for _ in range(prompt_len)])
        if rng.random() < 0.5:
            params.append(greedy(total - prompt_len))
        else:
            params.append(SamplingParams(max_tokens=total - prompt_len, temperature=0.9, top_k=rng.choice([-1, 20]),
                                         seed=rng.randrange(1000), n=rng.choice([1, 2])))
    return prompts, params


@pytest.mark.parametrize("engine", PAGED)
@pytest.mark.parametrize(("block_size", "num_blocks"), POOLS)
def test_tiny_pools_complete_every_request_that_fits(tiny: Path, reference: Reference, engine: str,
                                                     block_size: int, num_blocks: int) -> None:
    capacity = block_size * num_blocks
    budget = {"max_num_batched_tokens": 3} if engine == "chunked" else {}
    llm = make(tiny, engine, block_size=block_size, num_gpu_blocks=num_blocks, max_num_seqs=4, **budget)
    # A prompt that cannot fit even alone, and one that fits but whose output would not: clear errors, no work.
    need = -(-(capacity + 1) // block_size)
    with pytest.raises(ValueError, match=rf"the prompt alone needs {need} KV blocks \({capacity + 1} tokens at "
                                         rf"block_size {block_size}\) but the pool has only {num_blocks} "
                                         rf"\({capacity} tokens\)"):
        llm.generate([[1], [1] * (capacity + 1)], greedy(1), use_tqdm=False)
    with pytest.raises(ValueError, match=rf"max_tokens 2 at block_size {block_size}\) but the pool has only "
                                         rf"{num_blocks}; lower max_tokens to at most 1"):
        llm.generate([[1] * capacity], greedy(2), use_tqdm=False)
    assert llm.engine.num_steps == 0
    # Everything that fits completes, through waiting and preemption, with the reference's tokens.
    prompts, params = fitting_workload(random.Random(capacity * 100 + num_blocks), block_size, num_blocks, 8)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs) == reference(prompts, params)
    assert all(c.finish_reason in ("stop", "length") for o in outs for c in o.outputs)
    assert max(s.kv_blocks_used or 0 for s in llm.engine.step_stats) <= num_blocks
    if num_blocks >= 4:
        assert llm.engine.num_preemptions > 0
