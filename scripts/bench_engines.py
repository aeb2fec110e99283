"""Benchmark the engines side by side: throughput on a heterogeneous workload, and what chunking buys.

Run from the repository root:

    .venv/bin/python scripts/bench_engines.py               # full run (64 requests), writes docs/benchmarks/engines.md
    .venv/bin/python scripts/bench_engines.py --smoke       # small sizes, well under a minute; no report
    .venv/bin/python scripts/bench_engines.py --threads 1   # on a shared machine: fewer threads, steadier timings

In one run, on the bundled model (CPU float32 unless --device says otherwise):

1. Throughput (output tokens/s over the wall time of the whole workload; median of ``--repeats`` rounds,
   3 by default, every round's ratio reported too) of labkit's engines ``kvcache``,
   ``paged``, ``continuous`` and ``chunked``, and of transformers' own batched generation on the same
   checkpoint: ``model.generate`` on FCFS batches of ``max_num_seqs`` prompts, left-padded, each batch run
   to its longest output; and transformers' continuous batching (``generate_batch``'s engine, the
   ``ContinuousBatchingManager``, given each request's own ``max_new_tokens``). Workload:
   ``data/workloads/heterogeneous_64.jsonl`` (64 requests, prompts 16-873 tokens, outputs 16-256), greedy,
   every request producing exactly its output length. Ratios are against ``chunked``.
1b. Batch slots: ``chunked`` and transformers' continuous batching again with 8, 16, 32 and 64 slots
   (``max_num_seqs`` = ``max_requests_per_batch``), in the same rounds; the ratio at equal slots and each
   system at its own best number of slots.
1c. Where ``chunked``'s time goes (CPU): one run at the fewest and the most slots with the linear layers
   and the attention backend timed, the rest being everything else; and the throughput ceiling if only the
   linear layers took time.
2. Chunked prefill against whole-prompt prefill (notebook 08's experiment, larger): short requests decode
   while long prompts arrive mid-run (``LLM.generate(..., arrival_times=...)``). p99 ITL (every gap of
   every request) and throughput of ``continuous`` and of ``chunked`` at several token budgets, medians of
   a few repetitions, as ratios against ``continuous``.

Goals (the issue's): ``chunked`` >= 2x transformers' padded ``generate`` and >= 3x its continuous batching in
output tokens/s; p99 ITL with chunking <= 0.5x without it, at <= 10% throughput cost.

Benchmarks are scripts, not tests (DESIGN.md section 6): compare side by side in one run, report ratios, name
the hardware. Notebooks 07 and 08 explain what is measured here.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, not installed
from bench_common import OtherLoad, md_table, timed  # noqa: E402  (scripts/ is on sys.path)

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.analysis.hardware import device_name  # noqa: E402
from labkit.attention import TorchAttentionBackend  # noqa: E402
from labkit.device import resolve_device, synchronize  # noqa: E402
from labkit.metrics.summary import Run, run_workload, summarize  # noqa: E402
from labkit.model.source import bundled_model_path  # noqa: E402
from labkit.text.tokenizer import load_tokenizer  # noqa: E402
from labkit.workbook.workloads import (  # noqa: E402
    Workload,
    load_workload,
    materialise,
    prompt_ids_of_length,
    sampling_params_for,
)

DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "engines.md"
LABKIT_ENGINES = ("kvcache", "paged", "continuous", "chunked")
HF_CB = "transformers continuous batching (generate_batch)"


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; --smoke shrinks everything."""

    workload: str  # a file in data/workloads/
    max_num_seqs: int  # batch slots of every engine (and transformers' batch size)
    budget: int  # max_num_batched_tokens of chunked (and transformers' max_batch_tokens)
    num_short: int  # chunking experiment: requests decoding when the long prompts arrive
    short_prompt: int
    short_output: int
    num_long: int
    long_prompt: int
    long_output: int
    budgets: tuple[int, ...]  # chunked budgets compared with continuous
    repeats: int  # repetitions of the chunking experiment (medians reported)
    slots: tuple[int, ...]  # batch-slot sweep of chunked and transformers' continuous batching (part 1b)


FULL = Sizes(workload="heterogeneous_64", max_num_seqs=16, budget=512, num_short=12, short_prompt=32,
             short_output=128, num_long=4, long_prompt=1024, long_output=16, budgets=(128, 256, 512), repeats=5,
             slots=(8, 16, 32, 64))
