"""Any paged attention backend over an 8-bit KV pool (``kv_cache_dtype="int8"`` or ``"fp8"``).

``with_quantized_kv(backend)`` is the backend's subclass the engine builds when its pool is a ``QuantizedKVPool``.
Once per step it collects the blocks the step's sequences read (their tables, up to their context) and renumbers
them 0..U-1; at each layer it quantizes the new K/V into the real pool, reads those U blocks back in the model's
dtype, and lets the backend ("torch", "cpp", "triton" or a learner's) attend over that small float pool exactly as
it attends over a float one, with the renumbered tables. The new tokens' K/V are handed to it as read back (quantized
and dequantized), so every token, new or old, is attended as the cache holds it. The pool's memory is the 8-bit
one; each layer's float copy is made, used and dropped within the step. Introduced in notebook 14.
"""

from __future__ import annotations

import functools

import torch

from labkit.core.attention.metadata import PagedAttentionBackend, PagedAttentionMetadata
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.kv.quantized_pool import QuantizedKVPool


class StepPool(PagedKVPool):
    """The float view of one step's blocks, one layer at a time: what the wrapped backend reads and writes."""

    def __init__(self, real: QuantizedKVPool, num_blocks: int) -> None:  # no super().__init__: it would allocate
        self.real, self.num_blocks, self.block_size, self.device = real, num_blocks, real.block_size, real.device
        shape = (num_blocks, *real.k[0].shape[1:])  # (U, block_size, n_kv, d)
        empty = torch.empty(shape, dtype=real.dtype, device=real.device)  # layer 0 until it attends (shape, dtype)
        self.k: list[torch.Tensor] = [empty] * len(real.k)
        self.v: list[torch.Tensor] = [empty] * len(real.v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        raise RuntimeError("a step's float view copies no blocks: the engine copies them in the real pool")


def renumber(meta: PagedAttentionMetadata, block_size: int, device: torch.device
             ) -> tuple[torch.Tensor, PagedAttentionMetadata]:
    """The step's blocks (U,) in first-use order, and ``meta`` with tables and slots renumbered to 0..U-1 (a table's
    entries past its context, which no backend reads, become 0)."""
    order: dict[int, int] = {}
    tables = []
    for table, ctx in zip(meta.block_tables, meta.context_lens):
        live = table[: -(-ctx // block_size)]
        tables.append([order.setdefault(b, len(order)) for b in live] + [0] * (len(table) - len(live)))
    blocks = torch.tensor(list(order), dtype=torch.long, device=device)  # (U,)
    remap = torch.zeros(int(blocks.max()) + 1 if len(order) else 1, dtype=torch.long, device=device)
    remap[blocks] = torch.arange(len(order), device=device)
    slots = meta.slot_mapping.long()
    new_slots = remap[slots // block_size] * block_size + slots % block_size  # (N,)
    table_tensor = None
    if meta.block_table_tensor is not None:
        width = meta.block_table_tensor.shape[1]
        table_tensor = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables],
                                    dtype=meta.block_table_tensor.dtype, device=meta.block_table_tensor.device)
    return blocks, PagedAttentionMetadata(list(meta.query_lens), list(meta.context_lens), tables,
                                          new_slots.to(meta.slot_mapping.dtype), table_tensor)


@functools.cache
def with_quantized_kv(backend: type[PagedAttentionBackend]) -> type[PagedAttentionBackend]:
    """``backend``'s subclass that reads and writes a ``QuantizedKVPool`` (over a float pool, ``backend`` itself)."""

    class QuantizedKVBackend(backend):  # type: ignore[valid-type,misc]
        __doc__ = f"{backend.__name__} over an int8/fp8 KV pool (labkit.core.attention.quantized_kv). Notebook 14."
        name = backend.name

        def __init__(self, pool: PagedKVPool, meta: PagedAttentionMetadata) -> None:
            self.real_pool: QuantizedKVPool | None = None
            if not isinstance(pool, QuantizedKVPool):
                super().__init__(pool, meta)
                return
            self.real_pool, self.real_slots = pool, meta.slot_mapping
            self.blocks, step_meta = renumber(meta, pool.block_size, pool.device)
            self.step_pool = StepPool(pool, len(self.blocks))
            super().__init__(self.step_pool, step_meta)

        def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # q: (1, N, n_heads, d); k, v: (1, N, n_kv, d)
            if self.real_pool is None:
                return super().attend(layer_idx, q, k, v)
            self.real_pool.write(layer_idx, self.real_slots, k[0], v[0])
            k_blocks, v_blocks = self.real_pool.read_blocks(layer_idx, self.blocks)  # (U, block_size, n_kv, d)
            self.step_pool.k[layer_idx], self.step_pool.v[layer_idx] = k_blocks, v_blocks
            if layer_idx > 0:  # the previous layer's float view is done with
                self.step_pool.k[layer_idx - 1] = self.step_pool.v[layer_idx - 1] = k_blocks[:0]
            slots = self.meta.slot_mapping  # renumbered
            k_read = k_blocks.flatten(0, 1)[slots][None]  # (1, N, n_kv, d): the new tokens as the cache holds them
            v_read = v_blocks.flatten(0, 1)[slots][None]
            return super().attend(layer_idx, q, k_read, v_read)

    QuantizedKVBackend.__name__ = QuantizedKVBackend.__qualname__ = f"QuantizedKV{backend.__name__}"
    return QuantizedKVBackend
