"""CUDA graphs are captured at engine start, for a bounded set of shapes, in the thread-local capture mode, and
never mid-run (sync or async), checked on the CPU with the capture mocked: ``capture_cuda_graph`` is replaced by
a stand-in whose "replay" reruns the captured forward pass into the same static output, as a graph does."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import labkit.core.engine.cuda_graphs as cuda_graphs
import labkit.core.engine.model_runner as model_runner
from labkit import LLM, SamplingParams
from labkit.core.engine.config import MAX_CAPTURE_SIZE, PagedConfig, capture_sizes
from labkit.core.engine.cuda_graphs import MAX_GRAPH_WIDTHS, graph_widths

PROMPTS = [[1, 40, 41, 42, 43], [1, 99, 7], list(range(3, 40)), [1, 5], list(range(50, 61))]
PARAMS = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (9, 3, 14, 6, 11)]
PARAMS[2] = SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)  # seeded sampling too


def test_capture_sizes_follow_vllm() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(5) == (1, 2, 4, 8)  # every batch up to max_num_seqs has a bucket
    assert capture_sizes(16) == (1, 2, 4, 8, 16)
    assert capture_sizes(17) == (1, 2, 4, 8, 16, 24)
    assert capture_sizes(256)[-3:] == (240, 248, 256) and len(capture_sizes(256)) == 35
    big = capture_sizes(10_000)
    assert big[-1] == MAX_CAPTURE_SIZE and len(big) == 3 + MAX_CAPTURE_SIZE // 8  # capped: bigger batches run eagerly


def test_table_widths_are_bounded() -> None:
    assert graph_widths(1) == [1]
    assert graph_widths(6) == [1, 2, 4, 8]
    assert graph_widths(8) == [1, 2, 4, 8]
    assert graph_widths(131072 // 16) == [1 << i for i in range(MAX_GRAPH_WIDTHS)]  # Llama 3's 128k context


def test_enforce_eager_defaults_to_graphs_on_cuda_only() -> None:
    config = PagedConfig(max_num_seqs=20)
    assert config.enforce_eager is None and config.cuda_graph_sizes == capture_sizes(20)
    assert config.use_cuda_graphs("cuda") and not config.use_cuda_graphs("cpu") and not config.use_cuda_graphs("mps")
    assert not PagedConfig(enforce_eager=True).use_cuda_graphs("cuda")
    assert PagedConfig(enforce_eager=False).use_cuda_graphs("cuda")
    with pytest.raises(ValueError, match=r"enforce_eager=False needs a CUDA device.*runs on cpu"):
        PagedConfig(enforce_eager=False).use_cuda_graphs("cpu")
    with pytest.raises(ValueError, match="enforce_eager must be True, False or None"):
        PagedConfig(enforce_eager="yes")  # type: ignore[arg-type]
    assert PagedConfig(cuda_graph_sizes=(8, 1, 8)).cuda_graph_sizes == (1, 8)


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() reruns the captured forward pass into the static output."""

    def __init__(self, forward: Callable[[], torch.Tensor], output: torch.Tensor, log: dict[str, list]) -> None:
        self.forward, self.output, self.log = forward, output, log

    def replay(self) -> None:
        self.log["replays"].append(threading.current_thread().name)
        self.output.copy_(self.forward())


