"""The pure scheduling rules (labkit.engine.sched.policy) say exactly what the real Scheduler does.

Each test drives a live engine with add_request/step and, before every step, asks the pure rule what
the step should compute; after the step, every sequence must have computed exactly that many tokens,
and the step's StepStats must add up to the plan.
"""

from __future__ import annotations

import random

import pytest

from labkit import LLM, SamplingParams
from labkit.engine.sched.policy import TokenPlan, admit_fcfs, fill_token_budget, planned_tokens, scheduler_state
from labkit.sequence import Sequence


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 2000) for _ in range(n - 1)]


def drive(llm: LLM, arrivals: dict[int, list[tuple[int, int]]], max_steps: int = 400) -> int:
    """Add (prompt_len, max_tokens) requests at the given step numbers; compare plan and step every step.

    Returns how many steps were compared (steps that preempted are skipped: the rules assume none).
    """
    sched = llm.engine.scheduler  # type: ignore[attr-defined]
    seqs: dict[int, Sequence] = {}
    compared = 0
    for step in range(max_steps):
        for k, (prompt_len, max_tokens) in enumerate(arrivals.get(step, [])):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            for seq in llm.add_request(tokens(prompt_len, step * 100 + k), params):
                seqs[seq.seq_id] = seq
        if not llm.engine.has_unfinished_requests():
            if step > max(arrivals):
                break
            continue
        plan = planned_tokens(scheduler_state(sched))
        before = {i: s.num_computed_tokens for i, s in seqs.items() if not s.is_finished}
        preempted_before = sched.num_preemptions
        num_stats = len(llm.engine.step_stats)
        llm.step()
        if sched.num_preemptions != preempted_before:
            continue
        # A sequence that finished this step had computed all but its last token, then gave its blocks back.
        done = {i: (s.num_tokens - 1 if s.is_finished else s.num_computed_tokens) - before[i]
                for i, s in seqs.items() if i in before}
        for seq_id, want in plan.items():
            assert done[seq_id] == want, f"step {step}: seq {seq_id} computed {done[seq_id]} tokens, rule says {want}"
        assert sum(done.values()) == sum(plan.values())
        if sum(plan.values()):
            stats = llm.engine.step_stats[num_stats]
            assert stats.num_computed_tokens == sum(plan.values())
        compared += 1
    assert not llm.engine.has_unfinished_requests()
    return compared


@pytest.fixture(scope="module")
def chunked_llm(bundled_path):  # type: ignore[no-untyped-def]
    def make(**options: object) -> LLM:
        return LLM(str(bundled_path), engine="chunked", device="cpu", **options)
    return make


def test_chunked_constructed_situations(chunked_llm) -> None:  # type: ignore[no-untyped-def]
    llm = chunked_llm(max_num_batched_tokens=32, max_num_seqs=3, block_size=4)
    # A long prompt first, short ones behind it; another long one mid-run; a burst at the end (slots run out).
    arrivals = {0: [(50, 6), (10, 4), (5, 8)], 3: [(70, 3)], 6: [(3, 2), (3, 2), (3, 2), (40, 2)]}
    assert drive(llm, arrivals) >= 10


