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
per-round ratios against ``per-token``, and names the hardware. Benchmarks are scripts, not timed tests: compare side
by side in one run, report ratios, name the hardware. Notebook 09 runs a smaller version of the same comparison; the
parts live in ``labkit.measure.benchmarks.server_overhead``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from labkit.measure.benchmarks.cli import REPO_ROOT, command_line, shown
from labkit.measure.benchmarks.report import finish_report, hardware, report_header
from labkit.measure.benchmarks.server_overhead import VARIANTS, compare, report_intro
from labkit.measure.load import OtherLoad

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "server_overhead.md"


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
                   help=f"Markdown report (default {shown(DEFAULT_OUT)}; none with --smoke)")
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
    lines = report_header("Benchmark: the server's own time per token, and changes to how tokens reach the client",
                          command_line("bench_server_overhead.py", argv or None), hw, time.perf_counter() - t0, load)
    lines += [*report_intro(), *body]
    finish_report("\n".join(lines) + "\n", args.out if args.out is not None else (None if args.smoke else DEFAULT_OUT),
                  load)
    return 0


if __name__ == "__main__":
    sys.exit(main())
