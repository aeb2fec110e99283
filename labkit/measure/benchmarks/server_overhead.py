"""``scripts/bench_server_overhead.py``'s comparison: servers that differ in one option, interleaved rounds.

Each server (``python -m labkit.serving --record-timings``) gets the same fresh streaming requests every round, the
order rotating (``labkit.measure.server_overhead.hand_off_contenders`` and ``labkit.measure.rounds.interleave``);
the client's TPOT and ITL and the server's ``/timings`` breakdown are kept per round, and each variant's figures
are compared with the first's round by round. Notebook 09, section 8, explains the breakdown.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from labkit.measure.load import measure_load
from labkit.measure.loadgen.datasets import RandomDataset
from labkit.measure.rounds import interleave
from labkit.measure.server_overhead import OverheadRun, hand_off_contenders
from labkit.serving.launcher import ServerProcess

SHOWN: list[tuple[str, str]] = [("tpot_ms", "client mean TPOT (ms)"), ("itl_ms", "client mean ITL, per event (ms)"),
         ("p99_itl_ms", "client p99 ITL (ms)"), ("engine_step_ms", "engine step (ms)"),
         ("non_engine_per_token_ms", "non-engine per token (ms)"),
         ("non_engine_per_token_%", "non-engine share of a token's time (%)"),
         ("server_share_%", "server's share of the engine loop's turn per token, server side (%)"),
         ("server_step_ms", "engine thread's serving work/step (ms)"),
         ("post_ms", "  of which hand-off 'post' (ms)"), ("tok/s", "output tokens/s"),
         ("tokens_per_step", "tokens per step"), ("wake_ups_per_step", "event-loop wake-ups per step"),
         ("events_per_token", "SSE events per token")]
# The servers compared, by name: each differs from the default (the first) in one option.
VARIANTS: dict[str, dict[str, object]] = {"per-token": {}, "per-step": {"hand_off": "per_step"},
                                          "coalesce": {"stream_coalesce": True}}


def compare(variants: list[str], concurrency: int, output_len: int, rounds: int, num_threads: int,
            say: Callable[[str], None]) -> None:
    """One interleaved comparison of the variants' servers at one concurrency, printed through ``say``."""
    dataset = RandomDataset(input_len=32, output_len=output_len)
    options = dict(engine="chunked", max_num_seqs=max(concurrency, 8), record_timings=True, num_threads=num_threads)
    servers = {v: ServerProcess(**options, **VARIANTS[v]).launch() for v in variants}
    runs: dict[str, list[OverheadRun]] = {}
    try:
        for s in servers.values():
            s.wait_until_ready()
        contenders = hand_off_contenders({k: s.base_url for k, s in servers.items()}, dataset,
                                         num_prompts=2 * concurrency, max_concurrency=concurrency, runs=runs)
        result = interleave(contenders, rounds, warmup=1)
    finally:
        for s in servers.values():
            s.stop()
    say(f"## {concurrency} streams at a time\n\n{2 * concurrency} requests of 32 prompt + {output_len} output tokens "
        f"per round, {rounds} interleaved rounds (+1 warm-up), {num_threads} torch thread(s) per server; "
        f"{measure_load(0.5).summary()}\n\n```")
    names = list(servers)
    for metric, title in SHOWN:
        say(title)
        say(result.table(metric, fmt=".3f" if "ms" in metric else ".1f"))
        for name in names[1:]:
            ratios = result.ratios(name, names[0], metric)
            say(f"{name + ' / ' + names[0]:<28}" + "".join(f"{r:10.3f}" for r in ratios)
                + f"{statistics.median(ratios):10.3f}  (ratio, per round; median)")
        say("")
    for name in names:
        b = runs[name][-1].breakdown
        say(f"server breakdown, last {name} round, ms per streamed token: "
            + ", ".join(f"{k} {v:.4f}" for k, v in b.per_token_ms().items()))
    say("per request, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in b.per_request_ms().items()) + "\n```\n")


def report_intro() -> list[str]:
    """What the report says under its hardware table, before the comparisons."""
    return ["Servers differ in one option each (`per-token`: the default; `per-step`: `--hand-off per-step`; "
            "`coalesce`: `--stream-coalesce`). Non-engine per token = the client's TPOT - the engine step a token "
            "waited for (server-timed). Ratios are each variant over the first, round by round. Notebook 09, "
            "section 8, explains the breakdown.", ""]
