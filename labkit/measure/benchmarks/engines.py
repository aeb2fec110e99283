"""``scripts/bench_engines.py``'s sizes and measurements: labkit's engines and transformers side by side.

Part 1: throughput of every system on one workload, in interleaved rounds (1b: ``chunked`` and transformers'
continuous batching at several batch slots; 1d: a prefill-heavier mix, in the same rounds); 1c: where ``chunked``'s
time goes; 2: chunked prefill against whole-prompt prefill. Notebooks 07 and 08 explain what is measured;
``engines_report`` writes the report and draws the figures.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from labkit.core.attention import TorchAttentionBackend
from labkit.core.llm import LLM
from labkit.core.model.linear import LinearKernel
from labkit.core.model.source import bundled_model_path
from labkit.core.sampling_params import SamplingParams
from labkit.measure.rounds import interleave
from labkit.measure.summary import Run, run_workload, summarize
from labkit.measure.timing import time_call, timing_calls
from labkit.measure.workloads import Workload, prompt_ids_of_length, sampling_params_for

LABKIT_ENGINES = ("kvcache", "paged", "continuous", "chunked")
HF_CB = "transformers continuous batching (generate_batch)"


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; --smoke shrinks everything."""

    workload: str  # a file in data/workloads/
    prefill_workload: str  # the prefill-heavier mix of part 1d
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


FULL = Sizes(workload="heterogeneous_64", prefill_workload="prefill_heavy_48",
             max_num_seqs=16, budget=512, num_short=12, short_prompt=32,
             short_output=128, num_long=4, long_prompt=1024, long_output=16, budgets=(128, 256, 512), repeats=5,
             slots=(8, 16, 32, 64))
SMOKE = Sizes(workload="heterogeneous_small_16", prefill_workload="uniform_small_16",
              max_num_seqs=4, budget=64, num_short=3, short_prompt=16,
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
        return int(out.shape[1] - width)

    batch_generate([[1, 5, 6, 7]], 4)  # warm-up
    prompts, lens = workload.prompts(), workload.output_lens

    def every_batch() -> tuple[int, int]:
        """Steps and token positions computed over the whole workload."""
        steps = computed = 0
        for i in tqdm(range(0, len(prompts), sizes.max_num_seqs), desc="transformers generate (batches)"):
            ids = [list(p) for p in prompts[i : i + sizes.max_num_seqs]]  # type: ignore[arg-type]
            new = max(lens[i : i + sizes.max_num_seqs])
            got = batch_generate(ids, new)
            assert got == new, f"generate produced {got} tokens per row, expected {new}"
            width = max(len(x) for x in ids)
            steps += new
            computed += len(ids) * (width + new - 1)  # padded prefill, then one position per row per step
        return steps, computed

    (steps, computed), seconds = time_call(every_batch, device)
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


@dataclass
class ThroughputRounds:
    """Part 1's interleaved rounds, with parts 1b and 1d run in the same rounds."""

    results: list[Result]  # each system's median round on the workload, labkit's engines first
    round_ratios: dict[str, list[float]]  # system -> chunked's tokens/s over its tokens/s, round by round
    slot_rows: list[SlotRow]  # part 1b
    prefill_rounds: list[tuple[Result, Result | None]]  # part 1d: chunked and padded generate, round by round


def measure_throughput(workload: Workload, prefill_workload: Workload, sizes: Sizes, device: str,
                       model: torch.nn.Module | None, repeats: int) -> ThroughputRounds:
    """Every system on ``workload`` (transformers' only with ``model``), ``chunked`` and ``generate_batch`` at every
    number of slots of ``sizes.slots``, and both on ``prefill_workload``: all of them once per round, interleaved,
    so that a slow spell of the machine hits every system. Each run warms its system up itself."""
    systems: dict[str, Callable[[], Result]] = {
        engine: (lambda engine=engine: run_labkit(engine, workload, sizes, device)) for engine in LABKIT_ENGINES}
    if model is not None:
        systems["generate"] = lambda: run_hf_generate(model, workload, sizes)
        systems["generate_batch"] = lambda: run_hf_continuous(model, workload, sizes, kv_tokens_for(sizes.max_num_seqs))
    part1 = list(systems)
    for slots in sizes.slots:  # part 1b; at max_num_seqs slots part 1's own runs serve
        if slots != sizes.max_num_seqs:
            sized = replace(sizes, max_num_seqs=slots)
            systems[f"chunked, {slots} slots"] = lambda sized=sized: run_labkit("chunked", workload, sized, device)
            if model is not None:
                systems[f"generate_batch, {slots} slots"] = (
                    lambda sized=sized, slots=slots: run_hf_continuous(model, workload, sized, kv_tokens_for(slots)))
    systems["chunked, prefill mix"] = lambda: run_labkit("chunked", prefill_workload, sizes, device)  # part 1d
    if model is not None:
        systems["generate, prefill mix"] = lambda: run_hf_generate(model, prefill_workload, sizes)
    runs: dict[str, list[Result]] = {name: [] for name in systems}

    def recorded(name: str) -> Callable[[], None]:
        return lambda: runs[name].append(systems[name]())

    interleave({name: recorded(name) for name in systems}, repeats, warmup=0, device=device, check_load=False)
    none: list[Result | None] = [None] * repeats
    chunked = runs["chunked"]
    sweep = {slots: list(zip(chunked, runs.get("generate_batch", none))) if slots == sizes.max_num_seqs else
             list(zip(runs[f"chunked, {slots} slots"], runs.get(f"generate_batch, {slots} slots", none)))
             for slots in sizes.slots}
    return ThroughputRounds(
        results=[median_run(runs[name]) for name in part1],
        round_ratios={runs[name][0].name: [c.tokens_per_s / x.tokens_per_s for c, x in zip(chunked, runs[name])]
                      for name in part1},
        slot_rows=[slot_row(slots, pairs) for slots, pairs in sweep.items()],
        prefill_rounds=list(zip(runs["chunked, prefill mix"], runs.get("generate, prefill mix", none))))


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
    with timing_calls(LinearKernel, "__call__", matmul), timing_calls(TorchAttentionBackend, "attend", attention):
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

    def repetition(name: str) -> Callable[[], None]:
        def run_once() -> None:
            run = last[name] = run_workload(llms[name], prompts, params, arrival_times=arrivals, label=name)
            s = run.summary()
            short_gaps = [g for o in run.outputs[: sizes.num_short] for g in o.metrics.itl]
            per_run[name].append(ChunkRow(
                name, s.itl.p99, s.itl.median, max(short_gaps),
                summarize(run.outputs[sizes.num_short :]).ttft.mean, s.output_throughput,
                max(st.num_computed_tokens for st in run.step_stats)))

        return run_once

    # interleaved, so a slow spell of the machine hits every engine alike (warmed up above)
    interleave({name: repetition(name) for name in llms}, sizes.repeats, warmup=0, device=device, check_load=False)
    rows = []
    for name, reps in per_run.items():
        med = lambda f, reps=reps: statistics.median(f(r) for r in reps)  # noqa: E731
        rows.append(ChunkRow(name, med(lambda r: r.itl_p99), med(lambda r: r.itl_p50), med(lambda r: r.short_itl_max),
                             med(lambda r: r.ttft_long), med(lambda r: r.throughput), reps[0].max_step_tokens))
    return rows, decode_step, arrivals[sizes.num_short :], last
