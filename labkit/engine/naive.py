"""Engine ``naive``: no KV cache, one request at a time, the whole sequence recomputed per token.

It is the baseline every later engine improves on: its step cost grows with the sequence length,
so generating n tokens costs O(n^2) token-positions of compute. Introduced in notebook 01
(``01_anatomy_of_a_request``) and dissected in notebook 02 (``02_naive_generation``).
"""

from __future__ import annotations

from collections import deque

import torch

from labkit.engine.base import Engine
from labkit.engine.config import EngineConfig
from labkit.engine.sampler import sample
from labkit.engine.step import StageClock
from labkit.model import CausalLM
from labkit.sequence import Sequence, SequenceStatus


class NaiveEngine(Engine):
    """Recompute-everything generation, FCFS, batch size 1. Notebooks 01-02."""

    name = "naive"

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        super().__init__(model, config)
        self.waiting: deque[Sequence] = deque()
        self.running: Sequence | None = None

    def add_request(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.running is not None or bool(self.waiting)

    def unfinished_sequences(self) -> list[Sequence]:
        return ([self.running] if self.running is not None else []) + list(self.waiting)

    def running_sequences(self) -> list[Sequence]:
        return [self.running] if self.running is not None else []

    def _drop(self, seq: Sequence) -> None:
        if self.running is seq:
            self.running = None
        if seq in self.waiting:
            self.waiting.remove(seq)

    @torch.inference_mode()
    def _step(self) -> list[Sequence]:
        clock = StageClock(self.device)
        with clock.stage("schedule"):
            if self.running is None and self.waiting:
                self.running = self.waiting.popleft()
                self.running.status = SequenceStatus.RUNNING
                self.running.metrics.first_scheduled_time = clock.start
        if self.running is None:
            return []
        seq = self.running
        self._before_forward([seq])
        is_prefill = seq.num_output_tokens == 0
        with clock.stage("prepare"):
            # The whole sequence, every time: this is what the KV cache will remove.
            ids = torch.tensor([seq.token_ids], dtype=torch.long, device=self.device)  # (1, T)
            positions = torch.arange(ids.shape[1], device=self.device)[None]  # (1, T)
        with clock.stage("forward"):
            hidden = self.model(ids, positions)  # (1, T, hidden)
            logits = self.model.compute_logits(hidden[:, -1])  # (1, vocab): only the last position is needed
        with clock.stage("sample"):
            token = sample(logits, [seq.params], [seq.generator])[0]
        with clock.stage("detokenize"):
            seq.append_token(token, clock.last)
            if seq.is_finished:
                self.running = None
        self.record_step(clock.start, clock.last, clock.times, num_seqs=1, num_computed_tokens=ids.shape[1],
                         num_new_tokens=1, num_prefill_tokens=0, is_prefill=is_prefill)
        return [seq]