SMOKE = Sizes(workload="heterogeneous_small_16", max_num_seqs=4, budget=64, num_short=3, short_prompt=16,
              short_output=24, num_long=1, long_prompt=256, long_output=4, budgets=(64,), repeats=1, slots=(2, 4))


@dataclass
class Result:
    """One system's run of the throughput workload."""

    name: str
    output_tokens: int  # tokens the workload asked for (what every system must produce)
    seconds: float  # wall time of the whole workload
    steps: int | None = None  # engine steps (labkit) or forward passes (transformers' padded generate)
    computed_tokens: int | None = None  # token positions run through the model, where known
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


# ---- part 1: throughput ----

def run_labkit(engine: str, workload: Workload, sizes: Sizes, device: str) -> Result:
    options: dict[str, object] = {"max_num_seqs": sizes.max_num_seqs}
    if engine == "chunked":
        options["max_num_batched_tokens"] = sizes.budget
    llm = LLM("labkit-tiny", engine=engine, device=device, dtype="float32", **options)
    prompts, params = workload.prompts(), sampling_params_for(workload)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    run = run_workload(llm, prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in run.outputs)
    expected = workload.num_output_tokens
    assert tokens == expected, f"{engine} produced {tokens} tokens, expected {expected}"
    s = run.summary()
    note = (f"TTFT p50/p99 {s.ttft.median:.2f}/{s.ttft.p99:.2f} s, ITL p50/p99 {s.itl.median * 1e3:.0f}/"
            f"{s.itl.p99 * 1e3:.0f} ms")
    if run.num_preemptions:
        note += f", {run.num_preemptions} preemptions"
    return Result(engine, tokens, run.wall_time, len(run.step_stats),
                  sum(st.num_computed_tokens for st in run.step_stats), note)


def hf_model(device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float32).to(device).eval()


@torch.inference_mode()
def run_hf_generate(model: torch.nn.Module, workload: Workload, sizes: Sizes) -> Result:
    """transformers' ``generate`` on FCFS batches of max_num_seqs prompts, left-padded, greedy."""
    device = model.device
    pad = 0

    def batch_generate(ids: list[list[int]], new_tokens: int) -> int:
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)  # (B, width)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        # min_new_tokens = max_new_tokens: no row stops at EOS, as ignore_eos does in labkit
        out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=pad)
        synchronize(device)
        return int(out.shape[1] - width)

    batch_generate([[1, 5, 6, 7]], 4)  # warm-up
    prompts, lens = workload.prompts(), workload.output_lens
    start = time.perf_counter()
    steps = computed = 0
    batches = range(0, len(prompts), sizes.max_num_seqs)
    for i in tqdm(batches, desc="transformers generate (batches)"):
        ids = [list(p) for p in prompts[i : i + sizes.max_num_seqs]]  # type: ignore[arg-type]
        new = max(lens[i : i + sizes.max_num_seqs])
        got = batch_generate(ids, new)
        assert got == new, f"generate produced {got} tokens per row, expected {new}"
        width = max(len(x) for x in ids)
        steps += new
        computed += len(ids) * (width + new - 1)  # padded prefill, then one position per row per step
    seconds = time.perf_counter() - start
    return Result("transformers generate (padded)", workload.num_output_tokens, seconds, steps, computed,
                  f"batches of {sizes.max_num_seqs}, left padding, each run to its longest output")


