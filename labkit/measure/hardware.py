"""Measuring this device's roof: memory bandwidth (bytes/s) and matmul throughput (FLOP/s).

The two numbers bound every step the engine runs: a step can go no faster than moving its bytes
at the bandwidth roof or doing its FLOPs at the compute roof. Measured in notebook 00
(``00_setup_and_hardware``) and saved, so notebook 04 can place the engine's steps on the roofline.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from labkit.core.device import resolve_device, resolve_dtype
from labkit.measure.timing import time_fn

RESULTS_DIR = Path(__file__).resolve().parents[2] / "results"
FULL_BUFFER_BYTES = {True: 2 << 30, False: 512 << 20}  # full-size probe buffers: on CUDA, elsewhere


@dataclass(frozen=True)
class DeviceRoof:
    """A device's measured roofs for one dtype. Notebook 00; reused in 04."""

    device: str
    device_name: str
    dtype: str
    memory_bandwidth: float  # bytes/s, best of a streaming read and a copy
    read_bandwidth: float  # bytes/s, x.sum() over a buffer larger than the caches
    copy_bandwidth: float  # bytes/s, counting the read and the write
    matmul_flops: float  # FLOP/s of an n x n @ n x n matmul
    matmul_size: int
    buffer_bytes: int
    num_threads: int
    smoke: bool = False  # measured with cache-sized buffers: bandwidth reads high; never the saved default

    @property
    def default_path(self) -> Path:
        return RESULTS_DIR / f"roof_{self.device}_{self.dtype}{'_smoke' if self.smoke else ''}.json"

    @property
    def ridge_point(self) -> float:
        """Arithmetic intensity (FLOP/byte) where a step stops being bandwidth-bound."""
        return self.matmul_flops / self.memory_bandwidth

    def attainable_flops(self, intensity: float) -> float:
        """Roofline: FLOP/s a step of this arithmetic intensity (FLOP/byte) can reach at best."""
        return attainable_flops(intensity, self.matmul_flops, self.memory_bandwidth)

    def summary(self) -> str:
        return (f"{self.device_name} ({self.device}, {self.dtype}, {self.num_threads} threads): "
                f"memory bandwidth {self.memory_bandwidth / 1e9:.1f} GB/s, "
                f"matmul {self.matmul_flops / 1e12:.3f} TFLOP/s, ridge point {self.ridge_point:.1f} FLOP/byte")

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path is not None else self.default_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path) -> DeviceRoof:
        return cls(**json.loads(Path(path).read_text()))


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: min(compute roof, intensity x bandwidth roof). Task 1 of notebook 00 mirrors it."""
    return min(peak_flops, intensity * bandwidth)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple GPU (MPS)"
    try:  # Linux names the CPU model in /proc/cpuinfo; platform.processor() is often empty there
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def describe_device(device: torch.device) -> dict[str, str]:
    """What a report needs to name the hardware: the device, and on CUDA its memory, compute capability and the
    CUDA version torch was built with (``scripts/gpu_check.py``)."""
    info = {"device": device.type, "name": device_name(device), "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(memory=f"{props.total_memory / 1e9:.1f} GB", compute_capability=f"{props.major}.{props.minor}",
                    multiprocessors=str(props.multi_processor_count), cuda=str(torch.version.cuda))
    else:
        info.update(threads=str(torch.get_num_threads()))
    return info


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> tuple[float, float]:
    """(read, copy) bandwidth in bytes/s over float32 buffers of ``nbytes``; best of ``repeats``."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    read = min(time_fn(lambda: src.sum(), device, repeats))
    copy = min(time_fn(lambda: dst.copy_(src), device, repeats))
    return nbytes / read, 2 * nbytes / copy


def measure_matmul(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 5) -> float:
    """FLOP/s of a square matmul (2 n^3 FLOPs); best of ``repeats``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = min(time_fn(lambda: a @ b, device, repeats))
    return 2 * n**3 / best


def probe(device: str | torch.device = "auto", dtype: str | torch.dtype = "auto", smoke: bool = False) -> DeviceRoof:
    """Measure this device's roofs. Smoke mode uses small buffers (numbers then run high: caches help)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if dev.type == "cuda":
        nbytes, n = (256 << 20, 2048) if smoke else (FULL_BUFFER_BYTES[True], 8192)
    else:
        nbytes, n = (64 << 20, 512) if smoke else (FULL_BUFFER_BYTES[False], 2048)
    read, copy = measure_bandwidth(dev, nbytes, repeats=3 if smoke else 10)
    flops = measure_matmul(dev, dt, n, repeats=3 if smoke else 10)
    return DeviceRoof(
        device=dev.type, device_name=device_name(dev), dtype=str(dt).removeprefix("torch."),
        memory_bandwidth=max(read, copy), read_bandwidth=read, copy_bandwidth=copy,
        matmul_flops=flops, matmul_size=n, buffer_bytes=nbytes, num_threads=torch.get_num_threads(), smoke=smoke,
    )


def load_or_probe(device: str | torch.device = "auto", dtype: str | torch.dtype = "auto",
                  smoke: bool = False) -> DeviceRoof:
    """The full-size roof saved by notebook 00 for this device and dtype, else a fresh measurement.

    A smoke run saves to its own file, so it never replaces a learner's full measurement.
    """
    dev = resolve_device(device)
    dt = str(resolve_dtype(dtype, dev)).removeprefix("torch.")
    path = RESULTS_DIR / f"roof_{dev.type}_{dt}.json"
    if path.is_file():
        roof = DeviceRoof.load(path)
        if not roof.smoke and roof.buffer_bytes >= FULL_BUFFER_BYTES[dev.type == "cuda"]:
            return roof  # ignore files written by smoke-sized probes (caches inflate their bandwidth)
    return probe(dev, dtype, smoke=smoke)
