"""Engine ``paged``: static batching, with K/V in a paged pool instead of contiguous reservations.

Same policy as ``kvcache`` (a batch of up to ``max_num_seqs`` runs until its last request finishes;
freed slots are not refilled), but memory is handed out block by block as sequences grow, and
returned the moment a sequence finishes. The batch is ragged: no padding is computed. With
``enable_prefix_caching`` a prompt that starts like an earlier one reuses its blocks and skips that
part of the prefill. If the pool runs dry mid-batch, the most recently admitted sequence is
preempted (its blocks freed, recomputed later). Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from labkit.cache.block_manager import BlockManager
from labkit.cache.paged import PagedKVPool, kv_block_bytes
from labkit.engine.base import Engine, EngineConfig, StageClock, StepStats, debug_checks_default
from labkit.engine.model_runner import ModelRunner, ScheduledBatch
from labkit.model import CausalLM
from labkit.sequence import Sequence, SequenceStatus

CPU_KV_BUDGET = 1 << 30  # bytes: the CPU default when neither num_gpu_blocks nor kv_cache_memory is given


@dataclass
class PagedConfig(EngineConfig):
    """Options of the paged engines (vLLM's names; ``kv_cache_memory`` is a byte budget)."""

    max_num_seqs: int = 16
    block_size: int = 16
    num_gpu_blocks: int | None = None  # pool size in blocks; overrides the memory budget
    kv_cache_memory: int | None = None  # pool size in bytes (all layers, K and V)
    gpu_memory_utilization: float = 0.9  # on CUDA: share of free memory the pool may take
    enable_prefix_caching: bool = False
    # Check the block manager's books after every step (default: on when LABKIT_DEBUG_CHECKS=1, as in the tests).
    debug_checks: bool = field(default_factory=debug_checks_default)
    # Host-side options (notebook 10). "loop" is the per-token Python input preparation it starts from.
    prepare_inputs: str = "vectorized"
    enforce_eager: bool = True  # False: capture decode steps as CUDA graphs and replay them (CUDA only)
    cuda_graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # decode batch-size buckets
    async_scheduling: bool = False  # plan step N+1 while the device runs step N (continuous, chunked; notebook 10)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_gpu_blocks is not None and (not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks < 1):
            raise ValueError(f"num_gpu_blocks must be an int >= 1, got {self.num_gpu_blocks!r}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.prepare_inputs not in ("loop", "vectorized"):
            raise ValueError(f"prepare_inputs must be 'loop' or 'vectorized', got {self.prepare_inputs!r}")
        sizes = tuple(self.cuda_graph_sizes)
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"cuda_graph_sizes must be positive ints, got {self.cuda_graph_sizes!r}")
        self.cuda_graph_sizes = tuple(sorted(set(sizes)))


def pool_num_blocks(model: CausalLM, config: PagedConfig) -> int:
    """How many KV blocks fit the configured budget."""
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    block_bytes = kv_block_bytes(model.config, config.block_size, model.dtype)
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = int(free * config.gpu_memory_utilization)
    else:  # enough for every slot at full length, within a modest CPU budget
        assert config.max_model_len is not None
        budget = min(CPU_KV_BUDGET, config.max_num_seqs * config.max_model_len * block_bytes // config.block_size)
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block ({block_bytes} bytes each at "
                         f"block_size {config.block_size}); raise kv_cache_memory or num_gpu_blocks")
    return num_blocks


class PagedEngineBase(Engine):
    """Pool, block manager and model runner shared by ``paged``, ``continuous`` and ``chunked``."""

    config_class = PagedConfig
    config: PagedConfig

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        super().__init__(model, config)
        if not self.config.enforce_eager and model.device.type != "cuda":
            raise ValueError(f"enforce_eager=False needs a CUDA device (CUDA graphs hide GPU launch overhead); this "
                             f"engine runs on {model.device.type}. Notebook 10 shows the CPU-side fixes instead.")
        if self.config.async_scheduling and self.name == "paged":
            raise ValueError("async_scheduling=True needs an iteration-level scheduler: use engine 'continuous' or "
                             "'chunked' (engine 'paged' runs static batches)")
        self.num_blocks = pool_num_blocks(model, self.config)
        # One block more than the manager hands out: the scratch block padded CUDA-graph rows write to.
        self.pool = PagedKVPool(model.config, self.num_blocks + 1, self.config.block_size, model.device, model.dtype)
        self.block_manager = BlockManager(self.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.runner = ModelRunner(model, self.pool, self.block_manager, self.config.prepare_inputs)
        if not self.config.enforce_eager:
            assert self.config.max_model_len is not None
            max_blocks = self.block_manager.blocks_needed(self.config.max_model_len)
            self.runner.use_decode_graphs(self.config.cuda_graph_sizes, max_blocks)
        self.waiting: deque[Sequence] = deque()
        self.num_preemptions = 0

    def validate(self, seq: Sequence) -> None:
        """Reject a request that could never fit the pool, even alone (anything smaller completes, by
        waiting for memory or through preemption)."""
        bm, size = self.block_manager, self.config.block_size
        prompt_blocks = bm.blocks_needed(seq.num_prompt_tokens)
        if prompt_blocks > self.num_blocks:
            raise ValueError(
                f"the prompt alone needs {prompt_blocks} KV blocks ({seq.num_prompt_tokens} tokens at block_size "
                f"{size}) but the pool has only {self.num_blocks} ({self.num_blocks * size} tokens); shorten the "
                "prompt or give the engine more KV memory (num_gpu_blocks / kv_cache_memory)"
            )
        budget = seq.params.max_tokens if seq.params.max_tokens is not None else seq.max_model_len - seq.num_prompt_tokens
        # The last output token is sampled but never run through the model: it needs no KV slot.
        needed = bm.blocks_needed(seq.num_prompt_tokens + budget - 1)
        if needed > self.num_blocks:
            room = self.num_blocks * size - seq.num_prompt_tokens + 1
            raise ValueError(
                f"request needs {needed} KV blocks ({seq.num_prompt_tokens} prompt tokens + max_tokens {budget} at "
                f"block_size {size}) but the pool has only {self.num_blocks}; lower max_tokens to at most {room} "
                "or give the engine more KV memory (num_gpu_blocks / kv_cache_memory)"
            )

    def add_request(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def _finish(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def check_invariants(self) -> None:
        """Debug mode: the block manager's books balance, running sequences own exactly the blocks in use,
        waiting ones own none, and no finished sequence is left in a queue."""
        if not self.config.debug_checks:
            return
        running = self.running_sequences()
        running_ids = {id(s) for s in running}
        for seq in self.unfinished_sequences():
            assert not seq.is_finished, f"sequence {seq.seq_id} is finished but still queued"
            if id(seq) not in running_ids:
                assert not seq.block_table, f"waiting sequence {seq.seq_id} holds blocks {seq.block_table}"
        assert all(not s.is_finished for s in running), "a finished sequence is still running"
        self.block_manager.check_invariants(running)

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the sequence's K/V; it re-enters at the head of the queue."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _run(self, batch: ScheduledBatch, clock: StageClock, num_slots: int) -> list[Sequence]:
        num_prefill = batch.num_prefill_tokens  # before the runner advances num_computed_tokens
        self._before_forward(batch.seqs)
        results = self.runner.run(batch, clock)
        blocks_in_use = self.block_manager.num_used_blocks  # at the step's peak, before finished ones free theirs
        with clock.stage("detokenize"):
            for seq, token in results:
                seq.append_token(token, clock.last)
                if seq.is_finished:
                    self._finish(seq)
        self.step_stats.append(StepStats(
            step=len(self.step_stats), start=clock.start, end=clock.last, num_seqs=num_slots,
            num_computed_tokens=batch.num_batched_tokens, num_new_tokens=len(results), stage_times=clock.times,
            num_idle_slots=num_slots - len(batch), is_prefill=num_prefill > 0,
            num_prefill_tokens=num_prefill, kv_blocks_used=blocks_in_use,
            num_preemptions=self.num_preemptions,
        ))
        return [seq for seq, _ in results]

    def live_sequences(self) -> list[Sequence]:
        """The sequences holding KV blocks."""
        return self.running_sequences()


class PagedEngine(PagedEngineBase):
    """Static batches over the paged pool. Notebook 06."""

    name = "paged"

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.batch: list[Sequence] = []  # the static batch: its slots stay taken until all are done
        self.running: list[Sequence] = []  # rows of the batch that still hold blocks, in admission order

    def has_unfinished_requests(self) -> bool:
        return bool(self.batch) or bool(self.waiting)

    def unfinished_sequences(self) -> list[Sequence]:
        return [s for s in self.batch if not s.is_finished] + list(self.waiting)

    def running_sequences(self) -> list[Sequence]:
        return list(self.running)

    def _drop(self, seq: Sequence) -> None:
        # Its slot in the static batch stays taken (finished) until the whole batch is done.
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.block_manager.free(seq)
        if all(s.is_finished for s in self.batch):
            self.batch = []

    def _admit(self, now: float) -> None:
        """Form a new static batch: FCFS while slots and blocks for the prompts last."""
        bm = self.block_manager
        while self.waiting and len(self.batch) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.waits_for_parent and seq.parent in self.batch:
                # A parallel sample joins its parent's batch without blocks; it forks once the parent's
                # prompt is computed (see step).
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                seq.metrics.first_scheduled_time = now
                self.batch.append(seq)
                self.running.append(seq)
                continue
            cached = bm.lookup_prefix(seq)
            num_new = seq.num_tokens - len(cached) * bm.block_size
            if not bm.can_allocate(seq, num_new, cached):
                break
            self.waiting.popleft()
            bm.allocate(seq, num_new, cached)
            bm.record_prefix_query(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            self.batch.append(seq)
            self.running.append(seq)

    def _step(self) -> list[Sequence]:
        clock = StageClock(self.device)
        with clock.stage("schedule"):
            batch = self._schedule(clock.start)
        if batch is None:
            return []
        done = self._run(batch, clock, len(self.batch))
        self.running = [s for s in self.running if not s.is_finished]
        if not self.running:
            self.batch = []
        return done

    def _schedule(self, now: float) -> ScheduledBatch | None:
        """Rows of the static batch that compute this step (admitting a new batch when the last one is done)."""
        if not self.batch:
            self._admit(now)
            if not self.batch:
                return None
        bm = self.block_manager
        scheduled: list[Sequence] = []
        num_new: list[int] = []
        copies: list[tuple[int, int]] = []
        for seq in list(self.running):  # admission order: the newest rows are the first to give way
            if seq not in self.running:
                continue  # preempted a moment ago to make room for an older row
            if seq.can_fork:
                bm.fork(seq.parent, seq, seq.num_prompt_tokens - 1)  # type: ignore[arg-type]
            elif seq.waits_for_parent:
                continue  # its parent's prompt is still being computed
            n = seq.num_tokens - seq.num_computed_tokens
            while not bm.can_allocate(seq, n):
                victim = self.running.pop()
                self.batch.remove(victim)  # it leaves this batch and waits for the next one
                self.preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            copies += bm.allocate(seq, n)
            scheduled.append(seq)
            num_new.append(n)
        if not scheduled:
            return None
        return ScheduledBatch(scheduled, num_new, copies)
