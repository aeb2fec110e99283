"""CUDA graphs for decode steps: capture the launches once, at engine start, and replay them with one call.

A decode step of a small model is hundreds of tiny kernel launches; on a GPU the host can take longer
to *launch* them than the device takes to *run* them. A CUDA graph records the launches of one forward
pass into static buffers and replays the whole sequence with a single call. Shapes must not change
between replays, so the batch is padded up to the next capture size (``cuda_graph_sizes``, vLLM's
buckets: 1, 2, 4, 8, 16, 24, ...) and the block tables up to a power-of-two width; padded rows write their
K/V into a scratch block that no sequence owns and attend only to it.

Every (size, width) graph is captured when the engine starts, as vLLM does, never mid-run: a capture in
the middle of a run would stall it, and with async scheduling it would race the main thread's own CUDA
calls. Captures use the thread-local capture mode for the same reason. The widths are bounded
(``MAX_GRAPH_WIDTHS``): a decode whose block table is wider runs eagerly. Engine option ``enforce_eager``
(graphs by default on CUDA). Introduced in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

import torch

from labkit.core.attention.metadata import PagedAttentionBackend, PagedAttentionMetadata
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.model import CausalLM

MAX_GRAPH_WIDTHS = 8  # block-table widths 1, 2, 4, ..., 128 blocks (2048 tokens at block_size 16)


class Replayable(Protocol):
    """What ``DecodeGraphs`` needs of a captured graph: ``torch.cuda.CUDAGraph``, or a test's stand-in. Notebook 10."""

    def replay(self) -> None: ...


def graph_widths(max_blocks: int, max_widths: int = MAX_GRAPH_WIDTHS) -> list[int]:
    """Block-table widths to capture: powers of two up to the first that holds ``max_blocks``, at most
    ``max_widths`` of them (a wider table decodes eagerly: a bounded number of graphs to capture at start)."""
    widths = [1 << i for i in range((max(1, max_blocks) - 1).bit_length() + 1)]
    return widths[:max_widths]


def capture_supported(device: torch.device) -> bool:
    """Whether graphs can be captured on ``device`` (CUDA only; elsewhere the padded path runs eagerly)."""
    return device.type == "cuda"


class CaptureState:
    """What every capture of one engine shares: one side stream for warm-ups and captures, and one graph memory pool
    (the smaller graphs reuse the largest one's memory). One stream per engine, not per capture: cuBLAS keeps a
    workspace for every stream it has run on, and hundreds of captures would each leave one behind."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self.mempool = torch.cuda.graph_pool_handle()


def capture_cuda_graph(forward: Callable[[], torch.Tensor], state: CaptureState | None
                       ) -> tuple[Replayable, torch.Tensor, CaptureState]:
    """Warm ``forward`` up on the engine's side stream (a capture must not run on the default stream), then capture
    it there in the thread-local mode: CUDA calls from other threads (the async engine's, the allocator's) stay legal
    meanwhile. Returns the graph, its static output and the capture state (created by the first capture).

    ``torch.cuda.graph`` would synchronise the device and empty the allocator's cache before every capture (up to a
    few hundred at engine start); the captures here queue behind the warm-up on the same stream instead, and the
    graph pool keeps its memory between them."""
    state = CaptureState() if state is None else state
    state.stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(state.stream):
        forward()  # warm-up: lazy initialisation (cuBLAS handles, Triton compilation) must not happen in a capture
        graph.capture_begin(state.mempool, capture_error_mode="thread_local")
        try:
            output = forward()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(state.stream)
    return graph, output, state


def clear_cublas_workspaces() -> None:
    """Free the workspaces cuBLAS keeps per (handle, stream) (``LLM.close``): up to ~1 GiB after an engine's
    captures. They come back on the next matmul, at the size it needs."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None and torch.cuda.is_initialized():
        clear()


