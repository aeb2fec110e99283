"""The prefill worker: a process that runs prompts and hands their KV blocks to the decode worker.

It owns a model (the same weights as the decode worker's: shared memory, not a second load), a paged KV pool of
its own and a block manager. For each ``PREFILL`` message it allocates the prompt's blocks, runs the whole prompt
in one forward pass through the attention backend, gathers the blocks into one contiguous buffer (the transfer's
staging copy), frees them, and sends the buffer with the last position's logits. The decode worker samples the
first token from those logits with the request's own generator, so a seeded request draws what it would draw in
a colocated engine. A request whose prefill raises gets an ``ERROR`` message and the worker goes on.

It exits on ``STOP``, when the link breaks, and when its parent process is gone (a watchdog thread), so it never
outlives the ``LLM`` that started it. Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

import torch

from labkit.core.attention import resolve_attention_backend
from labkit.core.attention.metadata import PagedAttentionMetadata
from labkit.core.disagg.transfer import (
    BYTES_TAG,
    HEADER_LEN,
    HEADER_TAG,
    KV_TAG,
    LOGITS_TAG,
    PREFILL_RANK,
    TOKENS_TAG,
    Kind,
    Link,
    header,
    now_ns,
    open_group,
    open_store,
)
from labkit.core.engine.workers import report_fatal
from labkit.core.kv.block_manager import BlockManager
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model import CausalLM, ModelConfig
from labkit.core.model.loader import _materialise
from labkit.core.quant import quantize_like

READY_KEY = "prefill_worker"  # in the rendezvous store: "ready", or "error: ..." if the worker could not be built


@dataclass
class PrefillRequest:
    """What the block manager needs of a request (a ``Sequence``'s KV bookkeeping). Notebook 12."""

    seq_id: int
    prompt_token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class PrefillWorkerSpec:
    """Everything the spawned process needs to build its worker (picklable; the weights travel in shared memory).
    Notebook 12."""

    model_config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    dtype: torch.dtype
    device: str
    block_size: int
    max_model_len: int
    attention_backend: str | type
    port: int
    timeout_s: float
    num_threads: int | None
    parent_pid: int


class PrefillWorker:
    """Runs prompts over its own paged pool and sends their KV blocks. A subclass passed as
    ``prefill_worker_cls`` can change ``compute`` or ``send_kv`` (the tests plant faults there). Notebook 12."""

    def __init__(self, spec: PrefillWorkerSpec, link: Link) -> None:
        self.link = link
        self.device = torch.device(spec.device)
        self.model = self.build_model(spec)
        self.block_manager = BlockManager(-(-spec.max_model_len // spec.block_size), spec.block_size)
        self.pool = PagedKVPool(spec.model_config, self.block_manager.num_blocks, spec.block_size, self.device,
                                spec.dtype)
        self.attention_backend = resolve_attention_backend(spec.attention_backend, self.device.type, spec.dtype)
        if self.device.type == "cuda":
            # Its largest prefill once, now (vLLM's profiling run): the memory it needs stays in this process's
            # caching allocator, so the decode worker, which sizes its pool after this one is built, leaves room.
            self.prefill(PrefillRequest(-1, [0] * spec.max_model_len))

    def build_model(self, spec: PrefillWorkerSpec) -> CausalLM:
        model = _materialise(spec.model_config, self.device, spec.dtype)  # empty tensors: no random init
        quantize_like(model, spec.state_dict)  # a quantized model's int8/int4 layers, empty (notebook 14)
        model.load_state_dict(spec.state_dict)
        return model.eval()

    def prefill(self, req: PrefillRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's K/V blocks, gathered: (num_blocks, layers, 2, block_size, n_kv_heads, head_dim), and the
        last position's logits (vocab,) in float32. Its blocks are free again when it returns, or raises."""
        self.block_manager.allocate(req, len(req.prompt_token_ids))  # type: ignore[arg-type]  # has the fields
        try:
            return self.compute(req)
        finally:
            self.block_manager.free(req)  # type: ignore[arg-type]

    @torch.inference_mode()
    def compute(self, req: PrefillRequest) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward pass over the whole prompt into its blocks, then the blocks gathered into one buffer."""
        n, size = len(req.prompt_token_ids), self.block_manager.block_size
        table = torch.tensor(req.block_table, dtype=torch.long)  # (num_blocks,)
        positions = torch.arange(n)  # (n,)
        slots = table[positions // size] * size + positions % size  # (n,)
        meta = PagedAttentionMetadata(query_lens=[n], context_lens=[n], block_tables=[list(req.block_table)],
                                      slot_mapping=slots.to(self.device))
        ids = torch.tensor([req.prompt_token_ids], device=self.device)  # (1, n)
        hidden = self.model(ids, positions[None].to(self.device), self.attention_backend(self.pool, meta))
        logits = self.model.compute_logits(hidden[0, -1:])[0].float()  # (vocab,)
        table = table.to(self.device)
        per_layer = [torch.stack([k[table], v[table]], dim=1) for k, v in zip(self.pool.k, self.pool.v)]
        kv = torch.stack(per_layer, dim=1)  # (num_blocks, layers, 2, block_size, n_kv_heads, head_dim)
        return kv.cpu(), logits.cpu()  # gloo sends host tensors: this is the staging copy

    def send_kv(self, req: PrefillRequest, kv: torch.Tensor, logits: torch.Tensor, start: int, end: int) -> None:
        """The answer: a header (id, prompt length, blocks, this worker's used blocks, timings), the KV, the logits."""
        self.link.send([header(Kind.KV, req.seq_id, len(req.prompt_token_ids), kv.shape[0],
                               self.block_manager.num_used_blocks, start, end, now_ns()), kv, logits],
                       [HEADER_TAG, KV_TAG, LOGITS_TAG])

    def serve(self) -> None:
        """Answer messages until ``STOP`` (or until the link breaks, which raises)."""
        while True:
            head = self.link.recv_now(torch.empty(HEADER_LEN, dtype=torch.int64), HEADER_TAG)
            kind = Kind(int(head[0]))
            if kind is Kind.STOP:
                self.link.flush()
                return
            if kind is Kind.ECHO:
                payload = self.link.recv_now(torch.empty(int(head[1]), dtype=torch.uint8), BYTES_TAG)
                self.link.send([header(Kind.ECHO, payload.numel()), payload], [HEADER_TAG, BYTES_TAG])
                continue
            seq_id, n = int(head[1]), int(head[2])
            tokens = self.link.recv_now(torch.empty(n, dtype=torch.int64), TOKENS_TAG)
            req = PrefillRequest(seq_id, tokens.tolist())
            start = now_ns()
            try:
                kv, logits = self.prefill(req)
            except Exception as exc:  # noqa: BLE001  one request's failure is reported, the worker goes on
                message = torch.tensor(list(f"{type(exc).__name__}: {exc}".encode()), dtype=torch.uint8)
                self.link.send([header(Kind.ERROR, seq_id, message.numel(), self.block_manager.num_used_blocks),
                                message], [HEADER_TAG, BYTES_TAG])
                continue
            self.send_kv(req, kv, logits, start, now_ns())


def watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as the parent is gone (its pid is no longer our parent's)."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def run_prefill_worker(spec: PrefillWorkerSpec, worker_cls: type[PrefillWorker]) -> None:
    """The spawned process's entry point: connect, build the worker, serve until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the decode worker, which stops us in turn
    threading.Thread(target=watch_parent, args=(spec.parent_pid,), daemon=True).start()
    if spec.num_threads is not None:
        torch.set_num_threads(spec.num_threads)
    store = open_store(PREFILL_RANK, spec.port, spec.timeout_s)
    link = Link(open_group(store, PREFILL_RANK), PREFILL_RANK)
    code = 1
    try:
        try:
            worker = worker_cls(spec, link)
        except Exception as exc:  # noqa: BLE001  the decode worker reads it from the store and raises it
            store.set(READY_KEY, f"error: {type(exc).__name__}: {exc}")
            report_fatal(exc)
            raise
        store.set(READY_KEY, "ready")
        worker.serve()
        code = 0
    finally:
        # STOP, or a broken link (the decode worker went away): leave at once, without tearing gloo down politely.
        os._exit(code)
