"""Notebook 12's Build tasks: the decode side of a KV transfer (``KVReceiver.receive_kv``), and the decision the
chapter teaches, the placement search (``choose_placement``: which unit of prefill and decode workers gives the most
goodput per device under the SLOs).

The checker runs the learner's receiver on the very parts the ``disaggregated`` engine's decode worker uses (a
``chunked`` engine's scheduler, block manager and paged pool, here in one process), fed by labkit's own
``PrefillWorker`` (in-process, no link): each prompt is prefilled there, its first token sampled, and the learner's
``receive_kv`` takes the KV in. Then the engine decodes, and the tokens must equal the colocated engine's, with
every block back at the end. The notebook then runs the same class inside the two-process engine
(``LLM(engine="disaggregated", kv_receiver_cls=...)``).

The placement checker gives the learner's search goodput tables (DistServe's goodput of each unit), each built so
that one mistake picks the wrong unit: a cluster where colocation wins, one where a smaller unit beats the full one
per device, a tie, and units that do not exist (no decode worker, more devices than there are); the failure names
the mistake. The notebook then runs the search on the simulator. Notebook 12.
"""

from __future__ import annotations

import os
import time

import torch

from labkit.core.disagg.prefill_worker import PrefillRequest, PrefillWorker, PrefillWorkerSpec
from labkit.core.disagg.receive import KVReceiver
from labkit.core.llm import LLM
from labkit.core.sampler import sample
from labkit.core.sampling_params import SamplingParams
from labkit.core.sched.stop import append_token
from labkit.core.sequence import Sequence, SequenceStatus
from labkit.course import Check, CheckResult, run_checker
from labkit.course.hints import Hints

RECEIVE_HINTS = Hints(
    concept=("The request arrives with its prompt's KV as a buffer of blocks. What does the decode worker need "
             "before its next step can decode it: where do the K/V go, and how does the scheduler learn the prompt "
             "is done?"),
    rule=("Allocate the prompt's blocks with the worker's block manager (its own ids); write each layer's K and V "
          "from the buffer into those blocks of the pool; mark the prompt as computed, the request RUNNING, and "
          "add it to the scheduler's running list."),
    code=("bm = scheduler.block_manager; bm.allocate(seq, seq.num_prompt_tokens); table = torch.tensor("
          "seq.block_table); for each layer: pool.k[layer][table] = kv[:, layer, 0] and pool.v[layer][table] = "
          "kv[:, layer, 1]; seq.num_computed_tokens = seq.num_prompt_tokens; seq.status = SequenceStatus.RUNNING; "
          "scheduler.running.append(seq)."),
    by_failure={
        "blocks": ("The prompt's KV needs as many blocks as its tokens fill at the pool's block size, and they must be "
                   "the request's own (in its block table), or they never go back."),
        "layout": ("Row i of the buffer is the prompt's block i; for each layer, index 0 is K and index 1 is V. Where "
                   "in the pool does block i of this request live now?"),
        "computed": "Once the prompt's K/V are in the pool, how does the scheduler know not to prefill it again?",
        "admit": "Which list does the scheduler decode from at its next step, and what status do its requests have?",
        "tokens": ("The decoded tokens differ although the checks right after receive_kv passed: is the K/V written at "
                   "the right positions inside each block?"),
        "leak": "Every block a request takes must be in its block table, so that finishing the request frees it.",
    },
)
PLACEMENT_HINTS = Hints(
    concept=("Replicas of a unit add up: a unit that serves 8 req/s on 2 devices, copied twice, serves 16 on 4. So "
             "what should the search compare between units of different sizes? And which units exist at all?"),
    rule=("Consider every unit that fits: n colocated engines (P = 0) for n = 1..N, and P prefill with D decode "
          "workers, P >= 1, D >= 1, P + D <= N; score each by its goodput divided by its devices; keep the best, "
          "and on a tie the one with fewer devices."),
    code=("best = None; for n in 1..N: candidates (0, n); for total in 2..N, for P in 1..total-1: (P, total - P); "
          "key = (goodput(P, D) / (P + D), -(P + D)); return the (P, D) with the largest key."),
    by_failure={
        "colocated": "Colocation is a placement too: (0, n) means n colocated engines.",
        "per-device": "Compare units by goodput per device: a smaller unit can be replicated.",
        "invalid": "A unit needs at least one decode worker and at most the devices available.",
        "tie": "On a tie per device, the smaller unit is cheaper to replicate.",
        "returns": "Return a tuple (P, D) of two ints.",
    },
)
BLOCK_SIZE = 8
PROMPT_LENS = (5, 16, 23)  # under a block, exactly two blocks, a partial third
MAX_TOKENS = 6


