"""Attention backends over the paged KV pool, by name: ``LLM(..., attention_backend="torch")``.

``ATTENTION_BACKENDS`` maps a name to a ``PagedAttentionBackend`` subclass; the model runner builds one per
step from that step's ``PagedAttentionMetadata``. A learner's backend (a subclass) can be passed as the
class itself. ``"triton"`` (notebook 11) is registered only where the triton package imports (its wheels are for
Linux). ``"cpp"`` is always registered: its kernel compiles on first use, and without a compiler it runs the PyTorch
path after one warning. The default, ``"auto"``, is ``"cpp"`` on a CPU where the kernel builds and ``"torch"``
elsewhere (``resolve_attention_backend``). Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

import torch

from labkit.core.attention.cpp_decode import KERNEL_DTYPES, CppAttentionBackend, load_extension
from labkit.core.attention.metadata import PagedAttentionBackend, PagedAttentionMetadata
from labkit.core.attention.torch_sdpa import TorchAttentionBackend

ATTENTION_BACKENDS: dict[str, type[PagedAttentionBackend]] = {
    TorchAttentionBackend.name: TorchAttentionBackend,
    CppAttentionBackend.name: CppAttentionBackend,  # compiled on first use, not on import
}

TRITON_MISSING: str | None = None  # why "triton" is not registered, if it is not
try:
    from labkit.core.attention.triton_decode import TritonAttentionBackend
except ImportError as error:  # no triton wheel for this platform (macOS, Windows), or not installed
    TRITON_MISSING = str(error)
else:
    ATTENTION_BACKENDS[TritonAttentionBackend.name] = TritonAttentionBackend


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
        if backend == "triton" and TRITON_MISSING is not None:
            raise ValueError(f"attention_backend 'triton' needs the triton package, which did not import "
                             f"({TRITON_MISSING}); it has wheels for Linux only (pip install -r requirements.txt); "
                             f"registered backends: {', '.join(ATTENTION_BACKENDS)}")
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {backend!r} is not registered; registered backends: "
                             f"{', '.join(ATTENTION_BACKENDS)}, or 'auto' (or pass a PagedAttentionBackend subclass)")
        return ATTENTION_BACKENDS[backend]
    if isinstance(backend, type) and issubclass(backend, PagedAttentionBackend):
        return backend
    raise TypeError(f"attention_backend must be a name in ATTENTION_BACKENDS ({', '.join(ATTENTION_BACKENDS)}) or a "
                    f"subclass of labkit.core.attention.PagedAttentionBackend, got {backend!r}")


__all__ = ["ATTENTION_BACKENDS", "AUTO", "TRITON_MISSING", "CppAttentionBackend", "PagedAttentionBackend",
           "PagedAttentionMetadata", "TorchAttentionBackend", "resolve_attention_backend"]
