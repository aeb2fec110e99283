"""What the benchmark scripts share: the machine's description, other processes' CPU load, Markdown tables.

Every report names the hardware it ran on and how busy other programs kept the CPUs, because on a shared
machine that load skews every timing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, not installed
from labkit.core.device import resolve_device, resolve_dtype  # noqa: E402
from labkit.measure.hardware import device_name  # noqa: E402
from labkit.measure.timing import timing_calls as timed  # noqa: E402, F401  (the benchmarks' timers)
from labkit.measure.timing import wrap_timed  # noqa: E402, F401


@dataclass(frozen=True)
class Hardware:
    device: str
    device_name: str
    num_threads: int
    num_cpus: int
    torch_version: str
    python_version: str
    platform: str
    date: str
    other_cpu_load: float | None  # share of all CPUs busy just before the run (other processes skew timings)



def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (Linux /proc/stat); None elsewhere."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def own_cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (servers and workers it started, once reaped)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """Share of all CPUs that *other* processes kept busy since ``start()``: they skew every timing here."""

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        self._machine = cpu_jiffies()
        self._own = own_cpu_seconds()

    def fraction(self) -> float | None:
        """Read once the benchmark's own child processes have ended (else their time counts as another's)."""
        end = cpu_jiffies()
        if self._machine is None or end is None or end[1] <= self._machine[1]:
            return None
        own_ticks = (own_cpu_seconds() - self._own) * os.sysconf("SC_CLK_TCK")
        busy = end[0] - self._machine[0] - own_ticks
        return max(0.0, busy / (end[1] - self._machine[1]))


def cpu_busy_fraction(seconds: float = 1.0) -> float | None:
    """Share of all CPUs busy over ``seconds`` while this script sleeps (so: other processes)."""
    load = OtherLoad()
    time.sleep(seconds)
    return load.fraction()


def hardware(device: torch.device) -> Hardware:
    return Hardware(
        device=str(device), device_name=device_name(device), num_threads=torch.get_num_threads(),
        num_cpus=os.cpu_count() or 1, torch_version=torch.__version__, python_version=platform.python_version(),
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
        date=dt.datetime.now().astimezone().isoformat(timespec="seconds"), other_cpu_load=cpu_busy_fraction(),
    )


def load_text(load: float | None, when: str) -> str:
    return f"unknown {when}" if load is None else f"{load:.0%} of all CPUs {when}"


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    align = "|".join("---:" if i else "---" for i in range(len(headers)))  # numbers right-aligned
    lines = ["| " + " | ".join(headers) + " |", f"|{align}|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def bench_parser(description: str, default_out: Path, device_help: str = "cpu (default), cuda, mps or auto",
                 dtype: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes: --smoke, --out, --device, --dtype (optional) and --threads."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CI); no report unless --out is given")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"Markdown report (default {default_out.relative_to(ROOT)}; none with --smoke)")
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
    if hw.other_cpu_load is not None and hw.other_cpu_load > 0.1:
        print(f"warning: other processes keep {hw.other_cpu_load:.0%} of the CPUs busy; timings will be skewed",
              file=sys.stderr)
    return BenchStart(
        out=args.out if args.out is not None else (None if args.smoke else default_out),
        command=" ".join([".venv/bin/python", f"scripts/{script}", *sys.argv[1:]]),
        device=device, dtype=dtype, hw=hw, t0=t0,
    )


def report_header(title: str, command: str, hw: Hardware, wall_s: float, other_load: float | None,
                  extra_rows: list[list[str]] | None = None, note: str = "") -> list[str]:
    """A report's first lines: title, when and how it was generated, and the hardware table."""
    script = command.split()[1] if len(command.split()) > 1 else command
    return [
        f"# {title}",
        "",
        f"Generated by `{script}` on {hw.date} in {wall_s:.0f} s{note}.",
        "",
        "```",
        command,
        "```",
        "",
        "## Hardware",
        "",
        md_table(["", ""], [
            ["device", f"{hw.device_name} ({hw.device})"],
            ["torch threads / CPUs", f"{hw.num_threads} / {hw.num_cpus}"],
            ["other processes' CPU load", load_text(hw.other_cpu_load, "at start") + "; "
             + load_text(other_load, "during the run") + " (above ~10% the timings are unreliable)"],
            ["torch", hw.torch_version], ["python", hw.python_version], ["platform", hw.platform],
            *(extra_rows or []),
        ]),
        "",
    ]


def finish_report(text: str, out: Path | None, load: float | None) -> None:
    """Warn if other programs loaded the CPUs during the run, print the report, write it where asked."""
    if load is not None and load > 0.1:
        print(f"warning: other processes kept {load:.0%} of the CPUs busy during the run; timings are skewed",
              file=sys.stderr)
    print()
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out}")
