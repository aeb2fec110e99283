"""The Build tasks of notebooks 02, 03 and 05: each checker passes labkit's own part, fails planted bugs typical of
learners (with a message naming the request, step or row), reports a stub as not started, and falls back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from labkit.core.engine.kvcache import KVCacheEngine
from labkit.core.engine.naive import NaiveEngine
from labkit.core.kv.contiguous import ContiguousKVCache
from labkit.core.model.attention import sdpa
from labkit.core.sampler import sample_row
from labkit.core.sched.stop import check_stop
from labkit.core.sequence import Sequence
from labkit.course import CheckResult, use_or_reference
from labkit.course.ch02_naive_generation import check_next_token, check_stop_rule
from labkit.course.ch02_naive_generation.naive_loop import STOP_RULES
from labkit.course.ch03_kv_cache import check_attend
from labkit.course.ch05_static_batching import check_attention_mask, check_prepare_prefill
from labkit.course.harness.runs import reference_run


def subclass(base: type, name: str, **methods: Callable[..., Any]) -> type:
    return type(name, (base,), methods)


def stub(*args: Any) -> Any:
    raise NotImplementedError


def assert_fails(result: CheckResult, *words: str) -> None:
    assert result.status == "failed", result.message()
    assert len(result.failures) == 1 and "Traceback" not in result.failures[0]
    for word in words:
        assert word in result.failures[0], result.failures[0]


def assert_not_started_and_falls_back(result: CheckResult, learner: Any, reference: Any, capsys: Any) -> None:
    assert result.status == "not started"
    assert use_or_reference(result, learner, reference) is reference
    assert "uses labkit's reference" in capsys.readouterr().out


# ---- 02, Task 2: NaiveEngine.next_token ----

def logits_at(engine: NaiveEngine, seq: Sequence, position: int) -> torch.Tensor:
    ids = torch.tensor([seq.token_ids])  # (1, T)
    hidden = engine.model(ids, torch.arange(ids.shape[1])[None])  # (1, T, hidden)
    return engine.model.compute_logits(hidden[:, position])[0]  # (vocab,)


def first_position(self: NaiveEngine, seq: Sequence) -> int:
    return sample_row(logits_at(self, seq, 0), seq.params, seq.generator)


def temperature_ignored(self: NaiveEngine, seq: Sequence) -> int:
    logits = logits_at(self, seq, -1)
    if seq.params.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(logits.softmax(-1), 1, generator=seq.generator))


def always_greedy(self: NaiveEngine, seq: Sequence) -> int:
    return int(logits_at(self, seq, -1).argmax())


def returns_a_tensor(self: NaiveEngine, seq: Sequence) -> Any:
    return logits_at(self, seq, -1).argmax()


def appends_itself(self: NaiveEngine, seq: Sequence) -> int:
    token = int(logits_at(self, seq, -1).argmax())
    seq.output_token_ids.append(token)  # the engine records it itself: appending here too changes the sequence
    return token


def test_next_token_checker_passes_the_reference() -> None:
    assert check_next_token(NaiveEngine).passed


@pytest.mark.parametrize(("bug", "words"), [
    (first_position, ("R0", "output token 0", "transformers")),
    (temperature_ignored, ("S0", "labkit's own engine (the same seed)")),
    (always_greedy, ("every sampled request produced its greedy tokens",)),
    (returns_a_tensor, ("returned a tensor", "engine step 0")),
    (appends_itself, ("changed the sequence", "the engine appends it")),
])
def test_next_token_checker_fails_planted_bugs(bug: Callable[..., Any], words: tuple[str, ...]) -> None:
    assert_fails(check_next_token(subclass(NaiveEngine, "MyEngine", next_token=bug)), *words)


def test_next_token_stub_is_not_started(capsys: pytest.CaptureFixture[str]) -> None:
    learner = subclass(NaiveEngine, "MyEngine", next_token=stub)
    assert_not_started_and_falls_back(check_next_token(learner), learner, NaiveEngine, capsys)


# ---- 02, Task 3: the stop rule, check_stop(seq) ----

def stop_rule(seq: Sequence, off_by_one: bool = False, eos: bool = True, honour_ignore_eos: bool = True,
              strings: bool = True, context: bool = True, stop_ids: bool = True,
              names_the_token: bool = True) -> tuple[str, str | int | None] | None:
    p, token = seq.params, seq.output_token_ids[-1]
    if strings and seq.detokenizer.stop_reason is not None:
        return "stop", seq.detokenizer.stop_reason
    if eos and not (p.ignore_eos and honour_ignore_eos) and token in seq.eos_token_ids:
        return "stop", None
    if stop_ids and token in p.stop_token_ids:
        return "stop", token if names_the_token else None
    if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens + off_by_one:
        return "length", None
    if context and seq.num_tokens >= seq.max_model_len:
        return "length", None
    return None


def test_stop_rule_setup_exercises_every_rule() -> None:
    ref = reference_run(STOP_RULES)  # max_model_len 32
    got = {name: (o.finish_reason, o.stop_reason, len(o.token_ids)) for name, o in ref.outcomes.items()}
    assert got == {"R0": ("length", None, 5), "R1": ("stop", 951, 4), "R2": ("stop", None, 2),
                   "R3": ("length", None, 6), "R4": ("stop", "play", 4), "R5": ("length", None, 20)}
    assert 6 in ref.outcomes["R3"].token_ids[:-1]  # ignore_eos: it went on past an end-of-sequence token


def test_stop_rule_checker_passes_the_reference() -> None:
    assert check_stop_rule(check_stop).passed


@pytest.mark.parametrize(("bug", "words"), [
    ({"off_by_one": True}, ("R0", "expected ('length', None)", "max_tokens 5")),
    ({"eos": False}, ("R2", "end-of-sequence", "ignore_eos is False")),
    ({"honour_ignore_eos": False}, ("R3", "expected None", "ignore_eos is True")),
    ({"strings": False}, ("R4", "stop string 'play'",)),
    ({"context": False}, ("R5", "max_model_len 32")),
    ({"stop_ids": False}, ("R1", "returned None (go on); expected ('stop', 951)", "params.stop_token_ids")),
    ({"names_the_token": False}, ("R1", "returned ('stop', None); expected ('stop', 951)",)),
])
def test_stop_rule_checker_fails_planted_bugs(bug: dict[str, bool], words: tuple[str, ...]) -> None:
    assert_fails(check_stop_rule(lambda seq: stop_rule(seq, **bug)), *words)


def test_stop_rule_checker_reports_a_malformed_answer() -> None:
    assert_fails(check_stop_rule(lambda seq: "stop"), "return None to go on, or a pair")


def test_stop_rule_checker_names_the_line_that_raised() -> None:
    def broken(seq: Sequence) -> None:
        return seq.params.max_token  # type: ignore[attr-defined]  # a typo

    assert_fails(check_stop_rule(broken), "raised AttributeError", "in your broken, line")


def test_stop_rule_stub_is_not_started(capsys: pytest.CaptureFixture[str]) -> None:
    assert_not_started_and_falls_back(check_stop_rule(stub), stub, check_stop, capsys)


# ---- 03, Task 2: ContiguousKVCache.attend ----

def attend_before_writing(self: ContiguousKVCache, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor) -> torch.Tensor:
    end = self.length + q.shape[1]
    keys = self.k[layer_idx][:, :, :end].transpose(1, 2).clone()  # this step's columns not written yet
    values = self.v[layer_idx][:, :, :end].transpose(1, 2).clone()
    out = sdpa(q, keys, values, mask=self.mask, is_causal=False)
    self.write(self.k[layer_idx], k, self.length)
    self.write(self.v[layer_idx], v, self.length)
    return out


def causal_over_the_cache(self: ContiguousKVCache, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor) -> torch.Tensor:
    keys = self.write(self.k[layer_idx], k, self.length)
    values = self.write(self.v[layer_idx], v, self.length)
    return sdpa(q, keys, values, mask=None, is_causal=True)


def no_mask(self: ContiguousKVCache, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> torch.Tensor:
    keys = self.write(self.k[layer_idx], k, self.length)
    values = self.write(self.v[layer_idx], v, self.length)
    return sdpa(q, keys, values, mask=None, is_causal=False)


def only_this_step(self: ContiguousKVCache, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor) -> torch.Tensor:
    self.write(self.k[layer_idx], k, self.length)
    self.write(self.v[layer_idx], v, self.length)
    return sdpa(q, k, v, mask=None, is_causal=True)


def never_written(self: ContiguousKVCache, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    return sdpa(q, k, v, mask=None, is_causal=True)


def advances_the_length(self: ContiguousKVCache, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> torch.Tensor:
    keys = self.write(self.k[layer_idx], k, self.length)
    values = self.write(self.v[layer_idx], v, self.length)
    self.length += q.shape[1]  # the engine advances it once every layer has run (end_step)
    return sdpa(q, keys, values, mask=self.mask, is_causal=False)


def test_attend_checker_passes_the_reference() -> None:
    assert check_attend(ContiguousKVCache).passed


@pytest.mark.parametrize(("bug", "words"), [
    (attend_before_writing, ("its prefill", "layer 0", "write first, then attend")),
    (causal_over_the_cache, ("decode step 1", "is_causal=True")),
    (no_mask, ("its prefill", "no mask")),
    (only_this_step, ("decode step 1", "this step's keys and values only")),
    (never_written, ("do not hold this step's keys",)),
    (advances_the_length, ("its prefill", "changed self.length from 0 to 11", "leave it alone")),
])
def test_attend_checker_fails_planted_bugs(bug: Callable[..., Any], words: tuple[str, ...]) -> None:
    assert_fails(check_attend(subclass(ContiguousKVCache, "MyKVCache", attend=bug)), "R0", *words)


def test_attend_stub_is_not_started(capsys: pytest.CaptureFixture[str]) -> None:
    learner = subclass(ContiguousKVCache, "MyKVCache", attend=stub)
    assert_not_started_and_falls_back(check_attend(learner), learner, ContiguousKVCache, capsys)


# ---- 05, Task 2: KVCacheEngine.prepare_prefill ----

def padded(seqs: list[Sequence], right: bool = False, positions_from_column_0: bool = False,
           all_valid: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cols = max(s.num_prompt_tokens for s in seqs)
    ids = torch.zeros(len(seqs), cols, dtype=torch.long)
    valid = torch.zeros(len(seqs), cols, dtype=torch.bool)
    for i, s in enumerate(seqs):
        where = slice(0, s.num_prompt_tokens) if right else slice(cols - s.num_prompt_tokens, cols)
        ids[i, where] = torch.tensor(s.prompt_token_ids)
        valid[i, where] = True
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    if positions_from_column_0:
        positions = torch.arange(cols).expand(len(seqs), cols).clone()
    if all_valid:
        valid[:] = True
    return ids, positions, valid


def test_prepare_prefill_checker_passes_the_reference() -> None:
    assert check_prepare_prefill(KVCacheEngine).passed


@pytest.mark.parametrize(("bug", "words"), [
    ({"right": True}, ("row 0", "pad on the LEFT")),
    ({"positions_from_column_0": True}, ("row 0", "counted from column 0 of the padded row")),
    ({"all_valid": True}, ("row 0", "attend to padding")),
])
def test_prepare_prefill_checker_fails_planted_bugs(bug: dict[str, bool], words: tuple[str, ...]) -> None:
    learner = subclass(KVCacheEngine, "MyEngine", prepare_prefill=lambda self, seqs: padded(seqs, **bug))
    assert_fails(check_prepare_prefill(learner), "static batches", "R0, R1, R2", *words)


def test_prepare_prefill_stub_is_not_started(capsys: pytest.CaptureFixture[str]) -> None:
    learner = subclass(KVCacheEngine, "MyEngine", prepare_prefill=stub)
    assert_not_started_and_falls_back(check_prepare_prefill(learner), learner, KVCacheEngine, capsys)


# ---- 05, Task 3: ContiguousKVCache.attention_mask ----

def mask(valid: torch.Tensor, start: int, padding: bool = True, causal: bool = True, offset: bool = True,
         itself: bool = True) -> torch.Tensor:
    s = valid.shape[1]
    q_pos = torch.arange(start, s)[:, None] - (0 if offset else start)  # (T, 1)
    k_pos = torch.arange(s)[None, :]  # (1, S)
    allowed = torch.ones(valid.shape[0], 1, s - start, s, dtype=torch.bool)  # (B, 1, T, S)
    if causal:
        allowed = allowed & (k_pos <= q_pos)
    if padding:
        allowed = allowed & valid[:, None, None, :]
    if itself:
        allowed = allowed | (k_pos == torch.arange(start, s)[:, None])
    return allowed


def test_attention_mask_checker_passes_the_reference() -> None:
    assert check_attention_mask(ContiguousKVCache).passed


@pytest.mark.parametrize(("bug", "words"), [
    ({"padding": False}, ("row 0, query in column 2 (a real token)", "columns [0, 1] are padding")),
    ({"causal": False}, ("come after it (the future)",)),
    ({"offset": False}, ("the decode step", "real tokens at or before it")),
    ({"itself": False}, ("(padding) may attend to no column",)),
])
def test_attention_mask_checker_fails_planted_bugs(bug: dict[str, bool], words: tuple[str, ...]) -> None:
    learner = subclass(ContiguousKVCache, "MyCache",
                       attention_mask=lambda self, valid, start: mask(valid, start, **bug))
    assert_fails(check_attention_mask(learner), *words)


def test_attention_mask_checker_checks_it_inside_the_engine_too() -> None:
    # Right on the hand-made steps, wrong once a batch is 16 columns wide: only the engine run can tell.
    def wide_bug(self: ContiguousKVCache, valid: torch.Tensor, start: int) -> torch.Tensor:
        return mask(valid, start, padding=valid.shape[1] < 10)

    assert_fails(check_attention_mask(subclass(ContiguousKVCache, "MyCache", attention_mask=wide_bug)),
                 "static batches", "engine step 0", "are padding")


def test_attention_mask_stub_is_not_started(capsys: pytest.CaptureFixture[str]) -> None:
    learner = subclass(ContiguousKVCache, "MyCache", attention_mask=stub)
    assert_not_started_and_falls_back(check_attention_mask(learner), learner, ContiguousKVCache, capsys)