@torch.inference_mode()
def run_hf_continuous(model: torch.nn.Module, workload: Workload, sizes: Sizes, kv_tokens: int) -> Result:
    """transformers' continuous batching: the ContinuousBatchingManager behind ``generate_batch``.

    ``generate_batch`` takes one ``max_new_tokens`` for every prompt; the workload gives each request its
    own, so the requests go to the same manager through its documented ``add_request(..., max_new_tokens=)``
    (``generate_batch`` itself is that manager's context plus ``add_requests`` and a result loop).
    """
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    page_size = 256  # transformers' default
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=-(-kv_tokens // page_size),
                                         max_batch_tokens=sizes.budget, max_requests_per_batch=sizes.max_num_seqs)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), pad_token_id=0,
                                  eos_token_id=-1)  # -1: no EOS, as ignore_eos does in labkit
    prompts, lens = workload.prompts(), workload.output_lens
    # One short call first: the first use of the model and the manager is slow everywhere.
    model.generate_batch([[1, 5, 6, 7]], generation_config=gen_config, continuous_batching_config=cb_config,
                         max_new_tokens=4)
    setup = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=60,
                                                   continuous_batching_config=cb_config) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(list(p), max_new_tokens=n, eos_token_id=-1)  # type: ignore[arg-type]
               for p, n in zip(prompts, lens)]
        results = {}
        with tqdm(total=len(ids), desc="transformers continuous batching") as bar:
            while len(results) < len(ids):
                out = manager.get_result(timeout=1)
                if out is not None and out.is_finished():
                    results[out.request_id] = out
                    bar.update(1)
                elif out is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped early")
        seconds = time.perf_counter() - start
    tokens = sum(len(results[i].generated_tokens) for i in ids)
    expected = workload.num_output_tokens
    assert tokens == expected, f"transformers' continuous batching produced {tokens} tokens, expected {expected}"
    return Result(HF_CB, tokens, seconds, None, None,
                  f"max_batch_tokens {sizes.budget}, max_requests_per_batch {sizes.max_num_seqs}, "
                  f"{-(-kv_tokens // page_size)} pages of {page_size}; manager start-up "
                  f"{start - setup:.2f} s not counted")


def kv_tokens_for(slots: int) -> int:
    """transformers' KV pool, in tokens: the same as labkit's paged pool on the CPU (slots x max_model_len)."""
    return slots * 2048


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
    matmul: float  # inside F.linear: MKL's matrix multiply, the same work transformers does
    attention: float  # inside the attention backend: K/V writes and gathers, scores, softmax, values
    other: float  # everything else: scheduler, runner, norms, RoPE, activations, sampling, detokenizing

    @property
    def matmul_only_tokens_per_s(self) -> float:
        """The ceiling: throughput if everything but the linear layers took no time at all."""
        return self.output_tokens / self.matmul


def time_breakdown(workload: Workload, sizes: Sizes, slots: int) -> Breakdown:
    """One run of ``chunked`` on the CPU with every ``F.linear`` call and every attention call timed."""
    llm = LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32", max_num_seqs=slots,
              max_num_batched_tokens=sizes.budget)
    prompts, params = workload.prompts(), sampling_params_for(workload)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    matmul, attention = [0.0], [0.0]
    with timed(torch.nn.functional, "linear", matmul), timed(TorchAttentionBackend, "attend", attention):
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


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"


