"""Calibrating the simulator on this device, and checking it against real runs.

``calibrate`` runs a workload on a real engine whose scheduler notes each step's shape (``RecordingScheduler``)
and fits ``StepCostModel`` to the measured step times. ``run_real`` replays a workload (the same ``SimRequest``s
the simulator takes: arrival times, prompt and output lengths) through a real ``LLM`` and returns what each
request saw, as ``RequestRecord``s, so measured and predicted TTFT and TPOT compare like for like.
Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from labkit.core.llm import LLM
from labkit.core.outputs import RequestOutput
from labkit.core.sampling_params import SamplingParams
from labkit.measure.loadgen.metrics import RequestRecord
from labkit.measure.sim.cluster import SimRequest
from labkit.measure.sim.cost_model import RecordingScheduler, StepCostModel, StepShape


def poisson_requests(rate: float, num_requests: int, prompt_lens: Sequence[int], output_len: int,
                     seed: int = 0) -> list[SimRequest]:
    """Poisson arrivals at ``rate`` requests/s (``inf``: all at 0), prompt lengths drawn from ``prompt_lens``."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(SimRequest(t, rng.choice(list(prompt_lens)), output_len))
        t += rng.expovariate(rate) if rate != float("inf") else 0.0
    return out


def prompt_ids(req: SimRequest, vocab_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, vocab_size) for _ in range(req.prompt_len)]  # ids 0-9 hold the special tokens


def run_real(llm: LLM, requests: Sequence[SimRequest], seed: int = 0) -> list[RequestOutput]:
    """Replay ``requests`` through ``llm`` (arrival times honoured, EOS ignored, greedy)."""
    prompts = [prompt_ids(r, llm.model_config.vocab_size, seed + i) for i, r in enumerate(requests)]
    params = [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in requests]
    first = min(r.arrival for r in requests)
    return llm.generate(prompts, params, use_tqdm=False, arrival_times=[r.arrival - first for r in requests])


def measured_records(outputs: Sequence[RequestOutput]) -> list[RequestRecord]:
    """What each request of a real run saw, in the simulator's terms."""
    records = []
    for out in outputs:
        m = out.metrics
        times = m.token_times
        records.append(RequestRecord(success=out.outputs[0].finish_reason in ("stop", "length"),
                                     prompt_len=len(out.prompt_token_ids), output_tokens=len(times),
                                     ttft=times[0] - m.arrival_time, itl=[b - a for a, b in zip(times, times[1:])],
                                     latency=times[-1] - m.arrival_time, start_time=m.arrival_time))
    return records


def calibrate(llm: LLM, requests: Sequence[SimRequest], seed: int = 0
              ) -> tuple[StepCostModel, list[StepShape], list[float]]:
    """Run ``requests`` on ``llm`` (built with ``scheduler_cls=RecordingScheduler``), after one unrecorded warm-up
    request, and fit the cost model to its steps: (the model, each step's shape, each step's measured seconds)."""
    scheduler = getattr(llm.engine, "scheduler", None)
    if not isinstance(scheduler, RecordingScheduler):
        raise TypeError("calibrate needs an LLM built with scheduler_cls=RecordingScheduler (labkit.measure.sim), "
                        f"got scheduler {type(scheduler).__name__}")
    # A fresh engine's first steps pay one-time costs (allocations, first calls into each kernel): several times a
    # steady step. Run the workload's first request once, unrecorded, so that the fit sees steady-state steps only.
    run_real(llm, list(requests)[:1], seed)
    num_shapes, num_steps = len(scheduler.shapes), len(llm.engine.step_stats)
    run_real(llm, requests, seed)
    shapes, steps = scheduler.shapes[num_shapes:], llm.engine.step_stats[num_steps:]
    if len(shapes) != len(steps):
        raise RuntimeError(f"{len(shapes)} planned steps but {len(steps)} timed ones: use a synchronous engine "
                           "(async_scheduling=False) to calibrate")
    seconds = [s.duration for s in steps]
    return StepCostModel.fit(shapes, seconds), shapes, seconds
