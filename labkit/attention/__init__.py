"""Attention backends over the paged KV pool, by name: ``LLM(..., attention_backend="torch")``.

``ATTENTION_BACKENDS`` maps a name to a ``PagedAttentionBackend`` subclass; the model runner builds one per
step from that step's ``PagedAttentionMetadata``. A learner's backend (a subclass) can be passed as the
class itself. Introduced in notebook 06 (``06_paged_attention``).
"""

from __future__ import annotations

from labkit.attention.metadata import PagedAttentionBackend, PagedAttentionMetadata
from labkit.attention.torch_sdpa import TorchAttentionBackend

ATTENTION_BACKENDS: dict[str, type[PagedAttentionBackend]] = {
    TorchAttentionBackend.name: TorchAttentionBackend,
}


def resolve_attention_backend(backend: str | type) -> type[PagedAttentionBackend]:
    """A backend class from a registered name or a class, with a clear error naming what is accepted."""
    if isinstance(backend, str):
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend {backend!r} is not registered; registered backends: "
                             f"{', '.join(ATTENTION_BACKENDS)} (or pass a PagedAttentionBackend subclass)")
        return ATTENTION_BACKENDS[backend]
    if isinstance(backend, type) and issubclass(backend, PagedAttentionBackend):
        return backend
    raise TypeError(f"attention_backend must be a name in ATTENTION_BACKENDS ({', '.join(ATTENTION_BACKENDS)}) or a "
                    f"subclass of labkit.attention.PagedAttentionBackend, got {backend!r}")


__all__ = ["ATTENTION_BACKENDS", "PagedAttentionBackend", "PagedAttentionMetadata", "TorchAttentionBackend",
           "resolve_attention_backend"]
