"""How close a batch-1 decode step comes to the memory's read roof, the GEMV baselines, and where its time goes.

At batch 1 almost every byte a decode step moves is a weight, read once for one row: the step is a chain of
matrix-vector products (GEMV). Its roof is the memory's: the rate at which this machine's threads can read memory at
all, measured by summing one tensor far larger than the caches (``read_roof``; notebook 00's probe measures the
same). No kernel streams weights faster. What a library's GEMV reaches is a **baseline** under that roof, and it
depends on the kernel and the weight's layout: ``measure_gemv_roof`` times PyTorch's ``F.linear`` over the usual
(out, in) weight, ``x @ W`` over an (in, out) one, and, on a CPU in float32, oneDNN over its packed layout
(``labkit.core.model.linear``); labkit's own C++ GEMV kernels (``labkit.core.quant.gemv``, float32, int8, int4) are
what move decode toward the roof (notebook 14). (The name ``GemvRoof`` is historical: its figures are baselines.)
``measure_decode_breakdown`` splits a real decode step into the linear layers, attention and everything else.
Notebook 04 (``04_prefill_vs_decode``); ``scripts/bench_kvcache.py`` runs both on the smollm2-135m preset.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn import functional as F

from labkit.core.model.linear import LinearKernel, onednn_linear_available
from labkit.core.quant.gemv import stream_read_bandwidth
from labkit.core.sampling_params import SamplingParams
from labkit.measure.roofline import decode_cost
from labkit.measure.rounds import interleave
from labkit.measure.timing import timing_calls

if TYPE_CHECKING:
    from labkit.core.engine.step import StepStats
    from labkit.core.llm import LLM

PLAIN_KERNELS = ("F.linear, weight (out, in)", "x @ W, weight (in, out)")  # PyTorch's own matmul, either layout
ONEDNN_KERNEL = "oneDNN, packed weight"


@dataclass(frozen=True)
class GemvRoof:
    """The bandwidth one matrix-vector product reaches on a matrix far larger than the caches, per kernel: library
    baselines under the memory's read roof (``read_roof``), not the roof itself.

    ``plain`` is the best of PyTorch's own matmul in either layout (what "a plain GEMV" reaches); ``best`` includes
    oneDNN's packed layout where this build has it. Notebook 04.
    """

    device: str
    dtype: str
    nbytes: int  # size of the matrix
    bandwidth: dict[str, float]  # kernel -> bytes/s, median of the rounds
    smoke: bool = False  # a small matrix: caches inflate the figures

    @property
    def plain(self) -> float:
        return max(self.bandwidth[k] for k in PLAIN_KERNELS)

    @property
    def best(self) -> float:
        return max(self.bandwidth.values())

    def summary(self) -> str:
        rates = ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in self.bandwidth.items())
        return f"GEMV roof ({self.device}, {self.dtype}, {self.nbytes / 2**20:.0f} MiB matrix): {rates}"


def read_roof(num_bytes: int = 256 << 20) -> float:
    """The roof of batch-1 decode on this CPU, bytes/s: one ``num_bytes`` float32 tensor (>= 256 MB) summed by this
    process's threads, rows split as labkit's GEMV kernels split them (``labkit.core.quant.gemv``). Notebook 14."""
    return stream_read_bandwidth(num_bytes)


def measure_gemv_roof(device: torch.device, dtype: torch.dtype, nbytes: int = 256 << 20, rounds: int = 5,
                      in_features: tuple[int, ...] = (512, 2048)) -> GemvRoof:
    """One vector times a matrix of ``nbytes``, each kernel in turn, ``rounds`` rounds; a kernel's figure is its best
    median over the matrix shapes tried (a roof is the most the kernel reaches; shapes favour kernels differently)."""
    best: dict[str, float] = {}
    for k in in_features:
        out_features = max(1, nbytes // (k * dtype.itemsize))
        matrix_bytes = out_features * k * dtype.itemsize
        for name, seconds in _time_gemv_kernels(device, dtype, out_features, k, rounds).items():
            best[name] = max(best.get(name, 0.0), matrix_bytes / seconds)
    return GemvRoof(device.type, str(dtype).removeprefix("torch."), nbytes, best, smoke=nbytes < 64 << 20)


def _time_gemv_kernels(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int,
                       rounds: int) -> dict[str, float]:
    """Median seconds of each kernel's (1, in) x (in, out) product, the kernels interleaved round by round."""
    weight = torch.randn(out_features, in_features, device=device, dtype=dtype)  # (out, in)
    weight_t = weight.t().contiguous()  # (in, out)
    x = torch.randn(1, in_features, device=device, dtype=dtype)  # (1, in)
    packed = LinearKernel()  # packs in the warm-up

    def out_in() -> None:
        F.linear(x, weight)

    def in_out() -> None:
        x @ weight_t

    def onednn() -> None:
        packed(x, weight, None)

    kernels: dict[str, Callable[[], None]] = {PLAIN_KERNELS[0]: out_in, PLAIN_KERNELS[1]: in_out}
    if device.type == "cpu" and dtype == torch.float32 and onednn_linear_available():
        kernels[ONEDNN_KERNEL] = onednn
    with torch.inference_mode():
        rounds_run = interleave(kernels, rounds, warmup=1, device=device, progress=False, check_load=False)
    return {k: rounds_run.median(k) for k in kernels}


