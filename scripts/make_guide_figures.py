"""Render the guides' benchmark figures from the committed reports' data (``docs/benchmarks/*.json``).

    .venv/bin/python scripts/make_guide_figures.py           # rewrite every figures-* region in place
    .venv/bin/python scripts/make_guide_figures.py --check   # exit 1 if a region differs from its report (CI)

A figure quoted in ``docs/instructor_guide.md`` or ``docs/learner_path.md`` lives in a generated region,
``<!-- BEGIN GENERATED: figures-NAME -->`` ... ``<!-- END GENERATED: figures-NAME -->``, whose text this script
renders from the report's machine-readable data (``labkit.measure.benchmarks.report_data``; each report writes its
``.json`` beside its ``.md``). Re-run a benchmark, then this script (``make guide-figures``), and the prose follows.
Only ``figures-*`` regions are touched; everything outside them is left as it is.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from labkit.core.engine.model_runner import SMALL_BATCH_TOKENS
from labkit.measure.benchmarks.report_data import cell, row, table_with

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "benchmarks"
GUIDE = ROOT / "docs" / "instructor_guide.md"
LEARNER = ROOT / "docs" / "learner_path.md"
Data = dict[str, Any]


def load(name: str) -> Data:
    return json.loads((BENCH / f"{name}.json").read_text(encoding="utf-8"))


def _source(data: Data, label: str) -> str:
    return (f"[{label}](benchmarks/{data['report']}) (`{data['command']}`, run on {data['generated'][:10]}, "
            "2-core CPU VM, no GPU)")


def fill(text: str) -> str:
    """One paragraph, wrapped as the guides are (at most 118 characters a line)."""
    return textwrap.fill(text, width=118, break_long_words=False, break_on_hyphens=False)


def host_overhead(data: Data) -> str:
    """Guide section 10: host share of a step, vectorised vs loop preparation, async vs sync."""
    steps = table_with(data, "host share")
    batches = list(dict.fromkeys(r[0] for r in steps["rows"]))
    lo, hi = batches[0], batches[-1]
    share = {b: cell(steps, "host share", B=b, configuration="vectorized") for b in (lo, hi)}
    traced = {col: cell(steps, col, B=lo, configuration="vectorized") for col in ("traced host ms", "traced step ms")}
    fix = table_with(data, "untraced step")
    vec = {b: cell(fix, "untraced step", B=b) for b in batches}
    sync = table_with(data, "async / sync")
    asy = {b: cell(sync, "async / sync", B=b) for b in batches}
    slower_async = all(float(a.rstrip("x")) > 1 for a in asy.values())

    def prep(b: str) -> str:
        if int(b) <= SMALL_BATCH_TOKENS:  # a decode step of b sequences has b tokens: the loop in both modes
            return f"{vec[b]} at batch {b} (both modes now run the same loop there: no evidence either way)"
        return f"{vec[b]} at batch {b} ({'vectorised faster' if float(vec[b].rstrip('x')) < 1 else 'the loop faster'})"

    return fill(
        f"Where the numbers come from: {_source(data, 'benchmarks/host_overhead.md')}. On `labkit-tiny` at batch "
        f"{lo} the host stages and the Python between the operators take {share[lo]} of a traced vectorized `chunked` "
        f"decode step ({traced['traced host ms']} of {traced['traced step ms']} ms); at batch {hi}, {share[hi]}. "
        "With `prepare_inputs=\"vectorized\"` the untraced step took, against the loop's, "
        + " and ".join(prep(b) for b in batches)
        + f". (The vectorised form runs the loop for steps of at most {SMALL_BATCH_TOKENS} tokens.) Async scheduling "
        "took " + " and ".join(f"{asy[b]} (batch {b})" for b in batches)
        + " the synchronous wall time per decode step on this CPU"
        + (": the worker thread and the host take turns on the GIL." if slower_async else ".")
    )


def spec_decode(data: Data) -> str:
    """Guide section 13: acceptance and speed-up per workload, batch and proposer, from the full-size report."""
    t = table_with(data, "acceptance")
    workloads = list(dict.fromkeys(r[0] for r in t["rows"]))
    batches = list(dict.fromkeys(r[1] for r in t["rows"]))
    methods = [m for m in dict.fromkeys(r[2] for r in t["rows"]) if m != "plain"]
    lines = [fill(f"Full size, from {_source(data, 'benchmarks/spec_decode.md')}: the share of proposals accepted "
                  "and tokens/s against plain decoding (median of the rounds, the rounds' range in brackets)."), "",
             "| workload | batch | " + " | ".join(methods) + " |", "|---|---:|" + "---:|" * len(methods)]
    paid, median_only = [], []
    for w in workloads:
        for b in batches:
            cells = []
            for m in methods:
                r = row(t, {"workload": w, "batch": b, "decoding": m})
                speed = r[t["headers"].index("speed-up")]
                cells.append(f"{r[t['headers'].index('acceptance')]} accepted, {speed}")
                median, low = (float(x) for x in re.match(r"([\d.]+)x \(([\d.]+)-", speed).groups())  # type: ignore[union-attr]
                if low > 1.0:
                    paid.append(f"{m} on {w} at batch {b}")
                elif median > 1.0:
                    median_only.append(f"{m} on {w} at batch {b}")
            lines.append(f"| {w} | {b} | " + " | ".join(cells) + " |")
    def listed(rows: list[str]) -> str:
        return rows[0] if len(rows) == 1 else ", ".join(rows[:-1]) + " and " + rows[-1]

    text = (f"Speculation was faster than plain decoding in every round in {len(paid)} of the "
            f"{len(workloads) * len(batches) * len(methods)} rows: {listed(paid)}." if paid else
            "Speculation was faster than plain decoding in every round in no row.")
    if median_only:
        text += (" It was faster at the median but not in every round for " + listed(median_only)
                 + ": a round slowed by another program counts against it.")
    if not paid and not median_only:
        text += " On this host-bound tiny model a proposal's host work costs as much as the step it saves."
    load_during = _load_during(data)
    if load_during is not None and load_during > 10:
        text += (f" Other programs kept {load_during}% of the CPUs busy during that run (the report's hardware "
                 "table; above ~10% its timings are unreliable): the speed-ups are rough, the acceptance rates "
                 "are not (greedy runs are deterministic).")
    lines += ["", fill(text)]
    return "\n".join(lines)


def _load_during(data: Data) -> int | None:
    """Other programs' CPU load during a report's run, in percent of all CPUs (None if the report does not say)."""
    hardware = table_with(data, "")
    for name, value in hardware["rows"]:
        if name == "other processes' CPU load":
            found = re.search(r"(\d+)% of all CPUs during the run", value)
            return int(found[1]) if found else None
    return None


def _rng(values: list[str]) -> str:
    """"0.39-0.71x" from every round's ratio (the last value, the median, left out)."""
    rounds = [float(v) for v in values[:-1]]
    return f"{min(rounds):.2f}-{max(rounds):.2f}x"


