"""The decode worker's handle on the prefill worker: start the process, hand it prompts, poll for their KV.

``PrefillClient`` spawns the prefill process (``torch.multiprocessing``, spawn), meets it on a gloo group over
127.0.0.1, and keeps the receive side of the link as a small state machine that never blocks the decode loop:
a header receive is posted while prompts are out, and once it lands the receives for the tensors it announces
are posted. If the process dies, or a receive fails, ``poll`` raises ``TransferError`` naming it. The process
always ends: ``close``, garbage collection and interpreter exit stop it here, and it stops itself when its
parent is gone. Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

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
from labkit.core.model import CausalLM


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


def stop_process(process: mp.Process, link: Link | None) -> None:
    """Ask the process to stop, then make sure it has (terminate, kill)."""
    if process.is_alive() and link is not None:
        try:
            link.send([header(Kind.STOP)], [HEADER_TAG])
        except RuntimeError:
            pass  # the link is broken already: terminate below
    process.join(timeout=5)
    if process.is_alive():
        process.terminate()
        process.join(timeout=5)
    if process.is_alive():
        process.kill()
        process.join()


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


class PrefillClient:
    """The prefill process and the decode end of the link to it. Notebook 12."""

    def __init__(self, model: CausalLM, block_size: int, max_model_len: int, attention_backend: str | type,
                 worker_cls: type[PrefillWorker], timeout_s: float, num_threads: int | None) -> None:
        self.timeout_s = timeout_s
        c = model.config  # the answers' shapes: one block's (layers, 2, block_size, n_kv_heads, head_dim)
        self.kv_block_shape = (c.num_hidden_layers, 2, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_dtype, self.vocab_size = model.dtype, c.vocab_size
        self.store = open_store(DECODE_RANK, 0, timeout_s)
        spec = PrefillWorkerSpec(model.config, {k: v.detach() for k, v in model.state_dict().items()}, model.dtype,
                                 str(model.device), block_size, max_model_len, attention_backend, self.store.port,
                                 timeout_s, num_threads, os.getpid())
        self.process = mp.get_context("spawn").Process(target=run_prefill_worker, args=(spec, worker_cls),
                                                      name="labkit-prefill-worker", daemon=True)
        self.process.start()
        self.link: Link | None = None
        self._finalizer = weakref.finalize(self, stop_process, self.process, None)
        self.link = Link(open_group(self.store, DECODE_RANK, timeout_s), DECODE_RANK)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, stop_process, self.process, self.link)
        self._wait_ready()
        self.num_inflight = 0  # prompts sent whose answer has not been read
        self.error: str | None = None  # set once the link is broken: nothing more can be prefilled
        self.prefill_blocks_in_use = 0
        self._inbox: queue.Queue[KVMessage | ErrorMessage | BaseException] = queue.Queue()
        self._echoes: queue.Queue[float] = queue.Queue()
        threading.Thread(target=receive_loop, name="labkit-kv-receiver", daemon=True,
                         args=(self.link, self.kv_block_shape, self.kv_dtype, self.vocab_size, self._inbox,
                               self._echoes)).start()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.store.check([READY_KEY]):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the prefill worker did not start (exit code {self.process.exitcode})")
            time.sleep(0.01)
        state = self.store.get(READY_KEY).decode()
        if state != "ready":
            self.close()
            raise RuntimeError(f"the prefill worker could not be built: {state}")

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def describe_failure(self, what: str) -> str:
        # A worker that is exiting resets its end of the link a moment before its exit code can be read: give it
        # that moment, so the message names the exit rather than "still running" (only failures pay this wait).
        self.process.join(timeout=2.0)
        code = self.process.exitcode
        state = f"exited with code {code}" if code is not None else "is still running"
        return f"{what}: the prefill worker (pid {self.pid}) {state}"

    def send_prompt(self, seq_id: int, token_ids: list[int]) -> None:
        """Hand one prompt to the prefill worker (returns at once)."""
        if self.error is not None:
            raise TransferError(self.error)
        if self.link is None or not self.process.is_alive():
            self.error = self.describe_failure("cannot send a prompt")
            raise TransferError(self.error)
        tokens = torch.tensor(token_ids, dtype=torch.int64)
        self.link.send([header(Kind.PREFILL, seq_id, len(token_ids)), tokens], [HEADER_TAG, TOKENS_TAG])
        self.num_inflight += 1

    def poll(self) -> list[KVMessage | ErrorMessage]:
        """Every answer that has fully arrived, without waiting. Raises ``TransferError`` if the link broke."""
        messages: list[KVMessage | ErrorMessage] = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return messages
            messages.append(self._check(item))

    def wait(self, timeout_s: float | None = None) -> list[KVMessage | ErrorMessage]:
        """Block until at least one answer arrives (or ``timeout_s``, default the transfer timeout, passes)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while self.num_inflight:
            try:
                item = self._inbox.get(timeout=0.1)
            except queue.Empty:
                if not self.process.is_alive() and self._inbox.empty():
                    self.error = self.describe_failure("the KV transfer was cut off")
                    raise TransferError(self.error) from None
                if time.monotonic() > deadline:
                    self.error = self.describe_failure(f"no KV arrived within {self.timeout_s:g} s")
                    raise TransferError(self.error) from None
                continue
            return [self._check(item), *self.poll()]
        return []

    def _check(self, item: KVMessage | ErrorMessage | BaseException) -> KVMessage | ErrorMessage:
        if isinstance(item, BaseException):
            self.error = self.describe_failure(f"the KV transfer failed ({item})")
            raise TransferError(self.error) from item
        self.num_inflight -= 1
        self.prefill_blocks_in_use = item.prefill_blocks_in_use
        return item

    def measure_link(self, num_bytes: int) -> float:
        """Round-trip seconds of ``num_bytes`` over the link (no prompt may be out: answers share its tags)."""
        if self.num_inflight or self.link is None:
            raise RuntimeError("measure_link needs an idle link: finish or abort the running requests first")
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