def local_prefill_worker(llm: LLM, block_size: int) -> PrefillWorker:
    """labkit's prefill worker in this process, on ``llm``'s weights (the checker needs no second process)."""
    model = llm.model
    spec = PrefillWorkerSpec(model.config, model.state_dict(), model.dtype, str(model.device), block_size,
                             llm.max_model_len, "torch", 0, 60.0, None, os.getpid())
    return PrefillWorker(spec, link=None)  # type: ignore[arg-type]  # prefill() never touches the link


def require_receiver(cls: object) -> type[KVReceiver]:
    if not (isinstance(cls, type) and issubclass(cls, KVReceiver)):
        raise TypeError(f"expected a subclass of labkit.core.disagg.KVReceiver (class MyReceiver(KVReceiver): ...), "
                        f"got {cls!r}")
    return cls


def received_problem(seq: Sequence, kv: torch.Tensor, llm: LLM, used_before: int) -> tuple[str, str] | None:
    """What is wrong right after ``receive_kv(scheduler, pool, seq, kv)`` and its failure class, or None."""
    engine = llm.engine
    bm, pool, n = engine.block_manager, engine.pool, seq.num_prompt_tokens
    name = f"request {seq.seq_id} ({n} prompt tokens)"
    if len(seq.block_table) != bm.blocks_needed(n):
        return (f"after your receive_kv, {name} holds {len(seq.block_table)} block(s); its prompt needs "
                f"{bm.blocks_needed(n)} at block_size {bm.block_size}: allocate them with "
                "scheduler.block_manager.allocate(seq, seq.num_prompt_tokens)", "blocks")
    taken = bm.num_used_blocks - used_before
    if taken != len(seq.block_table):
        return (f"your receive_kv took {taken} block(s) from the pool for {name}, but its block table lists "
                f"{len(seq.block_table)}: take blocks only through block_manager.allocate(seq, ...), so they are in "
                "seq.block_table and go back when the request ends", "leak")
    table = torch.tensor(seq.block_table, device=pool.device)
    for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
        for which, got, sent in (("K", k[table], kv[:, layer, 0]), ("V", v[table], kv[:, layer, 1])):
            got = got.flatten(0, 1)[:n]  # (n, n_kv_heads, head_dim) prompt slots
            sent = sent.flatten(0, 1)[:n].to(got.device, got.dtype)  # the KV arrives on the CPU (over gloo)
            if not torch.equal(got, sent):
                bad = int((got != sent).flatten(1).any(1).nonzero()[0])
                return (f"after your receive_kv, layer {layer}'s {which} of {name} differs from what was sent, first "
                        f"at token {bad} (block {bad // bm.block_size}): kv[i, layer, 0] is block i's K and "
                        "kv[i, layer, 1] its V; write them into pool.k[layer] / pool.v[layer] at seq.block_table[i]",
                        "layout")
    if seq.num_computed_tokens != n:
        return (f"after your receive_kv, {name} has num_computed_tokens {seq.num_computed_tokens}: its prompt's K/V "
                f"are in the pool now, so set it to seq.num_prompt_tokens ({n}), or the scheduler prefills it again",
                "computed")
    if not any(s is seq for s in engine.scheduler.running) or seq.status is not SequenceStatus.RUNNING:
        return (f"after your receive_kv, {name} is not in the running batch: scheduler.running.append(seq) with "
                "seq.status = SequenceStatus.RUNNING, so the next step decodes it", "admit")
    return None


