"""Every task of the workbook, in one list: ``TASKS`` maps a task id (``"07.schedule_waiting"``) to its notebook,
the labkit symbol it builds, its checker and labkit's reference.

The tests of the checkers, the answer key (``scripts/make_answer_key.py``) and the guides' task tables are
generated from, or checked against, this list. Names are dotted paths, resolved only when used, so importing
the list is cheap. *Build* tasks are the chapter's core component, written by the learner and run inside the real
engine (a subclass passed with ``scheduler_cls=``, ``block_manager_cls=``, ``attention_backend=``,
``kv_cache_cls=`` or ``engine=``); the others are smaller exercises that still teach one formula or rule.
Introduced in notebook 00 (``00_setup_and_hardware``).
"""

from __future__ import annotations

import pkgutil
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    """One task: where it is taught, what it builds, how it is checked, what it falls back to. Notebook 00."""

    id: str  # "NN.name"
    notebook: str  # e.g. "07_continuous_batching"
    title: str
    symbol: str  # the labkit function, or Class.method, the learner writes
    checker: str  # dotted name of the checker the notebook's check cell calls
    reference: str  # dotted name of labkit's own function or class (what the notebook falls back to)
    minutes: int  # expected time for a learner, from reading the task to a passing check
    runs_inside: str = ""  # the engine(s) the learner's code runs in ("" for a function checked on its own)
    catches: tuple[str, ...] = ()  # typical mistakes its checker catches (the guides list them)
    hints: str = ""  # dotted name of the task's labkit.course.hints.Hints (next to its checker), "" if none

    @property
    def is_build(self) -> bool:
        """A build task: the learner's code runs inside the real engine."""
        return bool(self.runs_inside)

    def load_checker(self) -> Any:
        return pkgutil.resolve_name(self.checker)

    def load_reference(self) -> Any:
        return pkgutil.resolve_name(self.reference)


def _tasks(*tasks: Task) -> dict[str, Task]:
    return {t.id: t for t in tasks}


