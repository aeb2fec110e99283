"""Benchmark host overhead: how much of each engine step the device spends waiting for Python.

Run from the repository root:

    .venv/bin/python scripts/bench_host_overhead.py              # full run, writes docs/benchmarks/host_overhead.md
    .venv/bin/python scripts/bench_host_overhead.py --smoke      # small sizes, well under a minute; no report
    .venv/bin/python scripts/bench_host_overhead.py --device cuda --mbu-preset llama3.2-1b --dtype bfloat16

In one run, on the bundled model (CPU float32 unless --device says otherwise), engine ``chunked``, decode
batches of 1 and 32 requests (prompts of 16 tokens, every request decoding to ``max_tokens``):

1. **Host time per decode step and its share of the step**, for each host-side option the engine exposes on
   this device, side by side: ``prepare_inputs="loop"`` (per-token Python input preparation) against
   ``"vectorized"`` (the default), and on CUDA also ``enforce_eager=False`` (CUDA graphs). Host time comes from a
   ``torch.profiler`` trace (``labkit.profiling``): the
   part of each step in which the device had no work (on a CPU: the step minus the aten operators of the
   forward pass; see ``labkit/profiling/trace_analysis.py``). Tracing slows every operator a little, so the
   untraced step time of the same configuration is reported beside it, and an estimate of the untraced host
   time (traced host share x untraced step time).
2. **transformers' own ``generate``** on the same checkpoint (greedy, EOS ignored) at the same batch sizes:
   per-step time = (time for N2 tokens - time for N1 tokens) / (N2 - N1), so prefill cancels out. The goal
   (issue 7): ``chunked``'s per-step host overhead at batch 1 <= 1/3 of transformers' per-step time.
3. With ``--mbu-preset``: decode MBU at batch 1 on that preset (random weights), per configuration; on a GPU
   that is where CUDA graphs show (a ~1B model in bf16: ``--mbu-preset llama3.2-1b --dtype bfloat16``).

Configurations alternate round by round so that a burst of load from other programs hits them alike; every
figure is a median. Benchmarks are scripts, not tests (DESIGN.md section 6). Notebook 10 explains the terms.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, not installed
from bench_common import Hardware, OtherLoad, bench_parser, finish_report, md_table, report_header, start_bench  # noqa: E402  (scripts/ is on sys.path)

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.analysis.hardware import DeviceRoof, probe  # noqa: E402
from labkit.analysis.roofline import decode_cost, mbu  # noqa: E402
from labkit.device import synchronize  # noqa: E402
from labkit.model.source import bundled_model_path  # noqa: E402
from labkit.profiling import profile_engine  # noqa: E402
from labkit.workbook.workloads import prompt_ids_of_length  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "host_overhead.md"
HOST_STAGES = ("schedule", "prepare", "sample", "detokenize")  # the StageClock stages outside the forward pass
ASYNC = "vectorized + async"  # async scheduling: steps overlap, so it is measured by its step period, untraced


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; --smoke shrinks everything."""

    batches: tuple[int, ...]
    prompt_len: int
    max_tokens: int  # tokens each request decodes (the decode steps measured)
    rounds: int
    hf_tokens: tuple[int, int]  # N1, N2 for transformers' per-step time
    mbu_context: int
    mbu_tokens: int


FULL = Sizes(batches=(1, 32), prompt_len=16, max_tokens=48, rounds=5, hf_tokens=(8, 56), mbu_context=512,
             mbu_tokens=32)
SMOKE = Sizes(batches=(1, 4), prompt_len=8, max_tokens=6, rounds=1, hf_tokens=(2, 6), mbu_context=32, mbu_tokens=4)


def configurations(device: torch.device) -> dict[str, dict[str, object]]:
    """The host-side options this device can run, by label."""
    # Eager unless the label says CUDA graphs (graphs are the default on CUDA).
    configs: dict[str, dict[str, object]] = {"loop": {"prepare_inputs": "loop", "enforce_eager": True},
                                             "vectorized": {"prepare_inputs": "vectorized", "enforce_eager": True},
                                             ASYNC: {"async_scheduling": True, "enforce_eager": True}}
    if device.type == "cuda":
        configs["vectorized + CUDA graphs"] = {"enforce_eager": False}
        configs["async + CUDA graphs"] = {"async_scheduling": True, "enforce_eager": False}
    return configs


def is_async(label: str) -> bool:
    return "async" in label


@dataclass
class Samples:
    """Per-decode-step samples of one (configuration, batch) cell, pooled over rounds. Seconds."""

    step: list[float] = field(default_factory=list)  # untraced step time
    period: list[float] = field(default_factory=list)  # untraced, from one step's end to the next's
    host_stages: list[float] = field(default_factory=list)  # untraced schedule+prepare+sample+detokenize
    traced_step: list[float] = field(default_factory=list)
    traced_host: list[float] = field(default_factory=list)  # device idle inside the traced step

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))

    @property
    def host_share(self) -> float:
        return statistics.median(h / s for h, s in zip(self.traced_host, self.traced_step))


