"""Stress: hundreds of seeded random requests through the ``chunked`` engine on a small KV pool.

Random prompt lengths (some sharing a prefix, for the prefix cache, some repeating a few tokens, so
equal blocks follow different prefixes), random sampling parameters
(greedy, temperature, top-k, top-p, seeds, n > 1, stop strings and stop tokens), arrivals spread over
the run, aborts, and injected step faults (with and without async scheduling), on a pool barely larger than the
largest request: requests wait, get preempted and are recomputed. The block manager's invariants are checked after
every step (``debug_checks``); at the end every request has finished and every block is free. Every completion
must equal a reference run of the same requests in static batches over a contiguous cache (float64,
so no schedule may change a token, sampled ones included: each sequence has its own seeded generator);
aborted and failed ones must be a prefix of it. The run is step-driven, so it is deterministic.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from labkit import LLM, SamplingParams
from labkit.core.engine.base import StepFailedError
from labkit.core.sequence import Sequence

NUM_REQUESTS = 120  # per configuration: 360 requests in all
STOP_STRINGS = ["e", "an", ".", "the"]


@dataclass
class Planned:
    """One request of the workload: what to send, at which step, and when (if ever) to abort it."""

    prompt: list[int]
    params: SamplingParams
    arrival_step: int
    abort_step: int | None = None


@dataclass
class StressConfig:
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool
    spare_blocks: int  # pool size = the largest request's blocks + this


CONFIGS = {  # seed -> engine configuration
    0: StressConfig(block_size=2, max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=True,
                    spare_blocks=3),
    1: StressConfig(block_size=4, max_num_seqs=5, max_num_batched_tokens=7, enable_prefix_caching=False,
                    spare_blocks=1),
    2: StressConfig(block_size=1, max_num_seqs=12, max_num_batched_tokens=24, enable_prefix_caching=True,
                    spare_blocks=6),
}


def random_params(rng: random.Random) -> SamplingParams:
    stop = [rng.choice(STOP_STRINGS)] if rng.random() < 0.1 else []
    stop_ids = [rng.randrange(3, 2000)] if rng.random() < 0.15 else []
    common = {"max_tokens": rng.randint(1, 24), "stop": stop, "stop_token_ids": stop_ids,
              "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.5:
        return SamplingParams(temperature=0, **common)
    return SamplingParams(temperature=rng.uniform(0.3, 1.5), top_k=rng.choice([-1, 1, 5, 50]),
                          top_p=rng.choice([1.0, 0.9, 0.5]), seed=rng.randrange(2**31),
                          n=rng.choice([1, 1, 1, 2, 3]), **common)


def workload(seed: int, n: int) -> list[Planned]:
    rng = random.Random(seed)
    prefixes = [[1] + [rng.randrange(3, 2000) for _ in range(rng.randint(6, 20))] for _ in range(3)]
    plan = []
    for _ in range(n):
        # Some prompts repeat a few tokens: equal blocks after different prefixes must not share K/V.
        vocab = (10, 13) if rng.random() < 0.25 else (3, 2000)
        body = [rng.randrange(*vocab) for _ in range(rng.randint(1, 30))]
        prompt = (rng.choice(prefixes) + body) if rng.random() < 0.3 else body
        arrival = rng.randint(0, 3 * n // 2)
        abort = arrival + rng.randint(0, 12) if rng.random() < 0.06 else None
        plan.append(Planned(prompt, random_params(rng), arrival, abort))
    return plan


class StepFaults:
    """Fault hook: raises on the chosen step calls and remembers which sequences each fault hit."""

    def __init__(self, calls: set[int]) -> None:
        self.calls, self.n = calls, 0
        self.hit: list[list[Sequence]] = []

    def __call__(self, seqs: list[Sequence]) -> None:
        self.n += 1
        if self.n in self.calls:
            self.hit.append(list(seqs))
            raise RuntimeError(f"injected fault {len(self.hit)}")


@pytest.fixture(scope="module")
def tiny(random_checkpoint) -> Path:  # type: ignore[no-untyped-def]
    return random_checkpoint("llama")


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", sorted(CONFIGS))
def test_random_traffic_on_a_small_pool(tiny: Path, seed: int, async_scheduling: bool) -> None:
    cfg = CONFIGS[seed]
    plan = workload(seed, NUM_REQUESTS)
    rng = random.Random(seed + 100)
    largest = max(len(p.prompt) + (p.params.max_tokens or 0) - 1 for p in plan)
    num_blocks = -(-largest // cfg.block_size) + cfg.spare_blocks
    llm = LLM(str(tiny), engine="chunked", dtype="float64", debug_checks=True, block_size=cfg.block_size,
              num_gpu_blocks=num_blocks, max_num_seqs=cfg.max_num_seqs,
              max_num_batched_tokens=cfg.max_num_batched_tokens, enable_prefix_caching=cfg.enable_prefix_caching,
              async_scheduling=async_scheduling)
    faults = StepFaults(set(rng.sample(range(5, 400), 4)))
    llm.engine.fault_hook = faults

    arrivals: dict[int, list[int]] = {}
    aborts: dict[int, list[int]] = {}
    for i, p in enumerate(plan):
        arrivals.setdefault(p.arrival_step, []).append(i)
        if p.abort_step is not None:
            aborts.setdefault(p.abort_step, []).append(i)
    seqs: dict[int, list[Sequence]] = {}
    failed: set[int] = set()
    last_arrival = max(arrivals)
    step = 0
    while step <= last_arrival or llm.engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            seqs[i] = llm.add_request(plan[i].prompt, plan[i].params)
        for i in aborts.get(step, []):
            for seq in seqs.get(i, []):
                llm.engine.abort_request(seq.seq_id)
        if llm.engine.has_unfinished_requests():
            try:
                llm.step()
            except StepFailedError as exc:
                failed.update(s.seq_id for s in exc.failed)
        step += 1
        assert step < 20_000, "the engine stopped making progress"

    # The stress really stressed: preemptions, faults, aborts (and prefix hits when caching is on).
    engine = llm.engine
    assert engine.num_preemptions > 0 and faults.hit and failed  # type: ignore[attr-defined]
    assert (engine.block_manager.num_hit_tokens > 0) == cfg.enable_prefix_caching  # type: ignore[attr-defined]
    assert max(s.kv_blocks_used or 0 for s in engine.step_stats) <= num_blocks
    assert engine.block_manager.num_free_blocks == num_blocks  # type: ignore[attr-defined]
    engine.block_manager.check_invariants([])  # type: ignore[attr-defined]
    assert failed == {s.seq_id for batch in faults.hit for s in batch if s.finish_reason.value == "error"}

    reference = LLM(str(tiny), engine="kvcache", dtype="float64", max_num_seqs=16)
    want = reference.generate([p.prompt for p in plan], [p.params for p in plan], use_tqdm=False)
    counts = {"stop": 0, "length": 0, "abort": 0, "error": 0}
    for i, out in enumerate(want):
        for seq, ref in zip(seqs[i], out.outputs):
            reason = seq.finish_reason.value if seq.finish_reason else None
            assert reason in counts, f"request {i}: unfinished ({reason})"
            counts[reason] += 1
            if reason in ("abort", "error"):
                assert seq.output_token_ids == ref.token_ids[: seq.num_output_tokens], f"request {i}"
                assert (reason == "error") == (seq.seq_id in failed)
            else:
                assert (seq.output_token_ids, reason, seq.text) == (ref.token_ids, ref.finish_reason, ref.text), \
                    f"request {i} ({plan[i].params})"
    assert counts["abort"] > 0 and counts["error"] > 0 and counts["stop"] > 0 and counts["length"] > 0