def report(command: str, sizes: Sizes, workload: Workload, results: list[Result], chunk_rows: list[ChunkRow],
           decode_step: float, long_arrivals: list[float], hw: dict[str, str], wall_s: float,
           figure_stem: str | None = None, other_load: float | None = None,
           round_ratios: dict[str, list[float]] | None = None,
           slot_rows: list[SlotRow] | None = None,
           breakdowns: list[Breakdown] | None = None) -> tuple[str, list[str]]:
    by_name = {r.name: r for r in results}

    n_rounds = max((len(v) for v in (round_ratios or {}).values()), default=1)

    def spread(name: str) -> str:
        ratios = (round_ratios or {}).get(name, [])
        return f" (rounds: {', '.join(f'{x:.2f}x' for x in ratios)})" if len(ratios) > 1 else ""

    chunked = by_name["chunked"]
    tput_rows = [[f"`{r.name}`" if r.name in LABKIT_ENGINES else r.name, f"{r.tokens_per_s:.1f}", f"{r.seconds:.1f}",
                  f"{chunked.tokens_per_s / r.tokens_per_s:.2f}x", "-" if r.steps is None else str(r.steps),
                  "-" if r.computed_tokens is None else f"{r.computed_tokens:,}", r.note] for r in results]
    goals = []
    hf_gen = by_name.get("transformers generate (padded)")
    hf_cb = by_name.get(HF_CB)
    if hf_gen:
        ratio = chunked.tokens_per_s / hf_gen.tokens_per_s
        goals.append(f"`chunked` vs transformers' padded `generate`: {ratio:.2f}x{spread(hf_gen.name)} (goal >= 2x): "
                     f"{verdict(ratio >= 2)}")
    if hf_cb:
        ratio = chunked.tokens_per_s / hf_cb.tokens_per_s
        goals.append(f"`chunked` vs transformers' continuous batching (`generate_batch`), both with "
                     f"{sizes.max_num_seqs} slots (part 1): {ratio:.2f}x{spread(hf_cb.name)} (goal >= 3x): "
                     f"{verdict(ratio >= 3)}")
    slot_rows = slot_rows or []
    compared = [r for r in slot_rows if r.ratio is not None]
    best = best_vs_best(slot_rows)
    if compared and best is not None:
        at = ", ".join(f"{r.slots}: {r.ratio:.2f}x" for r in compared)  # type: ignore[str-format]
        met_at = [str(r.slots) for r in compared if r.ratio >= 3]  # type: ignore[operator]
        goals.append(f"the same with equal slots from {compared[0].slots} to {compared[-1].slots} (part 1b): {at}; "
                     f"goal >= 3x met at {', '.join(met_at) + ' slots' if met_at else 'none'}")
        ours, theirs = best
        ratio = ours.chunked.tokens_per_s / theirs.hf.tokens_per_s  # type: ignore[union-attr]
        goals.append(f"each at its own best number of slots (part 1b): `chunked` with {ours.slots} "
                     f"({ours.chunked.tokens_per_s:.0f} tok/s) vs `generate_batch` with {theirs.slots} "
                     f"({theirs.hf.tokens_per_s:.0f} tok/s): {ratio:.2f}x (goal >= 3x): "  # type: ignore[union-attr]
                     f"{verdict(ratio >= 3)}")
    base = next(r for r in chunk_rows if r.name == "continuous")
    chunk_table = [[f"`{r.name}`", f"{r.max_step_tokens}", f"{r.itl_p50 * 1e3:.1f}", f"{r.itl_p99 * 1e3:.1f}",
                    f"{r.itl_p99 / base.itl_p99:.2f}x", f"{r.short_itl_max * 1e3:.1f}", f"{r.ttft_long * 1e3:.0f}",
                    f"{r.throughput:.1f}", f"{r.throughput / base.throughput:.2f}x"] for r in chunk_rows]
    meeting = [r.name for r in chunk_rows if r.name != "continuous"
               and r.itl_p99 <= 0.5 * base.itl_p99 and r.throughput >= 0.9 * base.throughput]
    default = next((r for r in chunk_rows if r.name == f"chunked {sizes.budget}"), None)
    for r in chunk_rows:
        if r.name == "continuous":
            continue
        ok = r.itl_p99 <= 0.5 * base.itl_p99 and r.throughput >= 0.9 * base.throughput
        goals.append(f"`{r.name}`: p99 ITL {r.itl_p99 / base.itl_p99:.2f}x of `continuous` (goal <= 0.5x), "
                     f"throughput {r.throughput / base.throughput:.2f}x (goal >= 0.90x): {verdict(ok)}")
    lines = [
        "# Benchmark: engines side by side, and chunked prefill",
        "",
        f"Generated by `scripts/bench_engines.py` on {hw['date']} in {wall_s:.0f} s.",
        "",
        "```", command, "```",
        "",
        "## Hardware",
        "",
        md_table(["", ""], [[k, v] for k, v in hw.items() if k != "date"]),
        "",
        "## Goals",
        "",
        *[f"- {g}" for g in goals],
        "",
        *([f"Other processes kept {other_load:.0%} of the CPUs busy during this run: every "
           "timing above competed with them, and ratios between systems can move by tens of percent from run to "
           "run. Rerun on an idle machine before reading much into a ratio near its goal.", ""]
          if other_load is not None and other_load > 0.1 else []),
        f"## 1. Throughput on `{workload.name}` (bundled model, float32, max_num_seqs {sizes.max_num_seqs})",
        "",
        f"{workload.summary()}. Greedy; every request produces exactly its output length (labkit: `ignore_eos`; "
        "transformers: EOS disabled). Output tokens/s = the workload's output tokens / wall time of the whole "
        f"workload (one warm-up call before each, not timed); each system's median of "
        f"{n_rounds} round(s), the rounds run one after the other so "
        "that a slow spell of this shared machine hits every system. `chunked` uses a budget of "
        f"{sizes.budget} tokens per "
        f"step, and transformers' continuous batching the same `max_batch_tokens`; transformers' padded `generate` "
        f"runs FCFS batches of {sizes.max_num_seqs}, left-padded, each until its longest output is done.",
        "",
        md_table(["system", "output tok/s", "seconds", "chunked is", "steps", "positions computed", "notes"],
                 tput_rows),
        "",
        "*chunked is*: `chunked`'s throughput divided by this row's. *positions computed*: token positions run "
        "through the model (for the padded `generate`: padded prefill plus every row of every decode step).",
        "",
        *([f"![throughput side by side]({figure_stem}_throughput.png)", ""] if figure_stem else []),
        *slot_section(slot_rows, sizes, n_rounds, figure_stem, len(workload.output_lens)),
        *breakdown_section(breakdowns or [], best),
        f"## 2. Chunked prefill vs whole-prompt prefill ({sizes.num_short} short requests decoding, {sizes.num_long} "
        "long prompts arriving)",
        "",
        f"{sizes.num_short} requests of {sizes.short_prompt} prompt + {sizes.short_output} output tokens start "
        f"together; {sizes.num_long} prompts of {sizes.long_prompt} tokens ({sizes.long_output} output tokens each) "
        f"arrive at {', '.join(f'{t * 1e3:.0f}' for t in long_arrivals)} ms (10, 26, ... decode steps' worth; a "
        f"decode step of the short requests alone took {decode_step * 1e3:.2f} ms). `continuous` prefills each "
        "prompt whole in one step; `chunked` fills each step's token budget with every decode first, then prefill "
        f"chunks. ITL: every gap between consecutive tokens of every request (vLLM's definition). Medians of "
        f"{sizes.repeats} interleaved repetitions.",
        "",
        md_table(["engine", "largest step (tokens)", "ITL p50 ms", "ITL p99 ms", "p99 vs continuous",
                  "short requests' max gap ms", "long prompts' TTFT ms", "output tok/s", "tok/s vs continuous"],
                 chunk_table),
        "",
        (f"Budgets meeting both chunking goals: {', '.join(meeting)}." if meeting else
         "No budget met both chunking goals in this run."),
        "" if default is None else
        f"At the budget used in part 1 ({sizes.budget}), p99 ITL is {default.itl_p99 / base.itl_p99:.2f}x and "
        f"throughput {default.throughput / base.throughput:.2f}x those of `continuous`.",
        "",
        *([f"![chunked prefill]({figure_stem}_chunking.png)", ""] if figure_stem else []),
    ]
    return "\n".join(lines), goals


