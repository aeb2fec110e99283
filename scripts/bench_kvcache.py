"""Benchmark the KV cache: naive vs kvcache decode cost side by side, and decode MBU on a real shape.

Run from the repository root:

    .venv/bin/python scripts/bench_kvcache.py              # full run, ~3-5 min on 2 CPU cores
    .venv/bin/python scripts/bench_kvcache.py --smoke      # small sizes, well under a minute
    .venv/bin/python scripts/bench_kvcache.py --out docs/benchmarks/kvcache.md

A full run writes docs/benchmarks/kvcache.md (a smoke run writes a file only when given --out). In one run:

1. Per-token decode cost at several context lengths, engine ``naive`` (recomputes the whole sequence every
   step) against ``kvcache`` (one new token per step against a contiguous cache), on the bundled model:
   the median decode-step time at each context, and their ratio (notebooks 02-03).
2. Total time to generate N tokens with each engine: quadratic against linear.
3. Decode MBU at batch 1 on a preset of a real architecture (``smollm2-135m``: 135M parameters, random
   weights): the median decode-step time, the bytes that step must move (``labkit.analysis.roofline.decode_cost``)
   and the bandwidth roof measured in this same run (``labkit.analysis.hardware.probe``, full size). MBU = achieved
   bytes/s over the roof (notebook 04).
4. Where a decode step's time goes: engine stages, a profile of the forward pass by operator, the floor set
   by the matmul kernels alone (every weight matrix times one vector, nothing else), and the attention call
   as labkit makes it against a fused grouped-query call.

Benchmarks are scripts, not tests (DESIGN.md §6): compare side by side in one run, report ratios, name the
hardware. Timings synchronise the device before reading the clock (``StageClock``, ``time_fn``).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, not installed
from bench_common import Hardware, OtherLoad, bench_parser, finish_report, md_table, report_header, start_bench  # noqa: E402  (scripts/ is on sys.path)

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.analysis.hardware import DeviceRoof, probe  # noqa: E402
from labkit.analysis.roofline import StepCost, decode_cost, mbu  # noqa: E402
from labkit.analysis.timing import time_fn  # noqa: E402
from labkit.cache import ContiguousKVCache  # noqa: E402
from labkit.device import synchronize  # noqa: E402
from labkit.model import CausalLM  # noqa: E402
from labkit.model.attention import sdpa  # noqa: E402
from labkit.workbook.workloads import prompt_ids_of_length  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "kvcache.md"


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; --smoke shrinks everything."""

    contexts: tuple[int, ...]  # context lengths at which a decode step is timed
    decode_steps: int  # decode steps timed per context (median reported)
    gen_prompt_len: int
    gen_tokens: int  # tokens generated in the end-to-end comparison
    mbu_context: int  # prompt length before the timed decode steps of the preset
    mbu_steps: int
    profile_steps: int


FULL = Sizes(contexts=(16, 64, 256, 512, 1024), decode_steps=8, gen_prompt_len=16, gen_tokens=512,
             mbu_context=128, mbu_steps=32, profile_steps=8)
SMOKE = Sizes(contexts=(16, 64, 128), decode_steps=3, gen_prompt_len=8, gen_tokens=24,
              mbu_context=32, mbu_steps=4, profile_steps=2)


# ---- records ----

@dataclass(frozen=True)
class DecodePoint:
    """Median decode-step cost of one engine at one context length."""

    engine: str
    context_len: int  # tokens before the first timed decode step
    step_s: float  # whole engine step: prepare + forward + sample + detokenize
    forward_s: float  # the model's forward pass (and lm_head) alone


@dataclass(frozen=True)
class GenerationRun:
    """One request generating ``num_tokens`` tokens; seconds since arrival at which each checkpoint was reached."""

    engine: str
    prompt_len: int
    num_tokens: int
    seconds_at: dict[int, float]


@dataclass(frozen=True)
class MBUResult:
    preset: str
    num_params: int
    dtype: str
    context_len: int  # the median timed step's context
    step_s: float
    forward_s: float
    stage_s: dict[str, float]  # median seconds per engine stage
    cost: StepCost

    def bandwidth(self, seconds: float) -> float:
        return self.cost.total_bytes / seconds


