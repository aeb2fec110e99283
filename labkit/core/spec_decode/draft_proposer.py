"""A draft model that costs nothing to ship: the target's own first layers (self-speculation, LayerSkip-style).

The draft is the target cut after ``draft_num_layers`` decoder layers, then the target's final norm and (tied)
head: no new weights, nothing to train or download, the same tokenizer by construction. It was chosen over a
separately trained draft because only the bundled model's weights may ship and training one takes minutes, not
seconds. Its quality is whatever the early exit gives; notebook 13 measures its acceptance rate.

Its KV needs no memory of its own. Draft layer i *is* target layer i, so for every token the target has computed,
the target's cache already holds exactly the K/V the draft would compute: the draft reads them from the same
blocks. Its only writes are its k guesses, into the slots (already reserved for this step) that the target's
verification pass overwrites before it reads them. Introduced in notebook 13 (``13_speculative_decoding``).
"""

from __future__ import annotations

import torch

from labkit.core.attention import PagedAttentionBackend, PagedAttentionMetadata
from labkit.core.attention.decode import host_to_device
from labkit.core.kv.block_manager import BlockManager
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model import CausalLM
from labkit.core.model.attention import AttentionBackend
from labkit.core.sampler import draw
from labkit.core.sched.output import SchedulerOutput
from labkit.core.sequence import Sequence
from labkit.core.spec_decode.proposer import DraftProposal, Proposer
from labkit.core.spec_decode.rejection_sampler import probs_under_params


class TruncatedDraft:
    """The target's embeddings, first ``num_layers`` layers, final norm and head, shared (not copied). Notebook 13."""

    def __init__(self, target: CausalLM, num_layers: int) -> None:
        self.target = target
        self.layers = list(target.model.layers)[:num_layers]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: (1, B) -> logits (B, V)."""
        body = self.target.model
        x = body.embed_tokens(input_ids)  # (1, B, hidden)
        cos, sin = body.rotary_emb.cos_sin(positions, x.dtype)
        for layer in self.layers:  # layer i keeps its layer_idx: it reads and writes the pool's layer i
            x = layer(x, cos, sin, backend)
        return self.target.compute_logits(body.norm(x)[0])  # (B, V)


class DraftModelProposer(Proposer):
    """k autoregressive draft steps over the paged pool, batched across the step's decodes. Notebook 13."""

    def __init__(self, target: CausalLM, num_layers: int, pool: PagedKVPool, block_manager: BlockManager,
                 attention_backend: type[PagedAttentionBackend]) -> None:
        self.draft = TruncatedDraft(target, num_layers)
        self.pool = pool
        self.block_manager = block_manager
        self.attention_backend = attention_backend

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int], out: SchedulerOutput) -> list[DraftProposal]:
        # Copy-on-write first: the draft reads the blocks this step's copies fill (the target repeats them, harmless).
        self.pool.copy_blocks(out.copies)
        guesses: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(num_tokens)):
            active = [i for i, k in enumerate(num_tokens) if k > j]
            batch = [seqs[i] for i in active]
            ids = [s.token_ids[-1] if j == 0 else guesses[i][-1] for i, s in zip(active, batch)]
            positions = [s.num_computed_tokens + j for s in batch]  # the last known token sits at num_computed
            slots = [self.block_manager.slot(s, p) for s, p in zip(batch, positions)]
            host = torch.tensor([ids, positions, slots], dtype=torch.long)  # (3, B)
            ids_d, pos_d, slots_d = host_to_device(host, self.pool.device).unbind(0)
            meta = PagedAttentionMetadata(query_lens=[1] * len(batch), context_lens=[p + 1 for p in positions],
                                          block_tables=[list(s.block_table) for s in batch], slot_mapping=slots_d)
            logits = self.draft(ids_d[None], pos_d[None], self.attention_backend(self.pool, meta))  # (B, V)
            greedy = logits.argmax(-1).tolist()  # (B,) one transfer for every greedy row
            for row, (i, seq) in enumerate(zip(active, batch)):
                if seq.params.greedy:  # q is a point mass on the argmax: the rejection sampler builds it
                    guesses[i].append(greedy[row])
                    continue
                q = probs_under_params(logits[row : row + 1], seq.params)[0]  # (V,)
                guesses[i].append(int(draw(q, seq.generator)))
                probs[i].append(q)
        return [DraftProposal(g, torch.stack(p) if p else None) for g, p in zip(guesses, probs)]