def measure_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams, cell: Samples, logdir: Path) -> None:
    """One untraced and one traced run of the same requests; decode steps only. An async engine is not traced
    (``profile_engine`` refuses it: its forward pass runs on a worker thread); only its step period counts."""
    first = len(llm.engine.step_stats)
    llm.generate(prompts, params, use_tqdm=False)
    steps = llm.engine.step_stats[first:]
    for prev, st in zip([None, *steps], steps):
        if not st.is_prefill:
            cell.step.append(st.duration)
            cell.host_stages.append(sum(st.stage_times.get(k, 0.0) for k in HOST_STAGES))
            if prev is not None:
                cell.period.append(st.end - prev.end)
    if llm.engine.async_scheduling:
        return
    prof = profile_engine(llm, prompts, params, logdir=logdir, warmup=False)
    prof.trace_path.unlink()  # traces are tens of MB at batch 32; the analysis is all we keep
    analysis = prof.analyze()
    for step, st in zip(analysis.steps, prof.step_stats, strict=True):
        if not st.is_prefill:
            cell.traced_step.append(step.duration / 1e6)
            cell.traced_host.append(step.host_overhead / 1e6)


@torch.inference_mode()
def hf_per_step(model: torch.nn.Module, ids: torch.Tensor, tokens: tuple[int, int], rounds: int) -> float:
    """transformers' generate: marginal seconds per decode step, (t(N2) - t(N1)) / (N2 - N1), median of rounds."""
    def run(n: int) -> float:
        synchronize(ids.device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                       min_new_tokens=n, pad_token_id=0)
        synchronize(ids.device)
        return time.perf_counter() - t0

    run(2)  # warm-up
    n1, n2 = tokens
    return statistics.median((run(n2) - run(n1)) / (n2 - n1) for _ in range(rounds))