@dataclass(frozen=True)
class OpTime:
    name: str
    calls_per_step: float
    ms_per_step: float


@dataclass
class Breakdown:
    """Where the preset's decode forward spends its time."""

    forward_s: float  # the forward pass timed by itself (no engine around it)
    ops: list[OpTime]
    ops_per_step: float
    matmul_floor_s: float  # every nn.Linear weight times one vector, back to back, nothing else
    matmul_floor_t_s: float  # the same with each weight stored transposed, (in, out): x @ W_t
    matmul_bytes: int
    attention_labkit_s: float  # labkit's sdpa (repeat_kv + boolean mask), all layers
    attention_fused_s: float  # F.scaled_dot_product_attention(enable_gqa=True), no mask, all layers
    categories: dict[str, float] = field(default_factory=dict)  # ms per step


# ---- measurements ----

def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def decode_steps(llm: LLM, ids: list[int], num_steps: int) -> tuple[list[float], list[float], list[dict[str, float]]]:
    """Generate num_steps + 1 tokens from ``ids``; (durations, forward times, stage times) of the decode steps."""
    before = len(llm.engine.step_stats)
    llm.generate([ids], greedy(num_steps + 1), use_tqdm=False)
    stats = [s for s in llm.engine.step_stats[before:] if not s.is_prefill]
    return [s.duration for s in stats], [s.stage_times["forward"] for s in stats], [s.stage_times for s in stats]


def measure_decode_points(llms: dict[str, LLM], contexts: tuple[int, ...], num_steps: int) -> list[DecodePoint]:
    points = []
    tokenizer = next(iter(llms.values())).tokenizer
    jobs = [(name, c) for c in contexts for name in llms]  # engines alternate, so drift hits both alike
    for name, c in tqdm(jobs, desc="decode cost by context", unit="point"):
        durations, forwards, _ = decode_steps(llms[name], prompt_ids_of_length(tokenizer, c, seed=c), num_steps)
        points.append(DecodePoint(name, c, statistics.median(durations), statistics.median(forwards)))
    return points


def measure_generation(llms: dict[str, LLM], prompt_len: int, num_tokens: int) -> list[GenerationRun]:
    checkpoints = sorted({n for n in (16, 32, 64, 128, 256, 512, 1024, num_tokens) if n <= num_tokens})
    runs = []
    for name, llm in tqdm(llms.items(), desc=f"generate {num_tokens} tokens", unit="engine"):
        ids = prompt_ids_of_length(llm.tokenizer, prompt_len, seed=7)
        out = llm.generate([ids], greedy(num_tokens), use_tqdm=False)[0]
        m = out.metrics
        runs.append(GenerationRun(name, prompt_len, num_tokens,
                                  {n: m.token_times[n - 1] - m.arrival_time for n in checkpoints}))
    return runs


