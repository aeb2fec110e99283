"""Megatron-style sharded linear layers: column-parallel (split the outputs) and row-parallel (split the inputs).

A linear layer ``y = x @ W.T`` with W of shape (out, in) splits two ways across N ranks:

* **column-parallel**: rank r keeps a slice of W's *rows* (its share of the output features). Each rank computes
  its own slice of y from the whole x; nothing is communicated, and the output stays split. q/k/v (by head) and
  gate/up are column-parallel: attention heads and SwiGLU's products are independent per feature.
* **row-parallel**: rank r keeps a slice of W's *columns* (its share of the input features) and multiplies the
  matching slice of x, the output of a column-parallel layer. Each rank's y is a partial sum; one all-reduce adds
  them, and every rank holds the whole y. o_proj and down_proj are row-parallel: one all-reduce after each, two
  per decoder layer. A bias is added once, after the sum (on every rank it would count N times).

The layers stay labkit's ``Linear`` (the kernel choice of notebook 04 applies to each shard); the row-parallel
wrapper only adds the all-reduce. Introduced in notebook 15 (``15_tensor_parallelism``).
"""

from __future__ import annotations

import torch
from torch import nn

from labkit.core.model.linear import Linear
from labkit.core.parallel.group import TPGroup


def shard_range(size: int, world_size: int, rank: int, what: str = "features") -> tuple[int, int]:
    """Rank ``rank``'s equal share [start, end) of ``size`` items; a clear error if N does not divide them."""
    if size % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} must divide the {size} {what}: each rank takes an equal "
                         f"share (choose a tensor_parallel_size that divides {size})")
    per = size // world_size
    return rank * per, (rank + 1) * per


def replace_weight(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Give ``linear`` new (smaller) parameters in place: shape attributes and kernel caches follow."""
    with torch.inference_mode(False), torch.no_grad():  # plain tensors even if sharded inside inference mode
        linear.weight = nn.Parameter(weight.detach().clone().contiguous(), requires_grad=False)
        linear.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
    linear.out_features, linear.in_features = weight.shape
    kernel = getattr(linear, "kernel", None)
    if kernel is not None:  # a repacked oneDNN copy of the old weight must not be reused
        kernel.packed = kernel.packed_from = None
        kernel.fastest = float("inf")


def shard_columns_(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Column-parallel, in place: keep the output features ``rows`` (indices into W's rows, in order)."""
    weight = linear.weight.index_select(0, rows.to(linear.weight.device))  # (out_local, in)
    bias = None if linear.bias is None else linear.bias.index_select(0, rows.to(linear.weight.device))
    replace_weight(linear, weight, bias)


class RowParallelLinear(nn.Module):
    """A row-parallel shard: ``linear`` holds W[:, start:end] (no bias), its output is all-reduced, then the bias
    (if any) is added once. Notebook 15."""

    def __init__(self, full: nn.Linear, group: TPGroup) -> None:
        super().__init__()
        start, end = shard_range(full.in_features, group.world_size, group.rank, f"input features of {type(full)}")
        with torch.device("meta"):  # no random initialisation: the shard's weight replaces it at once
            self.linear = Linear(end - start, full.out_features, bias=False)
        replace_weight(self.linear, full.weight[:, start:end], None)  # (out, in_local)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone(), requires_grad=False)
        self.group = group
        self.in_features, self.out_features = end - start, full.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).contiguous()  # (..., out): this rank's partial sum
        self.group.all_reduce(y)  # (..., out): the whole product, on every rank
        return y if self.bias is None else y + self.bias
