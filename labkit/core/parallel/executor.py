"""The driver's side of tensor parallelism: start the worker ranks, announce each step, all-reduce, stop them.

``TPExecutor`` is rank 0 of the group and lives in the ``LLM``'s process next to the scheduler and the block
manager (vLLM's executor, with the driver as a worker itself). It spawns ranks 1..N-1 as ``WorkerProcess``es
(``labkit.core.engine.workers``: spawned, watched while they start), hands them their weights in shared memory,
waits until each reports ready (a rank that dies meanwhile is named at once, with its last error), then forms the
group. Each step it broadcasts the forward pass's inputs; the sharded layers of the driver's own model call its
``all_reduce``, which meets the workers' inside the same layers.

If a rank dies, the next collective fails; the executor then names the rank and its exit code, stops the other
ranks, and raises ``EngineDeadError`` from that and every later step, so every request ends with that error and no
process is left behind. ``close`` (also from garbage collection and interpreter exit) stops the ranks politely,
then by force; they also stop themselves when the driver is gone. Introduced in notebook 15
(``15_tensor_parallelism``).
"""

from __future__ import annotations

import os
import time
import weakref
from collections import deque
from dataclasses import dataclass

import torch

from labkit.core.attention.metadata import PagedAttentionMetadata
from labkit.core.engine.errors import EngineDeadError, WorkerStartError
from labkit.core.engine.workers import WorkerProcess, run_watched
from labkit.core.model import CausalLM
from labkit.core.parallel.group import ProcessTPGroup, open_store
from labkit.core.parallel.messages import Kind, header, pack_step
from labkit.core.parallel.worker import POOL_KEY, TPWorker, TPWorkerSpec, ready_key, run_tp_worker

COMM_LOG_LEN = 100_000  # steps whose all-reduce time is kept (like step_stats, but bounded)
DEFAULT_TIMEOUT_S = 120.0  # start-up (a spawned Python importing torch on a busy machine) and any one collective


@dataclass(frozen=True)
class CommRecord:
    """One step as rank 0 saw it: tokens run, and seconds spent in all-reduces (waiting for the slowest rank
    included). Notebook 15."""

    num_tokens: int
    all_reduce_s: float


def check_devices(device: torch.device, world_size: int) -> None:
    """On CUDA each rank needs its own GPU: a clear error if there are fewer than ``world_size``."""
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if world_size > count:
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} CUDA devices (one per rank), "
                             f"but this machine has {count}")
        if (device.index or 0) != 0:
            raise ValueError(f"with tensor_parallel_size > 1 the driver runs on cuda:0 and rank r on cuda:r; "
                             f"got device {device}")
    elif device.type != "cpu":
        raise ValueError(f"tensor_parallel_size > 1 runs on CPU (gloo) or CUDA (NCCL), not on {device.type}")


def stop_ranks(workers: list[WorkerProcess], group: ProcessTPGroup | None) -> None:
    """Tell the ranks to stop (if the group still works), then make sure they have: terminate, kill."""
    if group is not None and all(w.is_alive() for w in workers):
        try:
            group.broadcast(header(Kind.STOP))
        except RuntimeError:
            pass  # a collective failed already: terminate below
        for w in workers:
            w.process.join(timeout=5)
    for w in workers:
        w.stop()


