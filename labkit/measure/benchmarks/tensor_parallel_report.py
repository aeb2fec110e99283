"""Tensor parallelism on this machine: all-reduce latency and bandwidth by size, and a decode step split into
compute and communication at ``tensor_parallel_size`` 1 and 2.

``scripts/bench_tensor_parallel.py`` runs ``run`` and writes ``docs/benchmarks/tensor_parallel.md`` (and its
.json). The all-reduces run between this process and one spawned peer on labkit's own group
(``labkit.core.parallel.group.ProcessTPGroup``: gloo over 127.0.0.1 on a CPU), each size repeated and the median
taken; bus bandwidth is NCCL's convention, 2 (N-1)/N x bytes / time. The steps are the engine's own
(``LLM(..., tensor_parallel_size=N)``), the threads split evenly (N=1: all threads; N=2: one share per rank), timed
in interleaved rounds (``labkit.measure.rounds``); rank 0's all-reduce time per step (``executor.comm_log``) is
the communication, the rest of the step is compute and host work. Introduced with notebook 15
(``15_tensor_parallelism``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp

from labkit.core.llm import LLM
from labkit.core.parallel.group import ProcessTPGroup, open_store
from labkit.core.sampling_params import SamplingParams
from labkit.measure.benchmarks.report import Hardware, md_table, report_header
from labkit.measure.rounds import interleave


@dataclass(frozen=True)
class Sizes:
    all_reduce_bytes: tuple[int, ...]
    repeats: int  # all-reduces per size (the median is reported)
    batches: tuple[int, ...]
    decode_tokens: int
    rounds: int


FULL = Sizes(tuple(4 ** k for k in range(5, 13)), 30, (1, 64), 16, 3)  # 1 KiB ... 16 MiB
SMOKE = Sizes((1 << 10, 1 << 16, 1 << 20), 10, (1, 64), 8, 2)


@dataclass
class Results:
    threads: int
    all_reduce: list[tuple[int, float]] = field(default_factory=list)  # (bytes, median seconds)
    steps: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # N -> batch -> (step, comm) s
    ranges: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)  # N -> batch -> step range


def peer(port: int, sizes: tuple[int, ...], repeats: int) -> None:
    """Rank 1 of the all-reduce measurement: the same all-reduces as rank 0, in the same order."""
    torch.set_num_threads(1)
    group = ProcessTPGroup(open_store(1, 2, port, 60.0), 1, 2, torch.device("cpu"), 60.0)
    for n in sizes:
        buf = torch.ones(n // 4)
        for _ in range(repeats + 2):
            group.all_reduce(buf)


def measure_all_reduce(sizes: Sizes) -> list[tuple[int, float]]:
    """Median seconds of a float32 sum all-reduce between two processes, per size in bytes."""
    store = open_store(0, 2, 0, 60.0)
    process = mp.get_context("spawn").Process(target=peer, args=(store.port, sizes.all_reduce_bytes, sizes.repeats),
                                              daemon=True)
    process.start()
    try:
        group = ProcessTPGroup(store, 0, 2, torch.device("cpu"), 60.0)
        out = []
        for n in sizes.all_reduce_bytes:
            buf = torch.ones(n // 4)
            times = []
            for i in range(sizes.repeats + 2):
                start = time.perf_counter()
                group.all_reduce(buf)
                if i >= 2:  # two warm-up calls per size
                    times.append(time.perf_counter() - start)
            out.append((n, statistics.median(times)))
        return out
    finally:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()


def run(sizes: Sizes, threads: int) -> Results:
    res = Results(threads, measure_all_reduce(sizes))
    prompts = [[1] + [100 + (7 * i + j) % 500 for j in range(15)] for i in range(max(sizes.batches))]
    params = SamplingParams(max_tokens=sizes.decode_tokens, temperature=0, ignore_eos=True)
    engines = {"N=1": (LLM(engine="continuous", device="cpu", max_num_seqs=max(sizes.batches)), threads),
               "N=2": (LLM(engine="continuous", device="cpu", max_num_seqs=max(sizes.batches),
                           tensor_parallel_size=2), max(1, threads // 2))}

    def contender(name: str):  # type: ignore[no-untyped-def]
        llm, n_threads = engines[name]

        def once() -> dict[str, float]:
            torch.set_num_threads(n_threads)
            out = {}
            for b in sizes.batches:
                llm.engine.step_stats.clear()
                log = getattr(llm.engine, "executor", None)
                if log is not None:
                    log.comm_log.clear()
                llm.generate(prompts[:b], params, use_tqdm=False)
                stats = llm.engine.step_stats
                comm = list(log.comm_log) if log is not None else [None] * len(stats)
                decode = [(s.duration, c.all_reduce_s if c is not None else 0.0) for s, c in zip(stats, comm)
                          if not s.is_prefill]
                out[f"step {b}"] = statistics.median(d for d, _ in decode)
                out[f"comm {b}"] = statistics.median(c for _, c in decode)
            return out

        return once

    try:
        rounds = interleave({name: contender(name) for name in engines}, num_rounds=sizes.rounds, warmup=1,
                            device="cpu", progress=False)
        for name in engines:
            res.steps[name] = {b: (rounds.median(name, f"step {b}"), rounds.median(name, f"comm {b}"))
                               for b in sizes.batches}
            res.ranges[name] = {b: rounds.spread(name, f"step {b}") for b in sizes.batches}
    finally:
        for llm, _ in engines.values():
            llm.close()
        torch.set_num_threads(threads)
    return res


def human_bytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def report(res: Results, command: str, hw: Hardware, wall_s: float, load: float | None) -> str:
    lines = report_header("Benchmark: tensor parallelism on this machine", command, hw, wall_s, load)
    lines += ["## All-reduce between two processes (gloo, 127.0.0.1)", "",
              "Float32 sum all-reduce between this process and one spawned peer on labkit's own group "
              "(`labkit.core.parallel.group.ProcessTPGroup`), median of the repeats. Bandwidth is bytes / time, "
              "which at N = 2 equals NCCL's bus bandwidth, 2 (N-1)/N x bytes / time.", ""]
    rows = [[human_bytes(n), f"{t * 1e6:.0f}", f"{n / t / 1e9:.3f}"] for n, t in res.all_reduce]
    lines += [md_table(["bytes", "latency (µs)", "bandwidth (GB/s)"], rows), ""]
    small, large = res.all_reduce[0], res.all_reduce[-1]
    fastest = min(res.all_reduce, key=lambda r: r[1])
    lines += [f"The smallest all-reduce ({human_bytes(small[0])}, a decode step's per-token buffer for the bundled "
              f"model; a step makes 8, two per layer) took {small[1] * 1e6:.0f} µs; the quickest of all sizes "
              f"({human_bytes(fastest[0])}) {fastest[1] * 1e6:.0f} µs. The largest ({human_bytes(large[0])}) "
              f"moved {large[0] / large[1] / 1e9:.2f} GB/s.", ""]
    lines += ["## A decode step at N = 1 and N = 2, split into compute and communication", "",
              f"Bundled model, engine `continuous`, float32, greedy; N=1 on {res.threads} thread(s), N=2 on "
              f"{max(1, res.threads // 2)} per rank. Median decode step of interleaved rounds (the range over the "
              "rounds in brackets); communication is rank 0's time in all-reduces per step (waiting for the other "
              "rank included), compute is the rest of the step.", ""]
    rows = []
    for name, per_batch in res.steps.items():
        for b, (step, comm) in per_batch.items():
            lo, hi = res.ranges[name][b]
            rows.append([name, str(b), f"{step * 1e3:.2f} ({lo * 1e3:.2f}-{hi * 1e3:.2f})", f"{comm * 1e3:.2f}",
                         f"{(step - comm) * 1e3:.2f}", f"{comm / step:.0%}"])
    lines += [md_table(["engine", "batch", "step (ms)", "all-reduces (ms)", "compute and host (ms)",
                        "communication share"], rows), ""]
    ratios = [f"batch {b}: {res.steps['N=2'][b][0] / res.steps['N=1'][b][0]:.2f}x" for b in res.steps["N=1"]]
    lines += [f"N=2's step time over N=1's: {', '.join(ratios)} (below 1: N=2 is faster).", ""]
    if load is not None and load > 0.1:
        lines += [f"Other programs kept {load:.0%} of the CPUs busy during this run: a two-thread matmul (N=1) "
                  "waits for whichever of its threads was descheduled, and an all-reduce (N=2) waits for the other "
                  "rank to get a core, so both columns measure the load as much as the engines. Re-run on a quiet "
                  "machine before reading the ratios as tensor parallelism's.", ""]
    lines += ["What this machine cannot show: both ranks share one CPU's memory bandwidth (splitting the weights "
              "saves no bandwidth), and the link is loopback TCP. GPUs on NVLink would cut each rank's weight "
              "traffic by N and all-reduce in microseconds; notebook 15 models that from public specs. This report "
              "measures the CPU path only (gloo); the NCCL path between GPUs is not measured here.", ""]
    return "\n".join(lines)
