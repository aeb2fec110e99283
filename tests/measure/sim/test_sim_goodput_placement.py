"""The simulator's DistServe goodput, whole-prompt prefill workers, and the datasheet GPU cost profile."""

from __future__ import annotations

import pytest

from labkit.core.model.presets import get_preset
from labkit.measure.sim import ClusterSpec, StepCostModel, poisson_requests, simulate
from labkit.measure.sim.device_profile import H100_SXM, gpu_cost_model
from labkit.measure.sim.goodput import attainment, distserve_goodput
from labkit.measure.sim.placement import choose_placement

COST = StepCostModel.of(step=0.01, prefill_tokens=1e-4, decode_rows=1e-4)


def test_prefill_workers_run_whole_prompts_colocated_engines_chunk() -> None:
    reqs = poisson_requests(float("inf"), 1, [640], 2)
    spec = dict(max_num_batched_tokens=128, num_blocks=256)
    colocated = simulate(reqs, COST, ClusterSpec(num_decode=1, **spec))
    split = simulate(reqs, COST, ClusterSpec(num_prefill=1, num_decode=1, **spec))
    # colocated: five 128-token chunks, five fixed step costs; the prefill worker: one step of 640 tokens
    assert colocated.records[0].ttft == pytest.approx(5 * 0.01 + 640 * 1e-4)
    assert split.records[0].ttft == pytest.approx(0.01 + 640 * 1e-4)


def test_distserve_goodput_is_the_highest_rate_meeting_the_target_per_device() -> None:
    slos = {"ttft": 100.0, "tpot": 50.0}
    workload = lambda rate: poisson_requests(rate, 60, [64], 8, seed=1)  # noqa: E731
    spec = ClusterSpec(num_decode=2, num_blocks=512)
    rate = distserve_goodput(workload, COST, spec, slos, target=0.9, low=0.1, high=50.0) * spec.num_devices
    assert rate > 0
    assert attainment(simulate(workload(rate), COST, spec, slos), slos) >= 0.9
    assert attainment(simulate(workload(4 * rate), COST, spec, slos), slos) < 0.9
    with pytest.raises(ValueError, match="share in"):
        distserve_goodput(workload, COST, spec, slos, target=90)


def test_gpu_profile_prices_a_decode_step_by_the_weights_and_a_prompt_token_by_its_flops() -> None:
    config = get_preset("llama3.1-8b")
    c = gpu_cost_model(config).describe()
    weights = config.num_params * 2 / (H100_SXM.memory_bandwidth * H100_SXM.bandwidth_efficiency)
    assert c["step"] == pytest.approx(weights + H100_SXM.step_overhead)
    assert 3e-3 < c["step"] < 10e-3  # a 16 GB model at ~2.7 TB/s: about 6 ms
    assert c["prefill_tokens"] < c["step"] / 100  # a prompt token costs far less than a decode step


def test_placement_prefers_goodput_per_device() -> None:
    table = {(0, 1): 2.0, (0, 2): 4.0, (1, 1): 8.0}
    assert choose_placement(2, lambda p, d: table[(p, d)]) == (1, 1)