def decode_and_compare(check: Check, receiver: KVReceiver, worker: PrefillWorker, llm: LLM, seqs: list[Sequence],
                       expected: list[list[int]]) -> None:
    """Prefill each request, receive it with the learner's code, decode them all, compare and count the blocks."""
    for seq in seqs:
        kv, logits = worker.prefill(PrefillRequest(seq.seq_id, seq.prompt_token_ids))
        append_token(seq, sample(logits[None], [seq.params], [seq.generator])[0], time.perf_counter())
        used_before = llm.engine.block_manager.num_used_blocks
        receiver.receive_kv(llm.engine.scheduler, llm.engine.pool, seq, kv)
        problem = received_problem(seq, kv, llm, used_before)
        if problem:
            check.expect(False, problem[0], because=problem[1])
            return
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    for seq, want in zip(seqs, expected):
        got = seq.output_token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        check.expect(got == want, f"request {seq.seq_id} decoded {got} after your receive_kv; the colocated "
                                  f"engine gives {want} (first difference at output token {first})", because="tokens")
    bm = llm.engine.block_manager
    check.expect(bm.num_free_blocks == bm.num_blocks,
                 f"{bm.num_used_blocks} KV block(s) still in use after every request finished: take blocks only "
                 "through block_manager.allocate(seq, ...), so they are in seq.block_table and go back when the "
                 "request ends", because="leak")


def release(llm: LLM, seqs: list[Sequence]) -> None:
    """Take the trial's requests out of the throwaway engine, whatever the learner's code left behind. Blocks it took
    outside any block table (a leak, reported above) cannot be traced: the engine's books start over."""
    for seq in seqs:
        llm.engine.scheduler.finish_request(seq)
    bm = llm.engine.block_manager
    if bm.num_free_blocks != bm.num_blocks:
        bm.__init__(bm.num_blocks, bm.block_size, bm.enable_prefix_caching)  # type: ignore[misc]


def check_receive_kv(cls: type[KVReceiver], model: str = "labkit-tiny") -> CheckResult:
    """Task 1: ``cls.receive_kv`` takes a transferred prompt into the decode pool and admits it."""

    def body(check: Check) -> None:
        receiver = require_receiver(cls)()
        with LLM(model, engine="chunked", block_size=BLOCK_SIZE, num_gpu_blocks=64, debug_checks=True) as llm:
            prompts = [[1] + [20 + (7 * i + j) % 200 for j in range(n - 1)] for i, n in enumerate(PROMPT_LENS)]
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            worker = local_prefill_worker(llm, BLOCK_SIZE)
            groups = llm.input_processor.make_sequences(prompts, [params] * len(prompts))
            try:
                decode_and_compare(check, receiver, worker, llm, [seq for (seq,) in groups], expected)
            finally:
                release(llm, [seq for (seq,) in groups])

    return run_checker("", "", body, task_id="12.receive_kv")


