"""The decode worker's handle on the prefill worker: start the process, hand it prompts, poll for their KV.

``PrefillClient`` spawns the prefill process (``labkit.core.engine.workers.WorkerProcess``: the parent watches it
while the gloo group forms, so a worker that dies or never arrives is reported at once or within the join timeout,
not after the group's), and keeps the receive side of the link in a thread that queues whole answers, so the
decode loop never blocks on it. When the worker dies, every answer it had sent in full is still taken (the thread
reads the socket to its end first); then ``error`` names the exit, and the engine reports itself dead. The process
always ends: ``close``, garbage collection and interpreter exit stop it here, and it stops itself when its parent
is gone. Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from labkit.core.disagg.prefill_worker import READY_KEY, PrefillWorker, PrefillWorkerSpec, run_prefill_worker
from labkit.core.disagg.transfer import (
    BYTES_TAG,
    DECODE_RANK,
    HEADER_LEN,
    HEADER_TAG,
    KV_TAG,
    LOGITS_TAG,
    TOKENS_TAG,
    Kind,
    Link,
    TransferError,
    header,
    open_group,
    open_store,
)
from labkit.core.engine.workers import WorkerProcess, run_watched
from labkit.core.model import CausalLM

DRAIN_S = 5.0  # after the worker died: how long the receiver thread gets to read what it had sent


@dataclass
class KVMessage:
    """One prompt's KV back from the prefill worker, with the worker's timings (perf_counter seconds). Notebook 12."""

    seq_id: int
    kv: torch.Tensor  # (num_blocks, layers, 2, block_size, n_kv_heads, head_dim)
    logits: torch.Tensor  # (vocab,) float32, the last prompt position's
    prefill_start: float
    prefill_end: float
    send_start: float
    received: float
    prefill_blocks_in_use: int  # the prefill worker's used blocks after it let this prompt's go

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class ErrorMessage:
    """The prefill worker could not prefill one request; ``message`` says why. Notebook 12."""

    seq_id: int
    message: str
    prefill_blocks_in_use: int


def stop_worker(worker: WorkerProcess, link: Link | None) -> None:
    """Ask the worker to stop over the link, then make sure it has (terminate, kill)."""
    ask = None if link is None else (lambda: link.send([header(Kind.STOP)], [HEADER_TAG]))
    worker.stop(ask)


def receive_loop(link: Link, kv_block_shape: tuple[int, ...], kv_dtype: torch.dtype, vocab_size: int,
                 inbox: queue.Queue[KVMessage | ErrorMessage | BaseException], echoes: queue.Queue[float]) -> None:
    """The receiver thread: read whole messages off the link (gloo's receives complete only inside ``wait``, which
    releases the GIL) and queue them for the decode loop; a broken link queues its exception and ends the thread.
    It holds no reference to the client, so an ``LLM`` dropped without ``close`` is still collected (and its
    prefill process stopped)."""
    try:
        while True:
            head = link.recv_now(torch.empty(HEADER_LEN, dtype=torch.int64), HEADER_TAG).tolist()
            kind = Kind(head[0])
            if kind is Kind.KV:
                kv = link.recv_now(torch.empty((head[3], *kv_block_shape), dtype=kv_dtype), KV_TAG)
                logits = link.recv_now(torch.empty(vocab_size), LOGITS_TAG)
                inbox.put(KVMessage(head[1], kv, logits, head[5] / 1e9, head[6] / 1e9, head[7] / 1e9,
                                    time.perf_counter(), head[4]))
            elif kind is Kind.ERROR:
                text = bytes(link.recv_now(torch.empty(head[2], dtype=torch.uint8), BYTES_TAG).tolist())
                inbox.put(ErrorMessage(head[1], text.decode(errors="replace"), head[3]))
            elif kind is Kind.ECHO:
                link.recv_now(torch.empty(head[1], dtype=torch.uint8), BYTES_TAG)
                echoes.put(time.perf_counter())
            else:
                raise TransferError(f"unexpected message of kind {kind.name} from the prefill worker")
    except Exception as exc:  # noqa: BLE001  the link is broken (or closed): the decode loop reports it
        inbox.put(exc)


def short_link_error(exc: BaseException) -> str:
    """gloo's message without its source location and advice: "Read error [127.0.0.1]:8085: Connection reset"."""
    text = str(exc).split("] ", 1)[-1] if str(exc).startswith("[") else str(exc)
    return text.split(". This is typically", 1)[0]


