"""Engine ``kvcache``: prefill once, then decode one token per step from a contiguous KV cache.

Requests run in *static* batches of up to ``max_num_seqs``: prompts are left-padded to the longest,
the batch's first step prefills every prompt in one forward pass, and each later step decodes one
token for every row. A batch runs until its slowest request finishes; finished rows keep their
slot and are still computed (their tokens are thrown away). That waste is the lesson of notebook 05.
``prepare_prefill`` (left padding, positions, the padding mask) is the method notebook 05's Task 2 replaces in a
subclass passed as ``LLM(..., engine=MyEngine)``. Introduced in notebook 03 (``03_kv_cache``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from labkit.core.attention.decode import host_to_device
from labkit.core.engine.base import Engine
from labkit.core.engine.config import EngineConfig, KVCacheConfig
from labkit.core.engine.step import StageClock
from labkit.core.kv.contiguous import ContiguousKVCache
from labkit.core.model import CausalLM
from labkit.core.sampler import sample
from labkit.core.sched.stop import append_token
from labkit.core.sequence import Sequence, SequenceStatus


@dataclass
class StaticBatch:
    """The rows of one static batch and their cache."""

    seqs: list[Sequence]
    cache: ContiguousKVCache
    prefilled: bool = False


class KVCacheEngine(Engine):
    """Static batching over a contiguous KV cache. Notebooks 03 and 05."""

    name = "kvcache"
    config_class = KVCacheConfig
    config: KVCacheConfig

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        super().__init__(model, config)
        self.waiting: deque[Sequence] = deque()
        self.batch: StaticBatch | None = None

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    def add_request(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished_requests(self) -> bool:
        return self.batch is not None or bool(self.waiting)

    def unfinished_sequences(self) -> list[Sequence]:
        return self.running_sequences() + list(self.waiting)

    def running_sequences(self) -> list[Sequence]:
        return [s for s in self.batch.seqs if not s.is_finished] if self.batch is not None else []

    def _drop(self, seq: Sequence) -> None:
        # A row of the running batch stays in it, idle, like any finished row: the cache is shaped for it.
        if seq in self.waiting:
            self.waiting.remove(seq)
        if self.batch is not None and all(s.is_finished for s in self.batch.seqs):
            self.batch = None

    def _reserved_len(self, seq: Sequence, prompt_cols: int) -> int:
        """Columns a row may need: the padded prompt plus its whole output budget."""
        budget = seq.params.max_tokens
        if budget is None:
            budget = seq.max_model_len - seq.num_prompt_tokens
        return prompt_cols + budget

    def _start_batch(self, now: float) -> StaticBatch:
        seqs = [self.waiting.popleft() for _ in range(min(self.config.max_num_seqs, len(self.waiting)))]
        self._scheduled = seqs  # if reserving their cache fails, they fail (rather than vanish)
        prompt_cols = max(s.num_prompt_tokens for s in seqs)
        max_len = max(self._reserved_len(s, prompt_cols) for s in seqs)
        cache = self.config.kv_cache_cls(self.model.config, len(seqs), max_len, self.device, self.model.dtype)
        for s in seqs:
            s.status = SequenceStatus.RUNNING
            s.metrics.first_scheduled_time = now
        return StaticBatch(seqs, cache)

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs of a static batch's first step: every prompt, left-padded to the longest. Notebook 05's Task 2.

        Returns ``(ids, positions, valid)``, each (B, T) with T the longest prompt: token ids, each token's position
        in its own sequence, and False where a column is padding. The engine moves them to its device.
        """
        cols = max(s.num_prompt_tokens for s in seqs)
        ids = torch.zeros(len(seqs), cols, dtype=torch.long)  # (B, T)
        valid = torch.zeros(len(seqs), cols, dtype=torch.bool)  # (B, T)
        for i, s in enumerate(seqs):  # left padding: the last prompt token of every row is column T-1
            ids[i, cols - s.num_prompt_tokens :] = torch.tensor(s.prompt_token_ids)
            valid[i, cols - s.num_prompt_tokens :] = True
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)  # (B, T): 0, 1, 2... from each row's first real token
        return ids, positions, valid

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inputs of a decode step: each row's newest token at its position, as (B, 1) ids, positions, valid."""
        # Finished rows still feed their last token: the slot is computed whether or not anyone wants it.
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.long)  # (B, 1)
        positions = torch.tensor([[s.num_tokens - 1] for s in seqs], dtype=torch.long)  # (B, 1)
        valid = torch.ones(len(seqs), 1, dtype=torch.bool)  # (B, 1)
        return ids, positions, valid

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Start a static batch if none runs (its prefill), else decode one token for every row."""
        with self.step_context():
            clock = StageClock(self.device)
            with clock.stage("schedule"):
                if self.batch is None and self.waiting:
                    self.batch = self._start_batch(clock.start)
            if self.batch is None:
                return []
            batch = self.batch
            # Every unfinished row runs this step; a fault leaves the shared cache half-written, so it fails them all.
            self._before_forward([s for s in batch.seqs if not s.is_finished])
            is_prefill = not batch.prefilled
            with clock.stage("prepare"):
                inputs = self.prepare_prefill(batch.seqs) if is_prefill else self.prepare_decode(batch.seqs)
                ids, positions, valid = (host_to_device(t, self.device) for t in inputs)  # each (B, T); pinned on CUDA
                batch.cache.begin_step(valid)
            with clock.stage("forward"):
                hidden = self.model(ids, positions, batch.cache)  # (B, T, hidden)
                batch.cache.end_step(ids.shape[1])
                batch.prefilled = True
                logits = self.model.compute_logits(hidden[:, -1])  # (B, vocab): every row's newest token is last
            with clock.stage("sample"):
                active = [s for s in batch.seqs if not s.is_finished]
                rows = [i for i, s in enumerate(batch.seqs) if not s.is_finished]
                tokens = sample(logits[rows], [s.params for s in active], [s.generator for s in active])
            with clock.stage("detokenize"):
                for seq, token in zip(active, tokens):
                    append_token(seq, token, clock.last)
                num_pad = int((~valid).sum())
                idle = len(batch.seqs) - len(active)
                if all(s.is_finished for s in batch.seqs):
                    self.batch = None
            self.record_step(clock.start, clock.last, clock.times, num_seqs=len(batch.seqs),
                             num_computed_tokens=ids.numel(), num_new_tokens=len(active), num_prefill_tokens=0,
                             num_padding_tokens=num_pad, num_idle_slots=idle, is_prefill=is_prefill)
            return active
