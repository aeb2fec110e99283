"""``scripts/bench_host_overhead.py``'s sizes, configurations and measurements.

How much of each engine step the device spends waiting for Python, for each host-side option side by side, and
transformers' per-step time beside it (notebook 10); ``host_overhead_report`` writes the report.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from labkit.core.llm import LLM
from labkit.core.sampling_params import SamplingParams
from labkit.measure.hardware import DeviceRoof
from labkit.measure.profiling import profile_engine
from labkit.measure.roofline import decode_cost, mbu
from labkit.measure.rounds import interleave
from labkit.measure.timing import time_call
from labkit.measure.workloads import prompt_ids_of_length

HOST_STAGES = ("schedule", "prepare", "sample", "detokenize")  # the StageClock stages outside the forward pass
ASYNC = "vectorized + async"  # async scheduling: steps overlap, so it is measured by its step period, untraced


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; --smoke shrinks everything."""

    batches: tuple[int, ...]
    prompt_len: int
    max_tokens: int  # tokens each request decodes (the decode steps measured)
    rounds: int
    hf_tokens: tuple[int, int]  # N1, N2 for transformers' per-step time
    mbu_context: int
    mbu_tokens: int


FULL = Sizes(batches=(1, 32), prompt_len=16, max_tokens=48, rounds=5, hf_tokens=(8, 56), mbu_context=512,
             mbu_tokens=32)
SMOKE = Sizes(batches=(1, 4), prompt_len=8, max_tokens=6, rounds=1, hf_tokens=(2, 6), mbu_context=32, mbu_tokens=4)


def configurations(device: torch.device) -> dict[str, dict[str, object]]:
    """The host-side options this device can run, by label."""
    # Eager unless the label says CUDA graphs (graphs are the default on CUDA).
    configs: dict[str, dict[str, object]] = {"loop": {"prepare_inputs": "loop", "enforce_eager": True},
                                             "vectorized": {"prepare_inputs": "vectorized", "enforce_eager": True},
                                             ASYNC: {"async_scheduling": True, "enforce_eager": True}}
    if device.type == "cuda":
        configs["vectorized + CUDA graphs"] = {"enforce_eager": False}
        configs["async + CUDA graphs"] = {"async_scheduling": True, "enforce_eager": False}
    return configs


def is_async(label: str) -> bool:
    return "async" in label


@dataclass
class Samples:
    """Per-decode-step samples of one (configuration, batch) cell, pooled over rounds. Seconds."""

    step: list[float] = field(default_factory=list)  # untraced step time
    period: list[float] = field(default_factory=list)  # untraced, from one step's end to the next's
    host_stages: list[float] = field(default_factory=list)  # untraced schedule+prepare+sample+detokenize
    traced_step: list[float] = field(default_factory=list)
    traced_host: list[float] = field(default_factory=list)  # device idle inside the traced step

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))

    @property
    def host_share(self) -> float:
        return statistics.median(h / s for h, s in zip(self.traced_host, self.traced_step))


def measure_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams, cell: Samples, logdir: Path) -> None:
    """One untraced and one traced run of the same requests; decode steps only. An async engine is not traced
    (``profile_engine`` refuses it: its forward pass runs on a worker thread); only its step period counts."""
    first = len(llm.engine.step_stats)
    llm.generate(prompts, params, use_tqdm=False)
    steps = llm.engine.step_stats[first:]
    for prev, st in zip([None, *steps], steps):
        if not st.is_prefill:
            cell.step.append(st.duration)
            cell.host_stages.append(sum(st.stage_times.get(k, 0.0) for k in HOST_STAGES))
            if prev is not None:
                cell.period.append(st.end - prev.end)
    if llm.engine.async_scheduling:
        return
    prof = profile_engine(llm, prompts, params, logdir=logdir, warmup=False)
    prof.trace_path.unlink()  # traces are tens of MB at batch 32; the analysis is all we keep
    analysis = prof.analyze()
    for step, st in zip(analysis.steps, prof.step_stats, strict=True):
        if not st.is_prefill:
            cell.traced_step.append(step.duration / 1e6)
            cell.traced_host.append(step.host_overhead / 1e6)


