"""bench_engines, part 1: the sizes, and each system's run of the throughput workload."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from labkit import LLM, SamplingParams
from labkit.core.device import synchronize
from labkit.core.model.source import bundled_model_path
from labkit.course.workloads import Workload, sampling_params_for
from labkit.measure.summary import run_workload

LABKIT_ENGINES = ("kvcache", "paged", "continuous", "chunked")
HF_CB = "transformers continuous batching (generate_batch)"


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; --smoke shrinks everything."""

    workload: str  # a file in data/workloads/
    prefill_workload: str  # the prefill-heavier mix of part 1d
    max_num_seqs: int  # batch slots of every engine (and transformers' batch size)
    budget: int  # max_num_batched_tokens of chunked (and transformers' max_batch_tokens)
    num_short: int  # chunking experiment: requests decoding when the long prompts arrive
    short_prompt: int
    short_output: int
    num_long: int
    long_prompt: int
    long_output: int
    budgets: tuple[int, ...]  # chunked budgets compared with continuous
    repeats: int  # repetitions of the chunking experiment (medians reported)
    slots: tuple[int, ...]  # batch-slot sweep of chunked and transformers' continuous batching (part 1b)


FULL = Sizes(workload="heterogeneous_64", prefill_workload="prefill_heavy_48",
             max_num_seqs=16, budget=512, num_short=12, short_prompt=32,
             short_output=128, num_long=4, long_prompt=1024, long_output=16, budgets=(128, 256, 512), repeats=5,
             slots=(8, 16, 32, 64))
SMOKE = Sizes(workload="heterogeneous_small_16", prefill_workload="uniform_small_16",
              max_num_seqs=4, budget=64, num_short=3, short_prompt=16,
              short_output=24, num_long=1, long_prompt=256, long_output=4, budgets=(64,), repeats=1, slots=(2, 4))


@dataclass
class Result:
    """One system's run of the throughput workload."""

    name: str
    output_tokens: int  # tokens the workload asked for (what every system must produce)
    seconds: float  # wall time of the whole workload
    steps: int | None = None  # engine steps (labkit) or forward passes (transformers' padded generate)
    computed_tokens: int | None = None  # token positions run through the model, where known
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


# ---- part 1: throughput ----

def run_labkit(engine: str, workload: Workload, sizes: Sizes, device: str) -> Result:
    options: dict[str, object] = {"max_num_seqs": sizes.max_num_seqs}
    if engine == "chunked":
        options["max_num_batched_tokens"] = sizes.budget
    llm = LLM("labkit-tiny", engine=engine, device=device, dtype="float32", **options)
    prompts, params = workload.prompts(), sampling_params_for(workload)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    run = run_workload(llm, prompts, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in run.outputs)
    expected = workload.num_output_tokens
    assert tokens == expected, f"{engine} produced {tokens} tokens, expected {expected}"
    s = run.summary()
    note = (f"TTFT p50/p99 {s.ttft.median:.2f}/{s.ttft.p99:.2f} s, ITL p50/p99 {s.itl.median * 1e3:.0f}/"
            f"{s.itl.p99 * 1e3:.0f} ms")
    if run.num_preemptions:
        note += f", {run.num_preemptions} preemptions"
    return Result(engine, tokens, run.wall_time, len(run.step_stats),
                  sum(st.num_computed_tokens for st in run.step_stats), note)


def hf_model(device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(bundled_model_path(), dtype=torch.float32).to(device).eval()


@torch.inference_mode()
def run_hf_generate(model: torch.nn.Module, workload: Workload, sizes: Sizes) -> Result:
    """transformers' ``generate`` on FCFS batches of max_num_seqs prompts, left-padded, greedy."""
    device = model.device
    pad = 0

    def batch_generate(ids: list[list[int]], new_tokens: int) -> int:
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)  # (B, width)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        # min_new_tokens = max_new_tokens: no row stops at EOS, as ignore_eos does in labkit
        out = model.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=pad)
        synchronize(device)
        return int(out.shape[1] - width)

    batch_generate([[1, 5, 6, 7]], 4)  # warm-up
    prompts, lens = workload.prompts(), workload.output_lens
    start = time.perf_counter()
    steps = computed = 0
    batches = range(0, len(prompts), sizes.max_num_seqs)
    for i in tqdm(batches, desc="transformers generate (batches)"):
        ids = [list(p) for p in prompts[i : i + sizes.max_num_seqs]]  # type: ignore[arg-type]
        new = max(lens[i : i + sizes.max_num_seqs])
        got = batch_generate(ids, new)
        assert got == new, f"generate produced {got} tokens per row, expected {new}"
        width = max(len(x) for x in ids)
        steps += new
        computed += len(ids) * (width + new - 1)  # padded prefill, then one position per row per step
    seconds = time.perf_counter() - start
    return Result("transformers generate (padded)", workload.num_output_tokens, seconds, steps, computed,
                  f"batches of {sizes.max_num_seqs}, left padding, each run to its longest output")


@torch.inference_mode()
def run_hf_continuous(model: torch.nn.Module, workload: Workload, sizes: Sizes, kv_tokens: int) -> Result:
    """transformers' continuous batching: the ContinuousBatchingManager behind ``generate_batch``.

    ``generate_batch`` takes one ``max_new_tokens`` for every prompt; the workload gives each request its
    own, so the requests go to the same manager through its documented ``add_request(..., max_new_tokens=)``
    (``generate_batch`` itself is that manager's context plus ``add_requests`` and a result loop).
    """
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    page_size = 256  # transformers' default
    cb_config = ContinuousBatchingConfig(page_size=page_size, num_blocks=-(-kv_tokens // page_size),
                                         max_batch_tokens=sizes.budget, max_requests_per_batch=sizes.max_num_seqs)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), pad_token_id=0,
                                  eos_token_id=-1)  # -1: no EOS, as ignore_eos does in labkit
    prompts, lens = workload.prompts(), workload.output_lens
    # One short call first: the first use of the model and the manager is slow everywhere.
    model.generate_batch([[1, 5, 6, 7]], generation_config=gen_config, continuous_batching_config=cb_config,
                         max_new_tokens=4)
    setup = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen_config, block=True, timeout=60,
                                                   continuous_batching_config=cb_config) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(list(p), max_new_tokens=n, eos_token_id=-1)  # type: ignore[arg-type]
               for p, n in zip(prompts, lens)]
        results = {}
        with tqdm(total=len(ids), desc="transformers continuous batching") as bar:
            while len(results) < len(ids):
                out = manager.get_result(timeout=1)
                if out is not None and out.is_finished():
                    results[out.request_id] = out
                    bar.update(1)
                elif out is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped early")
        seconds = time.perf_counter() - start
    tokens = sum(len(results[i].generated_tokens) for i in ids)
    expected = workload.num_output_tokens
    assert tokens == expected, f"transformers' continuous batching produced {tokens} tokens, expected {expected}"
    return Result(HF_CB, tokens, seconds, None, None,
                  f"max_batch_tokens {sizes.budget}, max_requests_per_batch {sizes.max_num_seqs}, "
                  f"{-(-kv_tokens // page_size)} pages of {page_size}; manager start-up "
                  f"{start - setup:.2f} s not counted")


def kv_tokens_for(slots: int) -> int:
    """transformers' KV pool, in tokens: the same as labkit's paged pool on the CPU (slots x max_model_len)."""
    return slots * 2048
