"""``scripts/bench_spec_decode.py``'s comparison: plain decoding and two proposers, interleaved rounds per workload.

Plain decoding, prompt lookup (ngram) and the self-speculative draft (the target's first layer) run side by side
(``labkit.measure.rounds.interleave`` over ``labkit.measure.spec_decode.contender``) on a workload whose answer is
quoted in the prompt and on fresh story openings, at batch 1 and at a larger batch. Notebook 13 explains the terms.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from labkit.core.llm import LLM
from labkit.core.sampling_params import SamplingParams
from labkit.measure.rounds import interleave
from labkit.measure.spec_decode import contender, fresh_prompts, quoting_prompts

# The decodings compared, by name: plain first (every speed-up is over it).
SPECS: dict[str, dict[str, object] | None] = {
    "plain": None,
    "ngram k=3": {"method": "ngram", "num_speculative_tokens": 3},
    "draft (1 layer) k=3": {"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 1},
}
HEADERS = ["workload", "batch", "decoding", "acceptance", "tokens/s", "speed-up", "ITL p99 (ms)"]


@dataclass(frozen=True)
class Sizes:
    """Output tokens per request and the larger batch; --smoke shrinks both."""

    max_tokens: int
    big_batch: int


FULL = Sizes(max_tokens=96, big_batch=16)
SMOKE = Sizes(max_tokens=24, big_batch=4)


def measure_rows(device: torch.device, dtype: torch.dtype, sizes: Sizes, num_rounds: int) -> list[list[str]]:
    """One table row per (workload, batch, decoding): acceptance, median tokens/s, the speed-up over plain decoding
    (median of the per-round ratios, range in brackets) and p99 ITL."""
    llms = {name: LLM("labkit-tiny", engine="chunked", device=str(device), dtype=str(dtype).split(".")[-1],
                      **({"speculative_config": spec} if spec else {})) for name, spec in SPECS.items()}
    params = SamplingParams(max_tokens=sizes.max_tokens, temperature=0, ignore_eos=True)
    quote_pool = quoting_prompts(llms["plain"], sizes.big_batch, length=sizes.max_tokens + 16)
    workloads = {("quoting", 1): quote_pool[:1], ("quoting", sizes.big_batch): quote_pool,
                 ("fresh", 1): fresh_prompts(1), ("fresh", sizes.big_batch): fresh_prompts(sizes.big_batch)}
    rows = []
    for (kind, batch), prompts in workloads.items():
        print(f"{kind} prompts, batch {batch}")
        rounds = interleave({n: contender(llm, prompts, params) for n, llm in llms.items()}, num_rounds,
                            device=device)
        for name in llms:
            speedups = rounds.ratios(name, "plain", "tokens_per_s")
            acc = (f"{rounds.median(name, 'acceptance_rate'):.0%}" if name != "plain" else "-")
            rows.append([kind, str(batch), name, acc,
                         f"{rounds.median(name, 'tokens_per_s'):.0f}",
                         f"{statistics.median(speedups):.2f}x ({min(speedups):.2f}-{max(speedups):.2f})",
                         f"{rounds.median(name, 'itl_p99_ms'):.1f}"])
    return rows
