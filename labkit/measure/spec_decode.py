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


def lookup_acceptance(prompt_ids: Sequence[int], output_ids: Sequence[int], k: int = 3, min_n: int = 1,
                      max_n: int = 3) -> float:
    """The acceptance rate prompt lookup (``method="ngram"``) gets on a greedy output, replayed offline: each step
    proposes up to k tokens from the text so far, keeps the ones that match the output, then adds one."""
    from labkit.core.spec_decode.ngram_proposer import ngram_lookup

    pos, proposed, accepted = 1, 0, 0  # the prefill emits output_ids[0]
    while pos < len(output_ids):
        guess = ngram_lookup(list(prompt_ids) + list(output_ids[:pos]), min(k, len(output_ids) - pos - 1),
                             min_n, max_n)
        hits = next((i for i, (g, t) in enumerate(zip(guess, output_ids[pos:])) if g != t), len(guess))
        proposed, accepted, pos = proposed + len(guess), accepted + hits, pos + hits + 1
    return accepted / proposed if proposed else 0.0


def quoting_prompts(llm: LLM, n: int, length: int, rounds: int = 2) -> list[str]:
    """Prompts whose answer is already in them (editing a draft, quoting a source), validated at this length.

    Start from a story the model tells after a seed; the prompt is the story, then the seed again. The model's
    continuation of that prompt need not be the story (the quote changes its context), so the prompt is rebuilt
    from the continuation ``rounds`` times, and of twice ``n`` candidates the ``n`` whose greedy answer prompt lookup
    predicts best (``lookup_acceptance``, at ``length`` tokens) are kept, the best first. At notebook 13's full size
    (96 output tokens, 16 prompts, two rounds) every kept prompt had 92-100% of its proposals accepted on the bundled
    model; short answers converge less often (print ``lookup_acceptance`` to see)."""
    seeds = [SEEDS[i % len(SEEDS)] for i in range(2 * n)]
    seeds = [seed if i < len(SEEDS) else f"{seed}, {fresh}" for i, (seed, fresh) in
             enumerate(zip(seeds, story_prompts(2 * n, seed=1)))]
    params = SamplingParams(max_tokens=length, temperature=0, ignore_eos=True)
    told = [o.outputs[0].text for o in llm.generate(seeds, params, use_tqdm=False)]
    for _ in range(rounds):
        prompts = [f"{seed}{story}\n{seed}" for seed, story in zip(seeds, told)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        told = [o.outputs[0].text for o in outs]
    prompts = [f"{seed}{story}\n{seed}" for seed, story in zip(seeds, told)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    score = [lookup_acceptance(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
    best = sorted(range(len(prompts)), key=lambda i: -score[i])[:n]
    return [prompts[i] for i in best]  # the best first: a batch-1 run takes the first


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


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification emits when each proposal is kept with probability ``alpha``, independently, until
    the first rejection: 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023)."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s speed-up: tokens per verification over the cost of a speculative step, 1 + k * c plain
    steps, c being one proposal's cost (proposing it and verifying it) relative to a plain decode step."""
    return expected_tokens(alpha, k) / (1 + k * c)


def acceptance_by_position(accepted_per_pos: Sequence[int], num_drafts: int) -> list[float]:
    """alpha at each proposal position, from vLLM's ``num_accepted_tokens_per_pos``: position j is reached only
    when positions 0..j-1 were all kept, so alpha_j = accepted_j / accepted_(j-1) (alpha_0 = accepted_0 / drafts).
    Unlike accepted / proposed, it does not fall with k by construction."""
    reached = [num_drafts, *accepted_per_pos[:-1]]
    return [a / r if r else float("nan") for a, r in zip(accepted_per_pos, reached)]


def step_seconds(llm: LLM, since: int = 0) -> float:
    """Median duration of ``llm``'s decode steps (no prompt tokens) from step index ``since`` on."""
    return statistics.median(st.duration for st in llm.engine.step_stats[since:] if st.num_prefill_tokens == 0)


def forward_ms_by_tokens(llm: LLM, since: int = 0) -> dict[int, float]:
    """Median forward-pass time (ms) of the steps of ``llm``'s runs so far (from step index ``since``), by tokens
    computed in the step: what verifying 1 + k tokens costs next to a plain decode step of 1 token (batch 1 when
    every run since then had one request)."""
    times: dict[int, list[float]] = defaultdict(list)
    for st in llm.engine.step_stats[since:]:
        if st.num_prefill_tokens == 0 and "forward" in st.stage_times:
            times[st.num_computed_tokens].append(st.stage_times["forward"] * 1e3)
    return {n: statistics.median(v) for n, v in sorted(times.items())}
