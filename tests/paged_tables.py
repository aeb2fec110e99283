"""Block tables for kernel tests: each sequence's blocks drawn from a shuffled pool, so no table is consecutive."""

from __future__ import annotations

import torch


def shuffled_tables(num_blocks: int, block_size: int, context_lens: list[int],
                    gen: torch.Generator) -> list[list[int]]:
    """One table per context length: ceil(len / block_size) distinct blocks of the pool, in a random order."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for c in context_lens:
        n = -(-c // block_size)
        tables.append(order[:n])
        order = order[n:]
    return tables
