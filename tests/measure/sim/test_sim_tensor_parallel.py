"""The simulator's tensor-parallel degree per phase (notebook 15): a worker of degree t runs the fitted compute in
1/t of the time plus its all-reduces, and counts as t devices."""

from __future__ import annotations

import pytest

from labkit.measure.sim import ClusterSpec, SimRequest, StepCostModel, TensorParallelCost, TensorParallelSpec, simulate
from labkit.measure.sim.cost_model import StepShape

COST = StepCostModel.of(step=0.010, prefill_tokens=1e-4, decode_rows=1e-3)
LINK = TensorParallelSpec(num_all_reduces=8, bytes_per_token=1000, link_bandwidth=1e9, link_latency=1e-4)


def test_a_step_is_compute_over_the_degree_plus_its_all_reduces() -> None:
    shape = StepShape(num_prefill_tokens=0, prefill_attention=0.0, num_decode_rows=4, decode_context=40,
                      num_prefill_seqs=0)
    whole = COST.step_time(shape)
    two = TensorParallelCost(COST, 2, LINK).step_time(shape)
    assert two == pytest.approx(whole / 2 + 8 * (1e-4 + 2 * 1 / 2 * 4 * 1000 / 1e9))
    assert TensorParallelCost(COST, 1, LINK).step_time(shape) == whole
    with pytest.raises(ValueError, match="degree must be an int >= 1"):
        TensorParallelCost(COST, 0, LINK)


def test_degrees_per_phase_change_devices_and_latencies() -> None:
    req = [SimRequest(0.0, 200, 20)]
    plain = ClusterSpec(num_prefill=1, num_decode=1)
    wide_prefill = ClusterSpec(num_prefill=1, num_decode=1, prefill_tp=4, tp=LINK)
    assert (plain.num_devices, wide_prefill.num_devices, wide_prefill.label()) == (2, 5, "1P(TP4):1D(TP1)")
    slow, fast = simulate(req, COST, plain).records[0], simulate(req, COST, wide_prefill).records[0]
    assert fast.ttft < slow.ttft  # the prompt's compute split four ways (and its all-reduces are cheap here)
    assert fast.itl == pytest.approx(slow.itl)  # decode at degree 1 on both
    colocated = ClusterSpec(num_decode=2, decode_tp=2, tp=LINK)
    assert colocated.num_devices == 4 and colocated.label() == "2 colocated (TP2)"
