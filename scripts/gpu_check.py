"""The GPU plan in one command: what an instructor (or a session lent a GPU) runs to check the GPU track.

    .venv/bin/python scripts/gpu_check.py                               # on a CUDA machine: the whole plan
    .venv/bin/python scripts/gpu_check.py --dry-run --out /tmp/gpu_dry  # the same plan on the CPU at tiny sizes

It runs, in order: the hardware probe (``labkit.measure.hardware``: the roof notebook 00 measures), the CUDA tests
(``pytest -m cuda``), every notebook in GPU mode at smoke sizes (nbval, a few at a time), decode bandwidth use (MBU)
of a ~1B preset in bfloat16 at batch 1 and 64 (eager and with CUDA graphs, for each ``--attention-backend``), decode
attention alone (the PyTorch paths and the Triton kernel of notebook 11, by batch and context length, against the
roof), async scheduling + CUDA graphs repeated (a stability check: the same tokens every run), and the quantized
decode GEMV (notebook 14's int8 / int4 weights on Triton's kernels, against the 16-bit layer). It writes one
JSON and one Markdown report, both naming the hardware, to ``docs/benchmarks/gpu/`` (or ``--out DIR``). Design
goal: under 8 minutes on one H100/H200-class GPU. ``--dry-run`` runs the same plan on the CPU with a small preset,
1-2 decode steps and one notebook, skipping what needs CUDA with the reason recorded (the test suite runs it).
Both plans also compile the Triton kernel ahead of time for sm_90 (``ptxas -v``: registers, no spills) and check
its float32 precision against a float64 reference (IEEE dots, not TF32). The reports are rewritten after every check,
so a run that is cut short still leaves what it measured; a check that cannot run is reported as skipped, with why.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__" and "--dry-run" in sys.argv[1:]:
    # The dry run is the CPU plan wherever it runs: on a GPU host too, the GPU stays hidden (so Triton chooses its
    # interpreter, which must happen before anything imports triton, and the notebooks run on the CPU).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from labkit import ATTENTION_BACKENDS, LLM, SamplingParams  # noqa: E402
from labkit.measure.benchmarks.attention_kernel import attention_kernel_markdown, attention_kernel_rows  # noqa: E402
from labkit.measure.hardware import DeviceRoof, describe_device, probe  # noqa: E402
from labkit.measure.roofline import decode_cost  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

NOTEBOOKS = tuple(sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "LABKIT_SMOKE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass(frozen=True)
class Plan:
    """How big each part of the check is: the GPU plan, or its CPU dry run."""

    device: str
    dtype: str
    preset: str  # the MBU model (random weights)
    batches: tuple[int, ...]
    prompt_len: int
    decode_steps: int
    repeats: int
    stability_model: str
    stability_runs: int
    stability_batch: int
    notebooks: tuple[str, ...]
    notebook_workers: int  # notebooks run side by side (each its own pytest process)
    timeout_s: int  # per subprocess


GPU = Plan("cuda", "bfloat16", "llama3.2-1b", (1, 64), 128, 32, 3, "llama3.2-1b", 5, 64, NOTEBOOKS, 4, 420)
DRY = Plan("cpu", "float32", "smollm2-135m", (1, 2), 8, 2, 1, "labkit-tiny", 2, 4, NOTEBOOKS[:1], 1, 240)


class Skipped(Exception):
    """A part of the plan that cannot run here; the reason goes into the report."""


@dataclass
class Check:
    name: str
    status: str = "passed"  # passed, failed or skipped
    reason: str = ""
    seconds: float = 0.0
    detail: dict = field(default_factory=dict)


def run_check(name: str, fn: Callable[[], dict]) -> Check:
    print(f"== {name}", flush=True)
    check, start = Check(name), time.perf_counter()
    try:
        check.detail = fn()
        check.status = check.detail.pop("status", "passed")
    except Skipped as why:
        check.status, check.reason = "skipped", str(why)
    except Exception as exc:  # noqa: BLE001  a failed part is recorded; the rest of the plan still runs
        check.status, check.reason = "failed", f"{type(exc).__name__}: {exc}"
    check.seconds = time.perf_counter() - start
    print(f"   {check.status} in {check.seconds:.1f} s {check.reason}", flush=True)
    return check


def pytest_run(args: list[str], timeout: int) -> dict:
    """Run pytest in a subprocess (smoke mode, offline); its outcome, time and summary line."""
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT,
                              env=ENV, capture_output=True, text=True, timeout=timeout)
        out, rc = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        out, rc = f"{exc.stdout or ''}\ntimed out after {timeout} s", -1
    lines = [ln for ln in str(out).splitlines() if ln.strip()]
    return {"status": "passed" if rc == 0 else "failed", "returncode": rc,
            "seconds": round(time.perf_counter() - start, 1), "summary": lines[-1] if lines else "",
            "tail": "" if rc == 0 else "\n".join(lines[-40:])}


def check_cuda_tests(plan: Plan) -> dict:
    if plan.device != "cuda":
        raise Skipped("needs a CUDA GPU: `pytest -m cuda` runs the CUDA tests on the GPU machine")
    return pytest_run(["-m", "cuda", "tests"], plan.timeout_s)


def check_notebooks(plan: Plan) -> dict:
    """Each notebook under nbval in smoke mode, on whatever device="auto" finds (the GPU, on a GPU machine)."""
    with ThreadPoolExecutor(plan.notebook_workers) as pool:
        runs = dict(zip(plan.notebooks, pool.map(lambda nb: pytest_run([f"notebooks/{nb}"], plan.timeout_s),
                                                  plan.notebooks)))
    failed = [nb for nb, r in runs.items() if r["status"] != "passed"]
    return {"status": "failed" if failed else "passed", "notebooks": runs, "failed": failed,
            "not_run": [nb for nb in NOTEBOOKS if nb not in runs]}


def decode_mbu(plan: Plan, roof: DeviceRoof, graphs: bool, backend: str) -> list[dict]:
    """Decode steps of each batch size on the preset (one engine): median forward and whole-step time, bytes, MBU."""
    context, batch_max = plan.prompt_len + plan.decode_steps + 8, max(plan.batches)
    rng, rows = random.Random(0), []
    with LLM(plan.preset, engine="chunked", device=plan.device, dtype=plan.dtype, max_num_seqs=batch_max,
             max_model_len=context, max_num_batched_tokens=max(512, batch_max * plan.prompt_len),
             num_gpu_blocks=batch_max * -(-context // 16) + 1, enforce_eager=not graphs,
             attention_backend=backend) as llm:
        prompts = [[rng.randrange(3, llm.model_config.vocab_size) for _ in range(plan.prompt_len)]
                   for _ in range(batch_max)]
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
        for batch in plan.batches:
            forward, whole = [], []
            for _ in range(plan.repeats):
                first = len(llm.engine.step_stats)
                llm.generate(prompts[:batch], SamplingParams(max_tokens=plan.decode_steps + 1, temperature=0.0,
                                                             ignore_eos=True), use_tqdm=False)
                decode = [s for s in llm.engine.step_stats[first:] if not s.is_prefill]
                forward += [s.stage_times["forward"] for s in decode]
                whole += [s.duration for s in decode]
            cost = decode_cost(llm.model_config, batch, plan.prompt_len + plan.decode_steps // 2, llm.dtype.itemsize)
            f, w = statistics.median(forward), statistics.median(whole)
            rows.append({"batch": batch, "graphs": graphs, "attention_backend": backend,
                         "forward_ms": f * 1e3, "step_ms": w * 1e3, "bytes_per_step": cost.total_bytes,
                         "mbu_forward": cost.total_bytes / f / roof.memory_bandwidth,
                         "mbu_step": cost.total_bytes / w / roof.memory_bandwidth})
    return rows


def check_mbu(plan: Plan, roof: DeviceRoof, backends: list[str]) -> dict:
    rows, skipped = [], []
    for backend in backends:
        rows += decode_mbu(plan, roof, False, backend)
    if plan.device == "cuda":  # graphs capture each backend's own decode ("torch": the padded path; "triton": its
        for backend in backends:  # kernel), so every backend has a graph row to compare with its eager one
            rows += decode_mbu(plan, roof, True, backend)
    else:
        skipped.append("CUDA graphs: they need CUDA")
    rows.sort(key=lambda r: (r["batch"], r["graphs"]))
    return {"preset": plan.preset, "dtype": plan.dtype, "prompt_len": plan.prompt_len,
            "decode_steps": plan.decode_steps, "roof_bandwidth": roof.memory_bandwidth, "rows": rows,
            "skipped": skipped}


def check_stability(plan: Plan) -> dict:
    """Async scheduling (+ CUDA graphs on a GPU) several times over: every run must give the synchronous tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randint(4, 48))] for _ in range(plan.stability_batch)]
    params = SamplingParams(max_tokens=2 * plan.decode_steps, temperature=0.0, ignore_eos=True)
    max_len = 48 + params.max_tokens + 8  # a pool of fixed size: what the run needs, whatever the device's memory
    options = dict(engine="chunked", device=plan.device, dtype=plan.dtype, max_num_seqs=plan.stability_batch,
                   max_model_len=max_len, num_gpu_blocks=plan.stability_batch * -(-max_len // 16) + 1)
    sync_seconds = []  # the synchronous engine's time for the same work: async scheduling's gain is the ratio
    with LLM(plan.stability_model, **options) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]  # warm-up too
        for _ in range(plan.stability_runs):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            sync_seconds.append(time.perf_counter() - start)
    runs = []
    with LLM(plan.stability_model, async_scheduling=True, **options) as llm:
        graphs = llm.engine.runner.graphs
        captured = graphs.num_captures if graphs is not None else 0
        for _ in range(plan.stability_runs):
            start = time.perf_counter()
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            runs.append({"seconds": time.perf_counter() - start, "same_tokens": tokens == reference})
        late = (graphs.num_captures - captured) if graphs is not None else 0
    ok = all(r["same_tokens"] for r in runs) and late == 0
    return {"status": "passed" if ok else "failed", "model": plan.stability_model, "graphs": graphs is not None,
            "runs": runs, "sync_seconds": sync_seconds, "captures_after_start": late}


def check_kernel_registers(plan: Plan) -> dict:
    """The Triton kernel compiled ahead of time for sm_90 as a GPU launch compiles it (``triton_aot``): registers
    per thread and spills, at head_dim 64 and 128, bfloat16 and float32. No GPU needed (ptxas ships with triton)."""
    from labkit.core.attention import TRITON_MISSING

    if TRITON_MISSING is not None:
        raise Skipped(f"needs the triton package: {TRITON_MISSING}")
    done = subprocess.run([sys.executable, "-m", "labkit.core.attention.triton_aot"], cwd=ROOT, capture_output=True,
                          text=True, timeout=plan.timeout_s, env={**ENV, "TRITON_INTERPRET": "0"})
    if done.returncode != 0:
        raise RuntimeError(f"ahead-of-time compilation failed: {done.stderr[-1500:]}")
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    spills = [r for r in rows if r["spills"]]
    return {"status": "failed" if spills else "passed", "rows": rows, "spilling": len(spills)}


def check_triton_precision(plan: Plan) -> dict:
    """The Triton kernel on a float32 pool within notebook 11's tolerance (1e-4) of a float64 softmax: on a GPU this
    fails if its dots run in TF32. Under the interpreter in the dry run (which computes float32 dots exactly)."""
    from labkit.core.attention import TRITON_MISSING

    if TRITON_MISSING is not None:
        raise Skipped(f"needs the triton package: {TRITON_MISSING}")
    from labkit.core.attention.triton_decode import dot_precision, is_interpreting, paged_decode_attention

    if plan.device != "cuda" and not is_interpreting():
        raise Skipped("Triton was imported without its interpreter and there is no GPU: run with --dry-run")
    dev, gen = torch.device(plan.device), torch.Generator().manual_seed(0)
    n_kv, group, d, block, lens = 2, 4, 64, 16, [45, 300 if plan.device == "cuda" else 70]
    blocks = sum(-(-c // block) for c in lens)
    k_pool = torch.randn(blocks, block, n_kv, d, generator=gen) * 2  # notebook 11's scales
    v_pool = torch.randn(blocks, block, n_kv, d, generator=gen) * 3
    q = torch.randn(len(lens), group * n_kv, d, generator=gen)
    order = torch.randperm(blocks, generator=gen).tolist()
    tables, want = [], torch.empty(q.shape, dtype=torch.float64)
    for i, c in enumerate(lens):
        n = -(-c // block)
        table, order = order[:n], order[n:]
        tables.append(table + [0] * (-(-max(lens) // block) - len(table)))
        keys, values = k_pool[table].flatten(0, 1)[:c].double(), v_pool[table].flatten(0, 1)[:c].double()
        for h in range(group * n_kv):
            want[i, h] = torch.softmax(keys[:, h // group] @ q[i, h].double() / d ** 0.5, 0) @ values[:, h // group]
    out = paged_decode_attention(q.to(dev), k_pool.to(dev), v_pool.to(dev),
                                 torch.tensor(tables, dtype=torch.int32, device=dev),
                                 torch.tensor(lens, dtype=torch.int32, device=dev), max(lens))
    error = float((out.cpu().double() - want).abs().max())
    return {"status": "passed" if error <= 1e-4 else "failed", "max_abs_diff": error, "tolerance": 1e-4,
            "dot_precision": dot_precision(torch.float32), "interpreter": is_interpreting()}


def check_quantized_gemv(plan: Plan, roof: DeviceRoof) -> dict:
    """Batch-1 decode GEMVs over int8 and int4 (group 32) weights, the Triton kernels CUDA decode runs
    (``labkit.core.quant.triton_gemv``), against the 16-bit layer (``F.linear``) and the path without a kernel
    (dequantize, then ``F.linear``), on a GPU preset's layer shapes: ms (median), GB/s of the bytes each reads, and
    the largest difference from x times the dequantized weight. The dry run: one small shape under the interpreter."""
    from torch.nn import functional as F

    from labkit.core.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8
    from labkit.core.quant.linear import dequantize, triton_gemv

    kernels = triton_gemv()
    if kernels is None:
        raise Skipped("needs the triton package")
    from labkit.core.attention.triton_decode import is_interpreting

    if plan.device != "cuda" and not is_interpreting():
        raise Skipped("Triton was imported without its interpreter and there is no GPU: run with --dry-run")
    dev, dtype = torch.device(plan.device), getattr(torch, plan.dtype)
    gen = torch.Generator().manual_seed(0)
    shapes = [(8192, 2048), (2048, 8192), (128256, 2048)] if plan.device == "cuda" else [(96, 128)]
    iters = 50 if plan.device == "cuda" else 2

    def timed(fn: Callable[[], torch.Tensor]) -> float:
        fn()
        times = []
        for _ in range(iters):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    def measure(out: int, n_in: int) -> list[dict]:
        w = torch.randn(out, n_in, generator=gen) * 0.02
        (q8, s8), (p4, s4) = quantize_int8(w), quantize_int4(w, 32)
        x = torch.randn(1, n_in, generator=gen).to(dev, dtype)
        refs = {"int8": dequantize_int8(q8, s8), "int4-g32": dequantize_int4(p4, s4, 32)}
        q8, s8, p4, s4, w16 = q8.to(dev), s8.to(dev), p4.to(dev), s4.to(dev), w.to(dev, dtype)
        calls = {f"F.linear ({plan.dtype})": (lambda: F.linear(x, w16), w16.numel() * w16.element_size(), None),
                 "int8, Triton": (lambda: kernels.gemv_quantized(x, q8, s8, "int8", 0), q8.numel() + s8.numel() * 4,
                                  "int8"),
                 "int4-g32, Triton": (lambda: kernels.gemv_quantized(x, p4, s4, "int4", 32),
                                      p4.numel() + s4.numel() * 4, "int4-g32"),
                 "int8, dequantize + F.linear": (lambda: F.linear(x, dequantize(q8, s8, "int8", 0, dtype)),
                                                 q8.numel() + s8.numel() * 4, "int8")}
        rows = []
        for name, (fn, nbytes, ref) in calls.items():
            seconds = timed(fn)
            diff = None
            if ref is not None:
                want = x.float().cpu() @ refs[ref].T
                diff = float((fn().float().cpu() - want).abs().max() / want.abs().max().clamp(min=1e-12))
            rows.append({"shape": f"{out} x {n_in}", "path": name, "ms": seconds * 1e3,
                         "gb_per_s": nbytes / seconds / 1e9, "share_of_roof": nbytes / seconds / roof.memory_bandwidth,
                         "max_rel_diff": diff})
        return rows

    rows = [row for out, n_in in shapes for row in measure(out, n_in)]
    worst = max(r["max_rel_diff"] for r in rows if r["max_rel_diff"] is not None)
    tolerance = 2e-2 if dtype != torch.float32 else 1e-5  # 16-bit x and output: about 3 significant digits
    return {"status": "passed" if worst <= tolerance else "failed", "rows": rows, "tolerance": tolerance,
            "interpreter": is_interpreting()}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def markdown(report: dict) -> str:
    hw, checks = report["hardware"], report["checks"]
    lines = [f"# GPU check: {hw['name']}", "", f"Generated by `scripts/gpu_check.py` on {report['date']} in "
             f"{report['seconds']:.0f} s{' (dry run on the CPU: tiny sizes, no CUDA)' if report['dry_run'] else ''}.",
             "", "```", report["command"], "```", "", "## Hardware", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in hw.items()] + ["", "## Checks", "", "| check | status | seconds | note |",
                                                           "|---|---|---:|---|"]
    lines += [f"| {c['name']} | {c['status']} | {c['seconds']:.1f} | {c['reason']} |" for c in checks]
    by_name = {c["name"]: c["detail"] for c in checks}
    if by_name.get("notebooks", {}).get("notebooks"):
        lines += ["", "## Notebooks (smoke sizes)", "", "| notebook | status | seconds | summary |",
                  "|---|---|---:|---|"]
        lines += [f"| {nb} | {r['status']} | {r['seconds']} | {r['summary']} |"
                  for nb, r in by_name["notebooks"]["notebooks"].items()]
    mbu = by_name.get("decode MBU", {})
    if mbu.get("rows"):
        lines += ["", f"## Decode MBU: {mbu['preset']} in {mbu['dtype']}", "",
                  f"Prompt {mbu['prompt_len']} tokens, {mbu['decode_steps']} decode steps, median step; bytes from "
                  f"`labkit.measure.roofline.decode_cost`; MBU against the measured roof "
                  f"({mbu['roof_bandwidth'] / 1e9:.0f} GB/s).", "",
                  "| batch | CUDA graphs | attention | forward ms | step ms | MBU (forward) | MBU (whole step) |",
                  "|---:|---|---|---:|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {'yes' if r['graphs'] else 'no'} | {r['attention_backend']} | "
                  f"{r['forward_ms']:.2f} | {r['step_ms']:.2f} | {r['mbu_forward']:.1%} | {r['mbu_step']:.1%} |"
                  for r in mbu["rows"]]
        lines += [f"\nNot measured here: {s}." for s in mbu["skipped"]]
    if by_name.get("decode attention", {}).get("rows"):
        lines += attention_kernel_markdown(by_name["decode attention"])
    registers = by_name.get("kernel registers (sm_90)", {})
    if registers.get("rows"):
        lines += ["", "## Triton kernel registers (sm_90, ptxas, ahead of time)", "",
                  "| kernel | head_dim | pool | warps | registers | spill stores | spill loads | TF32 MMA |",
                  "|---|---:|---|---:|---:|---:|---:|---|"]
        lines += [f"| {r['kernel']} | {r['head_dim']} | {r['dtype']} | {r['num_warps']} | {r['registers']} | "
                  f"{r['spill_stores']} | {r['spill_loads']} | {'yes' if r['tf32_mma'] else 'no'} |"
                  for r in registers["rows"]]
    precision = by_name.get("triton float32 precision", {})
    if "max_abs_diff" in precision:
        lines += ["", f"Triton kernel on a float32 pool: largest difference from a float64 softmax "
                  f"{precision['max_abs_diff']:.2g} (tolerance {precision['tolerance']}; dots in "
                  f"{precision['dot_precision']}{', under the interpreter' if precision['interpreter'] else ''})."]
    stable = by_name.get("async + graphs stability", {})
    if stable.get("runs"):
        lines += ["", f"## Stability: async scheduling{' + CUDA graphs' if stable['graphs'] else ''} "
                  f"({stable['model']})", "", "| run | seconds | same tokens as synchronous |", "|---:|---:|---|"]
        lines += [f"| {i} | {r['seconds']:.2f} | {'yes' if r['same_tokens'] else 'NO'} |"
                  for i, r in enumerate(stable["runs"], 1)]
        lines += ["", f"Graphs captured after start-up: {stable['captures_after_start']}."]
        if stable.get("sync_seconds"):
            sync = statistics.median(stable["sync_seconds"])
            took = statistics.median(r["seconds"] for r in stable["runs"])
            lines += [f"The same work synchronously: median {sync:.2f} s over {len(stable['sync_seconds'])} runs; "
                      f"async scheduling took {took / sync:.2f}x that (below 1: the host's planning hid behind the "
                      "device's work; the synchronous runs went first, not interleaved)."]
    gemv = by_name.get("quantized GEMV", {})
    if gemv.get("rows"):
        lines += ["", "## Quantized decode GEMV (batch 1)", "",
                  "Triton's int8 / int4 kernels (`labkit.core.quant.triton_gemv`) against the 16-bit layer and the "
                  "path without a kernel; GB/s: the bytes each reads over its time; difference: the largest from x "
                  f"times the dequantized weight, over the output's largest (tolerance {gemv['tolerance']})"
                  f"{'; under the interpreter' if gemv['interpreter'] else ''}.", "",
                  "| shape | path | ms | GB/s | share of roof | difference |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {r['shape']} | {r['path']} | {r['ms']:.4g} | {r['gb_per_s']:.3g} | {r['share_of_roof']:.2g} | "
                  f"{'-' if r['max_rel_diff'] is None else format(r['max_rel_diff'], '.2g')} |" for r in gemv["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the same plan on the CPU at tiny sizes (CI)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "gpu", help="report folder")
    parser.add_argument("--attention-backend", nargs="+", default=None,
                        help=f"backends to measure decode MBU with (default: all, {', '.join(ATTENTION_BACKENDS)}; "
                             "torch in a dry run, where Triton's interpreter would only be slow)")
    parser.add_argument("--notebooks", nargs="*", default=None, help="notebook file names (default: the plan's)")
    parser.add_argument("--notebook-workers", type=int, default=None, help="notebooks run side by side (GPU: 4)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run on a CUDA machine, or pass --dry-run")
    plan = DRY if args.dry_run else GPU
    if args.notebooks is not None:
        plan = Plan(**{**asdict(plan), "notebooks": tuple(args.notebooks)})
    if args.notebook_workers is not None:
        plan = Plan(**{**asdict(plan), "notebook_workers": args.notebook_workers})
    start, device = time.perf_counter(), torch.device(plan.device)
    report = {"dry_run": args.dry_run, "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join([".venv/bin/python", "scripts/gpu_check.py", *(argv or sys.argv[1:])]),
              "seconds": 0.0, "hardware": describe_device(device), "plan": asdict(plan), "checks": [],
              "complete": False}
    stem = "dry-run" if args.dry_run else slug(report["hardware"]["name"])
    args.out.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        """Both reports as they stand: rewritten after every check, so a run cut short keeps what it measured."""
        report["seconds"] = time.perf_counter() - start
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        (args.out / f"{stem}.md").write_text(markdown(report), encoding="utf-8")

    checks: list[Check] = []

    def run(name: str, fn: Callable[[], dict]) -> None:
        checks.append(run_check(name, fn))
        report["checks"].append(asdict(checks[-1]))
        write()

    roofs: list[DeviceRoof] = []

    def hardware() -> dict:
        roofs.append(probe(device, plan.dtype, smoke=args.dry_run))
        return asdict(roofs[0])

    def roof() -> DeviceRoof:
        if not roofs:  # reported as skipped, with the reason, never dropped from the report
            raise Skipped("needs the hardware probe's measured roof, and the probe failed (see its row)")
        return roofs[0]

    backends = args.attention_backend or (["torch"] if args.dry_run else
                                          [b for b in ATTENTION_BACKENDS if b != "cpp"])  # "cpp": the CPU's
    write()
    run("hardware probe", hardware)
    run("CUDA tests", lambda: check_cuda_tests(plan))
    run("kernel registers (sm_90)", lambda: check_kernel_registers(plan))
    run("triton float32 precision", lambda: check_triton_precision(plan))
    run("notebooks", lambda: check_notebooks(plan))
    run("decode MBU", lambda: check_mbu(plan, roof(), backends))
    run("decode attention", lambda: attention_kernel_rows(plan.device, plan.dtype, roof().memory_bandwidth,
                                                          args.dry_run))
    run("async + graphs stability", lambda: check_stability(plan))
    run("quantized GEMV", lambda: check_quantized_gemv(plan, roof()))
    report["complete"] = True
    write()
    print(f"wrote {args.out / stem}.json and .md in {report['seconds']:.0f} s")
    return 1 if any(c.status == "failed" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
