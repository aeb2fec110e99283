"""Notebook 15 (``15_tensor_parallelism``): the Build tasks' checkers and the measurements' helpers.

``linear``: Build task (a), a column-parallel then a row-parallel layer with the all-reduce in its place
(simulated in one process). ``attention``: Build task (b), one layer's heads and KV pool share for a rank, run in
threads and then inside the two-process engine. ``costs``: bytes per all-reduce, and a decode step's compute and
communication at 8B and 70B scale from public link and memory specs.
"""

from labkit.course.ch15_tensor_parallelism.attention import ATTENTION_HINTS, check_shard_attention
from labkit.course.ch15_tensor_parallelism.linear import (
    LINEAR_HINTS,
    SimulatedAllReduce,
    check_column_then_row,
    column_then_row,
)

__all__ = ["ATTENTION_HINTS", "LINEAR_HINTS", "SimulatedAllReduce", "check_column_then_row", "check_shard_attention",
           "column_then_row"]
