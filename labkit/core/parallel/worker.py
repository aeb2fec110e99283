"""A tensor-parallel worker: ranks 1..N-1, each a process holding its shard of the model and of the KV pool.

The worker builds its sharded modules and loads the share of the weights the driver cut for it (shared memory,
no second load: ``weights.build_rank_model``), builds a paged KV pool of its heads only, with the driver's number
of blocks, and reports "ready" in the rendezvous store (or "error: ..." if it could not be built). Then it joins
the group and loops: receive a step's header and inputs by broadcast from the driver, run the same forward pass
as every other rank (its all-reduces meet theirs inside the row-parallel layers), and throw the output away: the
lm_head is replicated, so the driver computes the logits alone. The block manager and the scheduler stay in the
driver; the slot mapping and block tables it broadcasts are all a worker needs to use its share of the pool.

It exits on ``STOP``, when a collective fails (the driver or another rank is gone) and when its parent process
is gone (a watchdog thread): it never outlives the ``LLM`` that started it. The process lifecycle follows
chapter 12's prefill worker. Introduced in notebook 15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import torch

from labkit.core.attention import resolve_attention_backend
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model import ModelConfig
from labkit.core.parallel.group import ProcessTPGroup, open_store
from labkit.core.parallel.messages import HEADER_LEN, Kind, payload_len, unpack_step
from labkit.core.parallel.weights import build_rank_model

POOL_KEY = "tp_pool"  # in the store: "num_blocks block_size", set by the driver once it has sized its pool


def ready_key(rank: int) -> str:
    return f"tp_ready_{rank}"  # "ready", or "error: ..." if the rank could not be built


@dataclass
class TPWorkerSpec:
    """Everything a spawned rank needs (picklable; the weights travel in shared memory). Notebook 15."""

    model_config: ModelConfig  # the whole model's: the rank builds its sharded modules from it
    state_dict: dict[str, torch.Tensor]  # this rank's share (``weights.shard_state_dict``), cut by the driver
    dtype: torch.dtype
    device: str  # "cpu", or "cuda:<rank>"
    rank: int
    world_size: int
    attention_backend: str | type
    port: int
    timeout_s: float
    num_threads: int | None
    parent_pid: int


class DeferredGroup:
    """A rank's group before it has joined: layers can be sharded against it; ``join`` supplies the real one."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.inner: ProcessTPGroup | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.inner is not None, "the tensor-parallel group has not formed yet"
        return self.inner.all_reduce(tensor)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        assert self.inner is not None, "the tensor-parallel group has not formed yet"
        return self.inner.broadcast(tensor)


class TPWorker:
    """One rank's model shard, KV pool share and step loop. Notebook 15."""

    def __init__(self, spec: TPWorkerSpec, store: torch.distributed.Store) -> None:
        self.device = torch.device(spec.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL binds each rank to its current device
        self.group = DeferredGroup(spec.rank, spec.world_size)
        # Sharded modules on the meta device, then this rank's share loaded: model.config is the rank's own.
        self.model = build_rank_model(spec.model_config, spec.state_dict, self.group, self.device, spec.dtype)
        num_blocks, block_size = (int(x) for x in store.get(POOL_KEY).decode().split())
        self.pool = PagedKVPool(self.model.config, num_blocks, block_size, self.device, spec.dtype)
        self.attention_backend = resolve_attention_backend(spec.attention_backend, self.device.type, spec.dtype)

    @torch.inference_mode()
    def run_step(self, head: torch.Tensor) -> None:
        payload = self.group.broadcast(torch.empty(payload_len(head), dtype=torch.int64))
        step = unpack_step(head, payload, self.device)
        self.pool.copy_blocks(step.copies)
        backend = self.attention_backend(self.pool, step.meta)
        self.model(step.input_ids[None], step.positions[None], backend)  # (1, N, hidden), identical on every rank

    def serve(self) -> None:
        """Run steps until ``STOP`` (a failed collective raises)."""
        while True:
            head = self.group.broadcast(torch.empty(HEADER_LEN, dtype=torch.int64))
            if Kind(int(head[0])) is Kind.STOP:
                return
            self.run_step(head)


def watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as the parent is gone (its pid is no longer our parent's)."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def run_tp_worker(spec: TPWorkerSpec, worker_cls: type[TPWorker] = TPWorker) -> None:
    """The spawned process's entry point: build the rank, report ready, join the group, serve until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the driver, which stops us in turn
    threading.Thread(target=watch_parent, args=(spec.parent_pid,), daemon=True).start()
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    code = 1
    try:
        store = open_store(spec.rank, spec.world_size, spec.port, spec.timeout_s)
        try:
            worker = worker_cls(spec, store)
        except Exception as exc:  # noqa: BLE001  the driver reads it from the store and raises it
            store.set(ready_key(spec.rank), f"error: {type(exc).__name__}: {exc}")
            raise
        store.set(ready_key(spec.rank), "ready")
        worker.group.inner = ProcessTPGroup(store, spec.rank, spec.world_size, worker.device, spec.timeout_s)
        worker.serve()
        code = 0
    finally:
        # STOP, or a failed collective (the driver or a peer went away): leave at once, without tearing gloo down.
        os._exit(code)
