"""KV sizing on CUDA leaves room for the CUDA graphs of decode steps (the largest captured step's temporaries, kept
in the graphs' private pool), with the device's memory queries mocked as in ``test_kv_sizing.py``."""

from __future__ import annotations

import pytest
import torch

from labkit.core.engine import kv_sizing
from labkit.core.engine.config import PagedConfig
from labkit.core.kv.paged_pool import kv_block_bytes
from labkit.core.model import PRESETS

GIB = 1 << 30


class FakeModel:
    def __init__(self) -> None:
        self.config = PRESETS["llama3.2-1b"]  # 8 KV heads of 64, 16 layers
        self.device = torch.device("cuda", 0)
        self.dtype = torch.bfloat16


@pytest.fixture
def card(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """An empty 80 GiB card (1 GiB used elsewhere); records the token counts profiled."""
    profiled: list[int] = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (79 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)

    def activations(model: object, num_tokens: int) -> int:
        profiled.append(num_tokens)
        return 1000 * num_tokens

    monkeypatch.setattr(kv_sizing, "profile_activation_peak", activations)
    return profiled


def test_the_largest_captured_step_is_set_aside(card: list[int]) -> None:
    model = FakeModel()
    config = PagedConfig(max_model_len=131072, max_num_seqs=256, max_num_batched_tokens=8192)
    peak = kv_sizing.graph_capture_peak(model, config)  # type: ignore[arg-type]
    tokens = 128 * 16  # the widest captured table: 128 blocks of 16
    gather = 2 * 256 * tokens * 8 * 64 * 2  # K and V of one layer, 256 rows, bfloat16
    assert peak == gather + 256 * tokens + 1000 * 256 and gather == GIB
    eager = PagedConfig(max_model_len=131072, max_num_seqs=256, max_num_batched_tokens=8192, enforce_eager=True)
    assert kv_sizing.graph_capture_peak(model, eager) == 0  # type: ignore[arg-type]
    block = kv_block_bytes(model.config, 16, torch.bfloat16)
    with_graphs = kv_sizing.pool_num_blocks(model, config, 8192)  # type: ignore[arg-type]
    without = kv_sizing.pool_num_blocks(model, eager, 8192)  # type: ignore[arg-type]
    assert without == (int(80 * GIB * 0.9) - GIB - 1000 * 8192) // block
    assert with_graphs == (int(80 * GIB * 0.9) - GIB - 1000 * 8192 - peak) // block < without
    assert 256 in card  # the dense forward of the largest capture size was profiled


def test_a_short_context_sets_aside_little(card: list[int]) -> None:
    config = PagedConfig(max_model_len=256, max_num_seqs=8)
    assert config.cuda_graph_sizes is not None and max(config.cuda_graph_sizes) == 8
    peak = kv_sizing.graph_capture_peak(FakeModel(), config)  # type: ignore[arg-type]
    assert peak == 2 * 8 * 256 * 8 * 64 * 2 + 8 * 256 + 1000 * 8
