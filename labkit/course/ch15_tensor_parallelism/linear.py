"""Notebook 15's Build task (a): a column-parallel layer, then a row-parallel one, and where the all-reduce goes.

Simulated in one process: a "rank" is an index into a list of shards, and ``SimulatedAllReduce`` takes one
tensor per rank and gives every rank their sum (counting calls and bytes, as a real one would move). The learner
writes ``column_then_row``, the shape of an MLP block (and of attention: heads column-parallel, o_proj
row-parallel); the checker compares every rank's result with the unsharded layers. Notebook 15.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from labkit.course import Check, CheckResult, run_checker
from labkit.course.hints import Hints

AllReduce = Callable[[list[torch.Tensor]], list[torch.Tensor]]


@dataclass
class SimulatedAllReduce:
    """Sum one tensor per rank; every rank gets the sum. Records each call's shape. Notebook 15."""

    shapes: list[tuple[int, ...]] = field(default_factory=list)
    num_bytes: int = 0

    def __call__(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        if not parts or any(p.shape != parts[0].shape for p in parts):
            raise ValueError(f"all_reduce takes one tensor per rank, all of one shape; got shapes "
                             f"{[tuple(p.shape) for p in parts]}")
        self.shapes.append(tuple(parts[0].shape))
        self.num_bytes += parts[0].numel() * parts[0].element_size()
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        return [total.clone() for _ in parts]


def column_then_row(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, world_size: int,
                    all_reduce: AllReduce) -> list[torch.Tensor]:
    """``silu(x @ w1.T) @ w2.T + b2`` on ``world_size`` simulated ranks; returns each rank's (B, out) result.

    x: (B, in); w1: (hidden, in), column-parallel (rank r keeps rows r*hidden/N ... of it); w2: (out, hidden),
    row-parallel (rank r keeps the matching columns); b2: (out,), added once, after the sum. labkit's reference.
    """
    hidden = w1.shape[0]
    per = hidden // world_size
    partials = []
    for r in range(world_size):
        rows = slice(r * per, (r + 1) * per)
        h = F.silu(x @ w1[rows].T)  # (B, hidden/N): this rank's features, no communication
        partials.append(h @ w2[:, rows].T)  # (B, out): a partial sum over this rank's features
    return [y + b2 for y in all_reduce(partials)]  # one all-reduce, then the bias once


LINEAR_HINTS = Hints(
    concept=("A column-parallel layer leaves each rank with some of the output features; a row-parallel layer "
             "gives each rank a partial sum of every output feature. Which of the two needs communication, and "
             "what kind?"),
    rule=("Split w1 by rows and w2 by the same columns, in the same order; each rank computes silu(x @ w1_r.T) "
          "@ w2_r.T with no communication; one all-reduce (sum) of those partial results, then b2 added once."),
    code=("per = w1.shape[0] // world_size; for r in range(world_size): rows = slice(r*per, (r+1)*per); "
          "parts.append(F.silu(x @ w1[rows].T) @ w2[:, rows].T); return [y + b2 for y in all_reduce(parts)]"),
    by_failure={
        "missing-all-reduce": "After a row-parallel layer each rank holds only a partial sum: the ranks must add "
                              "them up before anyone uses the result.",
        "column-all-reduce": "The column-parallel layer's outputs are different features on each rank, not "
                             "partial sums: adding them mixes unrelated features. Nothing is communicated there.",
        "shard-order": "Rank r's slice of w2's columns must be the features rank r computed with its slice of "
                       "w1's rows: the same slice, in the same order.",
        "bias-every-rank": "A bias added before the sum is counted once per rank: add it after the all-reduce.",
        "ranks": "Return one result per rank: a list of world_size tensors, each (B, out).",
    },
)

SIZES = ((2, 16), (4, 32))  # (world size, hidden): small, exact in float64


def check_column_then_row(fn: Callable[..., list[torch.Tensor]]) -> CheckResult:
    """Task (a): every rank's result equals the unsharded layers', with exactly one all-reduce of (B, out)."""

    def body(check: Check) -> None:
        gen = torch.Generator().manual_seed(15)
        for world_size, hidden in SIZES:
            x = torch.randn(3, 8, generator=gen, dtype=torch.float64)  # (B, in)
            w1 = torch.randn(hidden, 8, generator=gen, dtype=torch.float64)  # (hidden, in)
            w2 = torch.randn(6, hidden, generator=gen, dtype=torch.float64)  # (out, hidden)
            b2 = torch.randn(6, generator=gen, dtype=torch.float64)
            want = F.silu(x @ w1.T) @ w2.T + b2  # (B, out)
            reduce = SimulatedAllReduce()
            outs = fn(x, w1, w2, b2, world_size, reduce)
            name = f"at world_size={world_size}"
            if not expect_ranks(check, outs, world_size, want, name):
                return
            if (3, hidden // world_size) in reduce.shapes:
                check.expect(False, f"{name} you all-reduced a (B, hidden/N) = (3, {hidden // world_size}) tensor: "
                                    "the column-parallel layer's output", because="column-all-reduce")
            if not reduce.shapes:
                check.expect(False, f"{name} nothing was all-reduced: each rank returned its partial sum",
                             because="missing-all-reduce")
            elif reduce.shapes != [(3, 6)] and (3, 6) in reduce.shapes:
                check.expect(False, f"{name} all_reduce was called {len(reduce.shapes)} times (shapes "
                                    f"{reduce.shapes}); one, on the (B, out) partial sums, is enough")
            for r, y in enumerate(outs):
                if torch.allclose(y, want):
                    continue
                if torch.allclose(y, want + (world_size - 1) * b2):
                    check.expect(False, f"{name} rank {r}'s result has b2 {world_size} times",
                                 because="bias-every-rank")
                elif reduce.shapes == [(3, 6)]:
                    check.expect(False, f"{name} rank {r}'s result differs from the unsharded layers' by up to "
                                        f"{(y - want).abs().max():.3g}, with the all-reduce in the right place",
                                 because="shard-order")
                else:
                    check.expect(False, f"{name} rank {r}'s result differs from the unsharded layers' by up to "
                                        f"{(y - want).abs().max():.3g}")
                return

    return run_checker("", "", body, task_id="15.column_row")


def expect_ranks(check: Check, outs: object, world_size: int, want: torch.Tensor, name: str) -> bool:
    is_list = isinstance(outs, (list, tuple))
    ok = is_list and len(outs) == world_size and all(  # type: ignore[arg-type]
        isinstance(y, torch.Tensor) and y.shape == want.shape for y in outs)  # type: ignore[union-attr]
    shapes = [tuple(getattr(y, "shape", ())) for y in outs] if is_list else []  # type: ignore[union-attr]
    check.expect(ok, f"{name} expected a list of {world_size} tensors of shape {tuple(want.shape)}, got "
                     f"{type(outs).__name__} {shapes}", because="ranks")
    return ok