SHARE = "non-engine share of a token's time (%)"


def server_overhead(data: Data) -> str:
    """Guide section 9: the server's own time per token, per-token vs per-step hand-off, at each stream count."""
    runs = {s["heading"].split()[0]: {r["title"]: r["rows"] for r in s["rounds"]} for s in data["sections"]
            if s["rounds"]}
    rows, shares = [], []
    for streams, r in runs.items():
        for variant, label in (("per-token", "per token (default)"), ("per-step", "per step")):
            non = f"{float(r['non-engine per token (ms)'][variant][-1]):.2f} ms"
            if variant != "per-token":
                ratios = r["non-engine per token (ms)"][f"{variant} / per-token"]
                every = all(float(v) < 1 for v in ratios[:-1])
                non += f" ({_rng(ratios)}, {'every round' if every else 'not every round'})"
            rows.append(f"| {streams} | {label} | {float(r['client mean TPOT (ms)'][variant][-1]):.1f} ms | "
                        f"{float(r['engine step (ms)'][variant][-1]):.1f} ms | {non} | "
                        f"{r[SHARE][variant][-1]}% |")
        shares.append((streams, r[SHARE]["per-step / per-token"]))
    top = list(runs)[-1]
    tpot = runs[top]["client mean TPOT (ms)"]["per-step / per-token"]
    post = runs[list(runs)[0]]["of which hand-off 'post' (ms)"]
    events = runs[top]["SSE events per token"]["coalesce"][-1]
    halved = all(float(v) < 0.5 for _, ratios in shares for v in ratios[:-1])
    gain = all(float(v) < 1 for v in tpot[:-1])
    return "\n".join([
        fill(f"Measured in {_source(data, 'benchmarks/server_overhead.md')}: `labkit-tiny`, one torch thread per "
             "server, 64-token answers, interleaved rounds; medians, and the per-step hand-off's ratio to per-token "
             "round by round:"), "",
        "| streams | hand-off | client TPOT | engine step per token | non-engine per token | its share |",
        "|---:|---|---:|---:|---:|---:|", *rows, "",
        fill("The per-step hand-off took the server's share of a token's time to "
             + " and ".join(f"{float(r[-1]):.2f}x at {n} streams (rounds {_rng(r)})" for n, r in shares)
             + (", below half in every round" if halved else ", not below half in every round")
             + f"; the engine thread's `post` went from {float(post['per-token'][-1]):.2f} to "
             f"{float(post['per-step'][-1]):.2f} ms per step at {list(runs)[0]} streams. The client's TPOT at {top} "
             f"streams: {float(tpot[-1]):.2f}x (rounds {_rng(tpot)}), "
             + ("lower in every round." if gain else "not lower in every round: no reliable gain.")
             + f" With coalescing, {events} SSE events per token at {top} streams."),
    ])


