"""Notebook 06's Build task "paged attention": its checker passes labkit's backend and a learner's own per-sequence
solution, fails the mistakes learners make (on the hand-built pool, and inside the engine), reports an untouched
stub, and the learner's class is the one the engine runs."""

from __future__ import annotations

import math

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.core.attention import TorchAttentionBackend
from labkit.course import use_or_reference
from labkit.course.ch06_paged_attention.attention import check_paged_attention, workloads
from labkit.course.harness.runs import reference_run


class LearnersAttention(TorchAttentionBackend):
    """A solution written the way the notebook's hints lead to it: one sequence at a time, gather + softmax."""

    write_first = True

    def gather(self, pool: torch.Tensor, table: list[int], ctx: int) -> torch.Tensor:
        return pool[table].flatten(0, 1)[:ctx]  # (ctx, n_kv_heads, d): the sequence's slots, in order

    def share_kv_heads(self, x: torch.Tensor, group: int) -> torch.Tensor:
        return x.repeat_interleave(group, dim=1)  # (ctx, n_heads, d): query head h reads KV head h // group

    def attend(self, layer_idx, q, k, v):  # type: ignore[no-untyped-def]
        k_pool, v_pool = self.pool.k[layer_idx], self.pool.v[layer_idx]
        if self.write_first:
            k_pool.flatten(0, 1)[self.meta.slot_mapping] = k[0]
            v_pool.flatten(0, 1)[self.meta.slot_mapping] = v[0]
        out = torch.empty_like(q)
        group = q.shape[2] // k.shape[2]
        start = 0
        for n, ctx, table in zip(self.meta.query_lens, self.meta.context_lens, self.meta.block_tables):
            keys = self.share_kv_heads(self.gather(k_pool, table, ctx), group)
            values = self.share_kv_heads(self.gather(v_pool, table, ctx), group)
            scores = torch.einsum("qhd,khd->hqk", q[0, start:start + n], keys) / math.sqrt(q.shape[-1])
            position = torch.arange(ctx - n, ctx, device=q.device)[:, None]  # (n, 1) the new tokens' positions
            visible = torch.arange(keys.shape[0], device=q.device)[None, :] <= position  # (n, ctx) causal
            scores = self.mask(scores, visible, n)
            out[0, start:start + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
            start += n
        return out

    def mask(self, scores: torch.Tensor, visible: torch.Tensor, n: int) -> torch.Tensor:
        return scores.masked_fill(~visible, float("-inf"))


# ---- mistakes learners make ----

class NeverWritesTheNewKV(LearnersAttention):
    write_first = False


class AttendsBeforeWriting(LearnersAttention):
    write_first = False

    def attend(self, layer_idx, q, k, v):  # type: ignore[no-untyped-def]
        out = super().attend(layer_idx, q, k, v)
        self.pool.k[layer_idx].flatten(0, 1)[self.meta.slot_mapping] = k[0]
        self.pool.v[layer_idx].flatten(0, 1)[self.meta.slot_mapping] = v[0]
        return out


class ReadsPastTheContext(LearnersAttention):
    """A decode reads every slot of its blocks (no slicing, no mask: "one token sees everything")."""

    def gather(self, pool: torch.Tensor, table: list[int], ctx: int) -> torch.Tensor:
        return pool[table].flatten(0, 1)

    def mask(self, scores: torch.Tensor, visible: torch.Tensor, n: int) -> torch.Tensor:
        return scores if n == 1 else super().mask(scores, visible, n)


class AssumesContiguousBlocks(LearnersAttention):
    """The wrong block for a position: as if a sequence's blocks followed each other in the pool."""

    def gather(self, pool: torch.Tensor, table: list[int], ctx: int) -> torch.Tensor:
        first = table[0] * pool.shape[1]
        return pool.flatten(0, 1)[first:first + ctx]


class WrongKVHeads(LearnersAttention):
    def share_kv_heads(self, x: torch.Tensor, group: int) -> torch.Tensor:
        return x.repeat(1, group, 1)  # query head h reads KV head h % n_kv_heads


class WritesIntoLayerZero(LearnersAttention):
    """Writes the new K/V into layer 0's pool as well (a hard-coded layer index left over from testing)."""

    def attend(self, layer_idx, q, k, v):  # type: ignore[no-untyped-def]
        out = super().attend(layer_idx, q, k, v)
        self.pool.k[0].flatten(0, 1)[self.meta.slot_mapping] = k[0]
        self.pool.v[0].flatten(0, 1)[self.meta.slot_mapping] = v[0]
        return out


class ContiguousOnlyInTheEngine(AssumesContiguousBlocks):
    """Right on the checker's float64 pool, wrong on the engine's float32 one: only the engine run sees it."""

    def gather(self, pool: torch.Tensor, table: list[int], ctx: int) -> torch.Tensor:
        if pool.dtype == torch.float64:
            return LearnersAttention.gather(self, pool, table, ctx)
        return super().gather(pool, table, ctx)


def test_the_workloads_exercise_cached_prefixes_and_chunks() -> None:
    cached, chunked = (reference_run(s) for s in workloads())
    assert cached.outcomes["P"].num_cached_tokens == 12
    mixed = [s for s in chunked.steps if len(s.ran) > 1 and max(s.ran.values()) > 1 and min(s.ran.values()) == 1]
    assert mixed, "a chunked step with a prefill chunk beside decodes"


@pytest.mark.parametrize("cls", [TorchAttentionBackend, LearnersAttention], ids=lambda c: c.__name__)
def test_the_checker_passes_labkits_and_a_learners_backend(cls: type[TorchAttentionBackend]) -> None:
    result = check_paged_attention(cls)
    assert result.passed, result.message()


PLANTED: dict[type, str | tuple[str, ...]] = {
    NeverWritesTheNewKV: "after attend they are not there",
    AttendsBeforeWriting: "before* this step's K/V were written",
    ReadsPastTheContext: "the slots past its context length",
    AssumesContiguousBlocks: "one decode, context of 6 tokens",
    WrongKVHeads: "query head h reading KV head h % 2",
    WritesIntoLayerZero: "changed layer 0's pool",
    ContiguousOnlyInTheEngine: ("R0: output token", "in transformers' greedy continuation"),
}


@pytest.mark.parametrize("bug", list(PLANTED), ids=lambda c: c.__name__)
def test_the_checker_fails_planted_bugs_naming_the_case(bug: type[TorchAttentionBackend]) -> None:
    result = check_paged_attention(bug)
    assert result.status == "failed", bug.__name__
    words = PLANTED[bug]
    for word in words if isinstance(words, tuple) else (words,):
        assert word in result.failures[0], result.failures
    assert "Traceback" not in result.message()


def test_a_wrong_output_names_the_sequence_token_and_head() -> None:
    failure = check_paged_attention(AssumesContiguousBlocks).failures[0]
    assert "sequence 0 (context 6, 1 new token), its new token 0 (position 5), head 0" in failure


def test_a_wrong_shape_is_explained() -> None:
    class ReturnsTheWrongShape(LearnersAttention):
        def attend(self, layer_idx, q, k, v):  # type: ignore[no-untyped-def]
            return super().attend(layer_idx, q, k, v)[0]

    assert "shaped (1, N, n_heads, head_dim)" in check_paged_attention(ReturnsTheWrongShape).failures[0]


def test_a_stub_is_not_started_and_falls_back(capsys: pytest.CaptureFixture[str]) -> None:
    class Stub(TorchAttentionBackend):
        def attend(self, layer_idx, q, k, v):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    result = check_paged_attention(Stub)
    assert result.status == "not started"
    assert use_or_reference(result, Stub, TorchAttentionBackend) is TorchAttentionBackend
    assert "uses labkit's reference labkit.core.attention.torch_sdpa.TorchAttentionBackend" in capsys.readouterr().out


def test_the_learners_backend_runs_inside_the_engine(bundled_path) -> None:  # type: ignore[no-untyped-def]
    layers: list[int] = []

    class Spy(LearnersAttention):
        def attend(self, layer_idx, q, k, v):  # type: ignore[no-untyped-def]
            layers.append(layer_idx)
            return super().attend(layer_idx, q, k, v)

    llm = LLM(str(bundled_path), engine="chunked", block_size=4, num_gpu_blocks=16, attention_backend=Spy)
    llm.generate([[1, 5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert layers == [0, 1, 2, 3] * 3  # every layer of every step: the prompt, then two decodes
