"""What the driver broadcasts to the tensor-parallel workers each step: one header, then one int64 payload.

The scheduler and block manager live in the driver only; a worker needs, per step, exactly what its forward pass
reads: the token ids and positions, the slot of each new token, each sequence's query and context length and
block table, and the copy-on-write block copies to run first. The header (``HEADER_LEN`` int64: kind, N tokens,
B sequences, W table width, C copies) tells the workers the payload's length before they receive it:

    payload = ids (N) | positions (N) | slots (N) | query_lens (B) | context_lens (B) | table_lens (B)
              | tables (B * W) | copies (2C)

Introduced in notebook 15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from labkit.core.attention.metadata import PagedAttentionMetadata

HEADER_LEN = 8


class Kind(enum.IntEnum):
    """What a broadcast header announces. Notebook 15."""

    STEP = 1
    STOP = 2


@dataclass
class StepMessage:
    """One step's forward-pass inputs, as every rank runs them. Notebook 15."""

    input_ids: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    meta: PagedAttentionMetadata
    copies: list[tuple[int, int]]


def header(kind: Kind, *fields: int) -> torch.Tensor:
    values = [int(kind), *fields] + [0] * (HEADER_LEN - 1 - len(fields))
    return torch.tensor(values, dtype=torch.int64)  # (HEADER_LEN,)


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata,
              copies: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) for one step: host int64 tensors, ready to broadcast."""
    b = len(meta.query_lens)
    width = max((len(t) for t in meta.block_tables), default=0)
    tables = torch.zeros(b, width, dtype=torch.int64)  # (B, W), padded with block 0 (never read past context_len)
    for i, t in enumerate(meta.block_tables):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
    payload = torch.cat([
        input_ids.reshape(-1).cpu(), positions.reshape(-1).cpu(), meta.slot_mapping.reshape(-1).cpu(),
        torch.tensor(meta.query_lens, dtype=torch.int64), torch.tensor(meta.context_lens, dtype=torch.int64),
        torch.tensor([len(t) for t in meta.block_tables], dtype=torch.int64), tables.flatten(),
        torch.tensor(copies, dtype=torch.int64).reshape(-1),
    ]).to(torch.int64)
    return header(Kind.STEP, input_ids.numel(), b, width, len(copies)), payload


def payload_len(head: torch.Tensor) -> int:
    n, b, width, c = (int(x) for x in head[1:5])
    return 3 * n + 3 * b + b * width + 2 * c


def unpack_step(head: torch.Tensor, payload: torch.Tensor, device: torch.device) -> StepMessage:
    """The inverse of ``pack_step`` on a worker: ids, positions and slots on ``device``."""
    n, b, width, c = (int(x) for x in head[1:5])
    ids, pos, slots, q_lens, ctx_lens, t_lens, tables = payload[: payload.numel() - 2 * c].split(
        [n, n, n, b, b, b, b * width])
    copies = payload[payload.numel() - 2 * c :]
    # Each sequence's own table again, the padding dropped (as long as the driver's: backends may read its length).
    block_tables = [row[:k] for row, k in zip(tables.view(b, width).tolist(), t_lens.tolist())]
    meta = PagedAttentionMetadata(query_lens=q_lens.tolist(), context_lens=ctx_lens.tolist(),
                                  block_tables=block_tables, slot_mapping=slots.to(device))
    pairs = copies.view(c, 2).tolist()
    return StepMessage(ids.to(device), pos.to(device), meta, [(s, d) for s, d in pairs])
