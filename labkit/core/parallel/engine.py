"""``EngineCore`` over N tensor-parallel ranks: ``LLM(..., tensor_parallel_size=N)`` (vLLM's option).

The driver (the ``LLM``'s process) is rank 0: it keeps the scheduler, the block manager and the sampler, shards
its own copy of the model, and holds its heads' share of the KV pool; ranks 1..N-1 are worker processes
(``worker.py``) with the other shares. Each step the model runner broadcasts the forward pass's inputs
(``TPModelRunner.forward``), every rank runs its shard, and the row-parallel layers' all-reduces keep the hidden
states identical on every rank; the driver alone computes the logits (the lm_head is replicated) and samples.

The pool has the number of blocks the driver's (sharded) model gets; each rank's pool holds that many blocks of its
own heads, so with the K/V heads split N ways the same memory budget holds N times the tokens. On a CPU the ranks
split the cores: the driver sets its own threads to cores // N while the engine lives (restored at ``close``).
Each rank's weights are cut in the driver (``weights.shard_state_dict``); the attention's cut is the class's
``shard_attention``, so a subclass (``LLM(engine=MyTP, tensor_parallel_size=2)``) runs a learner's. Not combined
(a clear error instead): CUDA graphs, ``async_scheduling``, ``speculative_config``. Introduced in
notebook 15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

import torch

from labkit.core.engine.config import PagedConfig
from labkit.core.engine.engine_core import EngineCore
from labkit.core.engine.model_runner import ModelRunner, StepInputs
from labkit.core.engine.step import StageClock
from labkit.core.model import CausalLM
from labkit.core.parallel.executor import CommRecord, TPExecutor, check_devices
from labkit.core.parallel.heads import check_tensor_parallel
from labkit.core.parallel.shard import check_shardable, shard_model_
from labkit.core.parallel.weights import AttentionSharder, load_rank_state, shard_attention_weights, shard_state_dict


class TPModelRunner(ModelRunner):
    """The model runner of rank 0: announces each step to the other ranks before its own forward pass.
    Notebook 15."""

    executor: TPExecutor

    def forward(self, inputs: StepInputs, clock: StageClock) -> torch.Tensor | None:
        with clock.stage("broadcast"):
            self.executor.broadcast_step(inputs.input_ids, inputs.positions, inputs.meta, inputs.copies)
        group = self.executor.group
        before = group.all_reduce_s if group is not None else 0.0
        logits = super().forward(inputs, clock)
        if group is not None:  # the part of this step's forward pass spent in all-reduces (notebook 15 splits it)
            self.executor.comm_log.append(CommRecord(inputs.input_ids.numel(), group.all_reduce_s - before))
        return logits


class TensorParallelEngineCore(EngineCore):
    """``continuous`` and ``chunked`` with ``tensor_parallel_size`` > 1. Notebook 15."""

    name = "tensor_parallel"  # built from a preset, the engine takes the preset's name ("continuous", "chunked")
    # Cuts one layer's attention weights for a rank (notebook 15's Build task replaces it in a subclass).
    shard_attention: AttentionSharder = staticmethod(shard_attention_weights)

    def __init__(self, model: CausalLM, config: PagedConfig) -> None:
        n = config.tensor_parallel_size
        check_tensor_parallel(model.config, n)  # before any process starts
        check_shardable(model)
        check_devices(model.device, n)
        if config.async_scheduling:
            raise ValueError("tensor_parallel_size > 1 runs steps synchronously: async_scheduling=True is not "
                             "supported with it")
        if config.speculative_config is not None:
            raise ValueError("speculative_config is not supported with tensor_parallel_size > 1")
        self.threads_before = torch.get_num_threads()
        per_rank = max(1, self.threads_before // n) if model.device.type == "cpu" else None
        # Every rank's share cut here, in the driver (the attention part by ``shard_attention``).
        whole = {k: v.detach() for k, v in model.state_dict().items()}
        sharder = type(self).shard_attention  # the function itself, whether or not declared a staticmethod
        states = [shard_state_dict(whole, model.config, n, r, sharder) for r in range(n)]
        self.executor = TPExecutor(model, n, states[1:], config.attention_backend, num_threads=per_rank)
        try:
            shard_model_(model, self.executor)  # the driver's own modules; its all-reduces go through the executor
            load_rank_state(model, states[0])
            del whole, states
            if per_rank is not None:
                torch.set_num_threads(per_rank)
            super().__init__(model, config)  # the pool is built from the sharded (local) config: this rank's heads
            self.runner.__class__ = TPModelRunner  # same state; forward announces each step first
            self.runner.executor = self.executor  # type: ignore[attr-defined]
            self.executor.connect(self.pool.num_blocks, config.block_size)
        except BaseException:
            self.executor.close()
            torch.set_num_threads(self.threads_before)
            raise

    def death_cause(self) -> str | None:
        """Why this engine cannot serve (a rank died), or None; ``LLM.is_alive`` and the server's /health ask it."""
        return self.executor.death_cause()

    @property
    def tensor_parallel_size(self) -> int:
        return self.executor.world_size

    def close(self) -> None:
        """Abort what runs, stop the other ranks, release the pool, give the driver its threads back."""
        try:
            self.abort_all()
        finally:
            self.executor.close()
            self.runner.close()
            torch.set_num_threads(self.threads_before)