def slot_section(rows: list[SlotRow], sizes: Sizes, n_rounds: int, figure_stem: str | None,
                 num_requests: int) -> list[str]:
    if not rows:
        return []
    table = [[str(r.slots), f"{r.chunked.tokens_per_s:.1f}", "-" if r.hf is None else f"{r.hf.tokens_per_s:.1f}",
              "-" if r.ratio is None else f"{r.ratio:.2f}x",
              ", ".join(f"{x:.2f}x" for x in r.round_ratios) or "-", str(r.chunked.steps)] for r in rows]
    return [
        f"## 1b. Batch slots: `chunked` and `generate_batch` from {rows[0].slots} to {rows[-1].slots} slots",
        "",
        "The same workload with labkit's `max_num_seqs` and transformers' `max_requests_per_batch` set to the same "
        f"number of slots, everything else as in part 1 (budget {sizes.budget}, KV pool of slots x 2048 tokens for "
        f"both); medians of {n_rounds} round(s), run in the same rounds as part 1. More slots let `chunked` decode "
        "more requests per step, so fewer steps serve the workload; transformers' continuous batching on the CPU "
        "attends with one SDPA over the whole batch under a dense mask (every new token against every cached token "
        "of every request in the batch), so its attention grows with the square of the batch and more slots make "
        "it slower. vLLM's default `max_num_seqs` is 256 and transformers' `max_requests_per_batch` is inferred "
        f"(up to 1024): both defaults let all {num_requests} requests in at once.",
        "",
        md_table(["slots", "`chunked` tok/s", "`generate_batch` tok/s", "chunked is", "rounds", "`chunked` steps"],
                 table),
        "",
        *([f"![batch slots]({figure_stem}_slots.png)", ""] if figure_stem else []),
    ]