@dataclass(frozen=True)
class DecodeBreakdown:
    """Batch-1 decode steps of an engine, median per step: the whole step, and its forward pass split into the
    linear layers, the attention backend and everything else (norms, RoPE, activations, residual adds, the Python
    between them). Notebook 04."""

    step_s: float  # the whole engine step (prepare, forward, sample, detokenize), untimed inside
    timed_step_s: float  # the same in the run with timers inside (a few µs per timed call)
    forward_s: float  # its forward stage
    matmul_s: float  # inside the linear layers' kernels
    attention_s: float  # inside the attention backend's attend (K/V writes, scores, softmax, values)
    nbytes: int  # bytes the step must move (labkit.measure.roofline.decode_cost)

    @property
    def other_s(self) -> float:
        return max(0.0, self.forward_s - self.matmul_s - self.attention_s)

    @property
    def bandwidth(self) -> float:
        """Bytes per second of the whole step: its MBU's numerator."""
        return self.nbytes / self.step_s

    def shares(self) -> dict[str, float]:
        """Seconds per step of each part, the engine around the forward pass included (from the timed run)."""
        return {"linear layers": self.matmul_s, "attention": self.attention_s, "everything else": self.other_s,
                "engine (prepare, sample, detokenize)": max(0.0, self.timed_step_s - self.forward_s)}


@contextmanager
def device_timing_calls(owner: object, name: str, into: list[float], device: torch.device) -> Iterator[None]:
    """``timing_calls`` that times the device's work: on CUDA a call returns once its kernels are *launched*, so a
    host clock would time the launches; there each call is bracketed by CUDA events, read once at the end of the
    block (no synchronisation per call). Elsewhere calls are synchronous: ``timing_calls`` itself."""
    if device.type != "cuda":
        with timing_calls(owner, name, into):
            yield
        return
    original = getattr(owner, name)
    pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def wrapper(*args: object, **kwargs: object) -> object:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return original(*args, **kwargs)
        finally:
            end.record()
            pairs.append((start, end))

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)
        torch.cuda.synchronize(device)
        into[0] += sum(start.elapsed_time(end) for start, end in pairs) / 1e3  # elapsed_time: milliseconds


def measure_decode_breakdown(llm: LLM, prompt_ids: list[int], num_steps: int, backend_cls: type) -> DecodeBreakdown:
    """Decode ``num_steps`` tokens after ``prompt_ids`` twice: untimed inside (the step's time), then with the linear
    kernels and ``backend_cls.attend`` timed (the split). ``llm``: batch 1. On CUDA the calls are timed with CUDA
    events (``device_timing_calls``), not by the host's clock, which would see only the launches."""
    device = llm.engine.device
    params = SamplingParams(max_tokens=num_steps + 1, temperature=0.0, ignore_eos=True)

    def decode_steps(timers: list[list[float]] | None) -> list[StepStats]:
        before = len(llm.engine.step_stats)
        llm.add_request(prompt_ids, params)
        llm.step()  # the prefill, never timed inside
        with (device_timing_calls(LinearKernel, "__call__", timers[0], device) if timers else nullcontext()), \
                (device_timing_calls(backend_cls, "attend", timers[1], device) if timers else nullcontext()):
            while llm.engine.has_unfinished_requests():
                llm.step()
        return [s for s in llm.engine.step_stats[before:] if not s.is_prefill]

    step_s = statistics.median(s.duration for s in decode_steps(None))
    matmul, attention = [0.0], [0.0]
    stats = decode_steps([matmul, attention])
    n = len(stats)
    cost = decode_cost(llm.model_config, 1, len(prompt_ids) + n // 2, llm.dtype.itemsize)
    forward = sum(s.stage_times["forward"] for s in stats) / n
    timed_step = sum(s.duration for s in stats) / n
    return DecodeBreakdown(step_s, timed_step, forward, matmul[0] / n, attention[0] / n, cost.total_bytes)
