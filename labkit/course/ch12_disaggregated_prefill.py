"""Notebook 12's Build task: the decode side of a KV transfer (``KVReceiver.receive_kv``).

The checker runs the learner's receiver on the very parts the ``disaggregated`` engine's decode worker uses (a
``chunked`` engine's scheduler, block manager and paged pool, here in one process), fed by labkit's own
``PrefillWorker`` (in-process, no link): each prompt is prefilled there, its first token sampled, and the learner's
``receive_kv`` takes the KV in. Then the engine decodes, and the tokens must equal the colocated engine's, with
every block back at the end. The notebook then runs the same class inside the two-process engine
(``LLM(engine="disaggregated", kv_receiver_cls=...)``). Notebook 12.
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


def received_problem(seq: Sequence, kv: torch.Tensor, llm: LLM, used_before: int) -> str | None:
    """What is wrong right after ``receive_kv(scheduler, pool, seq, kv)``, or None."""
    engine = llm.engine
    bm, pool, n = engine.block_manager, engine.pool, seq.num_prompt_tokens
    name = f"request {seq.seq_id} ({n} prompt tokens)"
    if len(seq.block_table) != bm.blocks_needed(n):
        return (f"after your receive_kv, {name} holds {len(seq.block_table)} block(s); its prompt needs "
                f"{bm.blocks_needed(n)} at block_size {bm.block_size}: allocate them with "
                "scheduler.block_manager.allocate(seq, seq.num_prompt_tokens)")
    taken = bm.num_used_blocks - used_before
    if taken != len(seq.block_table):
        return (f"your receive_kv took {taken} block(s) from the pool for {name}, but its block table lists "
                f"{len(seq.block_table)}: take blocks only through block_manager.allocate(seq, ...), so they are in "
                "seq.block_table and go back when the request ends")
    table = torch.tensor(seq.block_table, device=pool.device)
    for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
        for which, got, sent in (("K", k[table], kv[:, layer, 0]), ("V", v[table], kv[:, layer, 1])):
            got = got.flatten(0, 1)[:n]  # (n, n_kv_heads, head_dim) prompt slots
            sent = sent.flatten(0, 1)[:n].to(got.device, got.dtype)  # the KV arrives on the CPU (over gloo)
            if not torch.equal(got, sent):
                bad = int((got != sent).flatten(1).any(1).nonzero()[0])
                return (f"after your receive_kv, layer {layer}'s {which} of {name} differs from what was sent, first "
                        f"at token {bad} (block {bad // bm.block_size}): kv[i, layer, 0] is block i's K and "
                        "kv[i, layer, 1] its V; write them into pool.k[layer] / pool.v[layer] at seq.block_table[i]")
    if seq.num_computed_tokens != n:
        return (f"after your receive_kv, {name} has num_computed_tokens {seq.num_computed_tokens}: its prompt's K/V "
                f"are in the pool now, so set it to seq.num_prompt_tokens ({n}), or the scheduler prefills it again")
    if not any(s is seq for s in engine.scheduler.running) or seq.status is not SequenceStatus.RUNNING:
        return (f"after your receive_kv, {name} is not in the running batch: scheduler.running.append(seq) with "
                "seq.status = SequenceStatus.RUNNING, so the next step decodes it")
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
            check.expect(False, problem)
            return
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    for seq, want in zip(seqs, expected):
        got = seq.output_token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        check.expect(got == want, f"request {seq.seq_id} decoded {got} after your receive_kv; the colocated "
                                  f"engine gives {want} (first difference at output token {first})")
    bm = llm.engine.block_manager
    check.expect(bm.num_free_blocks == bm.num_blocks,
                 f"{bm.num_used_blocks} KV block(s) still in use after every request finished: take blocks only "
                 "through block_manager.allocate(seq, ...), so they are in seq.block_table and go back when the "
                 "request ends")


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

    return run_checker(
        "Task 1 (receive_kv)",
        "bm = scheduler.block_manager; bm.allocate(seq, seq.num_prompt_tokens); table = torch.tensor("
        "seq.block_table); for each layer: pool.k[layer][table] = kv[:, layer, 0] and pool.v[layer][table] = "
        "kv[:, layer, 1]; seq.num_computed_tokens = seq.num_prompt_tokens; seq.status = SequenceStatus.RUNNING; "
        "scheduler.running.append(seq).",
        body,
    )