def test_chunked_first_steps_by_hand(chunked_llm) -> None:  # type: ignore[no-untyped-def]
    llm = chunked_llm(max_num_batched_tokens=32, max_num_seqs=3, block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a, b, c = (llm.add_request(tokens(n, n), params)[0] for n in (50, 10, 5))
    llm.step()  # 32 tokens: the first chunk of a; b and c wait behind it (FCFS)
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (32, 0, 0)
    llm.step()  # a's last 18, then b whole (10), then 4 of c's 5
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (50, 10, 4)
    stats = llm.engine.step_stats[-1]
    assert (stats.num_computed_tokens, stats.num_new_tokens) == (32, 2)
    llm.step()  # decodes of a and b, c's last prompt token (counted as one token to compute, like a decode)
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (51, 11, 5)
    assert fill_token_budget(2, [], [], 32, 1) == TokenPlan([1, 1], [], [])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chunked_random_arrivals(chunked_llm, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    llm = chunked_llm(max_num_batched_tokens=rng.choice([8, 16, 48]), max_num_seqs=rng.randint(2, 4),
                      block_size=rng.choice([4, 16]))
    arrivals: dict[int, list[tuple[int, int]]] = {}
    for _ in range(8):
        arrivals.setdefault(rng.randint(0, 12), []).append((rng.randint(2, 60), rng.randint(1, 5)))
    assert drive(llm, arrivals) >= 5


def test_step_stats_count_the_prefill_tokens(chunked_llm) -> None:  # type: ignore[no-untyped-def]
    llm = chunked_llm(max_num_batched_tokens=32, max_num_seqs=3, block_size=4)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for n in (50, 10, 5):
        llm.add_request(tokens(n, n), params)
    for _ in range(4):
        llm.step()
    # 32 prompt tokens; 18 + 10 + 4; a's and b's last decodes + c's last prompt token; c's last decode
    got = [(s.num_computed_tokens, s.num_prefill_tokens, s.is_prefill) for s in llm.engine.step_stats]
    assert got == [(32, 32, True), (32, 32, True), (3, 1, True), (1, 0, False)]


def test_continuous_admission_with_few_blocks(bundled_path) -> None:
    """Whole-prompt admission limited by budget, slots and KV blocks, as admit_fcfs says."""
    llm = LLM(str(bundled_path), engine="continuous", device="cpu", max_num_batched_tokens=64, max_num_seqs=3,
              block_size=4, num_gpu_blocks=14)
    # Step 0 admits 30 + 16 tokens (8 + 4 blocks); the 8-token prompt fits the budget but not the 2 blocks
    # left. Later the pool runs dry mid-decode: that step preempts (and is skipped), the others compare.
    arrivals = {0: [(30, 4), (16, 2), (8, 4), (6, 2)], 2: [(40, 2), (4, 3)], 5: [(12, 3), (12, 3), (12, 3)]}
    assert drive(llm, arrivals) >= 8
    assert llm.engine.scheduler.num_preemptions >= 1


def test_admit_fcfs_is_a_prefix_and_respects_every_limit() -> None:
    rng = random.Random(3)
    for _ in range(300):
        waiting = [(t, -(-t // 16)) for t in (rng.randint(1, 200) for _ in range(rng.randint(0, 6)))]
        slots, budget, blocks = rng.randint(0, 4), rng.randint(0, 400), rng.randint(0, 30)
        got = admit_fcfs(waiting, slots, budget, blocks)
        assert got == list(range(len(got)))
        assert len(got) <= slots
        assert sum(waiting[i][0] for i in got) <= budget and sum(waiting[i][1] for i in got) <= blocks
        if len(got) < len(waiting) and len(got) < slots:  # it stopped because the next one did not fit
            t, b = waiting[len(got)]
            assert t > budget - sum(waiting[i][0] for i in got) or b > blocks - sum(waiting[i][1] for i in got)


def test_fill_token_budget_never_exceeds_the_budget() -> None:
    rng = random.Random(4)
    for _ in range(300):
        partials = [rng.randint(2, 500) for _ in range(rng.randint(0, 3))]
        waiting = [rng.randint(1, 500) for _ in range(rng.randint(0, 4))]
        budget, slots, decodes = rng.randint(1, 300), rng.randint(0, 4), rng.randint(0, 10)
        plan = fill_token_budget(decodes, partials, waiting, budget, slots)
        assert plan.num_batched_tokens == min(budget, decodes + sum(partials) + sum(waiting[:slots]))
        assert sum(1 for n in plan.waiting if n) <= slots
        assert all(0 <= n <= p for n, p in zip(plan.partials, partials))
