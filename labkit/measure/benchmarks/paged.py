"""``scripts/bench_paged.py``'s sizes, records and measurements: the engine run, prefix caching and its cost.

Paged KV memory against contiguous reservation and prefix caching on and off, side by side (notebook 06);
``paged_report`` writes the report and draws the figures.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from labkit.core.kv.block_manager import BlockManager
from labkit.core.kv.paged_pool import kv_bytes_per_token
from labkit.core.llm import LLM
from labkit.core.model.source import resolve_model_source
from labkit.core.sampling_params import SamplingParams
from labkit.measure.kv_memory import (
    ContiguousLayout,
    KVMemoryUsage,
    Layout,
    PagedLayout,
    kv_memory_usage,
    max_concurrent_seqs,
    paged_blocks_per_step,
)
from labkit.measure.rounds import interleave
from labkit.measure.stats import Percentiles
from labkit.measure.timing import time_call, wrap_timed
from labkit.measure.workloads import Workload, load_workload, materialise, prompt_ids_of_length, sampling_params_for

MODEL = "labkit-tiny"
BLOCK_SIZE = 16
WASTE_WORKLOAD = "heterogeneous_64"
MAX_MODEL_LEN = 2048
WASTE_GOAL = 0.04
TTFT_GOAL = 3.0
COST_GOAL = 0.01


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; --smoke shrinks the engine runs (the accounting is always full size)."""

    run_workload: str  # for the engine run at equal budget
    run_max_model_len: int
    run_reservations: int  # KV budget = this many max_model_len reservations
    num_requests: int  # measured requests sharing the prefix
    prefix_len: int
    suffix_len: int
    ttft_rounds: int
    cost_workload: str
    cost_rounds: int


FULL = Sizes(run_workload="heterogeneous_64", run_max_model_len=MAX_MODEL_LEN, run_reservations=8, num_requests=16,
             prefix_len=512, suffix_len=16, ttft_rounds=3, cost_workload="heterogeneous_small_16", cost_rounds=20)
SMOKE = Sizes(run_workload="heterogeneous_small_16", run_max_model_len=512, run_reservations=2, num_requests=4,
              prefix_len=128, suffix_len=16, ttft_rounds=1, cost_workload="heterogeneous_small_16", cost_rounds=1)


# ---- records ----

@dataclass(frozen=True)
class EngineRun:
    """The paged engine on a workload with a pool of ``budget_tokens`` slots."""

    workload: str
    num_requests: int
    budget_tokens: int
    max_model_len: int
    max_running: int  # most sequences computed in one step
    first_batch: int  # sequences admitted into the first static batch
    num_preemptions: int
    peak_blocks: int
    num_blocks: int
    prediction_matches: bool | None  # kv_blocks_used == paged_blocks_per_step (None: preempted, not comparable)
    seconds: float
    num_output_tokens: int


@dataclass(frozen=True)
class PrefixResult:
    """Shared-prefix requests with prefix caching on or off (medians over rounds)."""

    caching: bool
    first_ttft: float  # the first round's first request, alone: it computes the prefix either way
    ttft_mean: float  # mean TTFT of the measured batch
    ttft_median: float
    ttft_p90: float
    prefill_tokens: float  # prompt tokens computed per measured request
    hit_rate: float  # cached prompt tokens / prompt tokens of the measured requests
    seconds: float  # wall time of the measured batch
    outputs: list[list[int]]


@dataclass(frozen=True)
class CostResult:
    """Unrelated prompts with caching on and off."""

    throughput_off: list[float]  # output tokens/s per round
    throughput_on: list[float]
    cached_tokens: int  # prompt tokens found in the cache (0 means a 0% hit rate, as intended)
    bookkeeping_s: float  # seconds in the block manager's hashing and lookups (caching on)
    total_on_s: float  # wall seconds of the caching-on runs

    @property
    def ratio(self) -> float:
        """Throughput with caching over without (1.0: no cost): the median of each round's on/off ratio, since
        the two runs of a round share whatever else the machine was doing at the time."""
        return statistics.median(on / off for on, off in zip(self.throughput_on, self.throughput_off))


# ---- measurements ----

