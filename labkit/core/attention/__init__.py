"""Attention backends over the paged KV pool, by name: ``LLM(..., attention_backend="torch")``.

``ATTENTION_BACKENDS`` maps a name to a ``PagedAttentionBackend`` subclass; the model runner builds one per
step from that step's ``PagedAttentionMetadata``. A learner's backend (a subclass) can be passed as the
class itself. The registry imports a backend's module only when its name is looked up (mini-sglang's shape), so
choosing ``"torch"`` or ``"cpp"`` never imports triton. ``"triton"`` (notebook 11) is listed only where the triton
package is installed (its wheels are for Linux). ``"cpp"`` is always listed: its kernel compiles on first use, and
without a compiler it runs the PyTorch path after one warning. The default, ``"auto"``, is ``"cpp"`` on a CPU where
the kernel builds and ``"torch"`` elsewhere (``resolve_attention_backend``). Introduced in notebook 06
(``06_paged_attention``).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterator, Mapping

import torch

from labkit.core.attention.cpp_decode import KERNEL_DTYPES, CppAttentionBackend, load_extension
from labkit.core.attention.metadata import PagedAttentionBackend, PagedAttentionMetadata
from labkit.core.attention.torch_sdpa import TorchAttentionBackend


def _load_triton() -> type[PagedAttentionBackend]:
    # Importing it imports triton, and chooses Triton's CPU interpreter where no GPU is found (triton_decode.py).
    return importlib.import_module("labkit.core.attention.triton_decode").TritonAttentionBackend


class BackendRegistry(Mapping[str, type[PagedAttentionBackend]]):
    """Backend names -> classes; a backend's module is imported the first time its name is looked up. Notebook 06."""

    def __init__(self, loaders: dict[str, Callable[[], type[PagedAttentionBackend]]],
                 available: dict[str, Callable[[], bool]]) -> None:
        self._loaders = loaders
        self._available = available  # cheap checks (no import): is the package a backend needs installed?
        self._loaded: dict[str, type[PagedAttentionBackend]] = {}

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._loaders if self._available.get(name, lambda: True)())

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in list(self)

    def __getitem__(self, name: str) -> type[PagedAttentionBackend]:
        if name not in self:
            raise KeyError(name)
        if name not in self._loaded:
            self._loaded[name] = self._loaders[name]()
        return self._loaded[name]


ATTENTION_BACKENDS = BackendRegistry(
    loaders={TorchAttentionBackend.name: lambda: TorchAttentionBackend,
             CppAttentionBackend.name: lambda: CppAttentionBackend,  # compiled on first use, not on import
             "triton": _load_triton},
    available={"triton": lambda: importlib.util.find_spec("triton") is not None},
)


def triton_missing() -> str | None:
    """Why ``"triton"`` cannot run here (the import error), or None if it can. Imports triton to find out."""
    if "triton" not in ATTENTION_BACKENDS:
        return "No module named 'triton'"
    try:
        ATTENTION_BACKENDS["triton"]
    except ImportError as error:  # installed but broken, or a platform without its compiled parts
        return str(error)
    return None


def __getattr__(name: str) -> object:
    # TRITON_MISSING is computed when first read, so that importing labkit never imports triton.
    if name == "TRITON_MISSING":
        return triton_missing()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


AUTO = "auto"  # the default: "cpp" on a CPU where its kernel builds (float32 or float64), else "torch"


def resolve_attention_backend(backend: str | type, device_type: str | None = None,
                              dtype: torch.dtype | None = None) -> type[PagedAttentionBackend]:
    """A backend class from a registered name, ``"auto"`` or a class, with a clear error naming what is accepted.

    ``"auto"`` needs the pool's device type and dtype: on a CPU in float32 or float64 it builds the ``"cpp"`` kernel
    (once per machine, about a minute; ``make env`` builds it ahead) and takes it if that works, quietly taking
    ``"torch"`` if not; everywhere else it is ``"torch"``. ``device_type=None``: the answer for an unknown device.
    """
    if backend == AUTO:
        if device_type == "cpu" and dtype in KERNEL_DTYPES and load_extension(warn=False) is not None:
            return CppAttentionBackend
        return TorchAttentionBackend
    if isinstance(backend, str):
        if backend == "triton" and (missing := triton_missing()) is not None:
            raise ValueError(f"attention_backend 'triton' needs the triton package, which did not import "
                             f"({missing}); it has wheels for Linux only (pip install -r requirements.txt); "
                             f"registered backends: {', '.join(ATTENTION_BACKENDS)}")
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {backend!r} is not registered; registered backends: "
                             f"{', '.join(ATTENTION_BACKENDS)}, or 'auto' (or pass a PagedAttentionBackend subclass)")
        return ATTENTION_BACKENDS[backend]
    if isinstance(backend, type) and issubclass(backend, PagedAttentionBackend):
        return backend
    raise TypeError(f"attention_backend must be a name in ATTENTION_BACKENDS ({', '.join(ATTENTION_BACKENDS)}) or a "
                    f"subclass of labkit.core.attention.PagedAttentionBackend, got {backend!r}")


__all__ = ["ATTENTION_BACKENDS", "AUTO", "BackendRegistry", "CppAttentionBackend", "PagedAttentionBackend",
           "PagedAttentionMetadata", "TorchAttentionBackend", "resolve_attention_backend", "triton_missing"]
