"""The simulator: labkit's own scheduler runs inside it, its virtual times follow the cost model exactly, the cost
model fit recovers known coefficients, every request completes and every block comes back, and disaggregation
removes the prefill stall from decodes at the price of the transfer."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from labkit import LLM
from labkit.core.sched.scheduler import Scheduler
from labkit.measure.sim import (
    ClusterSpec,
    RecordingScheduler,
    SimRequest,
    StepCostModel,
    StepShape,
    calibrate,
    poisson_requests,
    simulate,
)
from labkit.measure.sim import cluster as cluster_module

# 10 ms per step, 0.1 ms per prompt token, 1 ms per decode row, nothing else.
COST = StepCostModel.of(step=0.010, prefill_tokens=1e-4, decode_rows=1e-3)


def test_the_scheduler_is_labkits_own_class_and_its_code_runs(monkeypatch) -> None:
    instances = []
    original = cluster_module.make_instance

    def spy(cost, spec):  # type: ignore[no-untyped-def]
        inst = original(cost, spec)
        instances.append(inst)
        return inst

    monkeypatch.setattr(cluster_module, "make_instance", spy)
    ran = set()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            ran.add(frame.f_code)

    sys.setprofile(profile)
    try:
        simulate(poisson_requests(50, 6, [40], 4, seed=1), COST, ClusterSpec(num_prefill=1, num_decode=1))
    finally:
        sys.setprofile(None)
    assert instances and all(type(i.scheduler) is Scheduler for i in instances)
    for method in (Scheduler.schedule, Scheduler.schedule_running, Scheduler.schedule_waiting, Scheduler.reserve):
        assert method.__code__ in ran, f"{method.__name__}'s own code object never ran"


def test_a_lone_request_takes_exactly_the_cost_models_time() -> None:
    req = SimRequest(arrival=1.0, prompt_len=100, output_len=5)
    spec = ClusterSpec(num_decode=1, max_num_batched_tokens=512)
    (rec,) = simulate([req], COST, spec).records
    assert rec.ttft == pytest.approx(0.010 + 100e-4)  # one prefill step of the whole prompt
    assert rec.itl == pytest.approx([0.011] * 4)  # then one decode row per step
    chunked = simulate([req], COST, ClusterSpec(num_decode=1, max_num_batched_tokens=40)).records[0]
    assert chunked.ttft == pytest.approx(3 * 0.010 + 100e-4)  # 40 + 40 + 20: three steps


def test_the_transfer_delays_the_first_token_as_in_labkits_engine() -> None:
    req = SimRequest(arrival=0.0, prompt_len=100, output_len=5)
    spec = ClusterSpec(num_prefill=1, num_decode=1, kv_bytes_per_token=1000, link_bandwidth=1e6, link_latency=0.002,
                       block_size=16)
    result = simulate([req], COST, spec)
    (rec,) = result.records
    transfer = 0.002 + 7 * 16 * 1000 / 1e6  # 7 blocks of 16 tokens
    # The decode worker samples the first token once the KV (and the logits) are in: prefill, then transfer.
    assert rec.ttft == pytest.approx(0.010 + 100e-4 + transfer)
    assert rec.itl == pytest.approx([0.011] * 4)  # then one decode row per step
    assert result.kv_bytes_moved == 7 * 16 * 1000
    # A busy decode worker takes the KV off the link only between two of its steps.
    busy = [SimRequest(0.0, 16, 40), SimRequest(0.001, 100, 5)]
    late = simulate(busy, COST, ClusterSpec(num_prefill=1, num_decode=1, block_size=16)).records[1]
    ready = (0.010 + 16e-4) + (0.010 + 100e-4)  # its prefill ends after the first one's (its KV moves instantly)
    picked = 0.001 + late.ttft
    assert ready <= picked < ready + 0.011  # at the end of the decode step running then: at most one step later


def test_every_request_completes_and_every_block_comes_back(monkeypatch) -> None:
    instances = []
    original = cluster_module.make_instance
    monkeypatch.setattr(cluster_module, "make_instance",
                        lambda c, s: instances.append(original(c, s)) or instances[-1])
    reqs = poisson_requests(200, 60, [20, 200, 600], 30, seed=3)
    # A small pool per worker: preemption (by recompute) and KV waiting for decode blocks both happen.
    spec = ClusterSpec(num_prefill=2, num_decode=1, num_blocks=80, block_size=16, max_num_seqs=16,
                       kv_bytes_per_token=100, link_bandwidth=1e8)
    result = simulate(reqs, COST, spec)
    assert result.metrics.completed == 60
    assert all(r.output_tokens == 30 for r in result.records)
    assert sum(i.scheduler.num_preemptions for i in instances) > 0
    for inst in instances:
        assert inst.block_manager.num_free_blocks == inst.block_manager.num_blocks
        inst.block_manager.check_invariants([])


def test_disaggregation_removes_the_prefill_stall_from_decodes() -> None:
    # Short requests decode while long prompts keep arriving: colocated, each long prefill stalls the decodes.
    shorts = [SimRequest(0.05 * i, 16, 60) for i in range(20)]
    longs = [SimRequest(0.2 * i + 0.1, 1500, 2) for i in range(5)]
    reqs = sorted(shorts + longs, key=lambda r: r.arrival)
    colocated = simulate(reqs, COST, ClusterSpec(num_decode=2, max_num_batched_tokens=2048))
    disagg = simulate(reqs, COST, ClusterSpec(num_prefill=1, num_decode=1, max_num_batched_tokens=2048,
                                              kv_bytes_per_token=1000, link_bandwidth=1e9))
    assert disagg.metrics.itl.p99 < colocated.metrics.itl.p99
    slow_link = simulate(reqs, COST, ClusterSpec(num_prefill=1, num_decode=1, max_num_batched_tokens=2048,
                                                 kv_bytes_per_token=1000, link_bandwidth=1e6))
    assert slow_link.metrics.ttft.p99 > disagg.metrics.ttft.p99  # a slow link makes every first token wait


def test_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(0)
    truth = np.array([0.004, 6e-4, 2e-5, 1e-8, 3e-4, 1e-6])
    shapes = [StepShape(int(p), float(p * rng.integers(1, 500)), int(r), int(r * rng.integers(10, 800)),
                        int(min(p, rng.integers(1, 5))))
              for p, r in zip(rng.integers(0, 400, 80), rng.integers(0, 32, 80))]
    seconds = [float(truth @ s.features()) for s in shapes]
    fitted = StepCostModel.fit(shapes, seconds)
    assert fitted.coefficients == pytest.approx(truth, rel=1e-6, abs=1e-12)
    with pytest.raises(ValueError, match="at least 6 measured steps"):
        StepCostModel.fit(shapes[:3], seconds[:3])


def synthetic_steps(truth: np.ndarray, seed: int) -> tuple[list[StepShape], list[float]]:
    """Steps of a colocated engine, timed by a known cost model: many decode steps, many full-budget prefill
    chunks, and a few short prompt chunks beside decodes (the rare kind that pins down the cost per chunk)."""
    rng = np.random.default_rng(seed)
    shapes = [StepShape(0, 0.0, int(r), int(r * rng.integers(20, 400)), 0) for r in rng.integers(1, 16, 120)]
    for _ in range(30):
        start = int(rng.integers(0, 600))
        shapes.append(StepShape(128, 128 * (start + 64.5), int(rng.integers(0, 8)), int(rng.integers(0, 2000)), 1))
    for n in (16, 24, 48, 16, 32, 48):
        shapes.append(StepShape(n, n * (n + 1) / 2, int(rng.integers(1, 12)), int(rng.integers(50, 2000)), 1))
    return shapes, [float(truth @ s.features()) for s in shapes]


TRUTH = np.array([1.5e-3, 4e-3, 8e-5, 1.2e-7, 3e-4, 5e-7])  # a CPU-like profile: a chunk costs ~3 decode steps


def test_fit_ignores_steps_another_program_slowed() -> None:
    shapes, seconds = synthetic_steps(TRUTH, seed=1)
    rng = np.random.default_rng(2)
    noisy = [t * float(rng.uniform(0.98, 1.02)) for t in seconds]
    slowed = rng.choice(len(noisy), size=len(noisy) // 10, replace=False)  # one step in ten, 2-5x slower
    for i in slowed:
        noisy[i] *= float(rng.uniform(2, 5))
    fitted = StepCostModel.fit(shapes, noisy)
    assert fitted.coefficients == pytest.approx(TRUTH, rel=0.15)
    predicted = np.array([fitted.step_time(s) for s in shapes])
    clean = np.delete(np.arange(len(shapes)), slowed)
    assert np.median(np.abs(predicted[clean] / np.array(seconds)[clean] - 1)) < 0.03


def test_fit_keeps_the_rare_short_chunks_that_price_a_prompt_chunk() -> None:
    # Six short prompt chunks among 156 steps are the only evidence that a chunk costs more than its tokens; the fit
    # must follow them, not discard them as outliers (the short prompts' TTFT is what they decide).
    shapes, seconds = synthetic_steps(TRUTH, seed=3)
    fitted = StepCostModel.fit(shapes, seconds)
    assert fitted.describe()["prefill_seqs"] == pytest.approx(TRUTH[1], rel=1e-3)
    short = [s for s in shapes if 0 < s.num_prefill_tokens < 64]
    assert [fitted.step_time(s) for s in short] == pytest.approx([float(TRUTH @ s.features()) for s in short],
                                                                rel=1e-3)
    with pytest.raises(ValueError, match="must be positive"):
        StepCostModel.fit(shapes, [0.0] * len(shapes))


def test_a_prompt_chunk_costs_its_own_fixed_time() -> None:
    # Two prompts arriving together run their chunks in one step: one step cost, two chunk costs.
    cost = StepCostModel.of(step=0.010, prefill_seqs=0.002, prefill_tokens=1e-4)
    spec = ClusterSpec(num_decode=1, max_num_batched_tokens=512)
    recs = simulate([SimRequest(0.0, 100, 1), SimRequest(0.0, 50, 1)], cost, spec).records
    assert [r.ttft for r in recs] == pytest.approx([0.010 + 2 * 0.002 + 150 * 1e-4] * 2)


def test_a_cost_model_names_its_features() -> None:
    with pytest.raises(ValueError, match="6 non-negative coefficients"):
        StepCostModel(np.array([0.01, 1e-4, 0.0, 1e-3, 0.0]))  # the five-feature model of an older labkit
    with pytest.raises(ValueError, match="unknown cost model features \\['decode_row'\\]"):
        StepCostModel.of(decode_row=1e-3)


def test_calibrate_pairs_each_planned_step_with_its_time(bundled_path) -> None:
    with LLM(str(bundled_path), engine="chunked", scheduler_cls=RecordingScheduler, max_num_seqs=4,
             max_num_batched_tokens=64) as llm:
        cost, shapes, seconds = calibrate(llm, poisson_requests(math.inf, 6, [8, 40, 90], 6, seed=2))
        # The warm-up request's steps come first and are left out of the fit; the rest pair one to one.
        recorded = llm.engine.step_stats[-len(shapes):]
        assert len(shapes) == len(seconds) < len(llm.engine.step_stats)
        assert seconds == [st.duration for st in recorded]
        assert [s.num_prefill_tokens for s in shapes] == [st.num_prefill_tokens for st in recorded]
        requests = poisson_requests(math.inf, 6, [8, 40, 90], 6, seed=2)
        assert sum(s.num_prefill_tokens for s in shapes) == sum(r.prompt_len for r in requests)  # no warm-up in it
        assert (cost.coefficients >= 0).all() and cost.coefficients.any()
    with LLM(str(bundled_path), engine="chunked") as plain, pytest.raises(TypeError, match="RecordingScheduler"):
        calibrate(plain, poisson_requests(math.inf, 1, [8], 2))