def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def paged_llm(device: torch.device, dtype: torch.dtype, **options: object) -> LLM:
    return LLM(MODEL, engine="paged", device=device, dtype=dtype, block_size=BLOCK_SIZE,
               **options)  # type: ignore[arg-type]


def waste_table(wl: Workload) -> tuple[dict[str, Layout], dict[str, KVMemoryUsage], dict[str, KVMemoryUsage]]:
    layouts: dict[str, Layout] = {
        "contiguous, reserve max_model_len": ContiguousLayout("max_model_len", MAX_MODEL_LEN),
        f"contiguous, reserve prompt + max_tokens {max(wl.output_lens)}":
            ContiguousLayout("max_tokens", MAX_MODEL_LEN, max_tokens=max(wl.output_lens)),
        "contiguous, reserve prompt + exact output": ContiguousLayout("max_tokens", MAX_MODEL_LEN),
        f"paged, block_size {BLOCK_SIZE}": PagedLayout(BLOCK_SIZE),
    }
    life = {name: kv_memory_usage(wl.requests, layout) for name, layout in layouts.items()}
    peak = {name: kv_memory_usage(wl.requests, layout, at="peak") for name, layout in layouts.items()}
    return layouts, life, peak


def concurrency_table(wl: Workload, layouts: dict[str, Layout]) -> tuple[list[int], dict[str, list[int]]]:
    """KV budgets of 1 to 32 max_model_len reservations, and how many of ``wl``'s sequences each layout fits in
    each (by accounting: every sequence counted at its longest)."""
    budgets = [k * MAX_MODEL_LEN for k in (1, 2, 4, 8, 16, 32)]
    return budgets, {name: [max_concurrent_seqs(wl.requests, b, layout) for b in budgets]
                     for name, layout in layouts.items()}


def kv_bytes_per_token_of(model: str, dtype: torch.dtype) -> int:
    """K and V bytes one token of ``model`` holds in the cache (the report's MiB column)."""
    return kv_bytes_per_token(resolve_model_source(model).config, dtype.itemsize)


def measure_engine_run(device: torch.device, dtype: torch.dtype, sizes: Sizes) -> EngineRun:
    base = load_workload(sizes.run_workload)
    budget = sizes.run_reservations * sizes.run_max_model_len
    llm = paged_llm(device, dtype, max_model_len=sizes.run_max_model_len, num_gpu_blocks=budget // BLOCK_SIZE,
                    max_num_seqs=len(base))
    wl = materialise(base, llm.tokenizer, seed=0)
    llm.generate(wl.prompts()[:2], greedy(2), use_tqdm=False)  # warm-up
    before = len(llm.engine.step_stats)
    _, seconds = time_call(lambda: llm.generate(wl.prompts(), sampling_params_for(wl), use_tqdm=False), llm.device)
    steps = llm.engine.step_stats[before:]
    preemptions = steps[-1].num_preemptions - llm.engine.step_stats[before - 1].num_preemptions
    used = [s.kv_blocks_used or 0 for s in steps]
    matches = used == paged_blocks_per_step(wl.requests, BLOCK_SIZE) if preemptions == 0 else None
    max_running = max(s.num_seqs - s.num_idle_slots for s in steps)
    return EngineRun(wl.name, len(wl), budget, sizes.run_max_model_len, max_running,
                     steps[0].num_seqs, preemptions, max(used), llm.engine.num_blocks, matches, seconds,
                     wl.num_output_tokens)


