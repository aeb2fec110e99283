"""CUDA graphs for decode steps: capture the launches once, replay them with one call.

A decode step of a small model is hundreds of tiny kernel launches; on a GPU the host can take longer
to *launch* them than the device takes to *run* them. A CUDA graph records the launches of one forward
pass into static buffers and replays the whole sequence with a single call. Shapes must not change
between replays, so the batch is padded up to the next size in ``cuda_graph_sizes`` (vLLM's batch-size
buckets) and the block tables up to a power-of-two width; padded rows write their K/V into a scratch
block that no sequence owns and attend only to it. One graph per (batch bucket, table width), captured
the first time it is needed. Engine option ``enforce_eager=False`` (CUDA only).
Introduced in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

import bisect

import torch

from labkit.attention.decode import DecodeOnlyAttention
from labkit.attention.metadata import PagedAttentionMetadata
from labkit.cache.paged import PagedKVPool
from labkit.model import CausalLM


class DecodeGraphs:
    """Static-shape decode forward passes, replayed as CUDA graphs (or run eagerly off CUDA, for tests).

    ``scratch_block`` is a pool block the block manager never hands out.
    """

    def __init__(self, model: CausalLM, pool: PagedKVPool, sizes: tuple[int, ...], max_blocks: int,
                 scratch_block: int, capture: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.sizes = sorted(sizes)
        self.widths = [1 << i for i in range(max(1, max_blocks - 1).bit_length() + 1)]  # 1, 2, 4, ... >= max
        self.scratch_block = scratch_block
        self.capture = capture and model.device.type == "cuda"
        device, b, w = model.device, self.sizes[-1], self.widths[-1]
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)  # (B_max,)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(b, dtype=torch.long, device=device)
        self.tables = torch.zeros(b, w, dtype=torch.long, device=device)  # (B_max, W_max)
        self.context_lens = torch.ones(b, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.num_runs = 0  # decode steps served (replayed, or run eagerly off CUDA)

    def can_run(self, meta: PagedAttentionMetadata) -> bool:
        return (meta.is_decode_only and len(meta.query_lens) <= self.sizes[-1]
                and max(len(t) for t in meta.block_tables) <= self.widths[-1])

    def _forward(self, b: int, w: int) -> torch.Tensor:
        backend = DecodeOnlyAttention(self.pool, self.slot_mapping[:b], self.tables[:b, :w], self.context_lens[:b])
        return self.model(self.input_ids[None, :b], self.positions[None, :b], backend)[0]  # (b, hidden)

    def _capture(self, key: tuple[int, int]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph, as torch.cuda.graphs requires
            for _ in range(2):
                self._forward(*key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            self.outputs[key] = self._forward(*key)
        self.graphs[key] = graph

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """input_ids, positions: (1, B) of a decode-only step -> hidden states (1, B, hidden)."""
        n = len(meta.query_lens)
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        w = self.widths[bisect.bisect_left(self.widths, max(len(t) for t in meta.block_tables))]
        bs = self.pool.block_size
        self.input_ids[:n] = input_ids[0]
        self.positions[:n] = positions[0]
        self.slot_mapping[:n] = meta.slot_mapping
        self.tables[:b, :w] = self.scratch_block
        if meta.block_table_tensor is not None:  # prebuilt by the vectorized input preparation
            self.tables[:n, : meta.block_table_tensor.shape[1]] = meta.block_table_tensor
        else:
            for i, t in enumerate(meta.block_tables):
                self.tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        self.context_lens[:n] = torch.tensor(meta.context_lens, dtype=torch.long)
        # Padding rows: token 0 at position 0, written to and reading only the scratch block.
        self.input_ids[n:b] = 0
        self.positions[n:b] = 0
        self.slot_mapping[n:b] = self.scratch_block * bs
        self.context_lens[n:b] = 1
        key = (b, w)
        self.num_runs += 1
        if not self.capture:
            return self._forward(b, w)[None, :n]
        if key not in self.graphs:
            self._capture(key)
        self.graphs[key].replay()
        return self.outputs[key][None, :n]