def measure_mbu(llm: LLM, preset: str, context: int, num_steps: int) -> MBUResult:
    ids = prompt_ids_of_length(llm.tokenizer, context, seed=11)
    durations: list[float] = []
    forwards: list[float] = []
    stages: list[dict[str, float]] = []
    # A few short runs from the same prompt: every timed step runs at context .. context + steps_per_run - 1.
    steps_per_run = min(8, num_steps)
    for _ in tqdm(range(max(1, num_steps // steps_per_run)), desc=f"{preset} decode", unit="run"):
        d, f, st = decode_steps(llm, ids, steps_per_run)
        durations += d
        forwards += f
        stages += st
    stage_s = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    dtype_bytes = llm.dtype.itemsize
    median_context = context + steps_per_run // 2
    return MBUResult(preset, llm.model_config.num_params, str(llm.dtype).removeprefix("torch."), median_context,
                     statistics.median(durations), statistics.median(forwards), stage_s,
                     decode_cost(llm.model_config, 1, median_context, dtype_bytes))


def prefilled_cache(model: CausalLM, context: int, extra: int) -> tuple[ContiguousKVCache, torch.Tensor]:
    """A batch-1 cache holding ``context`` tokens, and the next token id to decode."""
    dev = model.device
    cache = ContiguousKVCache(model.config, 1, context + extra + 1, dev, model.dtype)
    ids = torch.randint(0, 1000, (1, context), device=dev)  # (1, T)
    cache.begin_step(torch.ones(1, context, dtype=torch.bool, device=dev))
    model(ids, torch.arange(context, device=dev)[None], cache)
    cache.end_step(context)
    return cache, ids[:, -1:]


@torch.inference_mode()
def decode_forward(model: CausalLM, cache: ContiguousKVCache, token: torch.Tensor) -> torch.Tensor:
    """One decode forward as the kvcache engine runs it: (1, 1) token -> (1, vocab) logits."""
    pos = torch.tensor([[cache.length]], device=token.device)  # (1, 1)
    cache.begin_step(torch.ones(1, 1, dtype=torch.bool, device=token.device))
    hidden = model(token, pos, cache)  # (1, 1, hidden)
    cache.end_step(1)
    return model.compute_logits(hidden[:, -1])  # (1, vocab)


CATEGORIES: dict[str, tuple[str, ...]] = {
    "matmul (linear layers, lm_head)": ("aten::mm", "aten::addmm"),
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_attention_math", "aten::bmm", "aten::_softmax", "aten::baddbmm"),
    "copies (repeat_kv, cache writes, casts)": ("aten::copy_", "aten::clone", "aten::_to_copy", "aten::contiguous",
                                                "aten::_unsafe_view"),
    "mask building": ("aten::bitwise_and", "aten::bitwise_or", "aten::eq", "aten::le", "aten::arange"),
}


@torch.inference_mode()
def measure_breakdown(model: CausalLM, context: int, num_steps: int) -> Breakdown:
    dev = model.device
    cache, token = prefilled_cache(model, context, 3 * num_steps + 4)
    decode_forward(model, cache, token)  # warm-up
    times = []
    for _ in range(num_steps):
        synchronize(dev)
        t0 = time.perf_counter()
        decode_forward(model, cache, token)
        synchronize(dev)
        times.append(time.perf_counter() - t0)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(num_steps):
            decode_forward(model, cache, token)
        synchronize(dev)
    per_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.key_averages():
        self_us = evt.self_device_time_total if dev.type == "cuda" else evt.self_cpu_time_total
        per_op[evt.key][0] += evt.count
        per_op[evt.key][1] += self_us
    ops = sorted((OpTime(k, c / num_steps, us / 1e3 / num_steps) for k, (c, us) in per_op.items()),
                 key=lambda o: -o.ms_per_step)
    aten = [o for o in ops if o.name.startswith("aten::")]  # self times of aten ops do not overlap
    categories = {cat: sum(o.ms_per_step for o in aten if o.name in names) for cat, names in CATEGORIES.items()}
    other = sum(o.ms_per_step for o in aten) - sum(categories.values())
    categories["other ops (norms, RoPE, SiLU, adds, views)"] = other
    # Ops called from Python (not from inside another op): what the interpreter dispatches one by one.
    ops_per_step = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")) / num_steps

    # The floor: every weight matrix of the forward pass times one vector, back to back.
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(1, m.in_features, device=dev, dtype=model.dtype) for m in linears]

    def matmuls() -> None:
        for m, x in zip(linears, xs):
            F.linear(x, m.weight)

    floor = statistics.median(time_fn(matmuls, dev, repeats=max(5, num_steps), warmup=2))
    matmul_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    # The same products with each weight stored transposed, (in, out): BLAS libraries run the two
    # layouts through different GEMV kernels, and on some CPUs one streams memory much faster.
    weights_t = [m.weight.t().contiguous() for m in linears]  # (in, out) each

    def matmuls_t() -> None:
        for w_t, x in zip(weights_t, xs):
            x @ w_t  # (1, in) @ (in, out)

    floor_t = statistics.median(time_fn(matmuls_t, dev, repeats=max(5, num_steps), warmup=2))
    weights_t.clear()  # free the copies before the attention measurements

    # The attention call at this context, as labkit makes it and as one fused GQA call.
    cfg = model.config
    q = torch.randn(1, 1, cfg.num_attention_heads, cfg.head_dim, device=dev, dtype=model.dtype)  # (B, T, nh, d)
    k = cache.k[0][:, :, : cache.length].transpose(1, 2)  # (B, S, n_kv, d)
    v = cache.v[0][:, :, : cache.length].transpose(1, 2)
    mask = torch.ones(1, 1, 1, cache.length, dtype=torch.bool, device=dev)  # (B, 1, T, S)
    layers = cfg.num_hidden_layers
    labkit_attn = statistics.median(time_fn(lambda: sdpa(q, k, v, mask=mask, is_causal=False), dev, 20, 3)) * layers
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, d) views of the cache
    fused = statistics.median(time_fn(lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True),
                                      dev, 20, 3)) * layers
    return Breakdown(statistics.median(times), ops, ops_per_step, floor, floor_t, matmul_bytes, labkit_attn, fused,
                     categories)


