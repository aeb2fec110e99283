"""The engine core shared by ``paged``, ``continuous`` and ``chunked``: a paged KV pool, a block manager, a
scheduler and a model runner, wired together.

Each step: the scheduler picks the sequences and their new-token counts (``SchedulerOutput``), the model
runner prepares inputs and runs the model through the attention backend, and the sampled tokens are
appended (finished sequences leave and return their blocks). The three engines differ only in their
scheduler class. Every part is pluggable with vLLM's option names (``scheduler_cls``,
``block_manager_cls``, ``attention_backend``): the learner's class is the one that runs.
Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from typing import ClassVar

from labkit.core.attention import resolve_attention_backend
from labkit.core.engine.base import Engine
from labkit.core.engine.config import EngineConfig, PagedConfig
from labkit.core.engine.kv_sizing import pool_num_blocks
from labkit.core.engine.model_runner import ModelRunner
from labkit.core.engine.step import StageClock
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model import CausalLM
from labkit.core.sched.output import SchedulerOutput
from labkit.core.sched.scheduler import Scheduler
from labkit.core.sequence import Sequence
from labkit.core.spec_decode.metrics import SpecDecodingStats
from labkit.core.spec_decode.proposer import Proposer
from labkit.core.spec_decode.rejection_sampler import RejectionSampler


class EngineCore(Engine):
    """Pool, block manager, scheduler and model runner; one synchronous step at a time. Notebook 06."""

    config_class = PagedConfig
    config: PagedConfig
    scheduler_cls: ClassVar[type[Scheduler]] = Scheduler  # the engine's own, unless scheduler_cls is given
    enable_chunked_prefill: ClassVar[bool] = False
    supports_async_scheduling: ClassVar[bool] = False  # AsyncEngineCore overlaps steps; static batches cannot

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        super().__init__(model, config)
        self.drafter: Proposer | None = None  # speculative decoding: engines that offer it set these (notebook 13)
        self.rejection_sampler: RejectionSampler | None = None
        self.spec_decoding_stats = SpecDecodingStats()
        use_graphs = self.config.use_cuda_graphs(model.device.type)  # enforce_eager=False off CUDA raises here
        if self.config.async_scheduling and not self.supports_async_scheduling:
            raise ValueError(f"async_scheduling=True needs an iteration-level scheduler: use engine 'continuous' or "
                             f"'chunked' (engine {self.name!r} runs static batches)")
        self.num_blocks = pool_num_blocks(model, self.config, self.max_num_batched_tokens)
        # One block more than the manager hands out: the scratch block padded CUDA-graph rows write to.
        self.pool = PagedKVPool(model.config, self.num_blocks + 1, self.config.block_size, model.device, model.dtype)
        self.block_manager = self.config.block_manager_cls(self.num_blocks, self.config.block_size,
                                                           self.config.enable_prefix_caching)
        backend = resolve_attention_backend(self.config.attention_backend, model.device.type, model.dtype)
        self.runner = ModelRunner(model, self.pool, self.block_manager, self.config.prepare_inputs, backend)
        if use_graphs:  # every graph is captured here, at start-up: none mid-run
            assert self.config.max_model_len is not None and self.config.cuda_graph_sizes is not None
            max_blocks = self.block_manager.blocks_needed(self.config.max_model_len)
            self.runner.use_decode_graphs(self.config.cuda_graph_sizes, max_blocks)
        scheduler_cls = self.config.scheduler_cls or self.scheduler_cls
        self.scheduler = scheduler_cls(self.block_manager, self.config.max_num_seqs, self.max_num_batched_tokens,
                                       self.enable_chunked_prefill)

    @property
    def max_num_batched_tokens(self) -> int:
        """The per-step token budget: a static batch's prompts are never limited by one."""
        assert self.config.max_model_len is not None
        return self.config.max_num_seqs * self.config.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    def validate(self, seq: Sequence) -> None:
        """Reject a request that could never fit the pool, even alone (anything smaller completes, by
        waiting for memory or through preemption), or that the scheduler could never run."""
        bm, size = self.block_manager, self.config.block_size
        prompt_blocks = bm.blocks_needed(seq.num_prompt_tokens)
        if prompt_blocks > self.num_blocks:
            raise ValueError(
                f"the prompt alone needs {prompt_blocks} KV blocks ({seq.num_prompt_tokens} tokens at block_size "
                f"{size}) but the pool has only {self.num_blocks} ({self.num_blocks * size} tokens); shorten the "
                "prompt or give the engine more KV memory (num_gpu_blocks / kv_cache_memory)"
            )
        budget = seq.params.max_tokens
        if budget is None:
            budget = seq.max_model_len - seq.num_prompt_tokens
        # The last output token is sampled but never run through the model: it needs no KV slot.
        needed = bm.blocks_needed(seq.num_prompt_tokens + budget - 1)
        if needed > self.num_blocks:
            room = self.num_blocks * size - seq.num_prompt_tokens + 1
            raise ValueError(
                f"request needs {needed} KV blocks ({seq.num_prompt_tokens} prompt tokens + max_tokens {budget} at "
                f"block_size {size}) but the pool has only {self.num_blocks}; lower max_tokens to at most {room} "
                "or give the engine more KV memory (num_gpu_blocks / kv_cache_memory)"
            )
        self.scheduler.validate(seq)

    # ---- the queues live in the scheduler ----

    def add_request(self, seq: Sequence) -> None:
        self.scheduler.add_request(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def unfinished_sequences(self) -> list[Sequence]:
        return self.scheduler.unfinished_sequences()

    def running_sequences(self) -> list[Sequence]:
        return list(self.scheduler.running)

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.finish_request(seq)

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

    def close(self) -> None:
        """Abort what still runs (its blocks go back), then drop the CUDA graphs and the KV pool's memory."""
        self.abort_all()
        self.runner.close()

    def check_progress(self) -> None:
        """After a step that scheduled nothing: if requests wait and none runs, no later step can differ (a
        scheduler that never admits, e.g. a learner's with a bug), so fail the waiting ones instead of spinning."""
        waiting = [s for s in self.scheduler.unfinished_sequences() if s not in self.scheduler.running]
        if waiting and not self.scheduler.running:
            self._scheduled = waiting  # the sequences this step's failure fails
            raise RuntimeError(
                f"{type(self.scheduler).__name__} scheduled nothing while {len(waiting)} request(s) wait and none "
                f"runs ({self.block_manager.num_free_blocks} of {self.num_blocks} KV blocks free, "
                f"{self.config.max_num_seqs} slots): it would never admit them"
            )

    # ---- one synchronous step ----

    def _run_speculative(self, out: SchedulerOutput, clock: StageClock) -> list[tuple[Sequence, list[int]]]:
        """Propose for the step's decodes, then verify every proposal in the step's one forward pass."""
        assert self.drafter is not None and self.rejection_sampler is not None
        with clock.stage("propose"):
            draft_probs = self.drafter.propose_for_step(out)
        proposed = {id(s): len(s.spec_token_ids) for s in out.seqs}
        results = self.runner.run_speculative(out, clock, self.rejection_sampler, draft_probs)
        for seq, tokens in results:
            self.spec_decoding_stats.observe(proposed[id(seq)], len(tokens) - 1)
        return results

    def _step(self) -> list[Sequence]:
        clock = StageClock(self.device)
        with clock.stage("schedule"):
            out = self.scheduler.schedule(clock.start)
        self.num_preemptions = self.scheduler.num_preemptions
        if not out.seqs:
            self.check_progress()
            return []
        num_prefill = out.num_prefill_tokens  # before the runner advances num_computed_tokens
        self._before_forward(out.seqs)
        if self.drafter is not None:  # speculative decoding (notebook 13): 1 to k + 1 tokens per sequence
            results = self._run_speculative(out, clock)
        else:
            results = [(seq, [token]) for seq, token in self.runner.run(out, clock)]
        blocks_in_use = self.block_manager.num_used_blocks  # at the step's peak, before finished ones free theirs
        num_new_tokens = 0
        with clock.stage("detokenize"):
            for seq, tokens in results:
                for token in tokens:  # the stop rule sees each token, so a stop mid-way drops the rest
                    seq.append_token(token, clock.last)
                    num_new_tokens += 1
                    if seq.is_finished:
                        self.scheduler.finish_request(seq)
                        break
        self.record_step(clock.start, clock.last, clock.times, num_seqs=len(out) + out.num_idle_slots,
                         num_computed_tokens=out.num_batched_tokens, num_new_tokens=num_new_tokens,
                         num_prefill_tokens=num_prefill, num_idle_slots=out.num_idle_slots,
                         kv_blocks_used=blocks_in_use)
        return [seq for seq, _ in results]
