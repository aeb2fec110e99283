"""bench_engines' figures: PNGs next to the report."""

from __future__ import annotations

from pathlib import Path

from benchlib.engines_parts import ChunkRow, SlotRow
from benchlib.engines_throughput import LABKIT_ENGINES, Result, Sizes
from labkit.measure.summary import Run


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