# ---- report ----

def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def gbs(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f}"


def report(command: str, hw: Hardware, roof: DeviceRoof, sizes: Sizes, model_name: str,
           points: list[DecodePoint], runs: list[GenerationRun], res: MBUResult, bd: Breakdown,
           wall_s: float, other_load: float | None) -> str:
    by = {(p.engine, p.context_len): p for p in points}
    decode_rows = []
    for c in sizes.contexts:
        n, k = by[("naive", c)], by[("kvcache", c)]
        decode_rows.append([str(c), ms(n.step_s), ms(k.step_s), f"{n.step_s / k.step_s:.1f}x",
                            ms(n.forward_s), ms(k.forward_s), f"{n.forward_s / k.forward_s:.1f}x"])
    first, last = sizes.contexts[0], sizes.contexts[-1]
    naive_growth = by[("naive", last)].step_s / by[("naive", first)].step_s
    kv_growth = by[("kvcache", last)].step_s / by[("kvcache", first)].step_s

    run_by = {r.engine: r for r in runs}
    gen_rows = [[str(n), f"{run_by['naive'].seconds_at[n]:.3f}", f"{run_by['kvcache'].seconds_at[n]:.3f}",
                 f"{run_by['naive'].seconds_at[n] / run_by['kvcache'].seconds_at[n]:.1f}x"]
                for n in run_by["naive"].seconds_at]

    bw_step, bw_fwd = res.bandwidth(res.step_s), res.bandwidth(res.forward_s)
    mbu_step, mbu_fwd = mbu(res.cost, res.step_s, roof), mbu(res.cost, res.forward_s, roof)
    floor_bw = bd.matmul_bytes / bd.matmul_floor_s
    floor_t_bw = bd.matmul_bytes / bd.matmul_floor_t_s
    c = res.cost
    mbu_rows = [
        ["whole engine step (median)", ms(res.step_s), gbs(bw_step), f"{mbu_step:.1%}",
         f"{bw_step / roof.read_bandwidth:.1%}"],
        ["forward stage only (median)", ms(res.forward_s), gbs(bw_fwd), f"{mbu_fwd:.1%}",
         f"{bw_fwd / roof.read_bandwidth:.1%}"],
        ["matmul kernels alone (the floor)", ms(bd.matmul_floor_s), gbs(floor_bw),
         f"{floor_bw / roof.memory_bandwidth:.1%}", f"{floor_bw / roof.read_bandwidth:.1%}"],
        ["matmul kernels alone, weights stored (in, out)", ms(bd.matmul_floor_t_s), gbs(floor_t_bw),
         f"{floor_t_bw / roof.memory_bandwidth:.1%}", f"{floor_t_bw / roof.read_bandwidth:.1%}"],
        ["roof: memory bandwidth (probe)", ms(c.total_bytes / roof.memory_bandwidth), gbs(roof.memory_bandwidth),
         "100%", f"{roof.memory_bandwidth / roof.read_bandwidth:.1%}"],
    ]
    stage_rows = [[k, ms(v), f"{v / res.step_s:.1%}"] for k, v in res.stage_s.items()]
    op_total = sum(bd.categories.values())
    cat_rows = [[k, f"{v:.2f}", f"{v / op_total:.1%}"] for k, v in bd.categories.items()]
    cat_rows.append(["sum of op self times", f"{op_total:.2f}", "100%"])
    op_rows = [[o.name, f"{o.calls_per_step:.0f}", f"{o.ms_per_step:.3f}"] for o in bd.ops[:12]]
    overhead_s = bd.forward_s - bd.matmul_floor_s

    findings = []
    findings.append(
        f"- The matmul kernels alone reach {gbs(floor_bw)} GB/s ({floor_bw / roof.memory_bandwidth:.0%} of the roof) "
        f"moving the {bd.matmul_bytes / 1e6:.0f} MB of weight matrices: that is the ceiling for this forward pass "
        f"as written, before any other op. Everything else in the forward pass adds {ms(overhead_s)} ms per step "
        f"({overhead_s / bd.forward_s:.0%} of it).")
    layout_gain = bd.matmul_floor_s / bd.matmul_floor_t_s
    findings.append(
        f"- Storing each weight transposed, (in, out), and computing `x @ W_t` instead of `F.linear(x, W)` changes "
        f"the matmul floor from {ms(bd.matmul_floor_s)} to {ms(bd.matmul_floor_t_s)} ms ({layout_gain:.2f}x): "
        + ("the BLAS library's GEMV kernel for that layout streams memory faster on this machine."
           if layout_gain > 1.1 else "the weight layout makes little difference to the GEMV kernels here."))
    findings.append(
        f"- Attention at context {res.context_len}: labkit's call (repeat_kv copies K/V to every query head, then "
        f"SDPA with a boolean mask) costs {ms(bd.attention_labkit_s)} ms per step over "
        f"all layers; one fused grouped-query call (`enable_gqa=True`, no mask) costs {ms(bd.attention_fused_s)} ms.")
    findings.append(
        f"- The engine around the forward pass (prepare, sample, detokenize) adds "
        f"{ms(res.step_s - res.forward_s)} ms per step ({(res.step_s - res.forward_s) / res.step_s:.0%}).")
    findings.append(f"- The forward pass dispatches about {bd.ops_per_step:.0f} aten ops from Python per decode step.")

    return "\n".join([
        *report_header("Benchmark: the KV cache (naive vs kvcache) and decode MBU", command, hw, wall_s, other_load, [
            ["measured roof", roof.summary()],
            ["read / copy bandwidth", f"{gbs(roof.read_bandwidth)} / {gbs(roof.copy_bandwidth)} GB/s "
                                      f"({roof.buffer_bytes >> 20} MiB buffers)"],
        ]),
        f"## 1. Per-token decode cost by context length ({model_name}, batch 1)",
        "",
        f"Median of {sizes.decode_steps} decode steps after a prompt of the given length (the steps run at "
        f"contexts c .. c+{sizes.decode_steps - 1}). *step* is the whole engine step (prepare, forward, sample, "
        "detokenize); *forward* is the model's forward pass with lm_head.",
        "",
        md_table(["context", "naive step ms", "kvcache step ms", "naive/kvcache", "naive fwd ms", "kvcache fwd ms",
                  "naive/kvcache (fwd)"], decode_rows),
        "",
        f"From context {first} to {last} the naive step grows {naive_growth:.1f}x (it recomputes every position); "
        f"the kvcache step grows {kv_growth:.1f}x (one position, plus a read of a longer cache).",
        "",
        f"## 2. Time to generate N tokens ({model_name}, prompt of {sizes.gen_prompt_len} tokens, greedy)",
        "",
        "Seconds from arrival until the N-th output token (prefill included).",
        "",
        md_table(["N tokens", "naive s", "kvcache s", "naive/kvcache"], gen_rows),
        "",
        f"## 3. Decode MBU at batch 1 ({res.preset}, {res.num_params / 1e6:.1f}M parameters, random weights, "
        f"{res.dtype}, {hw.device})",
        "",
        f"Median of {sizes.mbu_steps} decode steps (engine `kvcache`) at contexts {sizes.mbu_context} .. "
        f"{sizes.mbu_context + min(8, sizes.mbu_steps) - 1} (short runs from the same prompt). Bytes per step from "
        f"`labkit.analysis.roofline.decode_cost` at context {res.context_len}: weights {c.weight_bytes / 1e6:.1f} MB + "
        f"KV read {c.kv_read_bytes / 1e6:.2f} MB + KV write {c.kv_write_bytes / 1e3:.1f} kB = "
        f"{c.total_bytes / 1e6:.1f} MB; {c.flops / 1e6:.0f} MFLOP, intensity {c.arithmetic_intensity:.2f} FLOP/byte "
        f"(ridge point {roof.ridge_point:.1f}). MBU = (bytes / time) / measured bandwidth roof "
        f"({gbs(roof.memory_bandwidth)} GB/s, the best of read and copy); the last column compares with the "
        f"read-only bandwidth ({gbs(roof.read_bandwidth)} GB/s), the closer match for a step that mostly reads.",
        "",
        md_table(["what is timed", "ms", "GB/s", "MBU", "of read bandwidth"], mbu_rows),
        "",
        f"**MBU {mbu_step:.1%}** for the whole step ({mbu_fwd:.1%} for the forward pass alone).",
        "",
        "## 4. Where the decode step's time goes",
        "",
        "Engine stages (median per step):",
        "",
        md_table(["stage", "ms", "share"], stage_rows),
        "",
        f"The forward pass on its own (timed outside the engine): {ms(bd.forward_s)} ms per step. By operator "
        f"(torch.profiler, self time, {sizes.profile_steps} steps):",
        "",
        md_table(["category", "self ms / step", "share of op time"], cat_rows),
        "",
        f"(The profiler's op times add up to {op_total:.2f} ms per step against {ms(bd.forward_s)} ms of wall time "
        "unprofiled: the difference is Python and dispatch between ops, minus the profiler's own overhead.)",
        "",
        md_table(["op", "calls / step", "self ms / step"], op_rows),
        "",
        "Findings:",
        "",
        *findings,
        "",
    ])


