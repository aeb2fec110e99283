"""Tensor parallelism (notebook 15): one model sharded across N ranks over ``torch.distributed``.

``group`` (the ranks and their collectives), ``local_group`` (the same between threads, for tests and the
notebook), ``layers`` (column- and row-parallel linear layers), ``heads`` (each rank's heads, features and KV pool
share), ``shard`` (a whole model sharded in place), ``messages`` (what the driver broadcasts each step), ``worker``
(ranks 1..N-1), ``executor`` (rank 0's side: start, announce, all-reduce, stop) and ``engine`` (``EngineCore`` over
them: ``LLM(..., tensor_parallel_size=N)``).
"""

from labkit.core.parallel.engine import TensorParallelEngineCore
from labkit.core.parallel.heads import HeadShard, check_tensor_parallel, head_shard
from labkit.core.parallel.local_group import ThreadTPGroup, run_ranks
from labkit.core.parallel.shard import shard_model_

__all__ = ["HeadShard", "TensorParallelEngineCore", "ThreadTPGroup", "check_tensor_parallel", "head_shard",
           "run_ranks", "shard_model_"]
