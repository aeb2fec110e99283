"""Measuring speculative decoding: workloads, one timed run, and the per-step cost of verifying more tokens.

Shared by notebook 13 and ``scripts/bench_spec_decode.py``, so both report the same figures the same way:
acceptance rate, mean accepted length, output tokens/s and ITL percentiles of one run (``spec_run_metrics``);
comparisons are interleaved rounds (``labkit.measure.rounds.interleave``). Introduced in notebook 13
(``13_speculative_decoding``).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from labkit.core.llm import LLM
from labkit.core.sampling_params import SamplingParams
from labkit.measure.corpus import story_prompts
from labkit.measure.summary import summarize

SEEDS = ["Once upon a time", "One day, a little girl", "There was a big dog", "Tom and his mom",
         "In a small town", "The sun was hot", "A kind old man", "Lily had a red ball"]


def fresh_prompts(n: int, seed: int = 0) -> list[str]:
    """Story openings: the model writes new text, which rarely repeats what came before."""
    return story_prompts(n, seed=seed)


def quoting_prompts(llm: LLM, n: int, length: int) -> list[str]:
    """Prompts whose answer is already in them (editing a draft, quoting a source): a story the model itself tells
    after a seed, then the seed again. Prompt lookup finds each next phrase in the quote."""
    seeds = [SEEDS[i % len(SEEDS)] for i in range(n)]
    params = SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)
    told = [o.outputs[0].text for o in llm.generate(seeds, params, use_tqdm=False)]
    return [f"{seed}{story}\n{seed}" for seed, story in zip(seeds, told)]


def spec_run_metrics(llm: LLM, prompts: Sequence[str], params: SamplingParams) -> dict[str, float]:
    """Generate once; output tokens/s, ITL median and p99 (ms; tokens of one verification arrive together, so some
    gaps are 0), and, with ``speculative_config``, the acceptance rate and tokens per verification of this run."""
    return measured_run(llm, prompts, params)[1]


def measured_run(llm: LLM, prompts: Sequence[str], params: SamplingParams) -> tuple[list[list[int]], dict[str, float]]:
    """``spec_run_metrics``, with each request's output token ids."""
    engine = llm.engine
    stats = getattr(engine, "spec_decoding_stats", None)
    before = (stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_drafts) if stats is not None else (0, 0, 0)
    start = time.perf_counter()
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    summary = summarize(outs, time.perf_counter() - start)
    metrics = {"tokens_per_s": summary.output_throughput, "itl_p50_ms": summary.itl.median * 1e3,
               "itl_p99_ms": summary.itl.p99 * 1e3}
    if stats is not None and engine.drafter is not None:
        proposed, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
        drafts = stats.num_drafts - before[2]
        metrics["acceptance_rate"] = accepted / proposed if proposed else 0.0
        metrics["accepted_length"] = 1 + accepted / drafts if drafts else 1.0
    return [o.outputs[0].token_ids for o in outs], metrics


def contender(llm: LLM, prompts: Sequence[str], params: SamplingParams) -> Callable[[], dict[str, float]]:
    """A run for ``labkit.measure.rounds.interleave``."""
    return lambda: spec_run_metrics(llm, prompts, params)


def forward_ms_by_tokens(llm: LLM) -> dict[int, float]:
    """Median forward-pass time (ms) of the steps of ``llm``'s runs so far, by tokens computed in the step: what
    verifying 1 + k tokens costs next to a plain decode step of 1 token (batch 1)."""
    times: dict[int, list[float]] = defaultdict(list)
    for st in llm.engine.step_stats:
        if st.num_prefill_tokens == 0 and "forward" in st.stage_times:
            times[st.num_computed_tokens].append(st.stage_times["forward"] * 1e3)
    return {n: statistics.median(v) for n, v in sorted(times.items())}
