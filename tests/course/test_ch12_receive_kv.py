"""Notebook 12's Build task checker (receive_kv) passes labkit's KVReceiver and a learner's correct one, and fails
planted bugs typical of learners with a message naming what to change; an unstarted stub is reported as such."""

from __future__ import annotations

import pytest
import torch

from labkit.core.disagg import KVReceiver
from labkit.core.kv.paged_pool import PagedKVPool
from labkit.core.sched.scheduler import Scheduler
from labkit.core.sequence import Sequence, SequenceStatus
from labkit.course.ch12_disaggregated_prefill import RECEIVE_HINTS, check_receive_kv
from labkit.course.tasks import TASKS


def learner(*, allocate: bool = True, swap_kv: bool = False, drop_last_block: bool = False,
            computed: bool = True, admit: bool = True, extra_block: bool = False) -> type[KVReceiver]:
    """A learner's receive_kv; each keyword plants one bug."""

    class Receiver(KVReceiver):
        def receive_kv(self, scheduler: Scheduler, pool: PagedKVPool, seq: Sequence, kv: torch.Tensor) -> None:
            bm = scheduler.block_manager
            if allocate:
                bm.allocate(seq, seq.num_prompt_tokens)
            if extra_block:
                bm._take_free_block()  # taken outside the block table: never given back
            table = torch.tensor(seq.block_table, dtype=torch.long)
            rows = kv.shape[0] - 1 if drop_last_block else kv.shape[0]
            k_index, v_index = (1, 0) if swap_kv else (0, 1)
            for layer in range(len(pool.k)):
                pool.k[layer][table[:rows]] = kv[:rows, layer, k_index]
                pool.v[layer][table[:rows]] = kv[:rows, layer, v_index]
            if computed:
                seq.num_computed_tokens = seq.num_prompt_tokens
            if admit:
                seq.status = SequenceStatus.RUNNING
                scheduler.running.append(seq)

    return Receiver


def test_the_task_is_listed() -> None:
    task = TASKS["12.receive_kv"]
    assert task.load_checker() is check_receive_kv and task.load_reference() is KVReceiver and task.is_build


@pytest.mark.parametrize("cls", [KVReceiver, learner()], ids=["labkit", "learner"])
def test_passes_correct_receivers(cls: type[KVReceiver]) -> None:
    result = check_receive_kv(cls)
    assert result.passed, result.message()


@pytest.mark.parametrize(("bug", "says", "because"), [
    ({"allocate": False}, "holds 0 block(s)", "blocks"),
    ({"swap_kv": True}, "layer 0's K of request", "layout"),
    ({"drop_last_block": True}, "differs from what was sent, first at token 0 (block 0)", "layout"),
    ({"computed": False}, "num_computed_tokens 0", "computed"),
    ({"admit": False}, "is not in the running batch", "admit"),
    ({"extra_block": True}, "took 2 block(s) from the pool for request 3 (5 prompt tokens), but its block table "
                            "lists 1", "leak"),
])
def test_fails_planted_bugs(bug: dict[str, bool], says: str, because: str) -> None:
    result = check_receive_kv(learner(**bug))
    assert not result.passed
    assert says in " ".join(result.failures), result.message()
    # the failure class's hint, in words, and never the code-level hint unless asked
    assert because in result.because, result.because
    message = result.message()
    assert RECEIVE_HINTS.by_failure[because] in message and RECEIVE_HINTS.code not in message


def test_reports_a_stub_and_a_wrong_class() -> None:
    class Stub(KVReceiver):
        def receive_kv(self, scheduler, pool, seq, kv):  # type: ignore[no-untyped-def]
            raise NotImplementedError

    assert check_receive_kv(Stub).status == "not started"
    wrong = check_receive_kv(int)  # type: ignore[arg-type]
    assert wrong.status == "failed" and "subclass of labkit.core.disagg.KVReceiver" in wrong.failures[0]
