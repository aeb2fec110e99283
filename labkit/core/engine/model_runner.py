"""The model runner: turns a scheduled ragged batch into tensors, runs the model, samples (vLLM's model runner).

Shared by every paged engine (``paged``, ``continuous``, ``chunked``). The scheduler decides *which*
sequences run and *how many* new tokens each computes; the runner prepares input ids, positions and
the slot mapping, runs one forward pass, and samples for each sequence whose tokens are now all
computed (a prefill chunk that stops mid-prompt samples nothing). It touches no scheduler bookkeeping: the
scheduler's ``update_from_output`` takes the tokens back. With speculative decoding (notebook 13) it also holds the
proposer and the acceptance rule. Introduced in notebook 06.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from labkit.core.attention import PagedAttentionBackend, PagedAttentionMetadata, TorchAttentionBackend
from labkit.core.attention.decode import host_to_device
from labkit.core.engine.cuda_graphs import DecodeGraphs, capture_supported
from labkit.core.engine.decode_plan import DecodePlan
from labkit.core.engine.step import StageClock
from labkit.core.kv.block_manager import BlockManager
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model import CausalLM
from labkit.core.sampler import SamplerOutput, sample, sample_tokens
from labkit.core.sched.output import ModelRunnerOutput, SchedulerOutput
from labkit.core.sequence import Sequence
from labkit.core.spec_decode.metrics import SpecDecodingStats
from labkit.core.spec_decode.proposer import Proposer
from labkit.core.spec_decode.rejection_sampler import RejectionSampler


@dataclass
class StepInputs:
    """A prepared step: the device tensors and who samples. Notebook 06; async scheduling in notebook 10."""

    input_ids: torch.Tensor  # (1, N)
    positions: torch.Tensor  # (1, N)
    meta: PagedAttentionMetadata
    logits_rows: list[int]  # rows of the N tokens whose logits are sampled
    samplers: list[Sequence]  # the sequences those rows belong to, in order
    copies: list[tuple[int, int]]  # copy-on-write block copies to run before the forward pass
    # Async scheduling: (row, sequence) whose input token the previous step is still sampling.
    pending_rows: list[tuple[int, Sequence]] = field(default_factory=list)
    # A decode step that CUDA graphs replay: (B, 1 + W) context lengths, then block tables (``DecodeGraphs.run``).
    graph_meta: torch.Tensor | None = None
    logits_index: torch.Tensor | None = None  # logits_rows on the device


def new_token_ids(seq: Sequence, start: int, n: int) -> list[int]:
    """Ids of positions start..start+n-1: known tokens, then this step's proposals (speculative decoding). Under
    async scheduling the last may still be being sampled by the launched step: it is 0 here and
    ``ModelRunner.fill_pending`` writes it in on the device, from that step's sampled tokens, before the forward
    pass."""
    ids = seq.token_ids[start : start + n]
    if len(ids) < n and seq.spec_token_ids:
        ids += seq.spec_token_ids[: n - len(ids)]
    return ids + [0] * (n - len(ids))


def num_logits(seq: Sequence, start: int, n: int) -> int:
    """Rows of logits this step needs from ``seq``: none while a prefill is unfinished, else one per proposal
    (speculative decoding, notebook 13) plus the one that yields the next token."""
    caught_up = start + n == seq.num_tokens + seq.num_pending_tokens + len(seq.spec_token_ids)
    return 1 + len(seq.spec_token_ids) if caught_up else 0


SMALL_BATCH_TOKENS = 8  # below this many tokens the plain loop is cheaper than setting up array arithmetic


class ModelRunner:
    """Prepares inputs, runs the model over the paged pool, samples. Notebook 06.

    ``prepare_inputs`` chooses how the host builds a step's inputs: ``"loop"`` walks every new token in
    Python (one slot lookup each, the way notebook 06 explains it); ``"vectorized"`` does the same with a
    handful of array operations on the whole batch (the loop for tiny batches, where it is cheaper) and
    moves the inputs to the device in one copy. Notebook 10 measures the difference.
    """

    def __init__(self, model: CausalLM, pool: PagedKVPool, block_manager: BlockManager,
                 prepare_inputs: str = "vectorized",
                 attention_backend: type[PagedAttentionBackend] = TorchAttentionBackend,
                 drafter: Proposer | None = None, rejection_sampler: RejectionSampler | None = None) -> None:
        self.model = model
        self.attention_backend = attention_backend
        self.pool = pool
        self.block_manager = block_manager
        self.device = model.device
        self.prepare = self.prepare_vectorized if prepare_inputs == "vectorized" else self.prepare_loop
        self.graphs: DecodeGraphs | None = None
        self.decode_plan: DecodePlan | None = None  # CPU decode steps as prebuilt C++ calls (use_decode_plan)
        # Speculative decoding (notebook 13): who proposes, the rule that keeps or replaces proposals, how it went.
        self.drafter = drafter
        self.rejection_sampler = rejection_sampler or (RejectionSampler() if drafter is not None else None)
        self.spec_decoding_stats = SpecDecodingStats()

    def use_decode_graphs(self, sizes: tuple[int, ...], max_blocks: int, capture: bool | None = None) -> DecodeGraphs:
        """Run decode steps through ``DecodeGraphs``, every graph captured now (``capture``: default on CUDA; off
        CUDA the same padded path runs eagerly). The pool's last block (never allocated) is the scratch."""
        if self.pool.num_blocks <= self.block_manager.num_blocks:
            raise ValueError("decode graphs need a scratch block: the pool must be one block larger than the "
                             "block manager's")
        capture = capture_supported(self.device) if capture is None else capture
        self.graphs = DecodeGraphs(self.model, self.pool, sizes, max_blocks, self.pool.num_blocks - 1, capture,
                                   self.attention_backend)  # its graph_decode: "triton" captures its own kernel
        return self.graphs

    def use_decode_plan(self) -> DecodePlan:
        """Run the decode steps that qualify through a ``DecodePlan`` (CPU, float32, the "cpp" backend); the others,
        and every step while the plan cannot be built (it says why: ``why_not``), layer by layer."""
        self.decode_plan = DecodePlan(self.model)
        return self.decode_plan

    def close(self) -> None:
        """Release the graphs and the KV pool's memory (``LLM.close``); the runner cannot run a step afterwards."""
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        self.pool.k.clear()  # the pool's per-layer tensors: nothing else holds them between steps
        self.pool.v.clear()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device without making the host wait for the device's queue: on CUDA from pinned memory,
        non-blocking (async scheduling prepares the next step while the device still runs this one)."""
        return host_to_device(t, self.device)

    def prepare_loop(self, batch: SchedulerOutput) -> tuple[torch.Tensor, PagedAttentionMetadata, list[int]]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            ids += new_token_ids(seq, start, n)
            positions += range(start, start + n)
            slots += [self.block_manager.slot(seq, p) for p in range(start, start + n)]
            # Caught up: this step yields the next token (after verifying any proposals).
            logits_rows += range(len(ids) - num_logits(seq, start, n), len(ids))
        host = torch.tensor([ids, positions, slots], dtype=torch.long)  # (3, N): prepare_step moves it in one copy
        meta = PagedAttentionMetadata(
            query_lens=list(batch.num_new_tokens),
            context_lens=[s.num_computed_tokens + n for s, n in zip(batch.seqs, batch.num_new_tokens)],
            block_tables=[list(s.block_table) for s in batch.seqs],
            slot_mapping=host[2],
        )
        return host, meta, logits_rows

    def prepare_vectorized(self, batch: SchedulerOutput) -> tuple[torch.Tensor, PagedAttentionMetadata, list[int]]:
        if batch.num_batched_tokens <= SMALL_BATCH_TOKENS:
            return self.prepare_loop(batch)
        # NumPy, not torch, for the index arithmetic: each small torch op costs microseconds of dispatch.
        seqs, q_lens = batch.seqs, batch.num_new_tokens
        starts = [s.num_computed_tokens for s in seqs]
        ids = list(chain.from_iterable(new_token_ids(s, a, n) for s, a, n in zip(seqs, starts, q_lens)))
        tables = [list(s.block_table) for s in seqs]  # copies: the scheduler may extend them while this step runs
        width = max(len(t) for t in tables)
        table = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64)  # (B, max_blocks)
        q_len = np.array(q_lens, dtype=np.int64)  # (B,)
        ends = np.cumsum(q_len)  # (B,) one past each sequence's last new token
        row = np.repeat(np.arange(len(seqs)), q_len)  # (N,) which sequence each token belongs to
        pos = np.array(starts, dtype=np.int64)[row] + np.arange(len(ids)) - (ends - q_len)[row]  # (N,)
        slots = self.block_manager.slot_mapping(table[row], pos)  # (N,)
        rows_per_seq = np.array([num_logits(s, a, n) for s, a, n in zip(seqs, starts, q_lens)], dtype=np.int64)
        host = torch.from_numpy(np.stack([np.array(ids, dtype=np.int64), pos, slots]))  # (3, N) ids, positions, slots
        meta = PagedAttentionMetadata(
            query_lens=list(q_lens),
            context_lens=[a + n for a, n in zip(starts, q_lens)],
            block_tables=tables,
            slot_mapping=host[2],
        )
        if rows_per_seq.max() <= 1:  # no proposals: each sampling sequence's last token
            return host, meta, (ends[rows_per_seq == 1] - 1).tolist()
        return host, meta, list(chain.from_iterable(range(e - r, e) for e, r in zip(ends.tolist(), rows_per_seq)))

    def graph_rows(self, meta: PagedAttentionMetadata) -> np.ndarray:
        """(B, 1 + W) for a CUDA-graph decode step: each row's context length, then its block table padded with
        the scratch block to the step's widest table W."""
        assert self.graphs is not None
        width = max(len(t) for t in meta.block_tables)
        rows = np.full((len(meta.block_tables), 1 + width), self.graphs.scratch_block, dtype=np.int64)
        rows[:, 0] = meta.context_lens
        for i, t in enumerate(meta.block_tables):
            rows[i, 1 : 1 + len(t)] = t
        return rows

    def prepare_step(self, batch: SchedulerOutput) -> StepInputs:
        """Everything the device needs for one step, built on the host and moved in one (pinned) copy: ids,
        positions and slots, plus the context lengths and block tables of a step that CUDA graphs replay."""
        host, meta, logits_rows = self.prepare(batch)
        num_tokens, num_rows = host.shape[1], len(logits_rows)
        parts = [host.flatten(), torch.tensor(logits_rows, dtype=torch.long)]  # (3N,), (R,)
        graph_rows = self.graph_rows(meta) if self.graphs is not None and self.graphs.can_run(meta) else None
        if graph_rows is not None:
            parts.append(torch.from_numpy(graph_rows).flatten())  # (B (1 + W),)
        packed = self.to_device(torch.cat(parts))  # the step's one host -> device copy
        input_ids, positions, slots, logits_index, rest = packed.split([num_tokens] * 3 + [num_rows,
                                                                       packed.numel() - 3 * num_tokens - num_rows])
        meta.slot_mapping = slots  # (N,)
        graph_meta = rest.view(graph_rows.shape) if graph_rows is not None else None
        samplers, pending_rows, ends = [], [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            ends += n
            if num_logits(seq, seq.num_computed_tokens, n):
                samplers.append(seq)
            if seq.num_pending_tokens and seq.num_computed_tokens + n > seq.num_tokens:
                pending_rows.append((ends - 1, seq))  # its input is the token the launched step is sampling
        return StepInputs(input_ids[None], positions[None], meta, logits_rows, samplers, list(batch.copies),
                          pending_rows, graph_meta, logits_index)

    @staticmethod
    def fill_pending(inputs: StepInputs, prev_samplers: list[Sequence], prev_tokens: torch.Tensor) -> None:
        """Async scheduling: write the tokens the previous step sampled into this step's holes, device to device.
        ``prev_tokens`` (P_prev,) are that step's sampled tokens, one per sequence of ``prev_samplers``, still on
        the device: the host never waits for them here (it reads them only after this step is launched)."""
        if not inputs.pending_rows:
            return
        where = {id(s): i for i, s in enumerate(prev_samplers)}
        host = torch.tensor([[r, where[id(seq)]] for r, seq in inputs.pending_rows])  # (P, 2): hole, source
        rows, src = host_to_device(host, inputs.input_ids.device).unbind(1)  # one host -> device copy
        inputs.input_ids[0, rows] = prev_tokens[src]  # (P,) gathered and scattered on the device
        inputs.pending_rows = []

    @torch.inference_mode()
    def execute_model(self, batch: SchedulerOutput, clock: StageClock) -> ModelRunnerOutput:
        """One scheduled step (vLLM's ``execute_model``): proposals first (speculative decoding), then the inputs,
        one forward pass, and sampling (verifying the proposals) for every sequence that caught up."""
        draft_probs = None
        if self.drafter is not None:
            with clock.stage("propose"):
                draft_probs = self.drafter.propose_for_step(batch)
        with clock.stage("prepare"):
            inputs = self.prepare_step(batch)
        logits = self.forward(inputs, clock)
        with clock.stage("sample"):
            samplers = inputs.samplers
            if not samplers:
                return ModelRunnerOutput()
            if self.rejection_sampler is None or draft_probs is None:
                tokens = sample(logits, [s.params for s in samplers], [s.generator for s in samplers])
                return ModelRunnerOutput(samplers, [[t] for t in tokens])
            verified = self.rejection_sampler.verify_batch(logits, samplers, draft_probs)  # accepted, then one
            for seq, accepted in zip(samplers, verified):
                self.spec_decoding_stats.observe(len(seq.spec_token_ids), len(accepted) - 1)
            return ModelRunnerOutput(samplers, verified)

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, clock: StageClock) -> SamplerOutput:
        """The device's part of a prepared step: block copies, one forward pass, sampling, and the start of the
        sampled tokens' copy to the host (waited for by ``SamplerOutput.tolist`` alone). Touches no host
        bookkeeping, so async scheduling (notebook 10) runs it on a worker thread while the host plans the next."""
        logits = self.forward(inputs, clock)
        with clock.stage("sample"):
            samplers = inputs.samplers
            if logits is None or not samplers:  # a prefill chunk that stops mid-prompt samples nothing
                return SamplerOutput(torch.empty(0, dtype=torch.long, device=self.device))
            out = sample_tokens(logits, [s.params for s in samplers], [s.generator for s in samplers])
            return out.copy_to_host()  # queued right behind the sampling: the host may read it after the next launch

    def forward(self, inputs: StepInputs, clock: StageClock) -> torch.Tensor | None:
        """Block copies and one forward pass: (R, vocab) logits of the sampled rows, or None if none samples."""
        assert not inputs.pending_rows, "fill_pending before execute"
        with clock.stage("forward"):
            self.pool.copy_blocks(inputs.copies)
            meta, rows = inputs.meta, inputs.logits_rows
            if self.graphs is not None and inputs.graph_meta is not None:  # (1, B, hidden): replayed
                hidden = self.graphs.run(inputs.input_ids[0], inputs.positions[0], meta.slot_mapping, inputs.graph_meta)
            else:
                attention = self.attention_backend(self.pool, meta)
                plan = self.decode_plan
                if plan is not None and plan.applies(inputs.input_ids, attention) and plan.current():
                    hidden = plan.run(inputs.input_ids, inputs.positions, attention)  # type: ignore[arg-type]
                else:
                    hidden = self.model(inputs.input_ids, inputs.positions, attention)  # (1, N, hidden)
            index = inputs.logits_index if inputs.logits_index is not None else rows
            return self.model.compute_logits(hidden[0, index]) if rows else None  # (n_sampled, vocab)