TASKS: dict[str, Task] = _tasks(
    Task("00.attainable_flops", "00_setup_and_hardware", "the roofline formula",
         "labkit.measure.hardware.attainable_flops", "labkit.course.ch00_setup_and_hardware.check_attainable_flops",
         "labkit.measure.hardware.attainable_flops", 5,
         catches=("max instead of min", "bandwidth divided by the intensity"),
         hints="labkit.course.ch00_setup_and_hardware.HINTS"),
    Task("01.request_latencies", "01_anatomy_of_a_request", "latencies from timestamps",
         "labkit.core.metrics.compute_latencies", "labkit.course.ch01_anatomy_of_a_request.check_request_latencies",
         "labkit.core.metrics.compute_latencies", 10,
         catches=("TPOT divided by all output tokens", "TTFT not measured from the arrival",
                  "the TTFT counted as an inter-token gap", "E2E not measured from the arrival"),
         hints="labkit.course.ch01_anatomy_of_a_request.HINTS"),
    Task("02.top_p", "02_naive_generation", "top-p (nucleus) filtering",
         "labkit.core.sampler.apply_top_p", "labkit.course.ch02_naive_generation.check_top_p",
         "labkit.core.sampler.apply_top_p", 15,
         catches=("the token that crosses p dropped", "the filter left in sorted order",
                  "the kept logits changed (renormalised)"),
         hints="labkit.course.ch02_naive_generation.TOP_P_HINTS"),
    Task("02.next_token", "02_naive_generation", "the next token",
         "labkit.core.engine.naive.NaiveEngine.next_token", "labkit.course.ch02_naive_generation.check_next_token",
         "labkit.core.engine.naive.NaiveEngine", 25, runs_inside="naive",
         catches=("the logits of the first position instead of the last", "the temperature ignored",
                  "sampled requests drawn greedily", "a tensor returned instead of an int",
                  "the token appended to the sequence by next_token"),
         hints="labkit.course.ch02_naive_generation.NEXT_TOKEN_HINTS"),
    Task("02.check_stop", "02_naive_generation", "when to stop",
         "labkit.core.sched.stop.check_stop", "labkit.course.ch02_naive_generation.check_stop_rule",
         "labkit.core.sched.stop.check_stop", 20, runs_inside="naive",
         catches=("max_tokens off by one", "an end-of-sequence token not stopping", "ignore_eos not honoured",
                  "stop strings ignored", "max_model_len ignored", "stop_token_ids ignored, or not named as the "
                  "stop reason"),
         hints="labkit.course.ch02_naive_generation.STOP_HINTS"),
    Task("03.write_kv", "03_kv_cache", "the cache update",
         "labkit.core.kv.contiguous.write_kv", "labkit.course.ch03_kv_cache.check_write_kv",
         "labkit.core.kv.contiguous.write_kv", 10, runs_inside="kvcache",
         catches=("not transposed back to (B, T, heads, d)", "writing from column 0 every step",
                  "the new K/V returned but not kept in the cache", "columns past the new ones overwritten"),
         hints="labkit.course.ch03_kv_cache.WRITE_KV_HINTS"),
    Task("03.attend", "03_kv_cache", "attention over the cache",
         "labkit.core.kv.contiguous.ContiguousKVCache.attend", "labkit.course.ch03_kv_cache.check_attend",
         "labkit.core.kv.contiguous.ContiguousKVCache", 25, runs_inside="kvcache",
         catches=("attending before this step's K/V are written", "is_causal=True over the cache (a decode query "
                  "sees column 0 only)", "no mask (a query sees later columns)", "attending over this step's K/V "
                  "only", "this step's K/V never written to the cache", "self.length advanced by attend"),
         hints="labkit.course.ch03_kv_cache.ATTEND_HINTS"),
    Task("04.decode_cost", "04_prefill_vs_decode", "the cost of a decode step",
         "labkit.measure.roofline.decode_cost", "labkit.course.ch04_prefill_vs_decode.check_decode_cost",
         "labkit.measure.roofline.decode_cost", 15,
         catches=("no KV read", "KV per query head (GQA ignored)", "weights read per sequence", "no lm_head",
                  "the new token's K/V write left out", "matmul FLOPs counted once per step, not per sequence"),
         hints="labkit.course.ch04_prefill_vs_decode.HINTS"),
    Task("05.static_batch_tokens", "05_static_batching", "what does one static batch compute?",
         "labkit.measure.batching.static_batch_tokens", "labkit.course.ch05_static_batching.check_static_batch_tokens",
         "labkit.measure.batching.static_batch_tokens", 10,
         catches=("no padding counted", "no idle slots counted", "the last token computed"),
         hints="labkit.course.ch05_static_batching.STATIC_BATCH_HINTS"),
    Task("05.prepare_prefill", "05_static_batching", "the padded prefill batch",
         "labkit.core.engine.kvcache.KVCacheEngine.prepare_prefill",
         "labkit.course.ch05_static_batching.check_prepare_prefill",
         "labkit.core.engine.kvcache.KVCacheEngine", 25, runs_inside="kvcache (static batches)",
         catches=("right padding instead of left", "positions counted from column 0 of the padded row",
                  "padding marked valid (real tokens attend to padding)"),
         hints="labkit.course.ch05_static_batching.PREPARE_PREFILL_HINTS"),
    Task("05.attention_mask", "05_static_batching", "the attention mask",
         "labkit.core.kv.contiguous.ContiguousKVCache.attention_mask",
         "labkit.course.ch05_static_batching.check_attention_mask",
         "labkit.core.kv.contiguous.ContiguousKVCache", 20, runs_inside="kvcache (static batches)",
         catches=("real tokens attend to padding", "no causal mask (a query sees later columns)",
                  "the causal mask not offset by the cached columns (a decode query sees column 0 only)",
                  "a padding query that sees no column (an empty softmax row)"),
         hints="labkit.course.ch05_static_batching.ATTENTION_MASK_HINTS"),
    Task("06.slot", "06_paged_attention", "the slot mapping",
         "labkit.core.kv.block_manager.BlockManager.slot", "labkit.course.ch06_paged_attention.check_slot",
         "labkit.core.kv.block_manager.BlockManager", 10, runs_inside="paged",
         catches=("off-by-one block index", "offset not multiplied by block_size"),
         hints="labkit.course.ch06_paged_attention.SLOT_HINTS"),
    Task("06.block_hashes", "06_paged_attention", "the prefix cache's block hash",
         "labkit.core.kv.block_manager.BlockManager.block_hashes",
         "labkit.course.ch06_paged_attention.check_block_hashes",
         "labkit.core.kv.block_manager.BlockManager", 15, runs_inside="paged (prefix caching)",
         catches=("hash not chained to the parent", "the partial last block hashed"),
         hints="labkit.course.ch06_paged_attention.BLOCK_HASH_HINTS"),
    Task("06.block_manager", "06_paged_attention", "the block manager",
         "labkit.core.kv.block_manager.BlockManager.allocate",
         "labkit.course.ch06_paged_attention.block_manager.check_block_manager",
         "labkit.core.kv.block_manager.BlockManager", 60, runs_inside="paged, continuous",
         catches=("a forgotten reference-count decrement in free",
                  "no copy-on-write before writing into a shared block", "one block too many or too few",
                  "blocks freed first to last",
                  "prefix lookup not stopping at the first miss", "prefix lookup matching the whole prompt",
                  "free not resetting num_computed_tokens (a preempted request skips its recompute)",
                  "the original kept after a copy-on-write", "cached tokens not counted as computed",
                  "a prefix lookup with prefix caching off", "free leaving the block table behind"),
         hints="labkit.course.ch06_paged_attention.block_manager.HINTS"),
    Task("06.paged_attention", "06_paged_attention", "paged attention",
         "labkit.core.attention.torch_sdpa.TorchAttentionBackend.attend",
         "labkit.course.ch06_paged_attention.attention.check_paged_attention",
         "labkit.core.attention.torch_sdpa.TorchAttentionBackend", 45, runs_inside="continuous, chunked",
         catches=("the new K/V not written to their slots", "attending before writing the new K/V",
                  "attending past the context length", "the wrong block for a position (blocks assumed contiguous)",
                  "GQA: query head h reading KV head h % n_kv_heads", "another layer's pool written"),
         hints="labkit.course.ch06_paged_attention.attention.HINTS"),
    Task("07.schedule_waiting", "07_continuous_batching", "the admission rule",
         "labkit.core.sched.scheduler.Scheduler.schedule_waiting",
         "labkit.course.ch07_continuous_batching.check_schedule_waiting",
         "labkit.core.sched.scheduler.Scheduler", 25, runs_inside="continuous, chunked",
         catches=("a later, smaller request jumps the queue", "max_num_seqs ignored", "KV blocks not checked",
                  "whole prompts only (no chunk in engine chunked)", "admissions not counted in the prefix cache's "
                  "statistics (record_prefix_query)"),
         hints="labkit.course.ch07_continuous_batching.ADMISSION_HINTS"),
    Task("07.preempt", "07_continuous_batching", "preemption by recompute",
         "labkit.core.sched.scheduler.Scheduler.reserve", "labkit.course.ch07_continuous_batching.check_preemption",
         "labkit.core.sched.scheduler.Scheduler", 30, runs_inside="continuous, chunked (also with async scheduling)",
         catches=("preempting the oldest instead of the newest", "the victim's blocks not given back",
                  "the victim appended at the tail of the queue",
                  "preempting a request this step already scheduled (or a launched step still computes)",
                  "going on after seq itself gave way", "preemptions not counted"),
         hints="labkit.course.ch07_continuous_batching.PREEMPTION_HINTS"),
    Task("08.schedule_running", "08_chunked_prefill", "the budget-filling rule",
         "labkit.core.sched.scheduler.Scheduler.schedule_running",
         "labkit.course.ch08_chunked_prefill.check_schedule_running",
         "labkit.core.sched.scheduler.Scheduler", 25, runs_inside="chunked",
         catches=("prefill chunks before decodes", "a chunk not capped by the budget",
                  "a request preempted by reserve not skipped", "budget taken although reserve returned False"),
         hints="labkit.course.ch08_chunked_prefill.HINTS"),
    Task("09.goodput", "09_serving_and_metrics", "goodput from per-request records",
         "labkit.measure.loadgen.metrics.request_goodput", "labkit.course.ch09_serving_and_metrics.check_goodput",
         "labkit.measure.loadgen.metrics.request_goodput", 10,
         catches=("any one SLO is enough", "failed requests counted", "per request, not per second"),
         hints="labkit.course.ch09_serving_and_metrics.HINTS"),
    Task("10.idle_fraction", "10_profiling_host_overhead", "the idle fraction from trace events",
         "labkit.measure.profiling.trace_analysis.idle_fraction",
         "labkit.course.ch10_profiling_host_overhead.check_idle_fraction",
         "labkit.measure.profiling.trace_analysis.idle_fraction", 15,
         catches=("nested events counted twice", "events not clipped to the window", "events not sorted"),
         hints="labkit.course.ch10_profiling_host_overhead.HINTS"),
    Task("10.capstone", "10_profiling_host_overhead", "your engine",
         "labkit.course.ch10_profiling_host_overhead.capstone.build_engine",
         "labkit.course.ch10_profiling_host_overhead.capstone.check_capstone",
         "labkit.course.ch10_profiling_host_overhead.capstone.build_engine", 20, runs_inside="chunked",
         catches=("the parts not passed to LLM (labkit's run instead)", "an engine other than chunked",
                  "a bug in one part: wrong slots, an uncapped chunk, a free that forgets the pool",
                  "the caller's options not passed on"),
         hints="labkit.course.ch10_profiling_host_overhead.capstone.CAPSTONE_HINTS"),
    Task("11.attend_tile", "11_attention_kernels", "the inner loop: one tile of the online softmax",
         "labkit.core.attention.triton_kernels.attend_tile", "labkit.course.ch11_attention_kernels.check_attend_tile",
         "labkit.core.attention.triton_kernels.attend_tile", 40, runs_inside="continuous (attention_backend, Triton)",
         catches=("the running sum not rescaled when the max grows", "a block-table off-by-one",
                  "positions past the context's end not masked", "bfloat16 arithmetic (no float32 conversion)"),
         hints="labkit.course.ch11_attention_kernels.TILE_HINTS"),
    Task("11.merge_splits", "11_attention_kernels", "the merge of the splits",
         "labkit.core.attention.triton_kernels.merge_splits", "labkit.course.ch11_attention_kernels.check_merge_splits",
         "labkit.core.attention.triton_kernels.merge_splits", 15, runs_inside="continuous (attention_backend, Triton)",
         catches=("the sums not weighted like the outputs", "no max subtracted (exp overflows)",
                  "an empty split divided by its own zero sum"),
         hints="labkit.course.ch11_attention_kernels.MERGE_HINTS"),
    Task("12.receive_kv", "12_disaggregated_prefill", "the decode side's KV receive",
         "labkit.core.disagg.receive.KVReceiver.receive_kv",
         "labkit.course.ch12_disaggregated_prefill.check_receive_kv",
         "labkit.core.disagg.receive.KVReceiver", 20, runs_inside="disaggregated (kv_receiver_cls)",
         catches=("no blocks allocated for the prompt", "K and V swapped, or a block left out",
                  "the prompt not counted as computed (the scheduler prefills it again)",
                  "the request not admitted to the running batch", "blocks taken outside the block table (a leak)"),
         hints="labkit.course.ch12_disaggregated_prefill.RECEIVE_HINTS"),
    Task("12.placement", "12_disaggregated_prefill", "the placement search",
         "labkit.measure.sim.placement.choose_placement",
         "labkit.course.ch12_disaggregated_prefill.check_placement",
         "labkit.measure.sim.placement.choose_placement", 20,
         catches=("colocation never considered", "total goodput compared instead of goodput per device",
                  "a unit with no decode worker, or more devices than there are", "the larger unit kept on a tie"),
         hints="labkit.course.ch12_disaggregated_prefill.PLACEMENT_HINTS"),
    Task("13.verify", "13_speculative_decoding", "the acceptance rule",
         "labkit.core.spec_decode.rejection_sampler.RejectionSampler.verify",
         "labkit.course.ch13_speculative_decoding.check_rejection_sampler",
         "labkit.core.spec_decode.rejection_sampler.RejectionSampler", 30,
         runs_inside="chunked (speculative_config rejection_sampler_cls)",
         catches=("no bonus token when every proposal is accepted", "going on after a rejection",
                  "accepting without the ratio test", "drawing from p instead of the residual max(0, p - q)",
                  "random numbers not from the request's generator"),
         hints="labkit.course.ch13_speculative_decoding.ACCEPTANCE_HINTS"),
    Task("14.quantize_weight", "14_quantization", "the weight quantizer (int8 per channel, int4 group-wise)",
         "labkit.core.quant.weights.quantize_weight", "labkit.course.ch14_quantization.quantizer.check_quantize_weight",
         "labkit.core.quant.weights.quantize_weight", 25, runs_inside="chunked (quantize_model(quantizer=...))",
         catches=("scales along the wrong axis", "no clamp (values wrap around)",
                  "a scale that lets the largest value overflow the range", "the nibbles swapped",
                  "a zero scale for a row of zeros"),
         hints="labkit.course.ch14_quantization.quantizer.QUANTIZER_HINTS"),
    Task("14.int8_kv", "14_quantization", "the int8 KV write and read",
         "labkit.core.kv.quantized_pool.QuantizedKVPool.write",
         "labkit.course.ch14_quantization.kv_pool.check_int8_kv_pool",
         "labkit.core.kv.quantized_pool.QuantizedKVPool", 20,
         runs_inside="chunked (kv_cache_dtype='int8', kv_pool_cls)",
         catches=("one scale per block instead of per token and head", "truncated instead of rounded",
                  "slots other than the new tokens' overwritten"),
         hints="labkit.course.ch14_quantization.kv_pool.KV_HINTS"),
    Task("15.column_row", "15_tensor_parallelism", "column- and row-parallel layers and the all-reduce",
         "labkit.course.ch15_tensor_parallelism.linear.column_then_row",
         "labkit.course.ch15_tensor_parallelism.linear.check_column_then_row",
         "labkit.course.ch15_tensor_parallelism.linear.column_then_row", 20,
         catches=("an all-reduce after the column-parallel layer", "no all-reduce", "w2's columns in another order "
                  "than w1's rows", "the bias added on every rank"),
         hints="labkit.course.ch15_tensor_parallelism.linear.LINEAR_HINTS"),
    Task("15.shard_attention", "15_tensor_parallelism", "a layer's heads and KV share per rank",
         "labkit.core.parallel.weights.shard_attention_weights",
         "labkit.course.ch15_tensor_parallelism.attention.check_shard_attention",
         "labkit.core.parallel.weights.shard_attention_weights", 25,
         runs_inside="continuous (tensor_parallel_size=2, a TensorParallelEngineCore subclass's shard_attention)",
         catches=("K/V heads not split with their query heads", "K/V heads not replicated when fewer than the "
                  "ranks", "o_proj cut by rows instead of columns", "a head's rows not taken together",
                  "biases not cut with their heads"),
         hints="labkit.course.ch15_tensor_parallelism.attention.ATTENTION_HINTS"),
)
