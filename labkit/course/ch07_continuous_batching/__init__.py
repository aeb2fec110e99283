"""Checkers for notebook 07 (``07_continuous_batching``).

Task 1 is a ``Scheduler`` subclass that overrides ``Scheduler.schedule_waiting``: the admission rule (first come,
first served while a slot, the token budget and the KV blocks allow; the first request that does not fit stops
admission). The checker runs engine ``continuous`` with the learner's class (``LLM(..., scheduler_cls=...)``) on a
workload whose KV pool is small enough for preemption to happen, then engine ``chunked`` on the same workload (the
rule is the same; a prompt that does not fit whole joins with a chunk, ``num_tokens_to_schedule``, so the rule runs
in notebook 10's capstone too), through the harness (``labkit.course.harness``), and reads every step's admission
(``labkit.course.harness.scheduler_records``): admitted requests are a prefix of the queue, no more than
``max_num_seqs`` run, admissions fit the budget and take what ``num_tokens_to_schedule`` allows (a whole prompt in
``continuous``), and a request left waiting did not fit. Then the run must match labkit's own scheduler and
transformers: the same greedy tokens, the same batch at every step, and no KV block left in use.

Task 2 is a ``Scheduler`` subclass that overrides ``Scheduler.reserve`` and ``Scheduler.preempt``: preemption by
recompute. The checker runs three trials whose pools are small enough for several preemptions (engine
``continuous``, engine ``chunked``, and ``chunked`` with async scheduling, where the launched step's requests are
protected) and reads every ``reserve`` and ``preempt`` call (``labkit.course.ch07_continuous_batching.preemption``): the
victim is the newest running request and never one this step already scheduled or a launched step still computes; it
loses its blocks, waits again at the head of the queue and is counted; preemption stops once there is room. Then every
greedy token must be transformers' (preempted requests included), no block may be left in use, and the
preemptions and every step's batch must be those of labkit's ``Scheduler``.
"""

from __future__ import annotations

from dataclasses import replace

from labkit.core.kv.block_manager import PoolExhausted
from labkit.core.sched.scheduler import Scheduler
from labkit.course import Check, CheckResult, Hints, run_checker
from labkit.course.ch07_continuous_batching.preemption import reserve_problem
from labkit.course.harness.compare import RUN_FAILURES, expect_run
from labkit.course.harness.runs import Request, Setup, TextOfLength, requests_of_lengths
from labkit.course.harness.scheduler_records import WaitingCall, require_scheduler, run_trial, show

# Three slots, a 64-token budget and 12 blocks of 8 tokens: each limit stops admission at some step, a small
# request waits behind a big one, and the pool runs dry mid-generation (preemptions). Then the same in engine
# chunked with a 32-token budget: prompts that do not fit whole join with a chunk.
ADMISSION_TRIAL = Setup(
    "7 requests, each limit in turn",
    requests_of_lengths((24, 12, 0), (20, 8, 0), (30, 10, 0), (8, 6, 0), (36, 4, 0), (12, 10, 0), (6, 3, 0)),
    engine="continuous", max_num_seqs=3, max_num_batched_tokens=64, block_size=8, num_gpu_blocks=12,
)
# The same 20-token prompt three times and another one: admissions meet the prefix cache, whose statistics
# (block_manager.hit_rate) count every admitted prompt once.
PREFIX_TRIAL = Setup(
    "4 requests, 3 sharing a prompt",
    (Request("R0", TextOfLength(20, seed=0), 6), Request("R1", TextOfLength(20, seed=0), 6, arrival_step=2),
     Request("R2", TextOfLength(12, seed=1), 6, arrival_step=2), Request("R3", TextOfLength(20, seed=0), 4,
                                                                            arrival_step=4)),
    engine="continuous", max_num_seqs=3, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=32,
    enable_prefix_caching=True,
)
ADMISSION_TRIALS = (ADMISSION_TRIAL, replace(ADMISSION_TRIAL, engine="chunked", max_num_batched_tokens=32),
                    PREFIX_TRIAL)

ADMISSION_HINTS = Hints(
    concept="Three things limit who may join a step: slots, the token budget and free KV blocks. When the request at "
            "the head of the queue does not fit but a smaller one behind it would, what does letting the smaller one "
            "in do to the big one, step after step?",
    rule="Walk the queue from its head. Admit the head while a slot is free, its tokens for this step (n) are not 0 "
         "and its blocks fit; each admission uses a slot, n tokens of the budget and its blocks, and is counted in "
         "the prefix cache's statistics. Stop at the first request that does not fit: nobody behind it may jump "
         "the queue (first come, first served).",
    code="inside the loop, after n is known: if len(self.running) >= self.max_num_seqs or n == 0 or not "
         "bm.can_allocate(seq, n, cached): break. Else self.waiting.popleft(); copies = bm.allocate(seq, n, cached); "
         "bm.record_prefix_query(seq); self.admit(seq, n, copies, out, now); budget -= n.",
    by_failure={
        **RUN_FAILURES,
        "pool-exhausted": "ask the block manager whether the blocks are free before taking them, and stop if not",
        "queue-jump": "first come, first served: the first request that does not fit stops admission for this step",
        "slots": "a step never runs more requests than there are slots (max_num_seqs)",
        "budget": "each admission must fit what is left of the step's token budget, and uses it up",
        "whole-prompt": "engine continuous prefills a prompt whole; the number of tokens a request may compute this "
                        "step is what num_tokens_to_schedule says, in either engine",
        "left-waiting": "admit while the head of the queue fits: a slot, the budget and its blocks",
    },
)

