"""The engine's options for closing host gaps (notebook 10): CUDA graphs and async scheduling on a GPU,
a clear error for CUDA graphs on a CPU, and the CPU-side fix (vectorised input preparation) changing no token.
Async scheduling on the CPU is tested in tests/core/engine/test_async_scheduling.py.

The GPU tests are marked ``cuda`` and run only where CUDA exists; the rest run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from labkit import LLM, SamplingParams

CUDA = torch.cuda.is_available()
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]

# Prompts of different lengths and outputs of different lengths: the decode batch shrinks 5 -> 3 -> 1 over the
# run, crossing CUDA-graph buckets (5 and 3 are padded to 8 and 4), with prefills mixed into the first steps.
PROMPTS = ["Once upon a time", "A little fox named Lily", "The sun was", "One day, Tom went to the park and",
           "Mia had a red ball"]
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 6, 14, 24, 6)]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


# ---- everywhere: CPU behaviour ----

def test_cuda_graphs_fail_clearly_on_cpu() -> None:
    with pytest.raises(ValueError, match=r"enforce_eager=False needs a CUDA device.*runs on cpu"):
        LLM("labkit-tiny", engine="chunked", device="cpu", enforce_eager=False)


def test_host_option_values_are_checked() -> None:
    with pytest.raises(ValueError, match="prepare_inputs must be 'loop' or 'vectorized', got 'fast'"):
        LLM("labkit-tiny", device="cpu", prepare_inputs="fast")
    with pytest.raises(ValueError, match="cuda_graph_sizes must be positive ints"):
        LLM("labkit-tiny", device="cpu", cuda_graph_sizes=(0, 4))


def test_vectorized_input_preparation_changes_no_token() -> None:
    # A small token budget: prefill chunks run in the same steps as decodes, a ragged batch for both paths.
    tokens = {}
    for mode in ("loop", "vectorized"):
        llm = LLM("labkit-tiny", engine="chunked", device="cpu", dtype="float32", prepare_inputs=mode,
                  max_num_batched_tokens=8)
        outs = llm.generate(PROMPTS[:3], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                          for n in (8, 3, 6)], use_tqdm=False)
        tokens[mode] = [o.outputs[0].token_ids for o in outs]
    assert tokens["loop"] == tokens["vectorized"] and all(tokens["loop"])


# ---- CUDA only ----

@pytest.fixture(scope="module")
def eager_tokens() -> list[list[int]]:
    if not CUDA:
        pytest.skip("needs a CUDA GPU")
    return _tokens(LLM("labkit-tiny", engine="chunked", device="cuda", dtype="float32", enforce_eager=True))


@pytest.mark.parametrize("options", [
    {},  # graphs are the default on CUDA
    {"enforce_eager": False},
    {"enforce_eager": False, "cuda_graph_sizes": (1, 4)},  # batches of 5 fall outside every bucket: run eagerly
    {"async_scheduling": True, "enforce_eager": True},
    {"async_scheduling": True},  # graphs replayed from the async worker thread
], ids=["default", "cuda-graphs", "few-buckets", "async", "async-cuda-graphs"])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_options_keep_greedy_tokens(options: dict, eager_tokens: list[list[int]]) -> None:
    llm = LLM("labkit-tiny", engine="chunked", device="cuda", dtype="float32", **options)
    graphs = llm.engine.runner.graphs
    captured = graphs.num_captures if graphs is not None else 0
    assert _tokens(llm) == eager_tokens
    assert _tokens(llm) == eager_tokens  # a second run replays the captured graphs
    if graphs is not None:
        assert graphs.num_captures == captured and graphs.num_runs > 0  # all captured at start, none mid-run
    llm.close()


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_graphs_are_replayed_in_decode_steps(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from labkit.measure.profiling import profile_engine

    def graph_launches(**options: object) -> int:
        llm = LLM("labkit-tiny", engine="chunked", device="cuda", dtype="float32", **options)
        prof = profile_engine(llm, PROMPTS, PARAMS, logdir=tmp_path)
        analysis = prof.analyze()
        assert analysis.device_type == "cuda" and analysis.busy > 0 and 0 <= analysis.idle_fraction <= 1
        return sum(1 for e in prof.events if e.get("name") == "cudaGraphLaunch")

    assert graph_launches(enforce_eager=True) == 0
    assert graph_launches(enforce_eager=False) > 0
    assert graph_launches() > 0  # the default on CUDA
