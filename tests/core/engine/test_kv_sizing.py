"""KV pool sizing on CUDA, with the device's memory queries mocked: vLLM's rule (utilization x total, less what else
lives there) gives seven engines built in a row the same pool, never overcommits while an engine is still alive, and
the block manager of a multi-million-block pool costs nothing up front."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from labkit.core.engine import kv_sizing
from labkit.core.engine.config import PagedConfig
from labkit.core.kv.block_manager import BlockManager
from labkit.core.kv.paged_pool import kv_block_bytes
from labkit.core.model import PRESETS

GIB = 1 << 30


@dataclass
class FakeCard:
    """A CUDA device's allocator, as the sizing code sees it: live tensors, cached free memory, other processes."""

    total: int = 80 * GIB
    others: int = 1 * GIB  # other processes and the CUDA context
    allocated: int = 0
    cached: int = 0  # freed by this process, kept by the caching allocator
    live_pools: list[int] = field(default_factory=list)

    def alloc(self, n: int) -> None:
        reuse = min(n, self.cached)
        self.cached -= reuse
        self.allocated += n

    def free(self, n: int) -> None:
        self.allocated -= n
        self.cached += n

    def patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        reserved = lambda device=None: self.allocated + self.cached  # noqa: E731
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.total - self.others - reserved(),
                                                                                self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(kv_sizing, "profile_activation_peak", lambda model, num_tokens: 2 * GIB)
        monkeypatch.setattr(kv_sizing, "graph_capture_peak", lambda model, config: 0)  # test_kv_sizing_graphs.py


class FakeModel:
    def __init__(self) -> None:
        self.config = PRESETS["llama3.2-1b"]
        self.device = torch.device("cuda", 0)
        self.dtype = torch.bfloat16


def config(**options: object) -> PagedConfig:
    return PagedConfig(max_model_len=131072, max_num_seqs=256, **options)  # never capped on this card


def test_seven_engines_in_a_row_get_equal_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    card, model = FakeCard(), FakeModel()
    card.patch(monkeypatch)
    card.alloc(3 * GIB)  # the weights
    block_bytes = kv_block_bytes(model.config, 16, model.dtype)
    sizes, old_rule = [], []
    for _ in range(7):
        old_rule.append(int(torch.cuda.mem_get_info()[0] * 0.9) // block_bytes)  # 0.9 x free: labkit's old sizing
        n = kv_sizing.pool_num_blocks(model, config(), 512)  # type: ignore[arg-type]
        sizes.append(n)
        card.alloc(n * block_bytes)  # the engine's pool...
        card.free(n * block_bytes)  # ...given back when the engine is closed or replaced (kept in the cache)
    assert len(set(sizes)) == 1, sizes
    # 0.9 x total, less others (1 GiB), the weights (3 GiB) and the activations (2 GiB)
    assert sizes[0] == (int(80 * GIB * 0.9) - 1 * GIB - 3 * GIB - 2 * GIB) // block_bytes
    assert old_rule[-1] < old_rule[0] // 2  # what the old rule did to the seventh engine


def test_a_live_engine_is_never_overcommitted(monkeypatch: pytest.MonkeyPatch) -> None:
    card, model = FakeCard(), FakeModel()
    card.patch(monkeypatch)
    card.alloc(3 * GIB)
    block_bytes = kv_block_bytes(model.config, 16, model.dtype)
    first = kv_sizing.pool_num_blocks(model, config(), 512)  # type: ignore[arg-type]
    card.alloc(first * block_bytes)  # still alive: a second engine must fit beside it
    with pytest.raises(ValueError, match="holds no block.*close engines you no longer use"):
        kv_sizing.pool_num_blocks(model, config(), 512)  # type: ignore[arg-type]
    half = kv_sizing.pool_num_blocks(model, config(gpu_memory_utilization=0.95), 512)  # type: ignore[arg-type]
    assert half * block_bytes <= 0.95 * card.total - card.others - card.allocated - 2 * GIB


def test_the_pool_is_capped_by_what_the_sequences_can_use(monkeypatch: pytest.MonkeyPatch) -> None:
    card, model = FakeCard(), FakeModel()
    card.patch(monkeypatch)
    small = PagedConfig(max_model_len=2048, max_num_seqs=16)
    n = kv_sizing.pool_num_blocks(model, small, 512)  # type: ignore[arg-type]
    assert n == 16 * 2048 // 16


def test_a_pool_of_eight_million_blocks_makes_no_block_objects_up_front() -> None:
    bm = BlockManager(8_000_000, 16, enable_prefix_caching=True)
    assert bm.num_free_blocks == 8_000_000 and bm.blocks.num_made == 0  # nothing per block until it is used
    taken = [bm._take_free_block() for _ in range(3)]
    assert taken == [0, 1, 2] and bm.blocks.num_made == 3 and bm.num_used_blocks == 3
    for block_id in taken:
        bm._release(block_id)
    assert bm.num_free_blocks == 8_000_000 and list(bm.free_block_ids)[-3:] == [0, 1, 2]  # returned ones come last
    assert bm.free_block_ids[0] == 3 and bm._take_free_block() == 3


def test_the_profiling_pass_is_one_sequence_at_most(monkeypatch: pytest.MonkeyPatch) -> None:
    card, model = FakeCard(), FakeModel()
    card.patch(monkeypatch)
    asked: list[int] = []
    monkeypatch.setattr(kv_sizing, "profile_activation_peak", lambda m, n: asked.append(n) or GIB)
    kv_sizing.pool_num_blocks(model, config(), 256 * 131072)  # type: ignore[arg-type]  # a static batch's budget
    kv_sizing.pool_num_blocks(model, config(), 512)  # type: ignore[arg-type]  # chunked's budget
    assert asked == [131072, 512]
