"""Which kernel runs a linear layer, and in which weight layout: chosen per shape.

``F.linear`` multiplies by the (out, in) weight through the BLAS library PyTorch was built with (MKL on x86).
Decode multiplies every weight by one row (a matrix-vector product, GEMV), and how fast that streams the weight
depends on the kernel and the layout far more than on the arithmetic. On a CPU in float32 labkit runs decode-shaped
calls (up to ``GemvKernel.max_rows`` rows) on its own C++ GEMV kernel (``labkit.core.quant.gemv``, notebook 14):
each thread streams a contiguous range of the (out, in) weight's rows once, and every output is summed by one thread
in a fixed order, so results do not depend on the number of threads (or on the batch, up to ``max_rows``). Calls
with more rows (prefill) run on oneDNN (the library behind PyTorch's ``mkldnn`` ops) over a copy repacked once into
its blocked layout, about twice MKL's GEMM throughput here.

Without the C++ kernel (no compiler), or with the ``"onednn"`` choice, labkit does what it did before it had one:
each weight lives as (in, out) in memory (the parameter still reads as (out, in): a transposed view), where MKL's
GEMV streams it about 1.5x faster, and oneDNN runs large decode-shaped calls too; calls with few rows keep
``F.linear`` for weights small enough to sit in the caches, where oneDNN's fixed cost per call (~15 µs against
~2 µs) outweighs its streaming.

A thread team (oneDNN's or the GEMV kernel's) waits for all its threads at the end of every call. When another
process holds one of the cores, the waiting thread's partner only runs again at the next scheduler tick: a 0.2 ms
call then takes several milliseconds. Calls with many rows amortise that; decode-shaped calls (few rows) do not, so
``StallWatch`` times them, and after a few stalls close together they run for ``STALL_HOLD_S`` seconds on one thread
(the GEMV kernel) or on ``F.linear`` over the (in, out) memory (without it), which stay fast under load, before the
thread team is tried again. Notebook 04 measures the layouts and kernels (``labkit.measure.decode_roof``) and shows
the stalls.

The GEMV kernel is built and registered by ``labkit.core.quant.gemv`` (``register_gemv_kernel``): that package
imports this module, so this one cannot import it; importing ``labkit`` imports both. The repacked oneDNN copy is
made on the first call and remade whenever the weight changes (loading a checkpoint, ``model.to(...)``):
parameters, names, values and ``state_dict`` stay nn.Linear's (the parameters are views).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

ONEDNN_MIN_ROWS = 16  # rows of a call from which oneDNN always runs it (the stall cost is amortised)
ONEDNN_MIN_WEIGHT = 1 << 18  # elements (1 MiB in float32): below, a call with fewer rows stays on F.linear (the
# weight sits in the caches, where oneDNN's fixed cost per call outweighs its faster streaming)
LINEAR_KERNELS = ("auto", "onednn", "torch")  # "auto": the choices above (CPU, float32); "onednn": the same without
# labkit's GEMV kernel ((in, out) storage, oneDNN or F.linear); "torch": F.linear, (out, in) storage
STALL_MIN_S = 1e-3  # a decode-shaped oneDNN call this slow ...
STALL_RATIO = 4.0  # ... and this many times its layer's fastest call waited for a descheduled thread
STALLS_TO_TRIP = 5  # this many stalls within STALL_WINDOW_CALLS decode-shaped calls: another process holds a core
STALL_WINDOW_CALLS = 100  # (the odd stall is the system's own housekeeping: here one every half second, ~2500 calls)
STALL_HOLD_S = 5.0  # then decode-shaped calls stay on one thread (or F.linear) this long, then threads are tried again


@dataclass
class StallWatch:
    """Whether a thread team (oneDNN's, the GEMV kernel's) keeps waiting for a core that another process holds
    (process-wide, as the CPU is). Notebook 04."""

    calls: int = 0  # decode-shaped calls on a thread team observed, since the process started
    stalls: int = 0  # of which stalled
    trips: int = 0  # times decode-shaped calls moved to one thread (or F.linear)
    hold_s: float = STALL_HOLD_S
    recent_stalls: deque[int] = field(default_factory=lambda: deque(maxlen=STALLS_TO_TRIP))  # their call numbers
    tripped_at: float = float("-inf")  # time.monotonic()

    def observe(self, seconds: float, fastest: float) -> bool:
        """Record one decode-shaped call on a thread team; True if it stalled."""
        self.calls += 1
        if seconds < STALL_MIN_S or seconds < STALL_RATIO * fastest:
            return False
        self.stalls += 1
        self.recent_stalls.append(self.calls)
        if len(self.recent_stalls) == STALLS_TO_TRIP and self.calls - self.recent_stalls[0] < STALL_WINDOW_CALLS:
            self.trips += 1
            self.tripped_at = time.monotonic()
            self.recent_stalls.clear()
        return True

    def recent(self) -> bool:
        """Whether decode-shaped calls should avoid thread teams now."""
        return time.monotonic() - self.tripped_at < self.hold_s


STALL_WATCH = StallWatch()  # one per process: a busy core slows every thread team of this process alike


@dataclass(frozen=True)
class GemvKernel:
    """labkit's C++ float32 GEMV kernel (and the same module's RMSNorm), as ``labkit.core.quant.gemv`` registers it.
    Notebook 14."""

    run: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]  # (x (B, in), weight (out, in) contiguous,
    # threads) -> (B, out); threads False: one thread (another process holds a core)
    max_rows: int  # calls with more rows (prefill) run on oneDNN
    available: Callable[[], bool]  # built (the first call may compile it); False: no compiler, fall back silently
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] | None = None  # the same module's RMSNorm
    # (x (..., d) contiguous, weight (d,), eps) -> (..., d), float32: RMSNorm (labkit.core.model.layers) runs on it
    silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None  # (rows, 2 * I) gate|up -> (rows, I): MLP's gate
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None = None  # (x (rows, heads *
    # d), cos, sin (rows, d), n_rot) -> (rows, n_rot * d): Attention's RoPE on its q and k heads


GEMV_KERNEL: list[GemvKernel] = []  # the registered kernel (at most one): register_gemv_kernel


def register_gemv_kernel(kernel: GemvKernel) -> None:
    """Let "auto" run decode-shaped float32 CPU calls on ``kernel`` (``labkit.core.quant.gemv`` calls this)."""
    GEMV_KERNEL[:] = [kernel]


GEMV_BUILT: list[GemvKernel] = []  # the registered kernel once ``available()`` said yes (a build stays built)


def gemv_kernel() -> GemvKernel | None:
    """The registered GEMV kernel if it is built, else None (the calls then run as the "onednn" choice does).
    Asked several times per layer in every decode step: a kernel found built is remembered."""
    if GEMV_KERNEL and GEMV_BUILT and GEMV_BUILT[0] is GEMV_KERNEL[0]:
        return GEMV_BUILT[0]
    if GEMV_KERNEL and GEMV_KERNEL[0].available():
        GEMV_BUILT[:] = [GEMV_KERNEL[0]]
        return GEMV_KERNEL[0]
    return None


@functools.cache
def onednn_linear_available() -> bool:
    """Whether this PyTorch build runs oneDNN's packed linear (x86 and most ARM builds do), checked once, exactly."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(8, 16), torch.randn(3, 16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(y, F.linear(x, w), atol=1e-5))


