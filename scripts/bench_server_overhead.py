"""Benchmark the server's own share of each token's latency, and changes to how tokens reach the client.

Run from the repository root (CPU; one server process per variant, on the bundled model):

    .venv/bin/python scripts/bench_server_overhead.py                # 5 rounds at 16 and at 64 streams, 64 tokens
                                                                     # each; writes docs/benchmarks/server_overhead.md
    .venv/bin/python scripts/bench_server_overhead.py --smoke        # 2 small rounds, well under a minute; no report

Servers (``python -m labkit.serving --record-timings``), identical but for one option each:

* ``per-token`` (the default): the engine thread wakes the event loop once per streamed token (``call_soon_threadsafe``
  per delta: a write to the loop's self-pipe each, on the engine thread's time);
* ``per-step`` (``--hand-off per-step``): once per step for all of the step's tokens (fewer wake-ups; but the loop
  then does the whole step's framing and sending in one go, which the engine thread may wait on for the GIL);
* ``coalesce`` (``--stream-coalesce``): a stream that fell behind gets every token waiting for it in one event, as
  vLLM's output collector does (one JSON encoding and one socket write for several tokens).

Each round sends the same fresh streaming requests to every server (the order rotating), then reads the client's
TPOT and ITL and the server's ``/timings`` breakdown: the engine step, the engine thread's serving work (collect,
metrics, post), the event loop's framing and sending. Non-engine time per token = client TPOT - engine step (ITL is
per event, and a coalesced event carries several tokens). The report gives every round, the medians and the
per-round ratios against ``per-token``, and names the hardware. A benchmark script, not a test (DESIGN.md section 7);
notebook 09 runs a smaller version of the same comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_common import ROOT, OtherLoad, finish_report, hardware, report_header  # noqa: E402

from labkit.measure import interleave, measure_load  # noqa: E402
from labkit.measure.loadgen.datasets import RandomDataset  # noqa: E402
from labkit.measure.server_overhead import OverheadRun, hand_off_contenders  # noqa: E402
from labkit.serving.launcher import ServerProcess  # noqa: E402

SHOWN = [("tpot_ms", "client mean TPOT (ms)"), ("itl_ms", "client mean ITL, per event (ms)"),
         ("p99_itl_ms", "client p99 ITL (ms)"), ("engine_step_ms", "engine step (ms)"),
         ("non_engine_per_token_ms", "non-engine per token (ms)"),
         ("non_engine_per_token_%", "non-engine share of a token's time (%)"),
         ("server_share_%", "server's share of the engine loop's turn per token, server side (%)"),
         ("server_step_ms", "engine thread's serving work/step (ms)"),
         ("post_ms", "  of which hand-off 'post' (ms)"), ("tok/s", "output tokens/s"),
         ("tokens_per_step", "tokens per step"), ("wake_ups_per_step", "event-loop wake-ups per step"),
         ("events_per_token", "SSE events per token")]
DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "server_overhead.md"
VARIANTS = {"per-token": {}, "per-step": {"hand_off": "per_step"}, "coalesce": {"stream_coalesce": True}}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="2 small rounds")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=None,
                   help="streams in flight at once; one comparison per value (default 16 64; 4 with --smoke)")
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per server (default 1)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                   help="servers to compare (the first is the baseline of the ratios)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"Markdown report (default {DEFAULT_OUT.relative_to(ROOT)}; none with --smoke)")
    args = p.parse_args(argv)
    rounds = args.rounds or (2 if args.smoke else 5)
    output_len = args.output_len or (16 if args.smoke else 64)
    t0, hw, other_load = time.perf_counter(), hardware(torch.device("cpu")), OtherLoad()
    body: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        body.append(line)

    for concurrency in args.concurrency or ([4] if args.smoke else [16, 64]):
        compare(args.variants, concurrency, output_len, rounds, args.num_threads, say)
    load = other_load.fraction()
    command = " ".join([".venv/bin/python", "scripts/bench_server_overhead.py", *(argv or sys.argv[1:])])
    lines = report_header("Benchmark: the server's own time per token, and changes to how tokens reach the client",
                          command, hw, time.perf_counter() - t0, load)
    lines += ["Servers differ in one option each (`per-token`: the default; `per-step`: `--hand-off per-step`; "
              "`coalesce`: `--stream-coalesce`). Non-engine per token = the client's TPOT - the engine step a token "
              "waited for (server-timed). Ratios are each variant over the first, round by round. Notebook 09, "
              "section 8, explains the breakdown.", "", *body]
    finish_report("\n".join(lines) + "\n", args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT),
                  load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