def kvcache(data: Data) -> str:
    """Guide section 3: per-step cost by context and time to N tokens, naive vs kvcache."""
    steps = table_with(data, "naive step ms")
    first, last = steps["rows"][0], steps["rows"][-1]
    col = steps["headers"].index
    naive = (float(first[col("naive step ms")]), float(last[col("naive step ms")]))
    cached = (float(first[col("kvcache step ms")]), float(last[col("kvcache step ms")]))
    tokens = table_with(data, "N tokens")
    t_first, t_last = tokens["rows"][0], tokens["rows"][-1]
    tcol = tokens["headers"].index
    return fill(
        f"**Numbers to expect** ({_source(data, 'kvcache benchmark')}, idle machine): per decode step, from "
        f"{first[0]} to {last[0]} tokens of context, `naive` grows {naive[0]:.1f} → {naive[1]:.1f} ms "
        f"({naive[1] / naive[0]:.1f}x) while `kvcache` stays at {cached[0]:.1f} → {cached[1]:.1f} ms "
        f"({cached[1] / cached[0]:.1f}x), a {last[col('naive/kvcache')]} gap at {last[0]}. Generating "
        f"{t_first[0]} tokens is only {t_first[tcol('naive/kvcache')]} faster with the cache; {t_last[0]} tokens "
        f"{t_last[tcol('naive/kvcache')]} ({t_last[tcol('naive s')]} s vs {t_last[tcol('kvcache s')]} s).")