def table(colocated: list[float], split: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """A goodput table: colocated[n - 1] is (0, n)'s goodput, ``split`` the (P, D) units'."""
    return {**{(0, n + 1): g for n, g in enumerate(colocated)}, **split}


# Scenarios for four devices, smallest idea first; each names the mistake that picks the wrong unit.
PLACEMENT_SCENARIOS = (
    ("long prompts, tight TPOT: the 2P:2D split is best", table(
        [2.0, 4.0, 6.0, 8.0], {(1, 1): 5.0, (1, 2): 6.0, (2, 1): 4.0, (1, 3): 9.0, (2, 2): 12.0, (3, 1): 8.0}), ""),
    ("short prompts: four colocated engines are best", table(
        [3.0, 6.0, 9.0, 12.4], {(1, 1): 4.0, (1, 2): 6.5, (2, 1): 5.0, (1, 3): 9.0, (2, 2): 10.0, (3, 1): 7.0}),
     "colocated"),
    ("a 1P:1D unit beats the whole cluster per device", table(
        [2.0, 4.0, 6.0, 8.0], {(1, 1): 8.0, (1, 2): 9.0, (2, 1): 7.0, (1, 3): 12.0, (2, 2): 14.0, (3, 1): 9.0}),
     "per-device"),
    ("colocation scales exactly linearly: every colocated unit ties at 3 req/s per device", table(
        [3.0, 6.0, 9.0, 12.0], {(1, 1): 5.0, (1, 2): 7.5, (2, 1): 6.0, (1, 3): 10.0, (2, 2): 11.0, (3, 1): 8.0}),
     "tie"),
)


def placement_problem(fn: object, what: str, goodputs: dict[tuple[int, int], float]) -> tuple[str, str] | None:
    """Run the learner's search on one table; (the failure, its class) or None."""
    asked: list[tuple[int, int]] = []

    def goodput(num_prefill: int, num_decode: int) -> float:
        asked.append((num_prefill, num_decode))
        if num_decode < 1 or num_prefill < 0 or num_prefill + num_decode > 4:
            raise ValueError(f"there is no unit ({num_prefill}, {num_decode}) on 4 devices: a unit needs a decode "
                             "worker (D >= 1), P >= 0, and at most 4 devices")
        return goodputs[(num_prefill, num_decode)]

    try:
        got = fn(4, goodput)  # type: ignore[operator]
    except ValueError as exc:
        if "there is no unit" in str(exc):
            return f"{what}: you asked for the goodput of unit {asked[-1]}: {exc}", "invalid"
        raise
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(x, int) for x in got)):
        return f"{what}: choose_placement must return a tuple (P, D) of two ints, got {got!r}", "returns"
    from labkit.measure.sim.placement import choose_placement

    want = choose_placement(4, lambda num_prefill, num_decode: goodputs[(num_prefill, num_decode)])
    if got == want:
        return None
    if got not in goodputs:
        return f"{what}: you chose {got}, which is not a unit of at most 4 devices with a decode worker", "invalid"
    per = {u: g / sum(u) for u, g in goodputs.items()}
    said = (f"{what}: you chose {got}, {goodputs[got]:g} req/s on {sum(got)} devices ({per[got]:.2f} per device); "
            f"{want} serves {goodputs[want]:g} req/s on {sum(want)} ({per[want]:.2f} per device)")
    if want[0] == 0 and not any(u[0] == 0 for u in asked):
        return said + ": you never looked at colocated units (P = 0)", "colocated"
    if per[got] < per[want] and goodputs[got] >= goodputs[want]:
        return said + (f": more req/s in total, fewer per device; {4 // sum(want)} replicas of {want} would serve "
                       f"{goodputs[want] * (4 // sum(want)):g} req/s on the same devices"), "per-device"
    if per[got] == per[want]:
        return said + ": a tie per device; the smaller unit is cheaper to replicate", "tie"
    return said, "per-device"


def check_placement(fn: object) -> CheckResult:
    """Task 2: ``fn(max_devices, goodput)`` returns the unit with the most goodput per device."""

    def body(check: Check) -> None:
        if not callable(fn):
            check.expect(False, f"expected a function choose_placement(max_devices, goodput), got {fn!r}")
            return
        for what, goodputs, _mistake in PLACEMENT_SCENARIOS:
            problem = placement_problem(fn, what, goodputs)
            if problem is not None:
                check.expect(False, problem[0], because=problem[1])
                return

    return run_checker("", "", body, task_id="12.placement")
