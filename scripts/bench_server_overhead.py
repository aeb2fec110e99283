"""Benchmark the server's own share of each inter-token latency, and a change to how tokens reach the event loop.

Run from the repository root (CPU; two server processes on the bundled model):

    .venv/bin/python scripts/bench_server_overhead.py            # 5 rounds, 16 streams at a time, 64 tokens each
    .venv/bin/python scripts/bench_server_overhead.py --smoke    # 2 small rounds, well under a minute

Two servers (``python -m labkit.serving --record-timings``), identical but for ``--hand-off``:

* ``per-token`` (the default): the engine thread wakes the event loop once per streamed token (``call_soon_threadsafe``
  per delta: a write to the loop's self-pipe each, on the engine thread's time);
* ``per-step``: once per step for all of the step's tokens (fewer wake-ups; but the loop then does the whole step's
  framing and sending in one go, which the engine thread may wait on for the interpreter lock).

Each round sends the same fresh streaming requests to both (the order alternating), then reads the client's mean
ITL and the server's ``/timings`` breakdown: the engine step, the engine thread's serving work (collect, metrics,
post), the event loop's framing and sending. Non-engine time per ITL = client ITL - engine step. The report gives
every round, the medians and the per-round ratios (per-step over per-token), and names the hardware. A benchmark
script, not a test (DESIGN.md section 7); notebook 09 runs a smaller version of the same comparison.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout, not installed
import torch  # noqa: E402

from labkit.analysis.hardware import device_name  # noqa: E402
from labkit.bench.datasets import RandomDataset  # noqa: E402
from labkit.bench.server_overhead import OverheadRun, hand_off_contenders  # noqa: E402
from labkit.measure import interleave, measure_load  # noqa: E402
from labkit.serving.launcher import ServerProcess  # noqa: E402

SHOWN = [("itl_ms", "client mean ITL (ms)"), ("p99_itl_ms", "client p99 ITL (ms)"),
         ("engine_step_ms", "engine step (ms)"), ("non_engine_ms", "non-engine per ITL (ms)"),
         ("non_engine_%", "non-engine share of ITL (%)"),
         ("server_share_%", "server's share of the engine loop's turn per token, server side (%)"),
         ("server_step_ms", "engine thread's serving work/step (ms)"),
         ("post_ms", "  of which hand-off 'post' (ms)"), ("tok/s", "output tokens/s"),
         ("tokens_per_step", "tokens per step"), ("wake_ups_per_step", "event-loop wake-ups per step")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="2 small rounds")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=None, help="streams in flight at once")
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per server (default 1)")
    args = p.parse_args(argv)
    rounds = args.rounds or (2 if args.smoke else 5)
    concurrency = args.concurrency or (4 if args.smoke else 16)
    output_len = args.output_len or (16 if args.smoke else 64)
    dataset = RandomDataset(input_len=32, output_len=output_len)
    options = dict(engine="chunked", max_num_seqs=max(concurrency, 8), record_timings=True,
                   num_threads=args.num_threads)
    servers = {f"hand-off {h}": ServerProcess(hand_off=h.replace("-", "_"), **options).launch()
               for h in ("per-token", "per-step")}
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
    load = measure_load(0.5)
    print(f"hardware: {device_name(torch.device('cpu'))}, {os.cpu_count()} CPUs, {platform.platform()}, "
          f"torch {torch.__version__}, {args.num_threads} torch thread(s) per server")
    print(f"load: {concurrency} streams at a time, {2 * concurrency} requests of 32 prompt + {output_len} output "
          f"tokens per round, {rounds} interleaved rounds (+1 warm-up); {load.summary()}\n")
    names = list(servers)
    for metric, title in SHOWN:
        print(f"{title}")
        print(result.table(metric, fmt=".3f" if "ms" in metric else ".1f"))
        ratios = result.ratios(names[1], names[0], metric)
        print(f"{'per-step / per-token':<28}" + "".join(f"{r:10.3f}" for r in ratios)
              + f"{statistics.median(ratios):10.3f}  (ratio, per round; median)\n")
    b = runs[names[1]][-1].breakdown
    print("server breakdown, last per-step round, ms per streamed token:",
          ", ".join(f"{k} {v:.4f}" for k, v in b.per_token_ms().items()))
    print("per request, ms:", ", ".join(f"{k} {v:.3f}" for k, v in b.per_request_ms().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