class DecodeGraphs:
    """Static-shape decode forward passes, replayed as CUDA graphs (or run eagerly off CUDA, for tests). Notebook 10.

    ``scratch_block`` is a pool block the block manager never hands out. With ``capture=True`` every graph is
    captured here; ``num_captures`` counts them (it never grows once the engine runs).
    """

    def __init__(self, model: CausalLM, pool: PagedKVPool, sizes: tuple[int, ...], max_blocks: int,
                 scratch_block: int, capture: bool = True,
                 attention_backend: type[PagedAttentionBackend] = PagedAttentionBackend) -> None:
        self.model = model
        self.attention_backend = attention_backend  # its graph_decode: the attention each graph captures
        self.pool = pool
        self.sizes = sorted(sizes)
        self.widths = graph_widths(max_blocks)
        self.scratch_block = scratch_block
        self.capture = capture
        device, b, w = model.device, self.sizes[-1], self.widths[-1]
        self.input_ids = torch.zeros(b, dtype=torch.long, device=device)  # (B_max,)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((b,), scratch_block * pool.block_size, dtype=torch.long, device=device)
        self.tables = torch.full((b, w), scratch_block, dtype=torch.long, device=device)  # (B_max, W_max)
        self.context_lens = torch.ones(b, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], Replayable] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_state: CaptureState | None = None  # the engine's one stream and graph pool (first capture)
        self.num_captures = 0
        self.num_runs = 0  # decode steps served (replayed, or run eagerly off CUDA)
        if capture:
            self.capture_all()

    @property
    def mempool(self) -> object | None:
        """The graph memory pool the captures share: None before the first capture and after ``close``."""
        return getattr(self.capture_state, "mempool", self.capture_state)

    def can_run(self, meta: PagedAttentionMetadata) -> bool:
        return (meta.is_decode_only and len(meta.query_lens) <= self.sizes[-1]
                and max(len(t) for t in meta.block_tables) <= self.widths[-1])

    def _forward(self, b: int, w: int) -> torch.Tensor:
        backend = self.attention_backend.graph_decode(self.pool, self.slot_mapping[:b], self.tables[:b, :w],
                                                      self.context_lens[:b])
        return self.model(self.input_ids[None, :b], self.positions[None, :b], backend)[0]  # (b, hidden)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (size, width) graph, largest first (the smaller ones reuse its memory in the shared pool).
        Every row points at the scratch block meanwhile, so the captures write nothing any sequence owns."""
        for b in reversed(self.sizes):
            for w in reversed(self.widths):
                key = (b, w)
                graph, self.outputs[key], self.capture_state = capture_cuda_graph(
                    lambda b=b, w=w: self._forward(b, w), self.capture_state)
                self.graphs[key] = graph
                self.num_captures += 1

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            graph_meta: torch.Tensor) -> torch.Tensor:
        """One decode-only step of n sequences -> hidden states (1, n, hidden). Every argument is already on the
        device (one packed copy, ``ModelRunner.prepare``): input_ids, positions, slot_mapping (n,); graph_meta
        (n, 1 + W): each row's context length, then its block table padded with the scratch block to W."""
        n, width = graph_meta.shape[0], graph_meta.shape[1] - 1
        b = self.sizes[bisect.bisect_left(self.sizes, n)]
        w = self.widths[bisect.bisect_left(self.widths, width)]
        # Device-to-device copies into the static buffers; padding rows: token 0 at position 0, writing to and
        # reading only the scratch block.
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = slot_mapping
        self.context_lens[:n] = graph_meta[:, 0]
        self.tables[:n, :width] = graph_meta[:, 1:]
        self.tables[:n, width:w] = self.scratch_block
        self.input_ids[n:b] = 0
        self.positions[n:b] = 0
        self.slot_mapping[n:b] = self.scratch_block * self.pool.block_size
        self.tables[n:b, :w] = self.scratch_block
        self.context_lens[n:b] = 1
        self.num_runs += 1
        if not self.capture:
            return self._forward(b, w)[None, :n]
        if (b, w) not in self.graphs:  # can_run() said yes: every such shape was captured at start-up
            raise RuntimeError(f"no CUDA graph for batch {b} x table width {w}: graphs are captured at start only")
        self.graphs[(b, w)].replay()
        return self.outputs[(b, w)][None, :n]

    def close(self) -> None:
        """Drop the graphs, their memory pool and stream, and cuBLAS's workspaces (``LLM.close``)."""
        self.graphs.clear()
        self.outputs.clear()
        if self.capture_state is not None:
            self.capture_state = None
            clear_cublas_workspaces()
