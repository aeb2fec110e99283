"""The scheduler on its own, driven by hand (no model, no engine): admission, the token budget, preemption by
recompute, the static batch, forking rules for parallel samples, and ``update_from_output`` (tokens appended, the
stop rule, finished requests leave and give their blocks back)."""

from __future__ import annotations

from bare_sequences import make_seq

from labkit.core.kv.block_manager import BlockManager
from labkit.core.sampling_params import SamplingParams
from labkit.core.sched.output import ModelRunnerOutput, SchedulerOutput
from labkit.core.sched.scheduler import Scheduler
from labkit.core.sched.static import StaticScheduler
from labkit.core.sched.stop import check_stop
from labkit.core.sequence import FinishReason, Sequence, SequenceStatus

BLOCK = 4


def request(seq_id: int, prompt_len: int, max_tokens: int = 8, **params: object) -> Sequence:
    seq = make_seq(seq_id, list(range(1, prompt_len + 1)))
    seq.params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params)  # type: ignore
    return seq


def scheduler(num_blocks: int = 16, max_num_seqs: int = 4, budget: int = 64, chunked: bool = False,
              cls: type[Scheduler] = Scheduler) -> Scheduler:
    return cls(BlockManager(num_blocks, BLOCK), max_num_seqs, budget, chunked)


def run_step(sched: Scheduler, token: int = 7, now: float = 1.0) -> tuple[SchedulerOutput, list[Sequence]]:
    """Schedule one step and hand every caught-up sequence one token, as the model runner would."""
    out = sched.schedule(now)
    samplers = [s for s, n in zip(out.seqs, out.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
    stepped = sched.update_from_output(out, ModelRunnerOutput(samplers, [[token] for _ in samplers]), now)
    return out, stepped


def test_admission_is_fcfs_within_slots_and_budget() -> None:
    sched = scheduler(max_num_seqs=2, budget=20)
    seqs = [request(i, 8) for i in range(3)]
    for s in seqs:
        sched.add_request(s)
    out = sched.schedule(0.0)
    assert out.seqs == seqs[:2] and out.num_new_tokens == [8, 8]  # the third waits: two slots
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING]
    assert all(s.metrics.first_scheduled_time == 0.0 for s in seqs[:2])


def test_a_prompt_larger_than_the_budget_waits_whole_or_joins_in_chunks() -> None:
    whole, chunked = scheduler(budget=10), scheduler(budget=10, chunked=True)
    for sched in (whole, chunked):
        sched.add_request(request(0, 6))
        sched.add_request(request(1, 8))
    assert whole.schedule(0.0).num_new_tokens == [6]  # 8 more would exceed 10: head-of-line, whole prompts only
    assert chunked.schedule(0.0).num_new_tokens == [6, 4]  # the rest of the budget as a chunk


def test_decodes_come_first_then_prefill_chunks_within_the_budget() -> None:
    sched = scheduler(budget=8, chunked=True)
    first = request(0, 4)
    sched.add_request(first)
    run_step(sched)  # prefilled, one token: now a decode
    sched.add_request(request(1, 20))
    out = sched.schedule(0.0)
    assert out.seqs[0] is first and out.num_new_tokens == [1, 7]


def test_update_from_output_moves_on_appends_and_finishes() -> None:
    sched = scheduler()
    a, b = request(0, 5, max_tokens=1), request(1, 5, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    out, stepped = run_step(sched, token=9, now=2.0)
    assert stepped == [a, b] and a.output_token_ids == [9] and b.num_computed_tokens == 5
    assert a.is_finished and a.finish_reason == FinishReason.LENGTH and a.metrics.finished_time == 2.0
    assert a not in sched.running and not a.block_table  # it left and gave its blocks back
    assert b in sched.running and not b.is_finished
    assert sched.block_manager.num_used_blocks == 2


def test_a_stop_mid_way_drops_the_remaining_proposed_tokens() -> None:
    sched = scheduler()
    seq = request(0, 5, max_tokens=10, stop_token_ids=[42])
    sched.add_request(seq)
    out = sched.schedule(0.0)
    output = ModelRunnerOutput([seq], [[3, 42, 5]])  # the stop token is the second of three
    assert sched.update_from_output(out, output, 1.0) == [seq]
    assert seq.output_token_ids == [3, 42] and output.sampled_token_ids == [[3, 42]]
    assert seq.finish_reason == FinishReason.STOP and seq.stop_reason == 42 and check_stop(seq) is not None


def test_preemption_recomputes_the_newest_request() -> None:
    sched = scheduler(num_blocks=4, budget=64)  # 16 slots: two 8-token prompts fit, growing they will not
    old, new = request(0, 8, max_tokens=8), request(1, 8, max_tokens=8)
    sched.add_request(old)
    sched.add_request(new)
    run_step(sched)
    assert sched.block_manager.num_free_blocks == 0
    out, _ = run_step(sched)  # both need a new block; only the older keeps its place
    assert out.seqs == [old] and sched.num_preemptions == 1 and new.num_preemptions == 1
    assert list(sched.waiting) == [new] and new.status == SequenceStatus.WAITING and not new.block_table
    assert new.num_computed_tokens == 0  # its K/V are recomputed when it is admitted again


def test_the_static_scheduler_refills_only_when_the_whole_batch_is_done() -> None:
    sched = scheduler(max_num_seqs=2, cls=StaticScheduler)
    short, long, late = request(0, 4, max_tokens=1), request(1, 4, max_tokens=3), request(2, 4)
    for s in (short, long, late):
        sched.add_request(s)
    out, _ = run_step(sched)
    assert out.seqs == [short, long] and short.is_finished
    out, _ = run_step(sched)
    assert out.seqs == [long] and out.num_idle_slots == 1  # the finished row keeps its slot
    run_step(sched)
    assert long.is_finished and late.status == SequenceStatus.WAITING
    out, _ = run_step(sched)
    assert out.seqs == [late]


def test_a_parallel_sample_forks_once_its_parents_prompt_is_computed() -> None:
    sched = scheduler()
    parent, child = request(0, 9), request(1, 9)
    child.parent = parent
    assert not sched.can_fork(child)  # the parent holds no blocks yet
    sched.add_request(parent)
    sched.add_request(child)
    out = sched.schedule(0.0)
    assert out.seqs == [parent] and sched.waits_for_parent(child)  # prefilled this step: share its blocks next step
    sched.update_from_output(out, ModelRunnerOutput([parent], [[5]]), 1.0)
    assert sched.can_fork(child)
    out = sched.schedule(1.0)
    assert child in out.seqs and child.block_table[:2] == parent.block_table[:2]  # the full prompt blocks, shared