PREEMPTION_HINTS = Hints(
    concept="The pool ran dry while requests decode. Somebody must give back their blocks and redo their work later. "
            "Which running request loses the least if it is recomputed, and which requests may not be touched "
            "because their blocks are being written right now?",
    rule="While the blocks for seq are missing, preempt the request admitted last (it has done the least work), "
         "unless it is protected (already in this step's batch, or in a launched step still computing): then give "
         "up. If seq itself was the one to go, give up too. Stop preempting as soon as there is room, then schedule "
         "seq. A preempted request leaves the running list, returns every block, waits again at the head of the "
         "queue (it arrived before everyone behind it) and is counted.",
    code="reserve: while not bm.can_allocate(seq, n): victim = self.running[-1]; if victim in out.seqs or "
         "id(victim) in self.in_flight: return False; self.preempt(victim); if victim is seq: return False. Then "
         "out.add(seq, n, bm.allocate(seq, n)); return True. preempt: self.running.remove(seq); "
         "self.block_manager.free(seq); seq.status = SequenceStatus.WAITING; seq.num_preemptions += 1; "
         "self.num_preemptions += 1; self.waiting.appendleft(seq).",
    by_failure={
        **RUN_FAILURES,
        "pool-exhausted": "take blocks only once the block manager says they are free; preempt until it does",
        "bypass-preempt": "every preemption goes through preempt, which the engine and its statistics rely on",
        "needless-preemption": "preempt only while the pool is short of blocks for seq",
        "victim-not-newest": "the request admitted last has done the least work: recomputing it wastes the least",
        "victim-protected": "a request in this step's batch, or in a launched step, has blocks being written: when "
                            "the newest is protected nobody may be preempted, and seq waits",
        "still-running": "a preempted request no longer runs",
        "blocks-not-freed": "a preempted request gives every block back to the pool",
        "status": "a preempted request is waiting again",
        "not-requeued": "a preempted request must be in the waiting queue, or it never runs again",
        "queue-tail": "a preempted request arrived before everyone now waiting: it goes back to the head",
        "not-counted": "count each preemption once, for the request and for the scheduler",
        "went-on": "once seq itself gave way there is nothing left to reserve for it",
        "over-preemption": "stop preempting as soon as seq fits",
        "return-value": "reserve answers one question: did seq get its blocks and join this step (True) or not",
        "gave-up": "when the pool is short and the newest request is not protected, somebody must give way",
        "not-added": "a request that got its blocks joins this step's batch with its n tokens",
    },
)


