"""``scripts/bench_host_overhead.py``'s findings and Markdown report (``docs/benchmarks/host_overhead.md``)."""

from __future__ import annotations

import torch

from labkit.measure.benchmarks.host_overhead import ASYNC, Samples, Sizes, is_async
from labkit.measure.benchmarks.report import Hardware, md_table, report_header
from labkit.measure.hardware import DeviceRoof


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
            f"`labkit.measure.roofline.decode_cost`; roof measured in this run: {roof.summary()}.",
            "",
            md_table(["configuration", "step ms", "GB/s", "MBU"], mbu_rows),
            "",
        ]
    return "\n".join(lines)
