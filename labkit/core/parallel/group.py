"""The tensor-parallel process group: N ranks, each holding 1/N of every sharded layer, meeting in all-reduces.

A ``TPGroup`` is what the sharded layers (``layers.py``) and the worker loop need from ``torch.distributed``: this
rank's number, the world size, a sum all-reduce (after every row-parallel layer) and a broadcast from rank 0 (the
driver announcing each step). ``ProcessTPGroup`` runs them over real process groups built directly on a
``TCPStore`` on 127.0.0.1 (as chapter 12's link does: no process-wide default group, so several engines can live
side by side): gloo for the step announcements, and for the all-reduces gloo on a CPU, NCCL on CUDA.
``ThreadTPGroup`` (``local_group.py``) runs the same collectives between threads of one process, for tests and the
notebook. Introduced in notebook 15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

import datetime
import time
from typing import Protocol

import torch
import torch.distributed as dist

DRIVER_RANK = 0  # the LLM's own process: it schedules, owns the block manager, and is rank 0 of the group


class TPGroup(Protocol):
    """What sharded layers and workers need of a tensor-parallel group. Notebook 15."""

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; every rank gets the same sum. Returns ``tensor``."""
        ...

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's ``tensor`` (same shape and dtype), in place. Returns it."""
        ...


def open_store(rank: int, world_size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous: the driver serves it on 127.0.0.1 (``port`` 0: any free port, read back from ``.port``)."""
    return dist.TCPStore("127.0.0.1", port, world_size, rank == DRIVER_RANK,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """A gloo group of ``world_size`` ranks whose sockets bind to 127.0.0.1 only."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, options)


def nccl_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> dist.ProcessGroup:
    """An NCCL group for the all-reduces of ranks on CUDA devices (one device per rank)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, world_size, options)


class ProcessTPGroup:
    """One rank's end of a tensor-parallel group of processes. Counts what it moves: ``num_all_reduces``,
    ``all_reduce_bytes`` and ``all_reduce_s`` (notebook 15 splits a step into compute and communication with them).
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.cpu = gloo_group(store, rank, world_size, timeout_s)  # step announcements: host tensors
        self.comm = nccl_group(store, rank, world_size, timeout_s) if device.type == "cuda" else self.cpu
        self.num_all_reduces = 0
        self.all_reduce_bytes = 0
        self.all_reduce_s = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        self.comm.allreduce([tensor]).wait()  # ReduceOp.SUM, in place
        self.num_all_reduces += 1
        self.all_reduce_bytes += tensor.numel() * tensor.element_size()
        self.all_reduce_s += time.perf_counter() - start
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        options = dist.BroadcastOptions()
        options.rootRank = DRIVER_RANK
        self.cpu.broadcast([tensor], options).wait()
        return tensor

    def reset_counters(self) -> None:
        self.num_all_reduces = self.all_reduce_bytes = 0
        self.all_reduce_s = 0.0
