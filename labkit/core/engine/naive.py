"""Engine ``naive``: no KV cache, one request at a time, the whole sequence recomputed per token.

It is the baseline every later engine improves on: its step cost grows with the sequence length,
so generating n tokens computes O(n^2) token positions. Each step is two overridable methods: ``next_token``
(one forward pass over the whole sequence, then the sampler on the last position's logits) and ``check_stop`` (the
stop rule, ``labkit.core.sched.stop``); notebook 02's Tasks 2 and 3 write them, in a subclass passed as
``LLM(..., engine=MyEngine)``. Introduced in notebook 01 (``01_anatomy_of_a_request``) and dissected in
notebook 02 (``02_naive_generation``).
"""

from __future__ import annotations

from collections import deque

import torch

from labkit.core.engine.base import Engine
from labkit.core.engine.config import EngineConfig
from labkit.core.engine.step import StageClock
from labkit.core.model import CausalLM
from labkit.core.sampler import sample
from labkit.core.sched.stop import StopDecision, check_stop, finish
from labkit.core.sequence import FinishReason, Sequence, SequenceStatus


class NaiveEngine(Engine):
    """Recompute-everything generation, FCFS, batch size 1. Notebooks 01-02."""

    name = "naive"

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        super().__init__(model, config)
        self.waiting: deque[Sequence] = deque()
        self.running: Sequence | None = None
        self.clock = StageClock(self.device)  # the running step's stage timer (next_token may time its stages on it)

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

    def next_token(self, seq: Sequence) -> int:
        """The next token of ``seq``: one forward pass over its whole sequence, then the sampler (greedy or sampled
        with ``seq.params`` and ``seq.generator``) on the last position's logits. Notebook 02's Task 2."""
        with self.clock.stage("prepare"):
            # The whole sequence, every time: this is what the KV cache will remove.
            ids = torch.tensor([seq.token_ids], dtype=torch.long, device=self.device)  # (1, T)
            positions = torch.arange(ids.shape[1], device=self.device)[None]  # (1, T)
        with self.clock.stage("forward"):
            hidden = self.model(ids, positions)  # (1, T, hidden)
            logits = self.model.compute_logits(hidden[:, -1])  # (1, vocab): only the last position is needed
        with self.clock.stage("sample"):
            return sample(logits, [seq.params], [seq.generator])[0]

    def check_stop(self, seq: Sequence) -> StopDecision | None:
        """Whether ``seq`` is done now that its newest token is recorded: (finish reason, stop reason), or None
        to go on. The stop rule is ``labkit.core.sched.stop.check_stop``; notebook 02 plugs the learner's in here."""
        return check_stop(seq)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Admit the next request if none runs, then one forward pass over its whole sequence and one new token."""
        with self.step_context():
            clock = self.clock = StageClock(self.device)
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
            num_computed = seq.num_tokens  # the whole sequence goes through the model
            token = self.next_token(seq)
            if "forward" not in clock.times:  # a next_token that times no stages of its own: all of it is the forward
                with clock.stage("forward"):
                    pass
            with clock.stage("detokenize"):
                seq.record_token(token, clock.last)
                stop = self.check_stop(seq)
                if stop is not None:
                    reason, stop_reason = stop
                    finish(seq, FinishReason(reason), stop_reason, clock.last)
                    self.running = None
            self.record_step(clock.start, clock.last, clock.times, num_seqs=1, num_computed_tokens=num_computed,
                             num_new_tokens=1, num_prefill_tokens=0, is_prefill=is_prefill)
            return [seq]