def paged(data: Data) -> str:
    """Guide section 6: KV waste by layout, sequences at equal budget, prefix caching, the cost of caching."""
    waste = table_with(data, "waste")
    w = {r[0]: r[waste["headers"].index("waste")].strip("*") for r in waste["rows"]}
    goals = table_with(data, "goal")
    g = {r[0]: r[goals["headers"].index("result")] for r in goals["rows"]}
    ttft = table_with(data, "caching off")
    t = {r[0]: r[1:] for r in ttft["rows"]}
    cost = table_with(data, "per round / note")
    c = {r[0]: r[1:] for r in cost["rows"]}
    seqs = g["sequences at equal budget (16,384 slots), paged / contiguous"]
    engine = g["engine at 16,384 slots: paged engine / contiguous"]
    return fill(
        f"**Numbers to expect** ({_source(data, 'paged benchmark')}, `heterogeneous_64`, max_model_len 2048): KV "
        f"waste {w['contiguous, reserve max_model_len']} when reserving `max_model_len`, "
        f"{w['contiguous, reserve prompt + max_tokens 256']} reserving prompt + `max_tokens` 256, "
        f"{w['contiguous, reserve prompt + exact output']} even with a perfect guess of each output, and "
        f"{w['paged, block_size 16']} paged with `block_size` 16. In a budget of 16,384 token slots, paged / "
        f"contiguous sequences: {seqs}; the `paged` engine ran {engine.split(' / ')[0]} at once. Prefix caching "
        "with 16 requests sharing a 512-token system prompt: prompt tokens computed per request "
        f"{' → '.join(t['prompt tokens computed per request'][:2])}, TTFT mean "
        f"{' → '.join(t['TTFT mean (ms)'][:2])} ms ({t['TTFT mean (ms)'][2].strip('*')}). At a 0% hit rate, "
        f"caching on / off throughput was {c['on / off (median of the per-round ratios)'][0].strip('*')} (median "
        f"of the per-round ratios; the bookkeeping {c['block-manager hashing + lookups'][1].split(' of ')[0]} of "
        "the time).")


def _tok(value: str) -> str:
    return f"{float(value):,.0f}"


def engines_slots(data: Data) -> str:
    """Guide section 7: tokens/s of `chunked` and transformers' `generate_batch` by batch slots; where the time goes."""
    t = table_with(data, "`generate_batch` tok/s")
    col = t["headers"].index
    first, last = t["rows"][0], t["rows"][-1]
    split = table_with(data, "linear layers s")
    scol = split["headers"].index
    parts = "; ".join(f"{r[0]} slots: linear layers {r[scol('linear layers s')].split()[1].strip('()')}, attention "
                      f"{r[scol('attention s')].split()[1].strip('()')}, everything else "
                      f"{r[scol('everything else s')].split()[1].strip('()')}" for r in split["rows"])
    return fill(
        f"Batch slots ({_source(data, 'engines benchmark')}, part 1b): from {first[0]} to {last[0]} slots `chunked` "
        f"went {_tok(first[col('`chunked` tok/s')])} → {_tok(last[col('`chunked` tok/s')])} output tokens/s and "
        f"transformers' `generate_batch` {_tok(first[col('`generate_batch` tok/s')])} → "
        f"{_tok(last[col('`generate_batch` tok/s')])}. Where `chunked`'s own time goes (part 1c): {parts}.")


LONG_TTFT = "long prompts' TTFT ms"


def engines_chunking(data: Data) -> str:
    """Guide section 8: chunked prefill against whole-prompt prefill in the engines benchmark."""
    t = table_with(data, "p99 vs continuous")
    col = t["headers"].index
    rows = {r[0].strip("`"): r for r in t["rows"]}
    cont, small = rows["continuous"], t["rows"][1]
    chunked = [r for name, r in rows.items() if name.startswith("chunked")]
    tput = [float(r[col("tok/s vs continuous")].rstrip("x")) for r in chunked]
    budgets = [r[0].strip("`").split()[-1] for r in chunked]
    return fill(
        f"The {_source(data, 'engines benchmark')} (section 2: short requests decoding while long prompts arrive) "
        f"found: ITL p99 {cont[col('ITL p99 ms')]} ms under `continuous`, {small[col('ITL p99 ms')]} ms at a budget of "
        f"{budgets[0]} ({small[col('p99 vs continuous')]}); the long prompts' TTFT {cont[col(LONG_TTFT)]}"
        f" → {small[col(LONG_TTFT)]} ms; throughput {min(tput):.2f}-{max(tput):.2f}x of "
        f"`continuous` across budgets {budgets[0]}-{budgets[-1]}.")


