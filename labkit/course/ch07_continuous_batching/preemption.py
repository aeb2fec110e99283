"""What is wrong with one preemption, read from a scheduler trial's records (notebook 07, Task 2).

``reserve(seq, n, out)`` must find blocks for ``n`` more tokens of a running request, preempting the newest
running request while the pool is short, but never one this step already scheduled (``out.seqs``) or one a
launched step still computes (``self.in_flight``, async scheduling); if ``seq`` itself gives way, or the newest is
protected, it gives up (returns False). ``preempt(victim)`` recomputes: the victim leaves ``self.running``, its
blocks go back to the pool, it waits again at the head of the queue, and it is counted. Each function here returns
one sentence naming the step, the request, who should have been preempted and what to change, or None.
Notebook 07.
"""

from __future__ import annotations

from labkit.core.kv.block_manager import PoolExhausted
from labkit.core.sequence import SequenceStatus
from labkit.course.harness.scheduler_records import PreemptCall, ReserveCall


def asked(call: ReserveCall) -> str:
    what = "its next token" if call.num_tokens == 1 else f"{call.num_tokens} tokens"
    return f"{call.seq} needed KV blocks for {what} and the pool was short ({call.free_blocks} free)"


def oldest_first(running: list[str]) -> str:
    return f"(running, oldest first: {', '.join(running)})"


def protected(name: str, scheduled: list[str], in_flight: list[str]) -> str | None:
    """Why ``name`` may not be preempted now, or None."""
    if name in scheduled:
        return "this step's batch already holds it (out.seqs)"
    if name in in_flight:
        return "the launched step is still computing it (id(seq) in self.in_flight, async scheduling)"
    return None


def victim_problem(where: str, call: ReserveCall, p: PreemptCall) -> tuple[str, str] | None:
    """Was ``p.victim`` the request to preempt at that moment?"""
    newest = p.running[-1]
    newest_protected = protected(newest, p.scheduled, p.in_flight)
    if newest_protected:
        instead = (f"{'when' if p.victim == newest else 'and'} the newest running request ({newest}) is protected, "
                   f"nobody may be preempted: return False, and {call.seq} waits for the next step")
    elif newest == call.seq:
        instead = (f"the newest running request is {call.seq} itself {oldest_first(p.running)}: it gives way, and "
                   "reserve returns False")
    else:
        instead = f"preempt the newest running request, {newest}, instead {oldest_first(p.running)}"
    why = protected(p.victim, p.scheduled, p.in_flight)
    if why:
        return f"{where}: {asked(call)}; your reserve preempted {p.victim}, but {why}: {instead}", "victim-protected"
    if p.victim != newest:
        oldest = " (the oldest)" if p.victim == p.running[0] else ""
        return (f"{where}: {asked(call)}; your reserve preempted {p.victim}{oldest}: {instead}; admitted last, it "
                "has done the least work", "victim-not-newest")
    return None


def eviction_problem(where: str, p: PreemptCall) -> tuple[str, str] | None:
    """Did ``preempt`` do all a recompute preemption does?"""
    v = p.victim
    if p.still_running:
        return f"{where}: your preempt({v}) left {v} in self.running", "still-running"
    if p.table_after or p.free_after - p.free_before < p.blocks_own:
        return (f"{where}: your preempt({v}) did not give {v}'s {p.blocks_held} KV block(s) back to the pool (free "
                f"blocks: {p.free_before} before, {p.free_after} after)", "blocks-not-freed")
    if p.status_after is not SequenceStatus.WAITING:
        name = getattr(p.status_after, "name", p.status_after)
        return f"{where}: after your preempt({v}) its status is {name}, not WAITING", "status"
    if v not in p.waiting_after:
        return (f"{where}: after your preempt({v}), {v} is in no queue, so it would never run again: put it back "
                "at the head of self.waiting", "not-requeued")
    if p.waiting_after[0] != v:
        return (f"{where}: after your preempt({v}), {v} is at place {p.waiting_after.index(v) + 1} of the waiting "
                f"queue ({', '.join(p.waiting_after)}): it goes back to the head, ahead of every request that "
                "arrived after it", "queue-tail")
    if p.victim_count != 1 or p.scheduler_count != 1:
        return (f"{where}: your preempt({v}) changed seq.num_preemptions by {p.victim_count} and "
                f"self.num_preemptions by {p.scheduler_count}: count each preemption once in both (the engine "
                "reports them, and a step that preempted admits nobody)", "not-counted")
    return None


def reserve_problem(where: str, call: ReserveCall) -> tuple[str, str] | None:
    """What is wrong with one ``reserve`` call and the preemptions it made, and its failure class, or None."""
    if isinstance(call.error, PoolExhausted):
        return (f"{where}: reserving {call.num_tokens} token(s) for {call.seq} ran the pool out of blocks: preempt "
                "while bm.can_allocate(seq, n) is False, and allocate only once it is True", "pool-exhausted")
    if call.error is not None:
        return None  # reported with its line by the run-level checks
    if call.left_running and not call.preempts:
        return (f"{where}: your reserve took {', '.join(call.left_running)} out of the running requests without "
                "calling self.preempt(...): let preempt do it (the engine and its statistics rely on it)",
                "bypass-preempt")
    if call.fit and call.preempts:
        return (f"{where}: {call.seq} needed {call.num_tokens} token(s) of room and the pool had it "
                f"({call.free_blocks} free blocks), yet your reserve preempted {call.preempts[0].victim}: preempt "
                "only while bm.can_allocate(seq, n) is False", "needless-preemption")
    for i, p in enumerate(call.preempts):
        problem = victim_problem(where, call, p) or eviction_problem(where, p)
        if problem:
            return problem
        later = call.preempts[i + 1:]
        if p.victim == call.seq and (later or call.returned is not False):
            went_on = f"preempted {later[0].victim}" if later else f"returned {call.returned!r}"
            return (f"{where}: {call.seq} gave way itself (it was the newest), but your reserve then {went_on}: "
                    "once seq is preempted, return False at once", "went-on")
        if later and p.room_after:
            return (f"{where}: after {p.victim} was preempted the pool had room for {call.seq}, yet your reserve "
                    f"also preempted {later[0].victim}: stop as soon as bm.can_allocate(seq, n) is True",
                    "over-preemption")
    if not isinstance(call.returned, bool):
        return (f"{where}: your reserve returned {call.returned!r}: return True when {call.seq} got its blocks and "
                "joined the step's batch, False when it waits for the next step", "return-value")
    newest = call.running[-1]
    if (not call.fit and not call.preempts and call.returned is False
            and not protected(newest, call.scheduled, call.in_flight)):
        return (f"{where}: {asked(call)}, and your reserve gave up without preempting anyone: the newest running "
                f"request, {newest}, should have given way {oldest_first(call.running)}", "gave-up")
    if call.returned and call.added.get(call.seq) != call.num_tokens:
        return (f"{where}: your reserve returned True but added {call.added or 'nothing'} to the step's batch, not "
                f"{call.seq} with its {call.num_tokens} token(s)", "not-added")
    if not call.returned and call.seq in call.added:
        return f"{where}: your reserve returned False but added {call.seq} to the step's batch anyway", "not-added"
    return None
