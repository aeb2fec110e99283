"""Write the workload files shipped in data/workloads/ (lengths only, no token ids).

Run from the repository root (seconds, no network, no model needed):

    python scripts/make_workloads.py            # (re)write every file
    python scripts/make_workloads.py --check    # exit 1 if a committed file differs from what this makes

Every workload is seeded, so the files are reproducible; tests/course/test_workloads.py checks that the committed
files match this script. Notebooks load them with ``labkit.measure.workloads.load_workload(name)`` and turn lengths
into token ids with ``labkit.measure.workloads.materialise`` (introduced in notebook 05, ``05_static_batching``).

The workloads:

- heterogeneous_64: 64 requests, heavy-tailed (log-normal) lengths: prompts 16-1024 tokens (median 128),
  outputs 16-256 (median 64). Static batching wastes most here: each batch waits for its longest request.
- heterogeneous_small_16: the same shape, shrunk for smoke mode: prompts 8-256 (median 32), outputs 4-64
  (median 16).
- uniform_small_16: 16 requests, prompts uniform in 8-64 tokens, outputs uniform in 8-32: a quick sanity run.
- uniform_64: 64 requests, prompts uniform in 32-512, outputs uniform in 32-128: varied, but no long tail.
- prefill_heavy_48: 48 requests, prompts uniform in 16-768 tokens, outputs uniform in 16-192: more of the work is
  prefill than in heterogeneous_64 (scripts/bench_engines.py compares with transformers' padded generate on both).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout, not installed
from labkit.measure.workloads import WORKLOADS_DIR, Workload, lognormal_lengths, uniform_lengths  # noqa: E402

# name -> how to build it; the file is data/workloads/<name>.jsonl
WORKLOADS: dict[str, Callable[[], Workload]] = {
    "heterogeneous_64": lambda: lognormal_lengths(
        64, prompt_median=128, output_median=64, sigma=1.0, prompt_max=1024, output_max=256, seed=0,
        prompt_min=16, output_min=16, name="heterogeneous_64"),
    "heterogeneous_small_16": lambda: lognormal_lengths(
        16, prompt_median=32, output_median=16, sigma=1.0, prompt_max=256, output_max=64, seed=1,
        prompt_min=8, output_min=4, name="heterogeneous_small_16"),
    "uniform_small_16": lambda: uniform_lengths(
        16, prompt_range=(8, 64), output_range=(8, 32), seed=2, name="uniform_small_16"),
    "uniform_64": lambda: uniform_lengths(
        64, prompt_range=(32, 512), output_range=(32, 128), seed=3, name="uniform_64"),
    "prefill_heavy_48": lambda: uniform_lengths(
        48, prompt_range=(16, 768), output_range=(16, 192), seed=4, name="prefill_heavy_48"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=WORKLOADS_DIR)
    parser.add_argument("--check", action="store_true", help="compare with the files on disk; write nothing")
    args = parser.parse_args()
    stale = []
    for name, build in WORKLOADS.items():
        wl = build()
        path = args.out_dir / f"{name}.jsonl"
        if args.check:
            if not path.is_file() or Workload.from_jsonl(path) != wl:
                stale.append(name)
            continue
        wl.to_jsonl(path)
        print(f"wrote {path}: {wl.summary()}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python scripts/make_workloads.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