def quantization(data: Data) -> str:
    """Guide section 14: decode speed and perplexity by weight format, and the goals' lines."""
    fmt = table_with(data, "decode ms/token")
    col = fmt["headers"].index
    by = {r[0]: r for r in fmt["rows"]}
    parts = [f"{name} {by[name][col('decode ms/token')].split(' ')[0]} ms/token ({by[name][col('tok/s vs float32')]}, "
             f"perplexity {by[name][col('perplexity (vs float32)')].split(' ')[-1].strip('()')})"
             for name in ("float32", "int8", "int8-a16", "int4-g32", "int4-g32-a16", "int4-g32-a8") if name in by]
    goals = table_with(data, "goal")
    missed = [r[0] for r in goals["rows"] if r[-1] != "met"]
    return fill(
        f"**Numbers to expect** ({_source(data, 'quantization benchmark')}): batch-1 decode of `smollm2-135m` "
        + "; ".join(parts) + ". " + (f"Goals not met in that run: {'; '.join(missed)}." if missed
                                     else "Every goal of the report was met in that run."))


def tensor_parallel(data: Data) -> str:
    """Guide section 15: one small all-reduce, and the decode step split into compute and communication."""
    sizes = table_with(data, "latency (µs)")
    small = sizes["rows"][0]
    steps = table_with(data, "communication share")
    col = steps["headers"].index
    lines = [f"{r[col('engine')]} at batch {r[col('batch')]}: {r[col('step (ms)')].split(' ')[0]} ms "
             f"({r[col('communication share')]} in all-reduces)" for r in steps["rows"]]
    return fill(
        f"**Numbers to expect** ({_source(data, 'tensor-parallel benchmark')}): a {small[0]} all-reduce between two "
        f"processes on loopback took {small[1]} µs; decode steps " + "; ".join(lines) + ".")


# region name -> (the file it is in, its renderer, the report it reads)
FIGURES: dict[str, tuple[Path, Callable[[Data], str], str]] = {
    "figures-kvcache": (GUIDE, kvcache, "kvcache"),
    "figures-paged": (GUIDE, paged, "paged"),
    "figures-engines-slots": (GUIDE, engines_slots, "engines"),
    "figures-engines-chunking": (GUIDE, engines_chunking, "engines"),
    "figures-host-overhead": (GUIDE, host_overhead, "host_overhead"),
    "figures-spec-decode": (GUIDE, spec_decode, "spec_decode"),
    "figures-server-overhead": (GUIDE, server_overhead, "server_overhead"),
    "figures-quantization": (GUIDE, quantization, "quantization"),
    "figures-tensor-parallel": (GUIDE, tensor_parallel, "tensor_parallel"),
}


def region(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN GENERATED: {re.escape(name)} -->\n)(.*?)(\n?<!-- END GENERATED: "
                      rf"{re.escape(name)} -->)", re.S)


def rendered(name: str) -> str:
    _, render, report = FIGURES[name]
    return render(load(report))


def current(name: str) -> str:
    """The region's text as the document has it now."""
    path = FIGURES[name][0]
    found = region(name).search(path.read_text(encoding="utf-8"))
    if found is None:
        raise KeyError(f"{path.name} has no region {name!r} (<!-- BEGIN GENERATED: {name} --> ... END)")
    return found[2]


def write(name: str) -> bool:
    """Rewrite one region; True if it changed."""
    path = FIGURES[name][0]
    text = path.read_text(encoding="utf-8")
    if region(name).search(text) is None:
        raise KeyError(f"{path.name} has no region {name!r} (<!-- BEGIN GENERATED: {name} --> ... END)")
    new = region(name).sub(lambda m: m[1] + rendered(name) + "\n" + m[3].lstrip("\n"), text, count=1)
    if new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if any region is out of date")
    args = parser.parse_args()
    stale = [name for name in FIGURES if current(name) != rendered(name)]
    if args.check:
        for name in stale:
            print(f"{FIGURES[name][0].name}: region {name} differs from docs/benchmarks/{FIGURES[name][2]}.json "
                  "(run scripts/make_guide_figures.py)")
        return 1 if stale else 0
    for name in FIGURES:
        print(f"{name}: {'rewritten' if write(name) else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
