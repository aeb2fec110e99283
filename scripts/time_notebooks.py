"""Time each notebook's full (non-smoke) run on this machine, one at a time: the learner path's time column.

    .venv/bin/python scripts/time_notebooks.py 00 01 02        # or no arguments: every notebook
    .venv/bin/python scripts/time_notebooks.py --smoke 03      # smoke mode, as the test suite runs it
    .venv/bin/python scripts/time_notebooks.py --busy --repeat 2 03 07   # twice, with one core kept busy

``--busy`` starts a neighbour process that keeps one core busy for each run (a classroom laptop's video call), so
the "busy" column of the learner path can be measured. Every run's printed verdicts (``labkit.measure``: "[holds]",
"[does NOT hold here]", "[too close to call]") are read back from the executed notebook and audited: a verdict
whose mark disagrees with the round figures printed beside it is reported as a problem.

Each notebook runs in a fresh kernel with nbclient (``NotebookClient.execute``, in a child process) into a temporary
folder (the committed notebooks are never touched). Not ``jupyter nbconvert --execute``, and without nbclient's
imitation of a frontend's Output widget (which sends widget state back to the kernel): with the CPUs busy, a cell
that displays an ``interactive_output`` widget then waited forever, kernel and client both idle (notebooks 06 and
08 here; jupyter/nbclient#312). The widgets' own outputs are left out of the executed copy; printed verdicts stay.
Beside each time it reports how busy *other* processes kept the CPUs during the run and the load average, because on
a shared machine that load inflates every time. Writes ``results/notebook_times.json`` (results/ is git-ignored) and
prints a Markdown table, with the three slowest cells of each notebook.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from labkit.measure.benchmarks.report import md_table
from labkit.measure.load import OtherLoad
from labkit.measure.verdict import MARK, audit

ROOT = Path(__file__).resolve().parents[1]

SPIN = "import time\nwhile True:\n    time.perf_counter()"  # the busy neighbour: one core, until killed
# Executes argv[1] into argv[2] (written even when a cell fails) with a per-cell timeout of argv[3] seconds.
EXECUTE = """
import sys
from pathlib import Path
import nbformat
from nbclient import NotebookClient
src, dst, timeout = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
nb = nbformat.read(src, as_version=4)
try:
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(src.parent)}})
    client.comm_open_handlers = {}  # no Output-widget mimicry: it talks back to the kernel and hung runs here
    client.execute()
finally:
    nbformat.write(nb, dst)
"""


def start_neighbour() -> int:
    """Start the busy neighbour outside this process's tree (the shell starts it and exits, so init adopts it), as a
    video call is unrelated to the notebook: the load meter counts this process's children as its own work. Its pid."""
    out = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "$SPIN" >/dev/null 2>&1 & echo $!'],
                         env={**os.environ, "SPIN": SPIN}, capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def printed_text(executed: Path) -> str:
    """Everything the executed notebook printed to stdout (stream outputs), in cell order."""
    nb = json.loads(executed.read_text())
    return "\n".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", [])
                     if o.get("output_type") == "stream" and o.get("name") == "stdout")


@dataclass
class NotebookTime:
    notebook: str
    smoke: bool
    ok: bool
    wall_s: float
    own_cpu_s: float  # CPU time of the executing process and its kernel
    other_cpu_load: float | None  # share of all CPUs that other processes kept busy during the run
    loadavg_before: float
    loadavg_after: float
    slowest_cells: list[tuple[int, float]]  # (cell index, seconds)
    busy_neighbour: bool = False  # a process kept one core busy during the run (--busy)
    verdicts: list[str] = field(default_factory=list)  # the first line of every printed verdict
    verdict_problems: list[str] = field(default_factory=list)  # labkit.measure.audit's findings


def cell_seconds(executed: Path) -> list[tuple[int, float]]:
    """(index, seconds) of every code cell, from the timestamps nbclient records in cell metadata."""
    nb = json.loads(executed.read_text())
    out = []
    for i, cell in enumerate(nb["cells"]):
        meta = cell.get("metadata", {}).get("execution", {})
        start, end = meta.get("iopub.execute_input"), meta.get("shell.execute_reply")
        if start and end:
            seconds = (datetime.fromisoformat(end.replace("Z", "+00:00"))
                       - datetime.fromisoformat(start.replace("Z", "+00:00"))).total_seconds()
            out.append((i, round(seconds, 1)))
    return out


