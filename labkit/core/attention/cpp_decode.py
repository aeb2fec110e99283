"""The ``"cpp"`` attention backend: decodes read K/V in place from the paged pool with a compiled C++ kernel (CPU).

``csrc/paged_decode_cpu.cpp`` is vLLM's CPU paged attention in miniature: one task per (sequence, KV head) and run of
blocks (a split, when there are fewer tasks than threads can share evenly), run in parallel by PyTorch's OpenMP
threads, walks its blocks in table order with an online softmax; splits are merged by the log-sum-exp rule. Nothing is
gathered or padded, unlike the PyTorch backend's ``split_decode_attention`` (the same math, one copy per block).
The kernel is compiled with ``torch.utils.cpp_extension`` the first time a ``"cpp"`` backend is built (about a
minute, once per machine: the build is kept under ``~/.cache/labkit/torch_extensions``, or ``$LABKIT_EXTENSIONS_DIR``).
Without a C++ compiler, or when the build fails, the backend runs the PyTorch path and says why, once per process.
Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from labkit.core.attention.metadata import PagedAttentionMetadata
from labkit.core.attention.torch_sdpa import TorchAttentionBackend
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model.linear import STALL_WATCH

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_cpu.cpp"
KERNEL_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class CppExtension:
    """The outcome of loading the kernel, once per process: the compiled module, or why there is none."""

    module: ModuleType | None
    missing: str | None  # why module is None: no compiler, no ninja, a failed build


def extensions_root() -> Path:
    """Where builds are kept, per torch version: ``$LABKIT_EXTENSIONS_DIR``, else the user's cache."""
    root = os.environ.get("LABKIT_EXTENSIONS_DIR")
    if root:
        return Path(root) / torch.__version__
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "labkit" / "torch_extensions" / torch.__version__


def build_name(source: Path, prefix: str = "labkit_paged_decode") -> str:
    """The module's name: the source, the labkit files it includes (``#include "..."``, at any depth) and this CPU's
    features in a hash (``-march=native`` code is not portable), so an edited kernel or another machine sharing the
    cache directory gets its own build."""
    key = hashlib.sha256()
    for path in included_sources(source):
        key.update(path.read_bytes())
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "") \
        if cpuinfo.exists() else ""
    key.update(f"{sys.platform} {platform.machine()} {flags}".encode())
    return f"{prefix}_{key.hexdigest()[:16]}"


def included_sources(source: Path) -> list[Path]:
    """``source`` and every labkit file it includes (``#include "..."``), and those files' own, each once."""
    found = [source.resolve()]
    todo = list(found)
    while todo:
        current = todo.pop()
        for name in re.findall(r'^#include "([^"]+)"', current.read_text(), flags=re.MULTILINE):
            path = (current.parent / name).resolve()
            if path.exists() and path not in found:
                found.append(path)
                todo.append(path)
    return found


def find_ninja() -> str | None:
    """torch's builder runs ``ninja`` from PATH: put the pip-installed one (this Python's bin) there if PATH has none;
    the tests run ``.venv/bin/python`` without an activated environment."""
    if shutil.which("ninja"):
        return None
    candidates = [Path(sys.executable).parent]
    try:
        import ninja  # the PyPI wheel (requirements.txt)

        candidates.insert(0, Path(ninja.BIN_DIR))
    except ImportError:
        pass
    for folder in candidates:
        if (folder / "ninja").exists() or (folder / "ninja.exe").exists():
            os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
            return None
    return "the ninja build tool was not found (pip install ninja)"