class TPExecutor:
    """Rank 0 of a tensor-parallel group: the worker processes and the collectives. Notebook 15."""

    def __init__(self, model: CausalLM, world_size: int, rank_states: list[dict[str, torch.Tensor]],
                 attention_backend: str | type, timeout_s: float = DEFAULT_TIMEOUT_S, num_threads: int | None = None,
                 worker_cls: type[TPWorker] = TPWorker) -> None:
        """Spawn ranks 1..N-1, rank r with ``rank_states[r - 1]`` (its share of ``model``'s weights); they build
        and wait for ``connect``."""
        check_devices(model.device, world_size)
        self.rank, self.world_size = 0, world_size
        self.device = model.device
        self.timeout_s = timeout_s
        self.group: ProcessTPGroup | None = None
        self.dead: str | None = None  # the cause, once a rank has died
        self.comm_log: deque[CommRecord] = deque(maxlen=COMM_LOG_LEN)  # per step, appended by the model runner
        self.store = open_store(0, world_size, 0, timeout_s)
        self.workers: list[WorkerProcess] = []
        for rank in range(1, world_size):
            device = f"cuda:{rank}" if model.device.type == "cuda" else "cpu"
            spec = TPWorkerSpec(model.config, rank_states[rank - 1], model.dtype, device, rank, world_size,
                                attention_backend, self.store.port, timeout_s, num_threads, os.getpid())
            self.workers.append(WorkerProcess(run_tp_worker, (spec, worker_cls), name=f"labkit-tp-rank-{rank}",
                                              label=f"tensor-parallel rank {rank}").start())
        self._finalizer = weakref.finalize(self, stop_ranks, self.workers, None)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.pid is not None]

    def connect(self, num_blocks: int, block_size: int) -> None:
        """Give the ranks the pool's size, wait until each is built (a clear error if one fails or dies), form
        the group."""
        self.store.set(POOL_KEY, f"{num_blocks} {block_size}")
        try:
            for rank, worker in enumerate(self.workers, start=1):
                worker.wait_started()  # dies -> at once, with its last error; never arrives -> the guard's message
                key = ready_key(rank)
                worker.wait_until(lambda key=key: self.store.check([key]),  # type: ignore[misc]
                                  f"building tensor-parallel rank {rank}", self.timeout_s)
                state = self.store.get(key).decode()
                if state != "ready":
                    raise WorkerStartError(f"tensor-parallel rank {rank} could not be built: {state}")
            self.group = run_watched(
                lambda: ProcessTPGroup(self.store, 0, self.world_size, self.device, self.timeout_s), self.workers,
                "forming the tensor-parallel group", self.timeout_s)
        except BaseException:
            self.close()
            raise
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, stop_ranks, self.workers, self.group)

    # ---- the TPGroup protocol, for the driver's own sharded layers ----

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        group = self._live_group()
        try:
            return group.all_reduce(tensor)
        except RuntimeError as exc:
            raise self._died("an all-reduce failed", exc) from exc

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        group = self._live_group()
        try:
            return group.broadcast(tensor)
        except RuntimeError as exc:
            raise self._died("a step's broadcast failed", exc) from exc

    def broadcast_step(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata,
                       copies: list[tuple[int, int]]) -> None:
        """Announce one step to every rank: its header, then its inputs."""
        head, payload = pack_step(input_ids, positions, meta, copies)
        self.broadcast(head)
        self.broadcast(payload)

    def _live_group(self) -> ProcessTPGroup:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        if self.group is None:
            raise RuntimeError("the tensor-parallel group has not formed yet (connect first) or is closed")
        for rank, worker in enumerate(self.workers, start=1):
            if not worker.is_alive():
                raise self._died(f"rank {rank} is gone", None)
        return self.group

    def _died(self, what: str, exc: BaseException | None) -> EngineDeadError:
        """Name the dead rank(s), stop the rest, and remember the cause for every later call."""
        time.sleep(0.05)  # a rank that is exiting resets its sockets a moment before its exit code can be read
        gone = [w.describe_exit() for w in self.workers if not w.is_alive()]
        detail = "; ".join(gone) if gone else f"no rank has exited yet ({exc})"
        self.dead = f"tensor-parallel {what}: {detail}"
        self.close()
        return EngineDeadError(self.dead)

    def death_cause(self) -> str | None:
        """Why this group cannot serve (a rank died), or None while every rank runs. Safe from any thread."""
        if self.dead is None and self.group is not None:
            gone = [w.describe_exit() for w in self.workers if not w.is_alive()]
            if gone:
                return f"tensor-parallel rank gone: {'; '.join(gone)}"
        return self.dead

    def close(self) -> None:
        """Stop every rank (politely, then by force) and drop the group. Safe to repeat."""
        self._finalizer()
        self.group = None
