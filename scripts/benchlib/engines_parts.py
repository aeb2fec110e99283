"""bench_engines, parts 1b, 1c and 2: batch slots, where `chunked`'s time goes, chunked prefill."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench_common import timed
from tqdm.auto import tqdm

from benchlib.engines_throughput import Result, Sizes
from labkit import LLM, SamplingParams
from labkit.core.attention import TorchAttentionBackend
from labkit.core.model.linear import LinearKernel
from labkit.course.workloads import Workload, prompt_ids_of_length, sampling_params_for
from labkit.measure.summary import Run, run_workload, summarize

# ---- part 1b: batch slots ----

@dataclass
class SlotRow:
    """``chunked`` and transformers' continuous batching with the same number of batch slots."""

    slots: int  # labkit's max_num_seqs = transformers' max_requests_per_batch
    chunked: Result  # median round
    hf: Result | None  # median round; None with --skip-transformers
    round_ratios: list[float]

    @property
    def ratio(self) -> float | None:
        return None if self.hf is None else self.chunked.tokens_per_s / self.hf.tokens_per_s


def median_run(runs: list[Result]) -> Result:
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def slot_row(slots: int, runs: list[tuple[Result, Result | None]]) -> SlotRow:
    hf_runs = [h for _, h in runs if h is not None]
    return SlotRow(slots, median_run([c for c, _ in runs]), median_run(hf_runs) if hf_runs else None,
                   [c.tokens_per_s / h.tokens_per_s for c, h in runs if h is not None])


def best_vs_best(rows: list[SlotRow]) -> tuple[SlotRow, SlotRow] | None:
    """Each system at its own best number of slots: (chunked's best row, transformers' best row)."""
    with_hf = [r for r in rows if r.hf is not None]
    if not with_hf:
        return None
    return (max(rows, key=lambda r: r.chunked.tokens_per_s),
            max(with_hf, key=lambda r: r.hf.tokens_per_s))  # type: ignore[union-attr]


# ---- part 1c: where chunked's time goes ----

@dataclass
class Breakdown:
    """One timed run of ``chunked``: its wall time split into the linear layers, attention and the rest."""

    slots: int
    output_tokens: int
    total: float  # seconds: wall time of the whole workload
    matmul: float  # inside the linear layers' kernels (labkit.core.model.linear): the same work transformers does
    attention: float  # inside the attention backend: K/V writes and gathers, scores, softmax, values
    other: float  # everything else: scheduler, runner, norms, RoPE, activations, sampling, detokenizing

    @property
    def matmul_only_tokens_per_s(self) -> float:
        """The ceiling: throughput if everything but the linear layers took no time at all."""
        return self.output_tokens / self.matmul


def time_breakdown(workload: Workload, sizes: Sizes, slots: int) -> Breakdown:
    """One run of ``chunked`` on the CPU with every linear kernel call and every attention call timed."""
    llm = LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32", max_num_seqs=slots,
              max_num_batched_tokens=sizes.budget)
    prompts, params = workload.prompts(), sampling_params_for(workload)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    matmul, attention = [0.0], [0.0]
    with timed(LinearKernel, "__call__", matmul), timed(TorchAttentionBackend, "attend", attention):
        run = run_workload(llm, prompts, params)
    return Breakdown(slots, workload.num_output_tokens, run.wall_time, matmul[0], attention[0],
                     run.wall_time - matmul[0] - attention[0])


# ---- part 2: chunked prefill vs whole-prompt prefill ----

@dataclass
class ChunkRow:
    name: str
    itl_p99: float
    itl_p50: float
    short_itl_max: float
    ttft_long: float
    throughput: float
    max_step_tokens: int


def chunk_experiment(sizes: Sizes, device: str) -> tuple[list[ChunkRow], float, list[float], dict[str, Run]]:
    kwargs: dict[str, object] = dict(device=device, dtype="float32", max_num_seqs=sizes.num_short + sizes.num_long)
    llms = {"continuous": LLM("labkit-tiny", engine="continuous", **kwargs)}  # type: ignore[arg-type]
    for b in sizes.budgets:
        llms[f"chunked {b}"] = LLM("labkit-tiny", engine="chunked",  # type: ignore[arg-type]
                                   max_num_batched_tokens=b, **kwargs)
    tok = llms["continuous"].tokenizer
    shorts = [prompt_ids_of_length(tok, sizes.short_prompt, seed=i) for i in range(sizes.num_short)]
    longs = [prompt_ids_of_length(tok, sizes.long_prompt, seed=100 + i) for i in range(sizes.num_long)]
    short_p = SamplingParams(max_tokens=sizes.short_output, temperature=0.0, ignore_eos=True)
    long_p = SamplingParams(max_tokens=sizes.long_output, temperature=0.0, ignore_eos=True)
    for llm in llms.values():
        llm.generate(shorts[:2] + longs[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    alone = run_workload(llms["continuous"], shorts, short_p)
    decode_step = statistics.median(st.duration for st in alone.step_stats[1:])
    arrivals = [0.0] * sizes.num_short + [(10 + 16 * k) * decode_step for k in range(sizes.num_long)]
    prompts, params = shorts + longs, [short_p] * sizes.num_short + [long_p] * sizes.num_long
    per_run: dict[str, list[ChunkRow]] = {name: [] for name in llms}
    last: dict[str, Run] = {}
    for _ in tqdm(range(sizes.repeats), desc="chunking experiment (repeats)"):
        for name, llm in llms.items():  # interleaved, so a slow spell of the machine hits every engine alike
            run = last[name] = run_workload(llm, prompts, params, arrival_times=arrivals, label=name)
            s = run.summary()
            short_gaps = [g for o in run.outputs[: sizes.num_short] for g in o.metrics.itl]
            per_run[name].append(ChunkRow(
                name, s.itl.p99, s.itl.median, max(short_gaps),
                summarize(run.outputs[sizes.num_short :]).ttft.mean, s.output_throughput,
                max(st.num_computed_tokens for st in run.step_stats)))
    rows = []
    for name, reps in per_run.items():
        med = lambda f, reps=reps: statistics.median(f(r) for r in reps)  # noqa: E731
        rows.append(ChunkRow(name, med(lambda r: r.itl_p99), med(lambda r: r.itl_p50), med(lambda r: r.short_itl_max),
                             med(lambda r: r.ttft_long), med(lambda r: r.throughput), reps[0].max_step_tokens))
    return rows, decode_step, arrivals[sizes.num_short :], last


# ---- report ----