def gemv_layout(weight: torch.Tensor) -> torch.Tensor:
    """The same (out, in) values stored as (in, out): ``F.linear`` then runs MKL's faster matrix-vector kernel (the
    layout of the "onednn" choice; labkit's own GEMV kernel reads the (out, in) memory nn.Linear has)."""
    return weight.t().contiguous().t()  # (out, in) view of (in, out) memory


class LinearKernel:
    """Runs ``x @ weight.T + bias`` on the kernel that suits this call's shape; keeps the oneDNN copy. Notebook 04."""

    def __init__(self, watch: StallWatch = STALL_WATCH) -> None:
        self.choice = "auto"  # one of LINEAR_KERNELS; set_linear_kernel changes it for a whole model
        self.packed: torch.Tensor | None = None  # oneDNN's blocked layout of the weight (opaque)
        self.packed_from: tuple[int, tuple[int, ...], torch.Size] | None = None  # (data_ptr, versions, shape) of it
        self.watch = watch
        self.fastest = float("inf")  # seconds of this layer's fastest decode-shaped call on a thread team

    def _cpu_float32(self, weight: torch.Tensor) -> bool:
        return self.choice != "torch" and weight.device.type == "cpu" and weight.dtype == torch.float32

    def wants_gemv_layout(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` should live in (in, out) memory (MKL's faster GEMV layout): "onednn", or "auto" without
        labkit's GEMV kernel, on a CPU, in float32. labkit's kernel reads nn.Linear's own (out, in) memory."""
        return self._cpu_float32(weight) and (self.choice == "onednn" or gemv_kernel() is None)

    def uses_gemv(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this call runs on labkit's GEMV kernel: "auto", CPU, float32, few rows, no gradient wanted."""
        return self._gemv_for(x, weight) is not None

    def _gemv_for(self, x: torch.Tensor, weight: torch.Tensor) -> GemvKernel | None:
        # The kernel that runs this call, or None. Every decode-shaped call of every layer asks, so the cheap tests
        # come first and the registry is looked up once.
        if self.choice != "auto" or weight.dtype != torch.float32 or x.dtype != torch.float32 \
                or weight.device.type != "cpu":
            return None
        kernel = gemv_kernel()
        if kernel is None or not 1 <= x.numel() // max(1, x.shape[-1]) <= kernel.max_rows \
                or not weight.is_contiguous():
            return None
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
            return None  # the kernel has no backward
        return kernel

    def uses_onednn(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        if not self._cpu_float32(weight) or x.dtype != weight.dtype:
            return False
        if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
            return False  # oneDNN's packed op has no backward
        if x.numel() < ONEDNN_MIN_ROWS * x.shape[-1] and (weight.numel() < ONEDNN_MIN_WEIGHT or self.watch.recent()):
            return False  # decode-shaped: a small weight, or another process holds a core (F.linear does not stall)
        return onednn_linear_available()

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 parts: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """``parts``: parameters whose memory ``weight`` shares (a merged layer's); writing into them (a checkpoint
        loading) bumps their version, not the weight's, so theirs count too."""
        kernel = self._gemv_for(x, weight)
        if kernel is not None:
            return self._gemv(kernel, x, weight, bias)
        if not self.uses_onednn(x, weight):
            return F.linear(x, weight, bias)
        made_from = (weight.data_ptr(), (weight._version, *(p._version for p in parts)), weight.shape)
        if self.packed is None or self.packed_from != made_from:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor even if first made in inference mode
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_MIN_ROWS)
            self.packed_from = made_from
        if x.numel() >= ONEDNN_MIN_ROWS * x.shape[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")  # (..., out)
        return self._timed(lambda: torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], ""))

    def _gemv(self, kernel: GemvKernel, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (B, in)
        if self.watch.recent():  # another process holds a core: one thread, untimed (a slower call is no stall)
            y = kernel.run(x2, weight, False)
        else:  # _timed, inlined: this runs for every decode-shaped layer call, where a closure costs ~1 µs
            start = time.perf_counter()
            y = kernel.run(x2, weight, True)  # (B, out)
            seconds = time.perf_counter() - start
            if not self.watch.observe(seconds, self.fastest) and seconds < self.fastest:
                self.fastest = seconds
        if bias is not None:
            y = y + bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.shape[0])  # (..., out)

    def _timed(self, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A decode-shaped call on a thread team, watched for a stall (the CPU runs it synchronously)."""
        start = time.perf_counter()
        out = call()
        seconds = time.perf_counter() - start
        if not self.watch.observe(seconds, self.fastest):
            self.fastest = min(self.fastest, seconds)
        return out


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, names, values) whose matmul runs on ``LinearKernel``'s choice. Notebook 04."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel = LinearKernel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.kernel.choice == "auto" and weight.is_contiguous() and gemv_kernel() is not None:
            return self.kernel(x, weight, self.bias)  # the usual case, (out, in) memory as it should be: no checks
        if self.kernel.wants_gemv_layout(weight) and weight.stride(0) != 1:
            relayout(weight, gemv_layout)  # once (and again if the weight is replaced)
        elif weight.stride(0) == 1 and not weight.is_contiguous() and not self.kernel.wants_gemv_layout(weight):
            relayout(weight, torch.Tensor.contiguous)  # back to (out, in) memory (the choice changed)
        return self.kernel(x, self.weight, self.bias)


def relayout(weight: torch.Tensor, layout: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Store a parameter's values in another memory layout, in place: shape, values and identity stay."""
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor even if first called in inference mode
        weight.data = layout(weight.data)


def set_linear_kernel(model: nn.Module, choice: str) -> None:
    """Run every linear layer of ``model`` on ``choice``: "auto" (the per-shape choice of this module), "onednn" (the
    same without labkit's GEMV kernel: (in, out) memory, oneDNN or F.linear) or "torch" (``F.linear`` over weights
    stored as nn.Linear stores them, (out, in))."""
    if choice not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel {choice!r} is not one of {', '.join(LINEAR_KERNELS)}")
    for module in model.modules():
        if isinstance(module, Linear) and module.weight.stride(0) == 1 and not module.weight.is_contiguous():
            relayout(module.weight, torch.Tensor.contiguous)  # back to (out, in) memory; "onednn" redoes it if wanted
        for value in vars(module).values():
            if hasattr(value, "merged") and isinstance(getattr(value, "kernel", None), LinearKernel):
                value.weight = value.bias = None  # a MergedLinear: merges again, in the new layout, on its next call
    for kernel in linear_kernels(model):
        kernel.choice = choice
        kernel.packed = kernel.packed_from = None  # "torch" frees the copies; the others remake them on first use
        kernel.fastest = float("inf")  # another kernel: its own fastest call


def linear_kernels(model: nn.Module) -> list[LinearKernel]:
    """Every ``LinearKernel`` in ``model``: its ``Linear`` layers' and its merged layers' (attributes, not modules)."""
    kernels = []
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, LinearKernel):
                kernels.append(value)
            elif isinstance(getattr(value, "kernel", None), LinearKernel) and not isinstance(value, nn.Module):
                kernels.append(value.kernel)
    return kernels
