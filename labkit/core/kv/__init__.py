"""Where K/V live between steps: a contiguous per-sequence cache (notebook 03), later a paged pool."""

from labkit.core.kv.contiguous import ContiguousKVCache

__all__ = ["ContiguousKVCache"]