def measure_mbu(preset: str, device: torch.device, dtype: torch.dtype, configs: dict[str, dict[str, object]],
                sizes: Sizes, roof: DeviceRoof) -> list[list[str]]:
    """Decode MBU at batch 1 on ``preset`` for each configuration (median decode step, untraced)."""
    rows = []
    ids = None
    for label, options in configs.items():
        llm = LLM(preset, engine="chunked", device=device, dtype=dtype,
                  max_model_len=sizes.mbu_context + sizes.mbu_tokens + 8, **options)  # type: ignore[arg-type]
        ids = ids or prompt_ids_of_length(llm.tokenizer, sizes.mbu_context, seed=3)
        params = SamplingParams(max_tokens=sizes.mbu_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        steps: list[float] = []
        for _ in range(sizes.rounds):
            first = len(llm.engine.step_stats)
            llm.generate([ids], params, use_tqdm=False)
            run = llm.engine.step_stats[first:]
            if is_async(label):  # overlapping steps: time from one step's end to the next's
                steps += [st.end - prev.end for prev, st in zip(run, run[1:]) if not st.is_prefill]
            else:
                steps += [st.duration for st in run if not st.is_prefill]
        step = statistics.median(steps)
        cost = decode_cost(llm.model_config, 1, sizes.mbu_context + sizes.mbu_tokens // 2, llm.dtype.itemsize)
        rows.append([label, f"{step * 1e3:.2f}", f"{cost.total_bytes / step / 1e9:.1f}",
                     f"{mbu(cost, step, roof):.1%}"])
        del llm
    return rows


def exposed_host(cells: dict[tuple[str, int], Samples], label: str, batch: int) -> float:
    """Host time per step the device is left waiting: the step period minus the device's work per step, taken
    from the synchronous configuration that runs the same arithmetic (vectorized, or vectorized + CUDA graphs)."""
    sync = cells[(label.replace("async", "vectorized", 1) if "CUDA" in label else "vectorized", batch)]
    device_work = sync.median("step") * (1 - sync.host_share)
    return max(0.0, cells[(label, batch)].median("period") - device_work)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def findings(sizes: Sizes, cells: dict[tuple[str, int], Samples]) -> list[str]:
    lo, hi = min(sizes.batches), max(sizes.batches)
    share_lo, share_hi = cells[("vectorized", lo)].host_share, cells[("vectorized", hi)].host_share
    why = ("the host's per-step work grows more slowly than the arithmetic, so batching spreads it over more tokens"
           if share_hi < share_lo else "batching did not lower the host's share here")
    lines = [f"- Host overhead is {share_lo:.0%} of a decode step at batch {lo} and {share_hi:.0%} at batch {hi} "
             f"(vectorized): {why}."]
    for b in sizes.batches:
        ratio = cells[(ASYNC, b)].median("period") / cells[("vectorized", b)].median("period")
        lines.append(f"- Batch {b}: async scheduling takes {ratio:.2f}x the wall time per decode step of the "
                     "synchronous engine, for the same tokens. "
                     + ("The host's scheduling and preparation hid behind the forward pass." if ratio < 1 else
                        "The overlap cost more than it hid: the worker thread's forward pass is Python calling small "
                        "operators too, so the two threads take turns on the GIL and the cores."))
    for b in sizes.batches:
        loop, vec = cells[("loop", b)], cells[("vectorized", b)]
        ratio = vec.median("host_stages") / loop.median("host_stages")
        lines.append(f"- Batch {b}: the untraced host stages take {ratio:.2f}x as long with "
                     f"`prepare_inputs=\"vectorized\"` as with `\"loop\"` "
                     f"({'vectorized' if ratio < 1 else 'the loop'} is faster here); the whole untraced step, "
                     f"{vec.median('step') / loop.median('step'):.2f}x.")
    return lines


def report(command: str, hw: Hardware, sizes: Sizes, dtype: torch.dtype, cells: dict[tuple[str, int], Samples],
           hf: dict[int, float], mbu_rows: list[list[str]] | None, mbu_preset: str | None, roof: DeviceRoof | None,
           wall_s: float, other_load: float | None) -> str:
    labels = list(dict.fromkeys(label for label, _ in cells))
    rows = []
    for b in sizes.batches:
        for label in labels:
            c = cells[(label, b)]
            if is_async(label):  # overlapping steps: no trace, no per-step duration that means the same
                rows.append([str(b), label, "", "", "", "", "", ms(exposed_host(cells, label, b)),
                             ms(c.median("period"))])
                continue
            rows.append([str(b), label, ms(c.median("step")), ms(c.median("host_stages")), ms(c.median("traced_step")),
                         ms(c.median("traced_host")), f"{c.host_share:.0%}", ms(c.host_share * c.median("step")),
                         ms(c.median("period"))])
        rows.append([str(b), "transformers generate", ms(hf[b]), "", "", "", "", "", ms(hf[b])])
    async_rows = []
    for b in sizes.batches:
        vec, asy = cells[("vectorized", b)], cells[(ASYNC, b)]
        async_rows.append([str(b), ms(vec.median("period")), ms(asy.median("period")),
                           f"{asy.median('period') / vec.median('period'):.2f}x",
                           ms(vec.host_share * vec.median("step")), ms(exposed_host(cells, ASYNC, b))])
    a1 = exposed_host(cells, ASYNC, 1) / hf[1]
    fix_rows = []
    for b in sizes.batches:
        loop, vec = cells[("loop", b)], cells[("vectorized", b)]
        fix_rows.append([str(b), f"{vec.median('traced_host') / loop.median('traced_host'):.2f}x",
                         f"{vec.median('host_stages') / loop.median('host_stages'):.2f}x",
                         f"{vec.median('step') / loop.median('step'):.2f}x",
                         f"{loop.host_share:.0%} -> {vec.host_share:.0%}"])
    b1 = cells[("vectorized", 1)]
    goal_traced = b1.median("traced_host") / hf[1]
    goal_estimate = b1.host_share * b1.median("step") / hf[1]
    lines = [
        *report_header("Benchmark: host overhead per engine step", command, hw, wall_s, other_load),
        f"## 1. Host time per decode step (labkit-tiny, {str(dtype).removeprefix('torch.')}, engine `chunked`)",
        "",
        f"Batches of B requests with {sizes.prompt_len}-token prompts, each decoding {sizes.max_tokens} tokens; decode "
        f"steps only, medians over {sizes.rounds} round(s). *untraced step*: the engine's own clock (`StepStats`). "
        "*host stages*: schedule + prepare + sample + detokenize, untraced (Python outside the forward pass). "
        "*traced host*: from the torch.profiler trace, the part of the step in which the device had no work: the "
        "host stages plus the Python between the forward pass's operators (on a CPU, device work = the aten "
        "operators inside `labkit::forward`). *share*: traced host / traced step. *est. untraced host*: share x "
        "untraced step. transformers' row: its generate's per-step time (no breakdown).",
        "",
        md_table(["B", "configuration", "untraced step ms", "host stages ms", "traced step ms", "traced host ms",
                  "host share", "est. untraced host ms", "step period ms"], rows),
        "",
        "*step period*: from one decode step's end to the next one's, untraced: what a token of every running "
        "request costs in wall time. With async scheduling the next step is planned while the current one runs, "
        "so steps overlap and only the period is comparable; its host overhead is estimated as the part of the "
        "period the device is not working: period - the vectorized configuration's device time per step "
        "(untraced step x (1 - host share)), the same arithmetic on the same batch.",
        "",
        "## 2. What the host-side fix changes (vectorized / loop)",
        "",
        md_table(["B", "traced host", "host stages", "untraced step", "host share loop -> vectorized"], fix_rows),
        "",
        "## 3. What async scheduling changes (vectorized + async / vectorized)",
        "",
        md_table(["B", "step period ms (sync)", "step period ms (async)", "async / sync",
                  "est. host ms (sync)", "est. exposed host ms (async)"], async_rows),
        "",
        "## 4. Goal: host overhead of `chunked` at batch 1 <= 1/3 of transformers' generate per-step time",
        "",
        md_table(["", "ms", "ratio to transformers' step"], [
            ["transformers generate, per step (B=1)", ms(hf[1]), "1"],
            ["chunked host overhead, traced (B=1)", ms(b1.median("traced_host")), f"{goal_traced:.2f}"],
            ["chunked host overhead, est. untraced (B=1)", ms(b1.host_share * b1.median("step")),
             f"{goal_estimate:.2f}"],
            ["chunked + async scheduling, est. exposed host overhead (B=1)", ms(exposed_host(cells, ASYNC, 1)),
             f"{a1:.2f}"],
        ]),
        "",
        f"Synchronous `chunked`: **goal {'met' if goal_traced <= 1 / 3 else 'not met'}** on the traced figure "
        f"({goal_traced:.2f}) and **{'met' if goal_estimate <= 1 / 3 else 'not met'}** on the untraced estimate "
        f"({goal_estimate:.2f}). With async scheduling: **{'met' if a1 <= 1 / 3 else 'not met'}** ({a1:.2f}, an "
        "estimate: see the definition under the first table). "
        "(Tracing slows host and device work alike, so no figure here is exact; read them together.)",
        "",
        "Findings:",
        "",
        *findings(sizes, cells),
        "",
    ]
    if mbu_rows is not None and roof is not None:
        lines += [
            f"## 5. Decode MBU at batch 1 ({mbu_preset}, random weights, {str(dtype).removeprefix('torch.')})",
            "",
            f"Context {sizes.mbu_context}, {sizes.mbu_tokens} decode steps per run, median step; bytes from "
            f"`labkit.analysis.roofline.decode_cost`; roof measured in this run: {roof.summary()}.",
            "",
            md_table(["configuration", "step ms", "GB/s", "MBU"], mbu_rows),
            "",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = bench_parser("host time per engine step, before and after the host-side fixes", DEFAULT_OUT,
                          device_help="cpu (default), cuda or auto")
    parser.add_argument("--mbu-preset", default=None, help="also measure decode MBU at batch 1 on this preset")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    bench = start_bench(args, "bench_host_overhead.py", DEFAULT_OUT)
    out, command, device, dtype, hw, t0 = bench.out, bench.command, bench.device, bench.dtype, bench.hw, bench.t0
    other_load = OtherLoad()

    configs = configurations(device)
    llms = {label: LLM("labkit-tiny", engine="chunked", device=device, dtype=dtype, max_num_seqs=max(sizes.batches),
                       **options)  # type: ignore[arg-type]
            for label, options in configs.items()}
    tokenizer = next(iter(llms.values())).tokenizer
    prompts = [prompt_ids_of_length(tokenizer, sizes.prompt_len, seed=i) for i in range(max(sizes.batches))]
    params = SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in llms.values():  # warm-up: first calls allocate, pick kernels, capture graphs
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)

    from transformers import AutoModelForCausalLM
    hf_model = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=dtype).to(device).eval()
    hf: dict[int, list[float]] = {b: [] for b in sizes.batches}
    cells = {(label, b): Samples() for label in configs for b in sizes.batches}
    with tempfile.TemporaryDirectory(prefix="bench-host-") as logdir:
        for _ in tqdm(range(sizes.rounds), desc="rounds"):
            for b in sizes.batches:
                for label, llm in llms.items():
                    measure_engine(llm, prompts[:b], params, cells[(label, b)], Path(logdir))
                ids = torch.tensor(prompts[:b], device=device)  # equal lengths: no padding needed
                hf[b].append(hf_per_step(hf_model, ids, sizes.hf_tokens, rounds=1))
    del llms, hf_model

    mbu_rows, roof = None, None
    if args.mbu_preset:
        roof = probe(device, dtype, smoke=args.smoke)
        mbu_rows = measure_mbu(args.mbu_preset, device, dtype, configs, sizes, roof)

    load = other_load.fraction()
    text = report(command, hw, sizes, dtype, cells, {b: statistics.median(v) for b, v in hf.items()}, mbu_rows,
                  args.mbu_preset, roof, time.perf_counter() - t0, load)
    finish_report(text, out, load)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
