"""The decode side of a KV transfer: the prompt's blocks arrive, and the request joins the running batch.

A request prefilled elsewhere reaches the decode worker as a buffer of KV blocks and its first token. Taking it
in is three moves, each on a part the colocated engine already has: the block manager allocates blocks for the
prompt (the decode worker's own ids: they need not match the prefill worker's), the buffer is written into those
blocks of the paged pool, layer by layer, and the sequence is admitted to the scheduler's running queue with its
prompt counted as computed, so the next step schedules it as a decode like any other. vLLM's KV connectors
(``kv_transfer_config``) do the same on its decode instances. Notebook 12's Build task writes ``receive_kv``.
Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

import time

import torch

from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.sched.scheduler import Scheduler
from labkit.core.sequence import Sequence, SequenceStatus


class KVReceiver:
    """Takes a transferred prompt's KV blocks into the decode worker's pool and admits the request. Notebook 12.

    ``LLM(..., engine="disaggregated", kv_receiver_cls=MyReceiver)`` runs a subclass's ``receive_kv`` instead.
    """

    def can_receive(self, scheduler: Scheduler, seq: Sequence) -> bool:
        """Whether the pool has the blocks for the prompt now (else the buffer waits for a later step)."""
        return scheduler.block_manager.can_allocate(seq, seq.num_prompt_tokens)

    def receive_kv(self, scheduler: Scheduler, pool: PagedKVPool, seq: Sequence, kv: torch.Tensor) -> None:
        """Allocate ``seq``'s prompt blocks, write ``kv`` into them, admit ``seq`` to the running batch.

        kv: (num_blocks, layers, 2, block_size, n_kv_heads, head_dim), block i of the prompt in row i (the last
        block padded). ``seq`` holds no blocks yet and its first token is already appended.
        """
        bm = scheduler.block_manager
        bm.allocate(seq, seq.num_prompt_tokens)  # fresh blocks for every prompt token
        table = torch.tensor(seq.block_table, device=pool.device)  # (num_blocks,)
        kv = kv.to(pool.device)
        for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
            k[table] = kv[:, layer, 0]  # (num_blocks, block_size, n_kv_heads, head_dim)
            v[table] = kv[:, layer, 1]
        seq.num_computed_tokens = seq.num_prompt_tokens
        bm.cache_full_blocks(seq)
        seq.status = SequenceStatus.RUNNING
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.perf_counter()
        scheduler.running.append(seq)
