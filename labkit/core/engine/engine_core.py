"""``EngineCore``: the one engine loop over a paged KV pool (vLLM v1's ``EngineCore``).

A KV pool, a block manager, a scheduler and a model runner, wired together; each step reads as vLLM's:

    scheduler_output = scheduler.schedule()                      # who runs, and how many new tokens each computes
    model_output = runner.execute_model(scheduler_output)        # inputs, one forward pass, sampling
    scheduler.update_from_output(scheduler_output, model_output)  # tokens appended, stop rule, finished ones leave

Engines ``paged``, ``continuous`` and ``chunked`` are presets of this one class (``labkit.core.presets``): a static
or an iteration-level scheduler, and whether prompts are chunked under the token budget. Speculative decoding
(``speculative_config``, notebook 13) adds a proposer to the runner; async scheduling (notebook 10) is the subclass
``AsyncEngineCore``. Every part is pluggable with vLLM's option names (``scheduler_cls``, ``block_manager_cls``,
``attention_backend``): the learner's class is the one that runs. Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from labkit.core.attention import resolve_attention_backend
from labkit.core.attention.quantized_kv import with_quantized_kv
from labkit.core.engine.base import Engine
from labkit.core.engine.config import PagedConfig
from labkit.core.engine.kv_sizing import pool_num_blocks
from labkit.core.engine.model_runner import ModelRunner
from labkit.core.engine.step import StageClock
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.kv.quantized_pool import QuantizedKVPool
from labkit.core.model import CausalLM
from labkit.core.sched.scheduler import Scheduler
from labkit.core.sequence import Sequence
from labkit.core.spec_decode.config import SpeculativeConfig
from labkit.core.spec_decode.draft_proposer import DraftModelProposer
from labkit.core.spec_decode.metrics import SpecDecodingStats
from labkit.core.spec_decode.ngram_proposer import NgramProposer
from labkit.core.spec_decode.proposer import Proposer

CHUNKED_BUDGET = 512  # the default token budget when prompts are chunked (vLLM's order of magnitude on a small GPU)


class EngineCore(Engine):
    """Pool, block manager, scheduler and model runner; one step at a time. Notebook 06; presets in 06-08."""

    name = "engine_core"
    config_class = PagedConfig
    config: PagedConfig

    def __init__(self, model: CausalLM, config: PagedConfig) -> None:
        super().__init__(model, config)
        assert config.max_model_len is not None
        if config.max_num_batched_tokens is None:  # a whole prompt per step; a fixed budget when chunking
            config.max_num_batched_tokens = CHUNKED_BUDGET if config.enable_chunked_prefill else config.max_model_len
        use_graphs = config.use_cuda_graphs(model.device.type)  # enforce_eager=False off CUDA raises here
        self.num_blocks = pool_num_blocks(model, config, self.max_num_batched_tokens)
        # One block more than the manager hands out: the scratch block padded CUDA-graph rows write to.
        pool_args = (model.config, self.num_blocks + 1, config.block_size, model.device, model.dtype)
        self.pool = PagedKVPool(*pool_args) if config.kv_cache_dtype == "auto" else \
            (config.kv_pool_cls or QuantizedKVPool)(*pool_args, config.kv_cache_dtype)  # 8-bit K/V (notebook 14)
        self.block_manager = config.block_manager_cls(self.num_blocks, config.block_size, config.enable_prefix_caching)
        backend = resolve_attention_backend(config.attention_backend, model.device.type, model.dtype)
        if config.kv_cache_dtype != "auto":  # an 8-bit pool: any backend, through a float view (notebook 14)
            backend = with_quantized_kv(backend)
        spec = config.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # made one by PagedConfig.__post_init__
        drafter: Proposer | None = None
        if spec is not None:
            spec.check_model(model.config.num_hidden_layers)
            drafter = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == "ngram" else
                       DraftModelProposer(model, spec.draft_num_layers, self.pool, self.block_manager, backend))
        self.runner = ModelRunner(model, self.pool, self.block_manager, config.prepare_inputs, backend, drafter,
                                  spec.rejection_sampler_cls() if spec is not None else None)
        if config.decode_plan:
            self.runner.use_decode_plan()
        if use_graphs:  # every graph is captured here, at start-up: none mid-run
            assert config.cuda_graph_sizes is not None
            max_blocks = self.block_manager.blocks_needed(config.max_model_len)
            self.runner.use_decode_graphs(config.cuda_graph_sizes, max_blocks)
        scheduler_cls = config.scheduler_cls or Scheduler
        self.scheduler = scheduler_cls(self.block_manager, config.max_num_seqs, self.max_num_batched_tokens,
                                       config.enable_chunked_prefill)
        if spec is not None:
            self.scheduler.num_lookahead_tokens = spec.num_speculative_tokens

    @property
    def max_num_batched_tokens(self) -> int:
        """The per-step token budget."""
        assert self.config.max_num_batched_tokens is not None  # set in __init__
        return self.config.max_num_batched_tokens

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def drafter(self) -> Proposer | None:
        """The proposer of speculative decoding (notebook 13), or None."""
        return self.runner.drafter

    @property
    def spec_decoding_stats(self) -> SpecDecodingStats:
        """How well the proposals did so far (notebook 13)."""
        return self.runner.spec_decoding_stats

    # ---- one step ----

    def step(self) -> list[Sequence]:
        """One iteration, as vLLM v1's ``EngineCore.step``: schedule, execute the model, update from its output."""
        with self.step_context():
            clock = StageClock(self.device)
            with clock.stage("schedule"):
                scheduler_output = self.scheduler.schedule(clock.start)
            if not scheduler_output.seqs:
                self.check_progress()
                return []
            self._before_forward(scheduler_output.seqs)  # the sequences a fault now fails
            num_prefill_tokens = scheduler_output.num_prefill_tokens  # before they count as computed
            model_output = self.runner.execute_model(scheduler_output, clock)
            blocks_in_use = self.block_manager.num_used_blocks  # the step's peak, before finished ones free theirs
            with clock.stage("detokenize"):
                stepped = self.scheduler.update_from_output(scheduler_output, model_output, clock.last)
            self.record_step(clock.start, clock.last, clock.times,
                             num_seqs=len(scheduler_output) + scheduler_output.num_idle_slots,
                             num_computed_tokens=scheduler_output.num_batched_tokens,
                             num_new_tokens=sum(len(t) for t in model_output.sampled_token_ids),
                             num_prefill_tokens=num_prefill_tokens, num_idle_slots=scheduler_output.num_idle_slots,
                             kv_blocks_used=blocks_in_use)
            return stepped

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

    # ---- the queues live in the scheduler ----

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

    def add_request(self, seq: Sequence) -> None:
        self.scheduler.add_request(seq)
        if self.runner.decode_plan is not None:  # user code may have changed the model since the last request
            self.runner.decode_plan.recheck()

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
