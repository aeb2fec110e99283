"""Engine ``disaggregated``: prefill and decode on two workers, in two processes, KV moved between them.

DistServe's and Splitwise's idea (vLLM ships it as disaggregated prefilling with KV connectors): a long prompt
on the same worker as running decodes makes them wait (notebook 08's stall, which chunking only softens), so the
prompts run on a prefill worker and the decodes on a decode worker, and the prompt's KV cache moves between them.

The decode worker is this engine, in the ``LLM``'s process: ``chunked``'s pool, block manager, scheduler and
model runner, whose running batch only ever holds decodes (and the recompute of a preempted request). A new
request is handed to the prefill worker (``PrefillClient``, another process on a gloo link); when its KV blocks
and last logits come back, the first token is sampled here with the request's own generator, the blocks are
taken in by ``KVReceiver.receive_kv`` (allocate, write, admit), and it decodes with the others from the next
step on. The prefill worker never holds the decode worker up: its answers are polled between decode steps.

A failed prefill fails its request only, with the prefill worker's error. A dead prefill worker (or a broken link)
ends the engine as vLLM's ``EngineDeadError`` does: the requests on their way through it fail with that error,
the ones whose KV had already arrived decode to the end, and every later request is refused
(``death_cause``, ``LLM.is_alive``). The prefill worker is started before this engine sizes its KV pool, so on
one device the worker's weights, pool and warm-up prefill are already in place (issue 37's memory item).
Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from labkit.core.disagg.client import ErrorMessage, KVMessage, PrefillClient
from labkit.core.disagg.config import DisaggregatedConfig
from labkit.core.disagg.transfer import TransferError
from labkit.core.engine.engine_core import EngineCore
from labkit.core.engine.errors import EngineDeadError
from labkit.core.model import CausalLM
from labkit.core.sampler import sample
from labkit.core.sched.stop import append_token
from labkit.core.sequence import Sequence


@dataclass
class TransferRecord:
    """One request's trip through the prefill worker (perf_counter seconds, comparable across the two processes
    on Linux). Notebook 12."""

    seq_id: int
    num_prompt_tokens: int
    num_bytes: int  # KV bytes moved (whole blocks, all layers, K and V)
    sent: float  # the prompt left the decode worker
    prefill_start: float
    prefill_end: float
    send_start: float  # the KV left the prefill worker
    received: float  # the KV was in the decode worker's hands
    admitted: float | None = None  # it joined the running batch (None: finished on its first token, or dropped)

    @property
    def transfer_time(self) -> float:
        """Seconds from the prefill worker's send to the last byte in the decode worker's receiver thread (the
        decode loop takes it over at its next step boundary: ``admitted``)."""
        return self.received - self.send_start


class DisaggregatedEngine(EngineCore):
    """The decode worker, driving a prefill worker in another process. Notebook 12."""

    name = "disaggregated"
    config_class = DisaggregatedConfig
    config: DisaggregatedConfig
    def __init__(self, model: CausalLM, config: DisaggregatedConfig) -> None:
        config.enable_chunked_prefill = True  # only a preempted request is prefilled here (recomputed), in chunks
        assert config.max_model_len is not None
        # The prefill worker first: on a shared device its weights (a second copy), its KV pool and its warm-up
        # prefill then count as another process's memory when EngineCore sizes this engine's pool.
        self.client = PrefillClient(model, config.block_size, config.max_model_len, config.attention_backend,
                                    config.prefill_worker_cls, config.transfer_timeout_s, config.prefill_num_threads,
                                    config.worker_join_timeout_s)
        try:
            super().__init__(model, config)
        except BaseException:
            self.client.close()
            raise
        self.receiver = config.kv_receiver_cls()
        self.to_prefill: deque[Sequence] = deque()  # waiting for a free prefill slot
        self.in_transit: dict[int, tuple[Sequence, float]] = {}  # seq_id -> (sequence, when it was sent)
        self.arrived: deque[tuple[Sequence, torch.Tensor, TransferRecord]] = deque()  # KV here, blocks not yet
        self.transfers: list[TransferRecord] = []

    def death_cause(self) -> str | None:
        """Why this engine cannot take new requests (its prefill worker is gone), or None while it can. Safe to call
        from any thread; ``LLM.is_alive`` and the server's ``/health`` ask it."""
        return self.client.death_cause()

    # ---- the queues: the scheduler's, plus the requests on their way through the prefill worker ----

    def add_request(self, seq: Sequence) -> None:
        self.to_prefill.append(seq)

    def unfinished_sequences(self) -> list[Sequence]:
        travelling = [s for s, _ in self.in_transit.values() if not s.is_finished]
        return (self.scheduler.unfinished_sequences() + [s for s, _, _ in self.arrived] + travelling
                + list(self.to_prefill))

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished_sequences())

    def _drop(self, seq: Sequence) -> None:
        """Out of every queue, its blocks back. One still in transit stays listed until its KV arrives (then the
        KV is dropped): the link must read every answer it was sent."""
        self.scheduler.finish_request(seq)
        self.to_prefill = deque(s for s in self.to_prefill if s is not seq)
        self.arrived = deque(a for a in self.arrived if a[0] is not seq)

    @property
    def prefill_blocks_in_use(self) -> int:
        """The prefill worker's used KV blocks, as of its last answer (0 when nothing leaked there)."""
        return self.client.prefill_blocks_in_use

    def measure_link(self, num_bytes: int) -> float:
        """Round-trip seconds of ``num_bytes`` to the prefill worker and back over the gloo link (engine idle)."""
        while self.client.num_inflight and self.client.error is None:  # answers for aborted requests, on their way
            self._take(self.client.wait(), time.perf_counter(), [], [])
        return self.client.measure_link(num_bytes)

    def close(self) -> None:
        """Abort what still runs, stop the prefill process, release the KV pool. Safe to repeat."""
        super().close()
        self.client.close()

    # ---- one step ----

    def step(self) -> list[Sequence]:
        """Take the prefill worker's answers (first tokens, KV into the pool), hand it new prompts, then one decode
        step (``EngineCore.step``, run inside this step) for the running batch. Once the worker is gone the
        requests still on their way through it fail with ``EngineDeadError``; the received ones decode on."""
        with self.step_context():
            now = time.perf_counter()
            done: list[Sequence] = []
            failed: list[tuple[Sequence, str]] = []
            self._take(self.client.poll(), now, done, failed)  # also the per-step liveness check
            self._admit_arrived()
            if self.client.error is None:
                self._dispatch()
            if (self.client.error is None and not self.scheduler.has_unfinished_requests() and not done
                    and self.client.num_inflight):
                self._take(self.client.wait(), time.perf_counter(), done, failed)  # nothing to decode meanwhile
                self._admit_arrived()
            dead = self.client.error
            if dead is not None:  # everything still on its way through the prefill worker is lost
                lost = [s for s, _ in self.in_transit.values() if not s.is_finished] + list(self.to_prefill)
                self.in_transit.clear()
                self.to_prefill.clear()
                failed += [(s, dead) for s in lost]
            if failed:
                # The step fails its sequences: these, and the ones that finished on their first token.
                self._scheduled = [s for s, _ in failed] + [s for s in done if s.is_finished]
                if dead is not None and all(why == dead for _, why in failed):
                    raise EngineDeadError(dead)
                reasons = "; ".join(sorted({why for _, why in failed}))
                raise TransferError(f"{len(failed)} request(s) could not be prefilled: {reasons}")
            if self.scheduler.has_unfinished_requests():
                seen = {id(s) for s in done}
                done += [s for s in super().step() if id(s) not in seen]  # one admitted now may decode at once
            return done

    def _dispatch(self) -> None:
        """Hand waiting prompts to the prefill worker, up to ``max_num_inflight_prefills`` out at once. Their
        forward pass runs there: the fault hook sees them here, as every engine's hook sees a step's sequences."""
        free = self.config.max_num_inflight_prefills - self.client.num_inflight
        batch = list(self.to_prefill)[: max(free, 0)]
        if not batch:
            return
        self._before_forward(batch)  # a fault raised here fails these prompts only
        self._scheduled = None
        for seq in batch:
            try:
                self.client.send_prompt(seq.seq_id, seq.prompt_token_ids)
            except TransferError:
                return  # the link is gone (client.error says why): the step fails what is left
            self.to_prefill.popleft()
            self.in_transit[seq.seq_id] = (seq, time.perf_counter())

    def _take(self, messages: list[KVMessage | ErrorMessage], now: float, done: list[Sequence],
              failed: list[tuple[Sequence, str]]) -> None:
        """Answers from the prefill worker: sample each first token; KV waits in ``arrived`` for its blocks."""
        for msg in messages:
            seq, sent = self.in_transit.pop(msg.seq_id)
            if isinstance(msg, ErrorMessage):
                if not seq.is_finished:
                    failed.append((seq, f"request {seq.seq_id}'s prefill failed on the prefill worker: {msg.message}"))
                continue
            record = TransferRecord(seq.seq_id, seq.num_prompt_tokens, msg.num_bytes, sent, msg.prefill_start,
                                    msg.prefill_end, msg.send_start, msg.received)
            self.transfers.append(record)
            if seq.is_finished:  # aborted while its prompt was away: the KV is dropped
                continue
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = msg.prefill_start
            expected = self.block_manager.blocks_needed(seq.num_prompt_tokens)
            if msg.kv.shape[0] != expected:
                failed.append((seq, f"request {seq.seq_id}'s KV arrived as {msg.kv.shape[0]} blocks, expected "
                                    f"{expected} for {seq.num_prompt_tokens} prompt tokens"))
                continue
            # The logits arrived on the CPU (over gloo); the request's generator lives on this engine's device.
            token = sample(msg.logits[None].to(self.device), [seq.params], [seq.generator])[0]
            append_token(seq, token, time.perf_counter())
            done.append(seq)
            if not seq.is_finished:  # a request that ends on its first token needs no decode blocks
                self.arrived.append((seq, msg.kv, record))

    def _admit_arrived(self) -> None:
        """Received KV into the pool, oldest first, while blocks are free (FCFS: the first that waits stops it)."""
        while self.arrived and len(self.scheduler.running) < self.config.max_num_seqs:
            seq, kv, record = self.arrived[0]
            if not self.receiver.can_receive(self.scheduler, seq):
                break
            self.arrived.popleft()
            self.receiver.receive_kv(self.scheduler, self.pool, seq, kv)
            record.admitted = time.perf_counter()
