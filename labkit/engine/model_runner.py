"""The model runner: turns a scheduled ragged batch into tensors, runs the model, samples.

Shared by every paged engine (``paged``, ``continuous``, ``chunked``). The scheduler decides *which*
sequences run and *how many* new tokens each computes; the runner prepares input ids, positions and
the slot mapping, runs one forward pass, and samples for each sequence whose tokens are now all
computed (a prefill chunk that stops mid-prompt samples nothing). Introduced in notebook 06.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.cache.block_manager import BlockManager
from labkit.cache.paged import PagedAttention, PagedAttentionMetadata, PagedKVPool
from labkit.engine.base import StageClock
from labkit.model import CausalLM
from labkit.sampler import sample
from labkit.sequence import Sequence


@dataclass
class ScheduledBatch:
    """What the scheduler hands the runner for one step. Notebook 06; built by schedulers in 07-08."""

    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence, tokens to compute this step
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(n for s, n in zip(self.seqs, self.num_new_tokens) if s.num_computed_tokens < s.num_prompt_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class ModelRunner:
    """Prepares inputs, runs the model over the paged pool, samples. Notebook 06."""

    def __init__(self, model: CausalLM, pool: PagedKVPool, block_manager: BlockManager) -> None:
        self.model = model
        self.pool = pool
        self.block_manager = block_manager
        self.device = model.device

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, PagedAttentionMetadata, list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [self.block_manager.slot(seq, p) for p in range(start, start + n)]
            if start + n == seq.num_tokens:  # caught up: this step yields the sequence's next token
                logits_rows.append(len(ids) - 1)
        meta = PagedAttentionMetadata(
            query_lens=list(batch.num_new_tokens),
            context_lens=[s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)],
            block_tables=[list(s.block_table) for s in batch.seqs],
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
        )
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, N)
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)  # (1, N)
        return input_ids, pos, meta, logits_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, clock: StageClock) -> list[tuple[Sequence, int]]:
        """One forward pass; returns (sequence, sampled token) for sequences that sample this step."""
        with clock.stage("prepare"):
            self.pool.copy_blocks(batch.copies)
            input_ids, positions, meta, logits_rows = self.prepare(batch)
        with clock.stage("forward"):
            hidden = self.model(input_ids, positions, PagedAttention(self.pool, meta))  # (1, N, hidden)
            logits = self.model.compute_logits(hidden[0, logits_rows]) if logits_rows else None  # (n_sampled, vocab)
        with clock.stage("sample"):
            samplers = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
            tokens = sample(logits, [s.params for s in samplers], [s.generator for s in samplers]) if logits is not None else []
            for seq, n in zip(batch.seqs, batch.num_new_tokens):
                seq.num_computed_tokens += n
                self.block_manager.cache_full_blocks(seq)
        return list(zip(samplers, tokens))