class PrefillClient:
    """The prefill process and the decode end of the link to it. Notebook 12."""

    def __init__(self, model: CausalLM, block_size: int, max_model_len: int, attention_backend: str | type,
                 worker_cls: type[PrefillWorker], timeout_s: float, num_threads: int | None,
                 join_timeout_s: float) -> None:
        self.timeout_s = timeout_s
        c = model.config  # the answers' shapes: one block's (layers, 2, block_size, n_kv_heads, head_dim)
        self.kv_block_shape = (c.num_hidden_layers, 2, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_dtype, self.vocab_size = model.dtype, c.vocab_size
        self.store = open_store(DECODE_RANK, 0, timeout_s)
        spec = PrefillWorkerSpec(model.config, {k: v.detach() for k, v in model.state_dict().items()}, model.dtype,
                                 str(model.device), block_size, max_model_len, attention_backend, self.store.port,
                                 timeout_s, num_threads, os.getpid())
        self.worker = WorkerProcess(run_prefill_worker, (spec, worker_cls), name="labkit-prefill-worker",
                                    join_timeout_s=join_timeout_s, label="the prefill worker")
        self.process = self.worker.process
        self.link: Link | None = None
        self.error: str | None = None  # set once the link is broken: nothing more can be prefilled
        self._finalizer = weakref.finalize(self, stop_worker, self.worker, None)
        self.worker.start()
        self.worker.wait_started()  # died at import, or never arrived: raises WorkerStartError naming the cause
        startup_s = max(timeout_s, join_timeout_s)  # forming the group, then building the worker (weights, pool)
        group = run_watched(lambda: open_group(self.store, DECODE_RANK), [self.worker],
                            "forming the process group with the prefill worker", startup_s)
        self.link = Link(group, DECODE_RANK)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, stop_worker, self.worker, self.link)
        self.worker.wait_until(lambda: self.store.check([READY_KEY]), "building the prefill worker", startup_s)
        state = self.store.get(READY_KEY).decode()
        if state != "ready":
            self.close()
            raise RuntimeError(f"the prefill worker could not be built: {state}")
        self.num_inflight = 0  # prompts sent whose answer has not been read
        self.last_progress = time.monotonic()  # the last answer, or the send that made num_inflight 1
        self.prefill_blocks_in_use = 0
        self._inbox: queue.Queue[KVMessage | ErrorMessage | BaseException] = queue.Queue()
        self._echoes: queue.Queue[float] = queue.Queue()
        self._receiver = threading.Thread(target=receive_loop, name="labkit-kv-receiver", daemon=True,
                                          args=(self.link, self.kv_block_shape, self.kv_dtype, self.vocab_size,
                                                self._inbox, self._echoes))
        self._receiver.start()

    @property
    def pid(self) -> int | None:
        return self.worker.pid

    def describe_failure(self, what: str) -> str:
        return f"{what}: {self.worker.describe_exit()}"

    def death_cause(self) -> str | None:
        """Why no more prompts can be prefilled, or None while the link works. Safe from any thread (it changes
        nothing): a worker that exited since the last ``poll`` shows here at once."""
        if self.error is not None:
            return self.error
        if not self.worker.is_alive():
            return self.worker.describe_exit()
        return None

    def send_prompt(self, seq_id: int, token_ids: list[int]) -> None:
        """Hand one prompt to the prefill worker (returns at once)."""
        if self.error is not None:
            raise TransferError(self.error)
        if self.link is None or not self.worker.is_alive():
            self.error = self.describe_failure("cannot send a prompt")
            raise TransferError(self.error)
        tokens = torch.tensor(token_ids, dtype=torch.int64)
        self.link.send([header(Kind.PREFILL, seq_id, len(token_ids)), tokens], [HEADER_TAG, TOKENS_TAG])
        if not self.num_inflight:
            self.last_progress = time.monotonic()
        self.num_inflight += 1

    def poll(self) -> list[KVMessage | ErrorMessage]:
        """Every answer that has fully arrived, without waiting (the per-step liveness check too). If the worker
        died or the link broke, ``error`` says so, after every answer the worker had sent in full was taken."""
        if self.error is None and not self.worker.is_alive():
            # The receiver thread reads what is still in the socket, then meets its end (and queues that).
            self._receiver.join(timeout=DRAIN_S)
        messages: list[KVMessage | ErrorMessage] = []
        while True:
            try:
                self._accept(self._inbox.get_nowait(), messages)
            except queue.Empty:
                break
        if self.error is None and not self.worker.is_alive():
            self.error = self.worker.describe_exit()
        if self.error is None and self.num_inflight and time.monotonic() - self.last_progress > self.timeout_s:
            self.error = self.describe_failure(f"no answer from the prefill worker for {self.timeout_s:g} s "
                                               f"(transfer_timeout_s) with {self.num_inflight} prompt(s) out")
        return messages

    def wait(self) -> list[KVMessage | ErrorMessage]:
        """Block until at least one answer arrives or the link breaks (``error`` set; no answer for the transfer
        timeout breaks it too)."""
        while self.num_inflight and self.error is None:
            messages = self.poll()
            if messages or self.error is not None:
                return messages
            try:
                self._accept(self._inbox.get(timeout=0.1), messages)
            except queue.Empty:
                continue
            return messages + self.poll()
        return self.poll() if self.num_inflight else []

    def _accept(self, item: KVMessage | ErrorMessage | BaseException, messages: list[KVMessage | ErrorMessage]
                ) -> None:
        if isinstance(item, BaseException):  # the receiver thread's last word: the link is broken
            if self.error is None:
                exit_ = self.worker.describe_exit()  # gives an exiting worker a moment to be seen as exited
                self.error = exit_ if not self.worker.is_alive() else \
                    f"the link to the prefill worker broke ({short_link_error(item)}): {exit_}"
            return
        self.num_inflight -= 1
        self.last_progress = time.monotonic()
        self.prefill_blocks_in_use = item.prefill_blocks_in_use
        messages.append(item)

    def measure_link(self, num_bytes: int) -> float:
        """Round-trip seconds of ``num_bytes`` over the link (no prompt may be out: answers share its tags)."""
        if self.num_inflight or self.link is None:
            raise RuntimeError("measure_link needs an idle link: finish or abort the running requests first")
        if self.error is not None:
            raise TransferError(self.error)
        start = time.perf_counter()
        self.link.send([header(Kind.ECHO, num_bytes), torch.zeros(num_bytes, dtype=torch.uint8)],
                       [HEADER_TAG, BYTES_TAG])
        try:
            return self._echoes.get(timeout=self.timeout_s) - start
        except queue.Empty:
            raise TransferError(self.describe_failure(f"no echo of {num_bytes} bytes within {self.timeout_s:g} s")) \
                from None

    def close(self) -> None:
        """Stop the prefill process (politely, then by force) and drop the link. Safe to repeat."""
        self._finalizer()
        self.link = None
