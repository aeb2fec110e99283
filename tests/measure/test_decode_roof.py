"""labkit.measure.decode_roof: the GEMV roof per kernel, and a decode step split into linear layers, attention and
the rest (notebook 04, scripts/bench_kvcache.py). Timings are never asserted, only how they are put together."""

from __future__ import annotations

import pytest
import torch

from labkit import LLM
from labkit.core.kv import ContiguousKVCache
from labkit.core.model.linear import LinearKernel, onednn_linear_available
from labkit.measure.decode_roof import (
    ONEDNN_KERNEL,
    PLAIN_KERNELS,
    measure_decode_breakdown,
    measure_gemv_roof,
)
from labkit.measure.roofline import decode_cost
from labkit.measure.timing import timing_calls
from labkit.measure.workloads import prompt_ids_of_length


def test_gemv_roof_names_every_kernel_and_its_plain_and_best_figures() -> None:
    roof = measure_gemv_roof(torch.device("cpu"), torch.float32, nbytes=1 << 20, rounds=2, in_features=(64, 256))
    expected = set(PLAIN_KERNELS) | ({ONEDNN_KERNEL} if onednn_linear_available() else set())
    assert set(roof.bandwidth) == expected and all(v > 0 for v in roof.bandwidth.values())
    assert roof.plain == max(roof.bandwidth[k] for k in PLAIN_KERNELS)
    assert roof.best == max(roof.bandwidth.values()) >= roof.plain
    assert roof.smoke  # 1 MiB sits in the caches: flagged
    assert "GEMV roof (cpu, float32, 1 MiB matrix)" in roof.summary()
    double = measure_gemv_roof(torch.device("cpu"), torch.float64, nbytes=1 << 20, rounds=1, in_features=(64,))
    assert set(double.bandwidth) == set(PLAIN_KERNELS)  # oneDNN's packed path is float32 only


def test_timing_calls_adds_up_and_restores_the_method_even_on_error() -> None:
    class Thing:
        def work(self, fail: bool) -> int:
            if fail:
                raise ValueError("planted")
            return 7

    spent = [0.0]
    original = Thing.work
    with pytest.raises(ValueError, match="planted"), timing_calls(Thing, "work", spent):
        assert Thing().work(False) == 7
        Thing().work(True)
    assert Thing.work is original and spent[0] > 0


def test_decode_breakdown_splits_the_step_it_timed() -> None:
    with LLM("labkit-tiny", engine="kvcache", device="cpu", dtype="float32", max_model_len=128) as llm:
        prompt = prompt_ids_of_length(llm.tokenizer, 20, seed=0)
        original = LinearKernel.__call__, ContiguousKVCache.attend
        b = measure_decode_breakdown(llm, prompt, num_steps=4, backend_cls=ContiguousKVCache)
        assert (LinearKernel.__call__, ContiguousKVCache.attend) == original  # the timers are gone
        assert b.step_s > 0 and b.timed_step_s > 0
        assert 0 < b.matmul_s and 0 < b.attention_s and b.matmul_s + b.attention_s <= b.forward_s <= b.timed_step_s
        shares = b.shares()
        assert list(shares) == ["linear layers", "attention", "everything else", "engine (prepare, sample, detokenize)"]
        assert sum(shares.values()) == pytest.approx(b.timed_step_s)
        # bytes at the middle of the four decode steps' contexts (20 + 1 .. 20 + 4)
        assert b.nbytes == decode_cost(llm.model_config, 1, 20 + 2, 4).total_bytes
        assert b.bandwidth == pytest.approx(b.nbytes / b.step_s)