def shared_prefix_prompts(tokenizer, sizes: Sizes, round_index: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """One warm-up prompt and ``num_requests`` measured ones: the same prefix, each with its own question."""
    prefix = prompt_ids_of_length(tokenizer, sizes.prefix_len, seed=1)
    return [prefix + prompt_ids_of_length(tokenizer, 64, seed=10_000 * (round_index + 1) + i)[-sizes.suffix_len:]
            for i in range(sizes.num_requests + 1)]


def measure_prefix_caching(device: torch.device, dtype: torch.dtype, sizes: Sizes, out_len: int = 4
                           ) -> dict[bool, PrefixResult]:
    """Caching off and on in interleaved rounds, each round with fresh questions after the same prefix."""
    llms = {c: paged_llm(device, dtype, max_num_seqs=sizes.num_requests, enable_prefix_caching=c)
            for c in (False, True)}
    for llm in llms.values():  # warm-up, not measured: first calls allocate and pick kernels
        llm.generate([prompt_ids_of_length(llm.tokenizer, 64, seed=0)], greedy(2), use_tqdm=False)
    tokenizer = llms[False].tokenizer
    prompts: list[list[int]] = []  # this round's, the same for caching off and on
    outputs: dict[bool, list[list[int]]] = {}  # each one's greedy tokens in the first round

    def new_round(r: int) -> None:
        prompts[:] = shared_prefix_prompts(tokenizer, sizes, r)

    def run(caching: bool) -> Callable[[], dict[str, float]]:
        llm = llms[caching]

        def one() -> dict[str, float]:
            first = llm.generate(prompts[:1], greedy(out_len), use_tqdm=False)[0]  # computes the prefix either way
            outs, seconds = time_call(lambda: llm.generate(prompts[1:], greedy(out_len), use_tqdm=False), llm.device)
            outputs.setdefault(caching, [o.outputs[0].token_ids for o in outs])
            ttft = Percentiles.of([o.metrics.ttft for o in outs])
            return {"first": first.metrics.ttft, "mean": ttft.mean, "median": ttft.median, "p90": ttft.p90,
                    "batch_seconds": seconds,
                    "prefill": statistics.mean(len(o.prompt_token_ids) - o.num_cached_tokens for o in outs),
                    "hit": sum(o.num_cached_tokens for o in outs) / sum(len(o.prompt_token_ids) for o in outs)}

        return one

    names = {False: "caching off", True: "caching on"}
    rounds = interleave({names[c]: run(c) for c in (False, True)}, sizes.ttft_rounds, warmup=0, device=device,
                        check_load=False, before_round=new_round)
    return {c: PrefixResult(c, rounds.get(name, "first")[0], rounds.median(name, "mean"), rounds.median(name, "median"),
                            rounds.median(name, "p90"), rounds.median(name, "prefill"), rounds.median(name, "hit"),
                            rounds.median(name, "batch_seconds"), outputs[c])
            for c, name in names.items()}


def measure_cost(device: torch.device, dtype: torch.dtype, sizes: Sizes) -> CostResult:
    """Caching off and on in interleaved rounds on prompts that share nothing, fresh every round."""
    base = load_workload(sizes.cost_workload)
    llms = {c: paged_llm(device, dtype, max_num_seqs=len(base), enable_prefix_caching=c) for c in (False, True)}
    box = [0.0]
    bm: BlockManager = llms[True].engine.block_manager  # type: ignore[attr-defined]
    for llm in llms.values():
        llm.generate([prompt_ids_of_length(llm.tokenizer, 64, seed=1)], greedy(2), use_tqdm=False)  # warm-up
    for name in ("lookup_prefix", "cache_full_blocks", "record_prefix_query"):
        wrap_timed(bm, name, box)  # for the rest of the run
    workload: list[Workload] = []  # this round's, the same for caching off and on

    def new_round(r: int) -> None:
        workload[:] = [materialise(base, llms[False].tokenizer, seed=2000 + r)]  # fresh prompts: nothing to find

    def run(caching: bool) -> Callable[[], dict[str, float]]:
        def one() -> dict[str, float]:
            wl = workload[0]
            outs = llms[caching].generate(wl.prompts(), sampling_params_for(wl), use_tqdm=False)
            return {"output_tokens": wl.num_output_tokens, "cached": sum(o.num_cached_tokens for o in outs)}

        return one

    rounds = interleave({"off": run(False), "on": run(True)}, sizes.cost_rounds, warmup=0, device=device,
                        check_load=False, before_round=new_round)
    throughput = {name: [n / t for n, t in zip(rounds.get(name, "output_tokens"), rounds.get(name, "seconds"))]
                  for name in ("off", "on")}
    return CostResult(throughput["off"], throughput["on"], int(sum(rounds.get("on", "cached"))), box[0],
                      sum(rounds.get("on", "seconds")))