@torch.inference_mode()
def hf_per_step(model: torch.nn.Module, ids: torch.Tensor, tokens: tuple[int, int], rounds: int) -> float:
    """transformers' generate: marginal seconds per decode step, (t(N2) - t(N1)) / (N2 - N1), median of rounds."""
    def run(n: int) -> float:
        return time_call(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                max_new_tokens=n, min_new_tokens=n, pad_token_id=0), ids.device)[1]

    run(2)  # warm-up
    n1, n2 = tokens
    return statistics.median((run(n2) - run(n1)) / (n2 - n1) for _ in range(rounds))


def chunked_engines(configs: dict[str, dict[str, object]], device: torch.device, dtype: torch.dtype, sizes: Sizes
                    ) -> tuple[dict[str, LLM], list[list[int]]]:
    """One ``chunked`` engine per configuration on the bundled model, warmed up, and the prompts of the largest
    batch (every batch takes the first B of them)."""
    llms = {label: LLM("labkit-tiny", engine="chunked", device=device, dtype=dtype, max_num_seqs=max(sizes.batches),
                       **options)  # type: ignore[arg-type]
            for label, options in configs.items()}
    tokenizer = next(iter(llms.values())).tokenizer
    prompts = [prompt_ids_of_length(tokenizer, sizes.prompt_len, seed=i) for i in range(max(sizes.batches))]
    for llm in llms.values():  # warm-up: first calls allocate, pick kernels, capture graphs
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return llms, prompts


def measure_cells(llms: dict[str, LLM], hf_model: torch.nn.Module, prompts: list[list[int]], sizes: Sizes,
                  device: torch.device, logdir: Path) -> tuple[dict[tuple[str, int], Samples], dict[int, float]]:
    """Every (configuration, batch) cell and transformers' per-step time at every batch, in interleaved rounds so
    that a burst of load from other programs hits them alike: the samples of each cell, and transformers' median
    per-step seconds by batch."""
    params = SamplingParams(max_tokens=sizes.max_tokens, temperature=0.0, ignore_eos=True)
    cells = {(label, b): Samples() for label in llms for b in sizes.batches}
    hf: dict[int, list[float]] = {b: [] for b in sizes.batches}

    def engine_cell(label: str, b: int) -> Callable[[], None]:
        return lambda: measure_engine(llms[label], prompts[:b], params, cells[(label, b)], logdir)

    def hf_cell(b: int) -> Callable[[], None]:
        ids = torch.tensor(prompts[:b], device=device)  # equal lengths: no padding needed
        return lambda: hf[b].append(hf_per_step(hf_model, ids, sizes.hf_tokens, rounds=1))

    contenders: dict[str, Callable[[], None]] = {}
    for b in sizes.batches:
        contenders.update({f"{label}, batch {b}": engine_cell(label, b) for label in llms})
        contenders[f"transformers generate, batch {b}"] = hf_cell(b)
    # Each engine was warmed up, and hf_per_step warms transformers up itself.
    interleave(contenders, sizes.rounds, warmup=0, device=device, check_load=False)
    return cells, {b: statistics.median(v) for b, v in hf.items()}


def measure_mbu(preset: str, device: torch.device, dtype: torch.dtype, configs: dict[str, dict[str, object]],
                sizes: Sizes, roof: DeviceRoof) -> list[list[str]]:
    """Decode MBU at batch 1 on ``preset`` for each configuration (median decode step, untraced)."""
    rows = []
    ids = None
    for label, options in configs.items():
        llm = LLM(preset, engine="chunked", device=device, dtype=dtype,
                  max_model_len=sizes.mbu_context + sizes.mbu_tokens + 8, **options)  # type: ignore[arg-type]
        ids = ids or prompt_ids_of_length(llm.tokenizer, sizes.mbu_context, seed=3)
        params = SamplingParams(max_tokens=sizes.mbu_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        steps: list[float] = []
        for _ in range(sizes.rounds):
            first = len(llm.engine.step_stats)
            llm.generate([ids], params, use_tqdm=False)
            run = llm.engine.step_stats[first:]
            if is_async(label):  # overlapping steps: time from one step's end to the next's
                steps += [st.end - prev.end for prev, st in zip(run, run[1:]) if not st.is_prefill]
            else:
                steps += [st.duration for st in run if not st.is_prefill]
        step = statistics.median(steps)
        cost = decode_cost(llm.model_config, 1, sizes.mbu_context + sizes.mbu_tokens // 2, llm.dtype.itemsize)
        rows.append([label, f"{step * 1e3:.2f}", f"{cost.total_bytes / step / 1e9:.1f}",
                     f"{mbu(cost, step, roof):.1%}"])
        del llm
    return rows