def main() -> int:
    parser = bench_parser("naive vs kvcache decode cost, and decode MBU on a preset", DEFAULT_OUT)
    parser.add_argument("--preset", default="smollm2-135m", help="preset for the MBU measurement")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    bench = start_bench(args, "bench_kvcache.py", DEFAULT_OUT)
    out, command, device, dtype, hw, t0 = bench.out, bench.command, bench.device, bench.dtype, bench.hw, bench.t0

    other_load = OtherLoad()
    roof = probe(device, dtype, smoke=args.smoke)
    print(roof.summary())

    max_len = max(sizes.contexts) + sizes.decode_steps + 2
    model_name = "labkit-tiny"
    llms = {name: LLM(model_name, engine=name, device=device, dtype=dtype,
                      max_model_len=max(max_len, sizes.gen_prompt_len + sizes.gen_tokens))
            for name in ("naive", "kvcache")}
    for llm in llms.values():  # warm-up: first calls allocate and pick kernels
        decode_steps(llm, prompt_ids_of_length(llm.tokenizer, 32, seed=0), 4)
    points = measure_decode_points(llms, sizes.contexts, sizes.decode_steps)
    runs = measure_generation(llms, sizes.gen_prompt_len, sizes.gen_tokens)
    del llms

    big = LLM(args.preset, engine="kvcache", device=device, dtype=dtype,
              max_model_len=sizes.mbu_context + sizes.mbu_steps + 2)
    decode_steps(big, prompt_ids_of_length(big.tokenizer, 16, seed=0), 3)  # warm-up
    res = measure_mbu(big, args.preset, sizes.mbu_context, sizes.mbu_steps)
    bd = measure_breakdown(big.model, sizes.mbu_context, sizes.profile_steps)

    load = other_load.fraction()
    text = report(command, hw, roof, sizes, model_name, points, runs, res, bd, time.perf_counter() - t0, load)
    finish_report(text, out, load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