def breakdown_section(rows: list[Breakdown], best: tuple[SlotRow, SlotRow] | None) -> list[str]:
    if not rows:
        return []
    hf_best = None if best is None or best[1].hf is None else best[1].hf
    table = [[str(b.slots), f"{b.total:.2f}", f"{b.matmul:.2f} ({b.matmul / b.total:.0%})",
              f"{b.attention:.2f} ({b.attention / b.total:.0%})", f"{b.other:.2f} ({b.other / b.total:.0%})",
              f"{b.matmul_only_tokens_per_s:.0f}",
              "-" if hf_best is None else f"{b.matmul_only_tokens_per_s / hf_best.tokens_per_s:.2f}x"] for b in rows]
    return [
        "## 1c. Where `chunked`'s time goes",
        "",
        "One more run of `chunked` at each end of part 1b with a wall-clock timer around every call of "
        "`F.linear` (the linear layers: MKL's matrix multiply, the same arithmetic transformers does) and of the "
        "attention backend (K/V writes and gathers, scores, softmax, values); the rest of the wall time is "
        "everything else (scheduler, input preparation, norms, RoPE, activations, residual adds, sampling, "
        "detokenizing, and the Python between them). The *matmul-only ceiling* is the throughput if everything "
        "but the linear layers took no time at all: no engine that runs these layers through MKL on this CPU can "
        "pass it.",
        "",
        md_table(["slots", "wall s", "linear layers s", "attention s", "everything else s",
                  "matmul-only ceiling tok/s", "ceiling vs transformers' best"], table),
        "",
    ]


