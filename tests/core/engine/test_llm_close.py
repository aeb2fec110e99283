"""``LLM.close()`` and ``with LLM(...) as llm:``: the KV pool, CUDA graphs, the async worker thread and the weights
are released, requests still running are aborted, and a closed LLM says so clearly (vLLM's LLM has no close;
labkit offers one so notebooks that build many engines give each one the whole device)."""

from __future__ import annotations

import threading

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.core.model.layers import MergedLinear

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("labkit-device")]


def test_with_block_releases_pool_and_weights() -> None:
    with LLM("labkit-tiny", engine="chunked", device="cpu") as llm:
        assert llm.generate("Once upon a time", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        pool = llm.engine.runner.pool
        assert pool.num_bytes > 0
    assert llm.closed and "closed" in repr(llm)
    assert pool.num_bytes == 0 and not pool.k and not pool.v  # the per-layer K/V tensors are gone
    assert all(p.device.type == "meta" for p in llm.model.parameters())  # no weight storage left
    merged = [m for mod in llm.model.modules() for m in vars(mod).values() if isinstance(m, MergedLinear)]
    assert merged and all(m.weight is None and m.bias is None for m in merged)
    bm = llm.engine.block_manager
    assert bm is not None and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("call", ["generate", "stream", "add_request", "step", "encode"])
def test_a_closed_llm_says_so(call: str) -> None:
    llm = LLM("labkit-tiny", engine="chunked", device="cpu")
    llm.close()
    llm.close()  # twice is fine
    with pytest.raises(RuntimeError, match=r"this LLM \(labkit-tiny, engine 'chunked'\) is closed.*create a new LLM"):
        if call == "generate":
            llm.generate("hi", PARAMS, use_tqdm=False)
        elif call == "stream":
            next(llm.stream("hi", PARAMS))
        elif call == "add_request":
            llm.add_request("hi", PARAMS)
        elif call == "step":
            llm.step()
        else:
            llm.encode("hi")


def test_close_aborts_running_requests_and_frees_their_blocks() -> None:
    llm = LLM("labkit-tiny", engine="continuous", device="cpu")
    (seq,) = llm.add_request("Once upon a time", SamplingParams(max_tokens=50, temperature=0.0))
    llm.step()
    assert llm.engine.block_manager.num_used_blocks > 0
    llm.close()
    assert seq.is_finished and seq.finish_reason is not None
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()


def test_close_stops_the_async_worker_thread_with_a_step_in_flight() -> None:
    before = set(worker_threads())
    llm = LLM("labkit-tiny", engine="chunked", device="cpu", async_scheduling=True)
    llm.add_request("Once upon a time", SamplingParams(max_tokens=20, temperature=0.0))
    llm.step()
    llm.step()  # now a step is launched on the worker thread
    assert llm.engine._in_flight is not None and llm.engine._executor is not None
    llm.close()
    assert llm.engine._in_flight is None and llm.engine._executor is None
    assert set(worker_threads()) <= before  # the worker thread has ended
    assert not llm.engine.has_unfinished_requests()


def test_close_drops_decode_graphs() -> None:
    llm = LLM("labkit-tiny", engine="chunked", device="cpu")
    graphs = llm.engine.runner.use_decode_graphs((1, 2), max_blocks=4, capture=False)
    llm.generate("Once upon a time", PARAMS, use_tqdm=False)
    assert graphs.num_runs > 0
    llm.close()
    assert llm.engine.runner.graphs is None and not graphs.graphs and graphs.mempool is None


@pytest.mark.parametrize("engine", ["naive", "kvcache"])
def test_engines_without_a_pool_close_too(engine: str) -> None:
    with LLM("labkit-tiny", engine=engine, device="cpu") as llm:
        llm.generate("Once upon a time", PARAMS, use_tqdm=False)
    with pytest.raises(RuntimeError, match="is closed"):
        llm.generate("Once upon a time", PARAMS, use_tqdm=False)


def test_close_returns_cached_memory_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA close() hands the caching allocator's freed blocks back (mocked here: no GPU needed)."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    llm = LLM("labkit-tiny", engine="chunked", device="cpu")
    llm.close()
    assert not emptied  # nothing to return on a CPU
    llm = LLM("labkit-tiny", engine="chunked", device="cpu")
    llm.device = torch.device("cuda")  # what close() looks at
    llm.close()
    assert emptied == [True]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_close_gives_the_device_memory_back() -> None:
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    llm = LLM("labkit-tiny", engine="chunked", device="cuda", num_gpu_blocks=4096)  # graphs captured too
    llm.generate("Once upon a time", PARAMS, use_tqdm=False)
    assert torch.cuda.memory_allocated() > allocated
    llm.close()
    assert torch.cuda.memory_allocated() <= allocated + (1 << 20)  # weights, pool and graphs are gone
