"""A tensor-parallel group of threads in one process: the same collectives as ``ProcessTPGroup``, no sockets.

Each rank is a thread running its shard of the model; ``all_reduce`` and ``broadcast`` meet at a barrier and add
the ranks' tensors in rank order (so every rank gets bit-identical sums, as NCCL's and gloo's all-reduces give).
The tests check sharding exactly this way in milliseconds, and notebook 15's Build task runs its shards on it
before the engine runs them in processes. ``run_ranks`` starts the threads and returns each rank's result.
Introduced in notebook 15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class ThreadCollective:
    """The meeting point the ranks' ``ThreadTPGroup``s share. Notebook 15."""

    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout_s)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def group(self, rank: int) -> ThreadTPGroup:
        return ThreadTPGroup(self, rank)


class ThreadTPGroup:
    """One thread's end of a ``ThreadCollective``: the ``TPGroup`` protocol, counted like ``ProcessTPGroup``."""

    def __init__(self, collective: ThreadCollective, rank: int) -> None:
        if not 0 <= rank < collective.world_size:
            raise ValueError(f"rank must be in [0, {collective.world_size}), got {rank}")
        self.collective = collective
        self.rank = rank
        self.world_size = collective.world_size
        self.num_all_reduces = 0
        self.all_reduce_bytes = 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        c = self.collective
        c.slots[self.rank] = tensor
        c.barrier.wait()  # every rank's partial result is in
        parts = c.slots
        total = parts[0].clone()  # type: ignore[union-attr]
        for part in parts[1:]:
            total += part  # rank order: the same sum on every rank
        c.barrier.wait()  # everyone has read every slot: now each may overwrite its own tensor
        tensor.copy_(total)
        self.num_all_reduces += 1
        self.all_reduce_bytes += tensor.numel() * tensor.element_size()
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        c = self.collective
        if self.rank == 0:
            c.slots[0] = tensor
        c.barrier.wait()
        if self.rank != 0:
            tensor.copy_(c.slots[0])  # type: ignore[arg-type]
        c.barrier.wait()
        return tensor


def run_ranks(world_size: int, fn: Callable[[ThreadTPGroup], T], timeout_s: float = 60.0) -> list[T]:
    """Run ``fn(group)`` on ``world_size`` threads, one per rank; their results in rank order. An exception in any
    rank breaks the barrier (so no rank waits forever) and is raised here."""
    collective = ThreadCollective(world_size, timeout_s)
    results: list[T | None] = [None] * world_size
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(collective.group(rank))
        except BaseException as exc:  # noqa: BLE001  reported below, after every thread ends
            errors.append(exc)
            collective.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}") for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]
    return results  # type: ignore[return-value]