def save_figures(out: Path, results: list[Result], chunk_rows: list[ChunkRow], example_runs: dict[str, Run],
                 sizes: Sizes, slot_rows: list[SlotRow]) -> list[Path]:
    """PNGs next to the report: throughput side by side; batch slots; chunked prefill's ITL and throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunked = next(r for r in results if r.name == "chunked")
    fig, ax = plt.subplots(figsize=(9, 3.8), layout="constrained")
    names = [r.name.replace(" (", "\n(") for r in results]
    colors = ["tab:green" if r.name == "chunked" else ("tab:blue" if r.name in LABKIT_ENGINES else "tab:gray")
              for r in results]
    bars = ax.barh(names, [r.tokens_per_s for r in results], color=colors)
    ax.bar_label(bars, [f"{r.tokens_per_s:.0f} tok/s (chunked is {chunked.tokens_per_s / r.tokens_per_s:.2f}x)"
                        for r in results], padding=4, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(r.tokens_per_s for r in results) * 1.6)
    ax.set_xlabel("output tokens / s (whole workload)")
    ax.set_title(f"{sizes.workload}: labkit's engines (blue/green) and transformers (grey)")
    first = out.with_name(out.stem + "_throughput.png")
    fig.savefig(first, dpi=110)
    plt.close(fig)

    figures = [first]
    if slot_rows:
        fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
        xs = [r.slots for r in slot_rows]
        ax.plot(xs, [r.chunked.tokens_per_s for r in slot_rows], "o-", color="tab:green", label="labkit `chunked`")
        hf = [r for r in slot_rows if r.hf is not None]
        if hf:
            ax.plot([r.slots for r in hf], [r.hf.tokens_per_s for r in hf], "s-", color="tab:gray",  # type: ignore[union-attr]
                    label="transformers `generate_batch`")
            for r in hf:
                ax.annotate(f"{r.ratio:.2f}x", (r.slots, r.chunked.tokens_per_s), textcoords="offset points",
                            xytext=(0, 7), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        top = max([r.chunked.tokens_per_s for r in slot_rows] + [r.hf.tokens_per_s for r in hf])  # type: ignore[union-attr]
        ax.set_ylim(0, top * 1.2)  # room for the labels
        ax.set_xlabel("batch slots (max_num_seqs = max_requests_per_batch)")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{sizes.workload}: throughput vs batch slots\n(labels: chunked's throughput / transformers')",
                     fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        slots_png = out.with_name(out.stem + "_slots.png")
        fig.savefig(slots_png, dpi=110)
        plt.close(fig)
        figures.append(slots_png)

    base = chunk_rows[0]
    fig, (ax_gap, ax_curve) = plt.subplots(1, 2, figsize=(12, 4), layout="constrained", width_ratios=[3, 2])
    smallest = f"chunked {min(sizes.budgets)}"
    for name, color in (("continuous", "tab:gray"), (smallest, "tab:green")):
        run = example_runs[name]
        t0 = min(o.metrics.arrival_time for o in run.outputs)
        xs = [(b - t0) * 1e3 for o in run.outputs[: sizes.num_short] for b in o.metrics.token_times[1:]]
        ys = [g * 1e3 for o in run.outputs[: sizes.num_short] for g in o.metrics.itl]
        ax_gap.scatter(xs, ys, s=6, color=color, label=name)
    for k, o in enumerate(example_runs["continuous"].outputs[sizes.num_short :]):
        t0 = min(x.metrics.arrival_time for x in example_runs["continuous"].outputs)
        ax_gap.axvline((o.metrics.arrival_time - t0) * 1e3, color="tab:red", ls="--", lw=1,
                       label="a long prompt arrives" if k == 0 else None)
    ax_gap.set_xlabel("time since the first arrival (ms)")
    ax_gap.set_ylabel("gap before each token of the short requests (ms)")
    ax_gap.set_title("Decode stalls: whole-prompt prefill vs chunked (one repetition)")
    ax_gap.legend(fontsize=8)
    budgets = [int(r.name.split()[1]) for r in chunk_rows[1:]]
    ax_curve.plot(budgets, [r.itl_p99 / base.itl_p99 for r in chunk_rows[1:]], "o-", color="tab:green",
                  label="p99 ITL vs continuous")
    ax_curve.plot(budgets, [r.throughput / base.throughput for r in chunk_rows[1:]], "s-", color="tab:blue",
                  label="throughput vs continuous")
    ax_curve.axhline(0.5, color="tab:green", ls=":", lw=1, label="goal: p99 ITL <= 0.5x")
    ax_curve.axhline(0.9, color="tab:blue", ls=":", lw=1, label="goal: throughput >= 0.9x")
    ax_curve.set_xscale("log", base=2)
    ax_curve.set_ylim(0, 1.3)
    ax_curve.set_xlabel("chunked: max_num_batched_tokens")
    ax_curve.set_ylabel("ratio to continuous")
    ax_curve.set_title("Chunked prefill: the budget's trade-off")
    ax_curve.legend(fontsize=8)
    for ax in (ax_gap, ax_curve):
        ax.grid(True, alpha=0.3)
    second = out.with_name(out.stem + "_chunking.png")
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [*figures, second]


def main() -> int:
    parser = argparse.ArgumentParser(description="engines side by side on a heterogeneous workload; chunked prefill")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI); no report unless --out is given")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"Markdown report (default {DEFAULT_OUT.relative_to(ROOT)}; none with --smoke)")
    parser.add_argument("--device", default="cpu", help="cpu (default, as the goals are stated) or auto/cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--skip-transformers", action="store_true", help="labkit's engines only")
    parser.add_argument("--repeats", type=int, default=None,
                        help="rounds of part 1 (default 3, --smoke 1); the report shows medians and every "
                             "round's ratio")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = SMOKE if args.smoke else FULL
    device = str(resolve_device(args.device))
    command = " ".join([".venv/bin/python", "scripts/bench_engines.py", *sys.argv[1:]])
    started, load = time.perf_counter(), OtherLoad()
    time.sleep(1.0)
    load_before = load.fraction()
    load = OtherLoad()

    # Part 2 first: its short runs are the most sensitive to the machine slowing down over a long run.
    chunk_rows, decode_step, long_arrivals, example_runs = chunk_experiment(sizes, device)
    workload = materialise(load_workload(sizes.workload), load_tokenizer(bundled_model_path()), seed=0)
    print(workload.summary())
    repeats = args.repeats if args.repeats is not None else (1 if args.smoke else 3)
    model = None if args.skip_transformers else hf_model(device)
    rounds: list[list[Result]] = []
    sweep: dict[int, list[tuple[Result, Result | None]]] = {n: [] for n in sizes.slots}
    for _ in tqdm(range(repeats), desc="rounds of part 1"):  # whole rounds, so a slow spell hits every system
        results = [run_labkit(engine, workload, sizes, device) for engine in LABKIT_ENGINES]
        if model is not None:
            results.append(run_hf_generate(model, workload, sizes))
            results.append(run_hf_continuous(model, workload, sizes, kv_tokens_for(sizes.max_num_seqs)))
        rounds.append(results)
        for slots in sizes.slots:  # part 1b, in the same round
            if slots == sizes.max_num_seqs:  # already run above with these settings
                by_name = {r.name: r for r in results}
                sweep[slots].append((by_name["chunked"], by_name.get(HF_CB)))
                continue
            sized = replace(sizes, max_num_seqs=slots)
            sweep[slots].append((run_labkit("chunked", workload, sized, device),
                                 None if model is None else run_hf_continuous(model, workload, sized,
                                                                              kv_tokens_for(slots))))
    # Each system's median round; each ratio also per round, to show the spread.
    results = [median_run(list(runs)) for runs in zip(*rounds)]
    round_ratios = {r.name: [next(x for x in rnd if x.name == "chunked").tokens_per_s / x.tokens_per_s
                             for rnd in rounds for x in rnd if x.name == r.name] for r in results}
    slot_rows = [slot_row(n, runs) for n, runs in sweep.items()]
    # Part 1c: one timed run at the fewest and the most slots (on the CPU, where calls are synchronous).
    breakdowns = ([time_breakdown(workload, sizes, n) for n in sorted({min(sizes.slots), max(sizes.slots)})]
                  if device == "cpu" else [])
    chunked = next(r for r in results if r.name == "chunked")
    print(f"\n{'system':<52} {'tok/s':>8} {'seconds':>8} {'chunked is':>10}")
    for r in results:
        print(f"{r.name:<52} {r.tokens_per_s:8.1f} {r.seconds:8.2f} {chunked.tokens_per_s / r.tokens_per_s:9.2f}x")
    print(f"\n{'slots':>5} {'chunked tok/s':>14} {'generate_batch tok/s':>21} {'ratio':>7}")
    for row in slot_rows:
        hf = "-" if row.hf is None else f"{row.hf.tokens_per_s:.1f}"
        print(f"{row.slots:>5} {row.chunked.tokens_per_s:14.1f} {hf:>21} "
              f"{'-' if row.ratio is None else f'{row.ratio:.2f}x':>7}")

    for b in breakdowns:
        print(f"chunked, {b.slots} slots: {b.total:.2f} s = linear layers {b.matmul:.2f} + attention "
              f"{b.attention:.2f} + other {b.other:.2f}; matmul-only ceiling {b.matmul_only_tokens_per_s:.0f} tok/s")

    base = chunk_rows[0]
    print(f"\n{'engine':<16} {'ITL p99 ms':>10} {'vs cont.':>9} {'tok/s':>8} {'vs cont.':>9} {'long TTFT ms':>12}")
    for r in chunk_rows:
        print(f"{r.name:<16} {r.itl_p99 * 1e3:10.1f} {r.itl_p99 / base.itl_p99:8.2f}x {r.throughput:8.1f} "
              f"{r.throughput / base.throughput:8.2f}x {r.ttft_long * 1e3:12.0f}")

    wall_s = time.perf_counter() - started
    other = load.fraction()
    dev = torch.device(device)
    hw = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": f"{device_name(dev)} ({device})",
        "torch threads / CPUs": f"{torch.get_num_threads()} / {os.cpu_count()}",
        "other processes' CPU load": ("unknown" if load_before is None else f"{load_before:.0%} of all CPUs at start")
        + "; " + ("unknown" if other is None else f"{other:.0%} during the run")
        + " (above ~10% the timings are unreliable)",
        "torch / transformers": f"{torch.__version__} / {__import__('transformers').__version__}",
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
    }
    if other is not None and other > 0.1:
        print(f"warning: other processes kept {other:.0%} of the CPUs busy; timings are skewed", file=sys.stderr)
    out = args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT)
    text, goals = report(command, sizes, workload, results, chunk_rows, decode_step, long_arrivals, hw, wall_s,
                         figure_stem=None if out is None else out.stem, other_load=other, round_ratios=round_ratios,
                         slot_rows=slot_rows, breakdowns=breakdowns)
    print("\n" + "\n".join(goals))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        figures = save_figures(out, results, chunk_rows, example_runs, sizes, slot_rows)
        print(f"wrote {out} and {', '.join(str(f) for f in figures)}")
    print(f"{wall_s:.0f} s in all; other processes' CPU load during the run: "
          f"{'unknown' if other is None else f'{other:.0%}'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
