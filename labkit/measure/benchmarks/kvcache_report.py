"""``scripts/bench_kvcache.py``'s Markdown report (``docs/benchmarks/kvcache.md``)."""

from __future__ import annotations

import statistics

from labkit.measure.benchmarks.kvcache import Breakdown, DecodePoint, GenerationRun, MBUResult, RoofRounds, Sizes
from labkit.measure.benchmarks.report import Hardware, md_table, report_header
from labkit.measure.hardware import DeviceRoof
from labkit.measure.roofline import mbu


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def gbs(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.2f}"


def report(command: str, hw: Hardware, roof: DeviceRoof, sizes: Sizes, model_name: str,
           points: list[DecodePoint], runs: list[GenerationRun], res: MBUResult, bd: Breakdown,
           roof_rounds: RoofRounds, wall_s: float, other_load: float | None) -> str:
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
    floor_labkit_bw = bd.matmul_bytes / bd.matmul_floor_labkit_s
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
        ["matmul kernels alone, as the model runs them (merged, labkit's kernels)", ms(bd.matmul_floor_labkit_s),
         gbs(floor_labkit_bw), f"{floor_labkit_bw / roof.memory_bandwidth:.1%}",
         f"{floor_labkit_bw / roof.read_bandwidth:.1%}"],
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
        f"`labkit.measure.roofline.decode_cost` at context {res.context_len}: weights {c.weight_bytes / 1e6:.1f} MB + "
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
        *gemv_section(roof_rounds, roof, res.preset),
    ])


def gemv_section(rr: RoofRounds, roof: DeviceRoof, preset: str) -> list[str]:
    """Part 5: the GEMV roof by kernel, the whole decode step against it with each linear kernel, and its split."""
    g = rr.gemv
    roof_rows = [[k, gbs(v), f"{v / g.plain:.2f}", f"{v / roof.read_bandwidth:.0%}"] for k, v in g.bandwidth.items()]
    names = {"auto": "labkit's linear kernels (`auto`)", "torch": "`F.linear` everywhere (`torch`)"}
    step_rows, split_rows = [], []
    for kernel, runs in rr.rounds.items():
        fractions = [b.bandwidth / g.plain for b in runs]
        bandwidth = statistics.median(b.bandwidth for b in runs)
        step_rows.append([names[kernel], ms(rr.median(kernel, "step_s")), gbs(bandwidth),
                          f"{statistics.median(fractions):.2f}", ", ".join(f"{f:.2f}" for f in fractions),
                          f"{bandwidth / g.best:.2f}", f"{bandwidth / roof.read_bandwidth:.0%}"])
        parts = {p: statistics.median(b.shares()[p] for b in runs) for p in runs[0].shares()}
        total = sum(parts.values())
        split_rows.append([names[kernel]] + [f"{v * 1e3:.2f} ({v / total:.0%})" for v in parts.values()])
    auto = [b.bandwidth / g.plain for b in rr.rounds["auto"]]
    speedup = [t.step_s / a.step_s for a, t in zip(rr.rounds["auto"], rr.rounds["torch"])]
    met = statistics.median(auto) >= 0.80
    parts_auto = {p: statistics.median(b.shares()[p] for b in rr.rounds["auto"])
                  for p in rr.rounds["auto"][0].shares()}
    matmul_bw = rr.rounds["auto"][0].nbytes / parts_auto["linear layers"]
    return [
        f"## 5. The decode step against the matrix-vector (GEMV) roof ({preset}, batch 1)",
        "",
        "At batch 1 a decode step is a chain of matrix-vector products, so its roof is the bandwidth at which one GEMV "
        f"streams a matrix far larger than the caches ({g.nbytes >> 20} MiB, shapes (n, 512) and (n, 2048), the best "
        "median of 5 interleaved rounds per kernel; `labkit.measure.decode_roof.measure_gemv_roof`). The *plain* "
        f"roof is the best of PyTorch's own matmul in either layout: **{gbs(g.plain)} GB/s**.",
        "",
        md_table(["GEMV kernel", "GB/s", "of the plain roof", "of read bandwidth"], roof_rows),
        "",
        f"The whole engine step (engine `kvcache`, context {rr.context_len}, median of {rr.steps} decode steps per "
        f"round, {len(auto)} rounds, the two kernels' order rotating), bytes per step from `decode_cost`:",
        "",
        md_table(["linear kernels", "step ms", "GB/s", "of the plain GEMV roof", "rounds", "of the best GEMV roof",
                  "of read bandwidth"], step_rows),
        "",
        f"- **Goal (>= 0.80 of the plain GEMV roof for the whole engine step): {'met' if met else 'not met'}** — "
        f"{statistics.median(auto):.2f} (rounds {', '.join(f'{f:.2f}' for f in auto)}). labkit's kernels make the "
        f"step {statistics.median(speedup):.2f}x faster than `F.linear` everywhere (rounds "
        f"{', '.join(f'{x:.2f}x' for x in speedup)}).",
        "",
        "Where the step's time goes (ms per step, median of the rounds, timed in a second run with a timer around "
        "every linear kernel call and every attention call; *everything else* is the rest of the forward pass: "
        "norms, RoPE, SiLU, residual adds, views and the Python between them):",
        "",
        md_table(["linear kernels", "linear layers", "attention", "everything else", "engine (prepare, sample, "
                  "detokenize)"], split_rows),
        "",
        f"The remaining gap, with labkit's kernels: the linear layers stream their weights at about "
        f"{gbs(matmul_bw)} GB/s inside the step (the step's bytes over their time), "
        f"{matmul_bw / g.best:.0%} of the best GEMV kernel on one large matrix: a model's matrices are small "
        f"(a few MB each), and each call pays a fixed cost and restarts the memory prefetchers. Attention and "
        f"everything else add {(parts_auto['attention'] + parts_auto['everything else']) * 1e3:.2f} ms, the engine "
        f"{parts_auto['engine (prepare, sample, detokenize)'] * 1e3:.2f} ms.",
        "",
    ]
