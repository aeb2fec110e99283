"""A benchmark's command line: the options every benchmark takes, and what it knows once they are parsed.

``scripts/bench_*.py`` build their parsers with ``bench_parser`` and start with ``start_bench``: threads applied,
device and dtype resolved, the machine described and a warning printed when other programs load it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from labkit.core.device import resolve_device, resolve_dtype
from labkit.measure.benchmarks.report import BUSY_SHARE, Hardware, finish_report, hardware
from labkit.measure.load import OtherLoad

# The checkout the scripts run from: reports go to its docs/benchmarks/ (as workloads come from its data/).
REPO_ROOT = Path(__file__).resolve().parents[3]


def shown(path: Path) -> str:
    """``path`` as the scripts' help names it: relative to the checkout where it lies inside."""
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that reproduces this run, as its report quotes it."""
    return " ".join([".venv/bin/python", f"scripts/{script}", *(sys.argv[1:] if argv is None else argv)])


def bench_parser(description: str, default_out: Path, device_help: str = "cpu (default), cuda, mps or auto",
                 dtype: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes: --smoke, --out, --device, --dtype (optional) and --threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI); no report unless --out is given")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"Markdown report (default {shown(default_out)}; none with --smoke)")
    parser.add_argument("--device", default="cpu", help=device_help)
    if dtype:
        parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    return parser


@dataclass
class BenchStart:
    """What a benchmark knows once its options are parsed: where to write, what it runs on, since when."""

    out: Path | None
    command: str
    device: torch.device
    dtype: torch.dtype | None
    hw: Hardware
    t0: float


def start_bench(args: argparse.Namespace, script: str, default_out: Path) -> BenchStart:
    """Apply --threads, resolve device and dtype, describe the machine, warn if other programs load it."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device) if getattr(args, "dtype", None) else None
    t0 = time.perf_counter()
    hw = hardware(device)
    print(f"{hw.device_name} ({hw.device}), {hw.num_threads} threads, torch {hw.torch_version}")
    if hw.other_cpu_load is not None and hw.other_cpu_load > BUSY_SHARE:
        print(f"warning: other processes keep {hw.other_cpu_load:.0%} of the CPUs busy; timings will be skewed",
              file=sys.stderr)
    return BenchStart(
        out=args.out if args.out is not None else (None if args.smoke else default_out),
        command=command_line(script), device=device, dtype=dtype, hw=hw, t0=t0,
    )


def run_cpu_bench(doc: str, script: str, default_out: Path, run: Callable[[Any, int], Any],
                  report: Callable[..., str], full: Any, smoke: Any) -> int:
    """The whole main() of a CPU benchmark whose parts are ``run(sizes, threads)`` and ``report(result, command,
    hardware, wall_s, other_load)``: parse the common options, run at full or smoke sizes, write the report."""
    args = bench_parser(doc.splitlines()[0], default_out, dtype=False).parse_args()
    start = start_bench(args, script, default_out)
    other_load = OtherLoad()
    res = run(smoke if args.smoke else full, torch.get_num_threads())
    load = other_load.fraction()
    finish_report(report(res, start.command, start.hw, time.perf_counter() - start.t0, load), start.out, load)
    return 0
