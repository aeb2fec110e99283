"""The link between the decode worker and the prefill worker: two ranks of a ``torch.distributed`` gloo group.

Nothing here is a home-made protocol: every message is a ``send``/``recv`` of tensors on a gloo process group
(rank 0: the decode worker, in the ``LLM``'s process; rank 1: the prefill worker, a spawned process), over TCP
on 127.0.0.1. The group is built directly (``ProcessGroupGloo`` on a ``TCPStore``), not through
``init_process_group``, so no process-wide default group exists and several engines can live side by side.

A message is a fixed-size int64 header (``HEADER_LEN`` numbers, the first is its ``Kind``) followed by the
tensors that kind announces, each on its own tag, so the receiver always knows their shapes before posting them:

- decode -> prefill: ``PREFILL`` (request id, prompt length; then the prompt's token ids), ``ECHO`` (a byte count;
  then that many bytes, sent straight back: the link's measured bandwidth), ``STOP``;
- prefill -> decode: ``KV`` (request id, prompt length, number of blocks, timings; then the request's KV blocks
  ``(num_blocks, layers, 2, block_size, n_kv_heads, head_dim)`` and the last prompt position's logits), ``ERROR``
  (request id, message length; then the message as bytes), ``ECHO``.

Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

import datetime
import enum
import time

import torch
import torch.distributed as dist

HEADER_LEN = 8
DECODE_RANK, PREFILL_RANK = 0, 1
HEADER_TAG, TOKENS_TAG, KV_TAG, LOGITS_TAG, BYTES_TAG = range(1, 6)


class Kind(enum.IntEnum):
    """What a message is, the first number of its header. Notebook 12."""

    PREFILL = 1
    KV = 2
    ERROR = 3
    ECHO = 4
    STOP = 5


class TransferError(RuntimeError):
    """The link to the prefill worker failed (the worker died, or a message never arrived). Notebook 12."""


def header(kind: Kind, *fields: int) -> torch.Tensor:
    """A message header: (HEADER_LEN,) int64, the kind first, then up to HEADER_LEN - 1 numbers."""
    assert len(fields) < HEADER_LEN, f"a header holds at most {HEADER_LEN - 1} fields"
    values = [int(kind), *fields] + [0] * (HEADER_LEN - 1 - len(fields))
    return torch.tensor(values, dtype=torch.int64)


def direction_tag(tag: int, sender: int) -> int:
    """Each direction has its own tags: gloo mixes up a send and a receive posted on one tag at the same time."""
    return tag + 16 * sender


def now_ns() -> int:
    """``time.perf_counter`` in nanoseconds: on Linux the monotonic clock, the same in both processes."""
    return time.perf_counter_ns()


def open_store(rank: int, port: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous: rank 0 serves it on 127.0.0.1 (``port`` 0: any free port, read back from ``store.port``)."""
    return dist.TCPStore("127.0.0.1", port, 2, rank == DECODE_RANK, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


# gloo ends a receive that waits longer than the group's timeout, and both ends always have one posted (the next
# message's header): a link idle for that long (a notebook left open) would break. So the group's timeout is this;
# liveness comes from watching the process (labkit.core.engine.workers) and the transfer timeout, counted by the
# decode worker from the last answer while prompts are out.
LINK_IDLE_TIMEOUT = datetime.timedelta(days=30)


def open_group(store: dist.Store, rank: int) -> dist.ProcessGroup:
    """A two-rank gloo group whose sockets bind to 127.0.0.1 only (forming it waits on ``store``'s timeout)."""
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = LINK_IDLE_TIMEOUT
    return dist.ProcessGroupGloo(store, rank, 2, options)


class Link:
    """One end of the decode <-> prefill link: sends that keep their tensors alive until done, and receives
    that can be polled (``Work.is_completed``) so the decode worker never blocks on the prefill worker. Notebook 12.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.peer = PREFILL_RANK if rank == DECODE_RANK else DECODE_RANK
        self._sends: list[tuple[dist.Work, list[torch.Tensor]]] = []
        self.num_bytes_sent = 0

    def send(self, tensors: list[torch.Tensor], tags: list[int]) -> None:
        """Post sends of ``tensors`` (contiguous CPU tensors) in order; finished ones are let go of as we go."""
        for t, tag in zip(tensors, tags):
            t = t.contiguous()
            self._sends.append((self.group.send([t], self.peer, direction_tag(tag, self.rank)), [t]))
            self.num_bytes_sent += t.numel() * t.element_size()
        self._sends = [(w, ts) for w, ts in self._sends if not w.is_completed()]

    def flush(self) -> None:
        """Wait for every posted send (raises if the peer is gone)."""
        sends, self._sends = self._sends, []
        for work, _ in sends:
            work.wait()

    def recv(self, like: torch.Tensor, tag: int) -> tuple[dist.Work, torch.Tensor]:
        """Post a receive into ``like`` (an empty tensor of the expected shape and dtype)."""
        return self.group.recv([like], self.peer, direction_tag(tag, self.peer)), like

    def recv_now(self, like: torch.Tensor, tag: int) -> torch.Tensor:
        work, t = self.recv(like, tag)
        work.wait()
        return t
