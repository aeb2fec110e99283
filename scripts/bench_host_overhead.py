"""Benchmark host overhead: how much of each engine step the device spends waiting for Python.

Run from the repository root:

    .venv/bin/python scripts/bench_host_overhead.py              # full run, writes docs/benchmarks/host_overhead.md
    .venv/bin/python scripts/bench_host_overhead.py --smoke      # small sizes, well under a minute; no report
    .venv/bin/python scripts/bench_host_overhead.py --device cuda --mbu-preset llama3.2-1b --dtype bfloat16

In one run, on the bundled model (CPU float32 unless --device says otherwise), engine ``chunked``, decode
batches of 1 and 32 requests (prompts of 16 tokens, every request decoding to ``max_tokens``):

1. **Host time per decode step and its share of the step**, for each host-side option the engine exposes on
   this device, side by side: ``prepare_inputs="loop"`` (per-token Python input preparation) against
   ``"vectorized"`` (the default), and on CUDA also ``enforce_eager=False`` (CUDA graphs). Host time comes from a
   ``torch.profiler`` trace (``labkit.measure.profiling``): the
   part of each step in which the device had no work (on a CPU: the step minus the aten operators of the
   forward pass; see ``labkit/measure/profiling/trace_analysis.py``). Tracing slows every operator a little, so the
   untraced step time of the same configuration is reported beside it, and an estimate of the untraced host
   time (traced host share x untraced step time).
2. **transformers' own ``generate``** on the same checkpoint (greedy, EOS ignored) at the same batch sizes:
   per-step time = (time for N2 tokens - time for N1 tokens) / (N2 - N1), so prefill cancels out. The goal
   (issue 7): ``chunked``'s per-step host overhead at batch 1 <= 1/3 of transformers' per-step time.
3. With ``--mbu-preset``: decode MBU at batch 1 on that preset (random weights), per configuration; on a GPU
   that is where CUDA graphs show (a ~1B model in bf16: ``--mbu-preset llama3.2-1b --dtype bfloat16``).

Configurations alternate round by round so that a burst of load from other programs hits them alike; every
figure is a median. Benchmarks are scripts, not tests (DESIGN.md section 6). Notebook 10 explains the terms.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout, not installed
from bench_common import OtherLoad, bench_parser, finish_report, start_bench  # noqa: E402  (scripts/ is on sys.path)
from benchlib.host_overhead_measure import (  # noqa: E402
    FULL,
    SMOKE,
    Samples,
    configurations,
    hf_per_step,
    measure_engine,
    measure_mbu,
)
from benchlib.host_overhead_report import report  # noqa: E402

from labkit import LLM, SamplingParams  # noqa: E402
from labkit.core.model.source import bundled_model_path  # noqa: E402
from labkit.course.workloads import prompt_ids_of_length  # noqa: E402
from labkit.measure.hardware import probe  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "benchmarks" / "host_overhead.md"


def main() -> int:
    parser = bench_parser("host time per engine step, before and after the host-side fixes", DEFAULT_OUT,
                          device_help="cpu (default), cuda or auto")
    parser.add_argument("--mbu-preset", default=None, help="also measure decode MBU at batch 1 on this preset")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    bench = start_bench(args, "bench_host_overhead.py", DEFAULT_OUT)
    out, command, device, dtype, hw, t0 = bench.out, bench.command, bench.device, bench.dtype, bench.hw, bench.t0
    other_load = OtherLoad()

    configs = configurations(device)
    llms = {label: LLM("labkit-tiny", engine="chunked", device=device, dtype=dtype, max_num_seqs=max(sizes.batches),
                       **options)  # type: ignore[arg-type]
            for label, options in configs.items()}
    tokenizer = next(iter(llms.values())).tokenizer
    prompts = [prompt_ids_of_length(tokenizer, sizes.prompt_len, seed=i) for i in range(max(sizes.batches))]
    params = SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0, ignore_eos=True)
    for llm in llms.values():  # warm-up: first calls allocate, pick kernels, capture graphs
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)

    from transformers import AutoModelForCausalLM
    hf_model = AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=dtype).to(device).eval()
    hf: dict[int, list[float]] = {b: [] for b in sizes.batches}
    cells = {(label, b): Samples() for label in configs for b in sizes.batches}
    with tempfile.TemporaryDirectory(prefix="bench-host-") as logdir:
        for _ in tqdm(range(sizes.rounds), desc="rounds"):
            for b in sizes.batches:
                for label, llm in llms.items():
                    measure_engine(llm, prompts[:b], params, cells[(label, b)], Path(logdir))
                ids = torch.tensor(prompts[:b], device=device)  # equal lengths: no padding needed
                hf[b].append(hf_per_step(hf_model, ids, sizes.hf_tokens, rounds=1))
    del llms, hf_model

    mbu_rows, roof = None, None
    if args.mbu_preset:
        roof = probe(device, dtype, smoke=args.smoke)
        mbu_rows = measure_mbu(args.mbu_preset, device, dtype, configs, sizes, roof)

    load = other_load.fraction()
    text = report(command, hw, sizes, dtype, cells, {b: statistics.median(v) for b, v in hf.items()}, mbu_rows,
                  args.mbu_preset, roof, time.perf_counter() - t0, load)
    finish_report(text, out, load)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