@pytest.fixture
def mocked_capture(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Pretend CUDA: engines capture graphs at start (through the fake), the rest runs on the CPU."""
    log: dict[str, list] = {"captures": [], "replays": []}

    def fake_capture(forward: Callable[[], torch.Tensor], pool: object | None
                     ) -> tuple[FakeGraph, torch.Tensor, object]:
        log["captures"].append(threading.current_thread().name)
        output = forward()
        return FakeGraph(forward, output, log), output, pool or "pool"

    monkeypatch.setattr(cuda_graphs, "capture_cuda_graph", fake_capture)
    monkeypatch.setattr(model_runner, "capture_supported", lambda device: True)
    monkeypatch.setattr(PagedConfig, "use_cuda_graphs", lambda self, device_type: self.enforce_eager is not True)
    return log


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_graphs_are_captured_at_start_and_never_mid_run(mocked_capture: dict[str, list], bundled_path,
                                                        async_scheduling: bool) -> None:
    options: dict[str, Any] = dict(engine="chunked", dtype="float64", block_size=4, max_num_seqs=8,
                                   max_model_len=256, async_scheduling=async_scheduling)
    llm = LLM(str(bundled_path), enforce_eager=True, **options)  # the reference: no graphs
    assert llm.engine.runner.graphs is None and not mocked_capture["captures"]
    graphs_llm = LLM(str(bundled_path), **options)
    graphs = graphs_llm.engine.runner.graphs
    assert graphs is not None and graphs.capture
    shapes = len(capture_sizes(8)) * len(graph_widths(256 // 4))
    assert graphs.num_captures == len(mocked_capture["captures"]) == shapes == 4 * 7  # all of them, at start-up
    assert set(mocked_capture["captures"]) == {threading.main_thread().name}
    reference = tokens(llm)
    assert tokens(graphs_llm) == reference and tokens(graphs_llm) == reference  # the same tokens, twice
    assert len(mocked_capture["captures"]) == shapes and graphs.num_captures == shapes  # none mid-run
    assert mocked_capture["replays"] and graphs.num_runs == len(mocked_capture["replays"])
    if async_scheduling:  # replayed by the worker thread, captured by the main thread before it existed
        assert set(mocked_capture["replays"]) == {"labkit-device_0"}


def test_wide_tables_decode_eagerly_without_capturing(mocked_capture: dict[str, list], bundled_path) -> None:
    llm = LLM(str(bundled_path), engine="chunked", dtype="float64", block_size=1, max_num_seqs=2,
              max_model_len=512)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.widths[-1] == 1 << (MAX_GRAPH_WIDTHS - 1)  # 128 blocks of 1 token
    captured = graphs.num_captures
    long_prompt = list(range(3, 200))  # 197 blocks: wider than any captured graph
    out = llm.generate([long_prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert graphs.num_captures == captured and graphs.num_runs == 0


def test_capture_uses_thread_local_mode_one_stream_and_one_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real capture function, with torch.cuda's graph API mocked: warm-up, then a capture in the thread-local mode
    into the shared pool, every capture of an engine on one side stream (cuBLAS keeps a workspace per stream), and no
    device-wide synchronize or empty_cache per capture (``torch.cuda.graph`` does both)."""
    calls: dict[str, Any] = {"streams": 0, "begin": [], "end": 0, "entered": []}

    class Stream:
        def __init__(self) -> None:
            calls["streams"] += 1

        def wait_stream(self, other: object) -> None:
            pass

    class Graph:
        def capture_begin(self, pool: object, capture_error_mode: str) -> None:
            calls["begin"].append((pool, capture_error_mode))

        def capture_end(self) -> None:
            calls["end"] += 1

    @contextmanager
    def fake_stream(stream: object):  # type: ignore[no-untyped-def]
        calls["entered"].append(stream)
        yield

    def refuse(*args: object) -> None:
        raise AssertionError("a capture must not synchronize the device or empty the allocator's cache")

    current = Stream()
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "stream", fake_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    monkeypatch.setattr(torch.cuda, "empty_cache", refuse)
    graph, output, state = cuda_graphs.capture_cuda_graph(lambda: torch.ones(2), None)
    assert isinstance(graph, Graph) and state.mempool == "pool" and torch.equal(output, torch.ones(2))
    for _ in range(5):
        _, _, again = cuda_graphs.capture_cuda_graph(lambda: torch.ones(2), state)
        assert again is state
    assert calls["streams"] == 1 + 1  # the test's "current" stream, and the engine's one side stream
    assert calls["entered"] == [state.stream] * 6 and calls["end"] == 6
    assert calls["begin"] == [("pool", "thread_local")] * 6


def test_close_clears_cublas_workspaces(monkeypatch: pytest.MonkeyPatch, mocked_capture: dict[str, list]) -> None:
    """``LLM.close`` frees the workspaces cuBLAS keeps per stream, once an engine has captured graphs (checked on the
    CPU with the capture mocked and CUDA pretended initialised)."""
    cleared: list[bool] = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: cleared.append(True), raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    llm = LLM("labkit-tiny", engine="chunked", device="cpu", max_num_seqs=2)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.num_captures > 0 and not cleared
    llm.close()
    assert cleared == [True] and graphs.mempool is None


def test_a_custom_attention_backend_is_never_bypassed_by_cuda_graphs() -> None:
    """Graphs replay labkit's own decode attention, so a learner's backend turns them off (and refuses them)."""
    from labkit.core.attention import TorchAttentionBackend
    from labkit.core.engine.config import PagedConfig

    class Mine(TorchAttentionBackend):
        pass

    assert PagedConfig(max_model_len=64).use_cuda_graphs("cuda")
    assert not PagedConfig(max_model_len=64, attention_backend=Mine).use_cuda_graphs("cuda")
    with pytest.raises(ValueError, match="would bypass attention_backend"):
        PagedConfig(max_model_len=64, attention_backend=Mine, enforce_eager=False).use_cuda_graphs("cuda")