def admission_problem(step: int, call: WaitingCall, max_num_seqs: int,
                      chunked: bool = False) -> tuple[str, str] | None:
    """What is wrong with one ``schedule_waiting`` call (in engine ``chunked`` if ``chunked``) and its failure class,
    or None."""
    queue = [name for name, _, _ in call.queue]
    admitted = list(call.admitted)
    if isinstance(call.error, PoolExhausted):
        name, num_new, blocks = next(entry for entry in call.queue if entry[0] not in call.admitted)
        return (f"step {step}: admitting {name} ({num_new} tokens, {blocks} KV blocks) ran the pool out of blocks "
                f"({call.free_blocks} were free before this step's admissions): ask "
                "bm.can_allocate(seq, num_new, cached) before allocating, and stop if it says no", "pool-exhausted")
    if call.error is not None:
        return None  # any other error is reported as such, with its line
    if admitted != queue[: len(admitted)]:
        jumped = next(name for name in admitted if name not in queue[: len(admitted)])
        skipped = next(name for name in queue[: len(admitted)] if name not in admitted)
        return (f"step {step}: {jumped} was admitted while {skipped}, ahead of it in the queue {queue}, kept waiting: "
                "first come, first served stops at the first request that does not fit", "queue-jump")
    if call.num_running_after > max_num_seqs:
        return (f"step {step}: {call.num_running_after} requests were running after admission, more than "
                f"max_num_seqs = {max_num_seqs} ({call.free_slots} slot(s) were free and you admitted "
                f"{', '.join(admitted)}): admit only while a slot is free", "slots")
    used = sum(call.admitted.values())
    if used > call.budget:
        return (f"step {step}: you admitted {show(call.admitted)} (request: tokens) = {used} tokens, but only "
                f"{call.budget} of the step's budget were left", "budget")
    left = call.budget
    for (name, num_new, _), n in zip(call.queue, call.admitted.values()):
        if not chunked and n != num_new:
            return (f"step {step}: {name} was admitted with {n} of the {num_new} tokens it must compute: engine "
                    "continuous prefills a prompt whole (if it does not fit the budget, it waits)", "whole-prompt")
        if chunked and n != min(num_new, left):
            return (f"step {step}: {name} was admitted with {n} of the {num_new} tokens it must compute, with {left} "
                    f"of the budget left: engine chunked gives it min(tokens, budget left) = {min(num_new, left)}; "
                    "n = self.num_tokens_to_schedule(num_new, budget) says how many, in either engine", "whole-prompt")
        left -= n
    if call.head_fit is not None:
        name, num_new, n, blocks = call.head_fit
        room = (f"{max_num_seqs - call.num_running_after} slot(s), {call.budget_left} tokens of budget and "
                f"{call.free_blocks_left} free blocks were left")
        if n < num_new:  # engine chunked: a chunk would have joined
            return (f"step {step}: {name} ({num_new} tokens to compute) was left waiting although a {n}-token chunk of "
                    f"it ({blocks} KV blocks) fit: {room}. In engine chunked a prompt that does not fit whole joins "
                    "with a chunk: n = self.num_tokens_to_schedule(num_new, budget)", "left-waiting")
        return (f"step {step}: {name} ({num_new} tokens, {blocks} KV blocks) was left waiting although it fit: {room}. "
                "Admit while a slot, the budget and the blocks allow", "left-waiting")
    return None


def check_schedule_waiting(cls: type[Scheduler], model: str = "labkit-tiny") -> CheckResult:
    """Task 1: ``cls`` (a ``Scheduler`` subclass) admits waiting requests as ``continuous`` and ``chunked`` must."""

    def body(check: Check) -> None:
        for setup in ADMISSION_TRIALS:
            trial = run_trial(require_scheduler(cls), setup, model)
            chunked = setup.engine == "chunked"
            for plan in trial.plans:
                problem = plan.waiting and admission_problem(plan.step, plan.waiting, setup.max_num_seqs, chunked)
                if problem:
                    text, because = problem
                    check.expect(False, f"engine chunked, {text}" if chunked else text, because=because)
                    return
            if not expect_run(check, trial.run, model, "schedule_waiting", "labkit's scheduler"):
                return

    return run_checker("Task 1 (schedule_waiting)", "", body, task_id="07.schedule_waiting")


# (prompt tokens, output tokens, arrival step), R0, R1, ... in order of arrival. Blocks of 4 tokens in pools of 14-15:
# requests outgrow the pool while they decode. Each trial preempts 4-5 times, the newest request giving way both
# to an older one and to itself; chunked recomputes in chunks; with async scheduling the launched step's requests
# are protected (reserve then gives up) several times.
PREEMPTION_TRIALS = (
    Setup("6 requests outgrowing the pool",
          requests_of_lengths((5, 11, 0), (18, 9, 0), (6, 17, 0), (11, 16, 3), (23, 17, 3), (15, 12, 3)),
          engine="continuous", max_num_seqs=4, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=14),
    Setup("6 requests outgrowing the pool",
          requests_of_lengths((14, 15, 0), (12, 15, 0), (4, 13, 0), (24, 15, 0), (15, 17, 3), (22, 8, 3)),
          engine="chunked", max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_gpu_blocks=14),
    Setup("6 requests outgrowing the pool",
          requests_of_lengths((11, 10, 0), (19, 12, 0), (21, 12, 0), (13, 16, 0), (17, 14, 2), (13, 17, 3)),
          engine="chunked", max_num_seqs=4, max_num_batched_tokens=48, block_size=4, num_gpu_blocks=15,
          async_scheduling=True),
)


def check_preemption(cls: type[Scheduler], model: str = "labkit-tiny") -> CheckResult:
    """Task 2: ``cls`` (a ``Scheduler`` subclass) preempts by recompute as labkit's engines must."""

    def body(check: Check) -> None:
        cls_ = require_scheduler(cls)
        for setup in PREEMPTION_TRIALS:
            trial = run_trial(cls_, setup, model)
            mode = " (async scheduling)" if setup.async_scheduling else ""
            for plan in trial.plans:
                for call in plan.reserves:
                    problem = reserve_problem(f"engine {setup.engine}{mode}, step {plan.step}", call)
                    if problem:
                        text, because = problem
                        check.expect(False, text, because=because)
                        return
            if not expect_run(check, trial.run, model, "reserve/preempt", "labkit's scheduler"):
                return

    return run_checker("Task 2 (preemption by recompute)", "", body, task_id="07.preempt")