def time_notebook(path: Path, smoke: bool, outdir: Path, timeout_s: int, busy: bool = False) -> NotebookTime:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", LABKIT_SMOKE="1" if smoke else "0")
    env.pop("CI", None)  # CI=true would switch smoke mode on
    outdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", EXECUTE, str(path), str(outdir / f"{path.stem}.ipynb"), str(timeout_s)]
    neighbour = start_neighbour() if busy else None
    try:
        load_before = os.getloadavg()[0]
        children0 = os.times()
        load = OtherLoad()  # counts this process and its children as ours: the executing process and its kernel
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        other: float | None = load.fraction()
        children1 = os.times()
    finally:
        if neighbour is not None:
            os.kill(neighbour, signal.SIGKILL)
    own = (children1.children_user + children1.children_system
           - children0.children_user - children0.children_system)  # the executing process and the kernel it reaped
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
    executed = outdir / f"{path.stem}.ipynb"
    cells = cell_seconds(executed) if executed.is_file() else []
    printed = printed_text(executed) if executed.is_file() else ""
    verdicts = [line.strip() for line in printed.splitlines() if line.lstrip().startswith(tuple(MARK.values()))]
    return NotebookTime(path.stem, smoke, proc.returncode == 0, round(wall, 1), round(own, 1), other,
                        load_before, os.getloadavg()[0], sorted(cells, key=lambda c: -c[1])[:3], busy, verdicts,
                        audit(printed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("numbers", nargs="*", help="notebook numbers (default: all)")
    parser.add_argument("--smoke", action="store_true", help="time smoke mode instead of the full run")
    parser.add_argument("--timeout", type=int, default=1800, help="per-cell timeout in seconds")
    parser.add_argument("--busy", action="store_true", help="keep one core busy with a neighbour process")
    parser.add_argument("--repeat", type=int, default=1, help="run each notebook this many times in a row")
    parser.add_argument("--keep", type=Path, help="folder for the executed notebooks (default: a temporary one)")
    args = parser.parse_args()
    paths = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.numbers:
        paths = [p for p in paths if p.name[:2] in args.numbers]
    outdir = args.keep or Path(tempfile.mkdtemp(prefix="labkit-nbtimes-"))
    outdir.mkdir(parents=True, exist_ok=True)
    results = []
    for path in paths:  # one at a time: two notebooks at once would share the CPUs and inflate both
        for _ in range(args.repeat):
            r = time_notebook(path, args.smoke, outdir, args.timeout, args.busy)
            results.append(r)
            print(f"{r.notebook}: {'ok' if r.ok else 'FAILED'} {r.wall_s:.0f} s (other load "
                  f"{'?' if r.other_cpu_load is None else f'{r.other_cpu_load:.0%}'}, loadavg {r.loadavg_before:.2f}"
                  f" -> {r.loadavg_after:.2f}); slowest cells {r.slowest_cells}", flush=True)
            for line in r.verdicts:
                print(f"    {line}")
            for problem in r.verdict_problems:
                print(f"    VERDICT PROBLEM: {problem}")
    (ROOT / "results").mkdir(exist_ok=True)
    out = ROOT / "results" / "notebook_times.json"
    previous = json.loads(out.read_text()) if out.is_file() else {}
    for i, r in enumerate(results):
        run = sum(q.notebook == r.notebook for q in results[:i]) + 1
        previous[f"{r.notebook}{'-smoke' if r.smoke else ''}{'-busy' if r.busy_neighbour else ''}-run{run}"] = asdict(r)
    out.write_text(json.dumps(previous, indent=2))
    rows = [[r.notebook, "yes" if r.ok else "FAILED", f"{r.wall_s / 60:.1f}",
             "?" if r.other_cpu_load is None else f"{r.other_cpu_load:.0%}", f"{r.loadavg_before:.2f}",
             str(len(r.verdicts)), str(len(r.verdict_problems))]
            for r in results]
    print(md_table(["notebook", "ran", "minutes", "other CPU load", "loadavg at start", "verdicts",
                    "verdict problems"], rows))
    if any(r.verdict_problems for r in results):
        sys.exit(1)
    print(f"executed notebooks in {outdir}; times in {out}")


if __name__ == "__main__":
    main()