def accepts_flag(compiler: str, flag: str) -> bool:
    try:
        return subprocess.run([compiler, flag, "-x", "c++", "-E", "-"], input="", capture_output=True, text=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def import_built(name: str, build_dir: Path) -> ModuleType | None:
    """A build this machine made before (this or another process): imported directly, no compiler or ninja needed."""
    path = build_dir / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, path) if path.exists() else None
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_extension(source: Path, prefix: str = "labkit_paged_decode",
                      what: str = "C++ paged decode attention") -> CppExtension:
    """Import the kernel's earlier build, or compile it (printing one line), or say why neither is possible.
    ``prefix`` names the module, ``what`` the kernel in the one line (labkit.core.quant.gemv builds its own)."""
    name = build_name(source, prefix)
    build_dir = extensions_root() / name
    try:
        module = import_built(name, build_dir)
    except ImportError:  # a build interrupted half-way: build again
        module = None
    if module is not None:
        return CppExtension(module, None)
    from torch.utils import cpp_extension

    compiler = cpp_extension.get_cxx_compiler()  # $CXX, else c++
    if shutil.which(compiler) is None:
        where = f"CXX={compiler} is not an executable" if "CXX" in os.environ else f"{compiler} is not on PATH"
        return CppExtension(None, f"no C++ compiler found ({where})")
    missing_ninja = find_ninja()
    if missing_ninja is not None:
        return CppExtension(None, missing_ninja)
    # -fopenmp: at::parallel_for runs its OpenMP loop only when compiled with it (torch's own libgomp at run time).
    flags = ["-O3", "-fopenmp"] + (["-march=native"] if accepts_flag(compiler, "-march=native") else [])
    print(f"compiling labkit's {what} (once, about a minute)...", flush=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(name, [str(source)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                    build_directory=str(build_dir), verbose=False)
    except Exception as error:  # compiler errors, a missing header, a linker failure: all mean "no kernel"
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        first = next((line for line in lines if "error:" in line), lines[0])[:300]  # the compiler's own words
        return CppExtension(None, f"building the C++ kernel failed ({first}; build directory {build_dir})")
    return CppExtension(module, None)


@functools.cache
def load_result() -> CppExtension:
    """Loaded (or built) once per process."""
    return compile_extension(SOURCE)


def load_extension(warn: bool = True) -> ModuleType | None:
    """The compiled kernel module (``paged_decode``), building it on first use, or None where it cannot be built:
    then, with ``warn``, one warning per process says why ("auto" asks without: it just takes "torch")."""
    result = load_result()
    if result.missing is not None and warn:
        fallback_warning(result.missing)
    return result.module


def cpp_missing() -> str | None:
    """Why the kernel is not available (None when it is); loads it first if no one has yet, without a warning."""
    return load_result().missing


@functools.cache
def fallback_warning(reason: str) -> None:
    warnings.warn(f"{reason}: attention_backend 'cpp' falls back to the PyTorch path 'torch'", RuntimeWarning,
                  stacklevel=4)


MIN_SPLIT_BLOCKS = 4  # the fewest blocks a split reads: below, merging costs more than the extra thread saves


def decode_splits(tasks: int, threads: int, max_blocks: int) -> int:
    """How many runs of blocks to cut each sequence's context into, so that ``threads`` share the work evenly: with
    few (sequence, KV head) ``tasks`` (3 at batch 1 on a model with 3 KV heads) two threads would split them 2 to 1;
    two splits each make 6, shared 3 to 3. Many tasks (a batch) balance without splits. Each split keeps at least
    ``MIN_SPLIT_BLOCKS`` of the longest context's ``max_blocks``."""
    if threads <= 1 or tasks >= 4 * threads:
        return 1
    splits = next(s for s in range(1, threads + 1) if tasks * s >= threads and tasks * s % threads == 0)
    return max(1, min(splits, max_blocks // MIN_SPLIT_BLOCKS))


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, parallel: bool = True,
                           num_splits: int | None = None) -> torch.Tensor:
    """One new token per sequence, K/V read in place: q (B, n_heads, d) -> (B, n_heads, d). k_pool, v_pool:
    (num_blocks, block_size, n_kv, d) float32 or float64; block_tables (B, W) and context_lens (B,), int32 or int64.
    ``parallel=False`` runs it on one thread. ``num_splits``: runs of blocks per sequence (default: ``decode_splits``
    for this many threads and the table's width; 1 on one thread). Raises RuntimeError where the kernel cannot be
    built (``cpp_missing()`` says why)."""
    module = load_extension()
    if module is None:
        raise RuntimeError(f"labkit's C++ decode kernel is not available: {cpp_missing()}")
    tasks = q.shape[0] * k_pool.shape[2]  # (sequence, KV head) pairs
    if num_splits is None:
        num_splits = decode_splits(tasks, torch.get_num_threads(), block_tables.shape[1]) if parallel else 1
    grain = 1 if parallel else max(1, tasks * num_splits)  # one thread: no waiting for another (StallWatch)
    return module.paged_decode(q.contiguous(), k_pool, v_pool, block_tables, context_lens, q.shape[-1] ** -0.5, grain,
                               num_splits)


@dataclass
class CppDecodeBatch:
    """A step's decodes as the kernel reads them, built once per step for every layer."""

    block_tables: torch.Tensor  # (B, W) int32, each table padded with block 0 to the widest
    context_lens: torch.Tensor  # (B,) int32
    num_splits: int  # runs of blocks per sequence on a thread team (decode_splits)


class CppAttentionBackend(TorchAttentionBackend):
    """Attention backend ``"cpp"``: decodes run the compiled C++ kernel over blocks in place (CPU, float32 or
    float64); prefill (chunks) take the PyTorch path. Where the kernel cannot be used (no compiler, a failed build,
    another device or dtype) decodes take the PyTorch path too, after one warning saying why. Notebook 06.
    """

    name = "cpp"

    def __init__(self, pool: PagedKVPool, meta: PagedAttentionMetadata) -> None:
        super().__init__(pool, meta)
        self.cpp_decode: CppDecodeBatch | None = None
        self.writes_kv = False
        if not self.kernel_applies(pool) or self.decode is None:  # builds the kernel on first use, in every case
            return
        rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
        lens = [meta.context_lens[i] for i in rows]
        width = max(-(-c // pool.block_size) for c in lens)
        tables = [meta.block_tables[i][:width] + [0] * (width - len(meta.block_tables[i][:width])) for i in rows]
        host = torch.tensor([t + [c] for t, c in zip(tables, lens)], dtype=torch.int32)  # (B, W + 1): one tensor
        splits = decode_splits(len(rows) * pool.k[0].shape[2], torch.get_num_threads(), width)
        self.cpp_decode = CppDecodeBatch(host[:, :width], host[:, width].contiguous(), splits)
        slots = meta.slot_mapping
        # A decode-only step writes its new K/V with the same module (one call instead of two indexed assignments).
        self.writes_kv = self.only_decodes and slots.dtype == torch.int64 and slots.device.type == "cpu" \
            and slots.is_contiguous()

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: (1, N, n_heads, d); k, v: (1, N, n_kv_heads, d) -- every sequence's new token
        k_pool, v_pool = self.pool.k[layer_idx], self.pool.v[layer_idx]
        if self.cpp_decode is None or not self.writes_kv or not (k_pool.is_contiguous() and v_pool.is_contiguous()):
            return super().attend(layer_idx, q, k, v)
        module = load_extension()
        assert module is not None  # cpp_decode is set only where the kernel loaded
        module.write_kv(k_pool, v_pool, k[0], v[0], self.meta.slot_mapping)  # as the parent's two assignments
        return self._attend_decodes(q[0], k_pool, v_pool)[None]

    @staticmethod
    def kernel_applies(pool: PagedKVPool) -> bool:
        """Whether this pool's decodes can run the kernel; if not, warn once per reason and use the PyTorch path."""
        dtype = pool.k[0].dtype
        if pool.device.type != "cpu":
            fallback_warning(f"the C++ decode kernel runs on the CPU, this pool is on {pool.device.type}")
            return False
        if dtype not in KERNEL_DTYPES:
            fallback_warning(f"the C++ decode kernel takes float32 or float64, this pool holds {dtype}")
            return False
        return load_extension() is not None

    def _attend_decodes(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        # q: (B_decode, n_heads, d)
        if self.cpp_decode is None:
            return super()._attend_decodes(q, k_pool, v_pool)
        d = self.cpp_decode  # one thread while another process holds a core: threads would wait for it every call
        parallel = not STALL_WATCH.recent()
        return paged_decode_attention(q, k_pool, v_pool, d.block_tables, d.context_lens, parallel=parallel,
                                      num_splits=d.num_splits if parallel else 1)

