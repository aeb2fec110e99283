"""``scripts/bench_kvcache.py``'s sizes, records and measurements: decode cost, generation, MBU, breakdown, GEMV roof.

Naive against kvcache decoding side by side (notebook 03), decode MBU on a real shape and the batch-1 decode step
against the matrix-vector roof (notebook 04). ``kvcache_report`` writes the report.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from labkit.core.device import synchronize
from labkit.core.kv import ContiguousKVCache
from labkit.core.llm import LLM
from labkit.core.model import CausalLM
from labkit.core.model.attention import sdpa
from labkit.core.model.linear import set_linear_kernel
from labkit.core.sampling_params import SamplingParams
from labkit.measure.decode_roof import DecodeBreakdown, GemvRoof, measure_decode_breakdown
from labkit.measure.roofline import StepCost, decode_cost
from labkit.measure.rounds import interleave
from labkit.measure.timing import time_fn
from labkit.measure.workloads import prompt_ids_of_length


@dataclass(frozen=True)
class Sizes:
    """How much work each part does; --smoke shrinks everything."""

    contexts: tuple[int, ...]  # context lengths at which a decode step is timed
    decode_steps: int  # decode steps timed per context (median reported)
    gen_prompt_len: int
    gen_tokens: int  # tokens generated in the end-to-end comparison
    mbu_context: int  # prompt length before the timed decode steps of the preset
    mbu_steps: int
    profile_steps: int
    roof_rounds: int  # interleaved rounds of the decode step against the GEMV roof, each kernel once per round
    gemv_bytes: int  # size of the matrix the GEMV roof is measured on


FULL = Sizes(contexts=(16, 64, 256, 512, 1024), decode_steps=8, gen_prompt_len=16, gen_tokens=512,
             mbu_context=128, mbu_steps=32, profile_steps=8, roof_rounds=5, gemv_bytes=256 << 20)
SMOKE = Sizes(contexts=(16, 64, 128), decode_steps=3, gen_prompt_len=8, gen_tokens=24,
              mbu_context=32, mbu_steps=4, profile_steps=2, roof_rounds=2, gemv_bytes=16 << 20)


# ---- records ----

@dataclass(frozen=True)
class DecodePoint:
    """Median decode-step cost of one engine at one context length."""

    engine: str
    context_len: int  # tokens before the first timed decode step
    step_s: float  # whole engine step: prepare + forward + sample + detokenize
    forward_s: float  # the model's forward pass (and lm_head) alone


@dataclass(frozen=True)
class GenerationRun:
    """One request generating ``num_tokens`` tokens; seconds since arrival at which each checkpoint was reached."""

    engine: str
    prompt_len: int
    num_tokens: int
    seconds_at: dict[int, float]


@dataclass(frozen=True)
class MBUResult:
    preset: str
    num_params: int
    dtype: str
    context_len: int  # the median timed step's context
    step_s: float
    forward_s: float
    stage_s: dict[str, float]  # median seconds per engine stage
    cost: StepCost

    def bandwidth(self, seconds: float) -> float:
        return self.cost.total_bytes / seconds


@dataclass(frozen=True)
class OpTime:
    name: str
    calls_per_step: float
    ms_per_step: float


@dataclass
class Breakdown:
    """Where the preset's decode forward spends its time."""

    forward_s: float  # the forward pass timed by itself (no engine around it)
    ops: list[OpTime]
    ops_per_step: float
    matmul_floor_s: float  # every nn.Linear weight times one vector with F.linear, back to back, nothing else
    matmul_floor_t_s: float  # the same with each weight stored transposed, (in, out): x @ W_t
    matmul_floor_labkit_s: float  # the same products as the model runs them: its merged layers, its linear kernels
    matmul_bytes: int
    attention_labkit_s: float  # labkit's sdpa (repeat_kv + boolean mask), all layers
    attention_fused_s: float  # F.scaled_dot_product_attention(enable_gqa=True), no mask, all layers
    categories: dict[str, float] = field(default_factory=dict)  # ms per step


# ---- measurements ----

def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def decode_steps(llm: LLM, ids: list[int], num_steps: int) -> tuple[list[float], list[float], list[dict[str, float]]]:
    """Generate num_steps + 1 tokens from ``ids``; (durations, forward times, stage times) of the decode steps."""
    before = len(llm.engine.step_stats)
    llm.generate([ids], greedy(num_steps + 1), use_tqdm=False)
    stats = [s for s in llm.engine.step_stats[before:] if not s.is_prefill]
    return [s.duration for s in stats], [s.stage_times["forward"] for s in stats], [s.stage_times for s in stats]


def naive_and_kvcache(model: str, device: torch.device, dtype: torch.dtype, sizes: Sizes) -> dict[str, LLM]:
    """The two engines compared in parts 1 and 2, long enough for both, warmed up."""
    max_len = max(max(sizes.contexts) + sizes.decode_steps + 2, sizes.gen_prompt_len + sizes.gen_tokens)
    llms = {name: LLM(model, engine=name, device=device, dtype=dtype, max_model_len=max_len)
            for name in ("naive", "kvcache")}
    for llm in llms.values():  # warm-up: first calls allocate and pick kernels
        decode_steps(llm, prompt_ids_of_length(llm.tokenizer, 32, seed=0), 4)
    return llms


def preset_llm(preset: str, device: torch.device, dtype: torch.dtype, sizes: Sizes) -> LLM:
    """The ``kvcache`` engine on ``preset`` (random weights) for parts 3-5, warmed up."""
    llm = LLM(preset, engine="kvcache", device=device, dtype=dtype,
              max_model_len=sizes.mbu_context + sizes.mbu_steps + 2)
    decode_steps(llm, prompt_ids_of_length(llm.tokenizer, 16, seed=0), 3)  # warm-up
    return llm


def measure_decode_points(llms: dict[str, LLM], contexts: tuple[int, ...], num_steps: int) -> list[DecodePoint]:
    points = []
    tokenizer = next(iter(llms.values())).tokenizer
    jobs = [(name, c) for c in contexts for name in llms]  # engines alternate, so drift hits both alike
    for name, c in tqdm(jobs, desc="decode cost by context", unit="point"):
        durations, forwards, _ = decode_steps(llms[name], prompt_ids_of_length(tokenizer, c, seed=c), num_steps)
        points.append(DecodePoint(name, c, statistics.median(durations), statistics.median(forwards)))
    return points


def measure_generation(llms: dict[str, LLM], prompt_len: int, num_tokens: int) -> list[GenerationRun]:
    checkpoints = sorted({n for n in (16, 32, 64, 128, 256, 512, 1024, num_tokens) if n <= num_tokens})
    runs = []
    for name, llm in tqdm(llms.items(), desc=f"generate {num_tokens} tokens", unit="engine"):
        ids = prompt_ids_of_length(llm.tokenizer, prompt_len, seed=7)
        out = llm.generate([ids], greedy(num_tokens), use_tqdm=False)[0]
        m = out.metrics
        runs.append(GenerationRun(name, prompt_len, num_tokens,
                                  {n: m.token_times[n - 1] - m.arrival_time for n in checkpoints}))
    return runs


def measure_mbu(llm: LLM, preset: str, context: int, num_steps: int) -> MBUResult:
    ids = prompt_ids_of_length(llm.tokenizer, context, seed=11)
    durations: list[float] = []
    forwards: list[float] = []
    stages: list[dict[str, float]] = []
    # A few short runs from the same prompt: every timed step runs at context .. context + steps_per_run - 1.
    steps_per_run = min(8, num_steps)
    for _ in tqdm(range(max(1, num_steps // steps_per_run)), desc=f"{preset} decode", unit="run"):
        d, f, st = decode_steps(llm, ids, steps_per_run)
        durations += d
        forwards += f
        stages += st
    stage_s = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    dtype_bytes = llm.dtype.itemsize
    median_context = context + steps_per_run // 2
    return MBUResult(preset, llm.model_config.num_params, str(llm.dtype).removeprefix("torch."), median_context,
                     statistics.median(durations), statistics.median(forwards), stage_s,
                     decode_cost(llm.model_config, 1, median_context, dtype_bytes))


def prefilled_cache(model: CausalLM, context: int, extra: int) -> tuple[ContiguousKVCache, torch.Tensor]:
    """A batch-1 cache holding ``context`` tokens, and the next token id to decode."""
    dev = model.device
    cache = ContiguousKVCache(model.config, 1, context + extra + 1, dev, model.dtype)
    ids = torch.randint(0, 1000, (1, context), device=dev)  # (1, T)
    cache.begin_step(torch.ones(1, context, dtype=torch.bool, device=dev))
    model(ids, torch.arange(context, device=dev)[None], cache)
    cache.end_step(context)
    return cache, ids[:, -1:]


@torch.inference_mode()
def decode_forward(model: CausalLM, cache: ContiguousKVCache, token: torch.Tensor) -> torch.Tensor:
    """One decode forward as the kvcache engine runs it: (1, 1) token -> (1, vocab) logits."""
    pos = torch.tensor([[cache.length]], device=token.device)  # (1, 1)
    cache.begin_step(torch.ones(1, 1, dtype=torch.bool, device=token.device))
    hidden = model(token, pos, cache)  # (1, 1, hidden)
    cache.end_step(1)
    return model.compute_logits(hidden[:, -1])  # (1, vocab)


CATEGORIES: dict[str, tuple[str, ...]] = {
    "matmul (linear layers, lm_head)": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"),
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_attention_math", "aten::bmm", "aten::_softmax", "aten::baddbmm"),
    "copies (repeat_kv, cache writes, casts)": ("aten::copy_", "aten::clone", "aten::_to_copy", "aten::contiguous",
                                                "aten::_unsafe_view"),
    "mask building": ("aten::bitwise_and", "aten::bitwise_or", "aten::eq", "aten::le", "aten::arange"),
}


@torch.inference_mode()
def measure_breakdown(model: CausalLM, context: int, num_steps: int) -> Breakdown:
    dev = model.device
    cache, token = prefilled_cache(model, context, 3 * num_steps + 4)
    times = time_fn(lambda: decode_forward(model, cache, token), dev, repeats=num_steps, warmup=1)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(num_steps):
            decode_forward(model, cache, token)
        synchronize(dev)
    per_op: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.key_averages():
        self_us = evt.self_device_time_total if dev.type == "cuda" else evt.self_cpu_time_total
        per_op[evt.key][0] += evt.count
        per_op[evt.key][1] += self_us
    ops = sorted((OpTime(k, c / num_steps, us / 1e3 / num_steps) for k, (c, us) in per_op.items()),
                 key=lambda o: -o.ms_per_step)
    aten = [o for o in ops if o.name.startswith("aten::")]  # self times of aten ops do not overlap
    categories = {cat: sum(o.ms_per_step for o in aten if o.name in names) for cat, names in CATEGORIES.items()}
    other = sum(o.ms_per_step for o in aten) - sum(categories.values())
    categories["other ops (norms, RoPE, SiLU, adds, views)"] = other
    # Ops called from Python (not from inside another op): what the interpreter dispatches one by one.
    ops_per_step = sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")) / num_steps

    # The floor: every weight matrix of the forward pass times one vector, back to back.
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    xs = [torch.randn(1, m.in_features, device=dev, dtype=model.dtype) for m in linears]

    def matmuls() -> None:
        for m, x in zip(linears, xs):
            F.linear(x, m.weight)

    floor = statistics.median(time_fn(matmuls, dev, repeats=max(5, num_steps), warmup=2))
    matmul_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    # The same products with each weight stored transposed, (in, out): BLAS libraries run the two
    # layouts through different GEMV kernels, and on some CPUs one streams memory much faster.
    weights_t = [m.weight.t().contiguous() for m in linears]  # (in, out) each

    def matmuls_t() -> None:
        for w_t, x in zip(weights_t, xs):
            x @ w_t  # (1, in) @ (in, out)

    floor_t = statistics.median(time_fn(matmuls_t, dev, repeats=max(5, num_steps), warmup=2))
    weights_t.clear()  # free the copies before the attention measurements
    # The same weights as the model multiplies them: q/k/v and gate/up merged, each on its LinearKernel's choice.
    calls: list[tuple[object, torch.Tensor]] = []
    for layer in model.model.layers:
        for part in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj):
            in_features = part.in_features if isinstance(part, torch.nn.Linear) else part.linears[0].in_features
            calls.append((part, torch.randn(1, 1, in_features, device=dev, dtype=model.dtype)))
    calls.append((model.lm_head, torch.randn(1, model.config.hidden_size, device=dev, dtype=model.dtype)))
    floor_labkit = statistics.median(time_fn(lambda: [part(x) for part, x in calls], dev,  # type: ignore[operator]
                                             repeats=max(5, num_steps), warmup=2))

    # The attention call at this context, as labkit makes it and as one fused GQA call.
    cfg = model.config
    q = torch.randn(1, 1, cfg.num_attention_heads, cfg.head_dim, device=dev, dtype=model.dtype)  # (B, T, nh, d)
    k = cache.k[0][:, :, : cache.length].transpose(1, 2)  # (B, S, n_kv, d)
    v = cache.v[0][:, :, : cache.length].transpose(1, 2)
    mask = torch.ones(1, 1, 1, cache.length, dtype=torch.bool, device=dev)  # (B, 1, T, S)
    layers = cfg.num_hidden_layers
    labkit_attn = statistics.median(time_fn(lambda: sdpa(q, k, v, mask=mask, is_causal=False), dev, 20, 3)) * layers
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, S, d) views of the cache
    fused = statistics.median(time_fn(lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True),
                                      dev, 20, 3)) * layers
    return Breakdown(statistics.median(times), ops, ops_per_step, floor, floor_t, floor_labkit, matmul_bytes,
                     labkit_attn, fused, categories)


@dataclass
class RoofRounds:
    """The GEMV roof, and the preset's batch-1 decode step with each linear kernel, interleaved rounds."""

    gemv: GemvRoof
    context_len: int
    steps: int
    rounds: dict[str, list[DecodeBreakdown]]  # linear kernel ("auto", "torch") -> one breakdown per round

    def median(self, kernel: str, part: str) -> float:
        return statistics.median(getattr(b, part) for b in self.rounds[kernel])


def measure_roof_rounds(llm: LLM, gemv: GemvRoof, context: int, steps: int, num_rounds: int) -> RoofRounds:
    """Decode steps with labkit's linear kernels ("auto") and with F.linear everywhere ("torch"), round by round,
    rotating which goes first; each round also splits the step into linear layers, attention and the rest."""
    ids = prompt_ids_of_length(llm.tokenizer, context, seed=11)
    kernels = ("auto", "torch")
    rounds: dict[str, list[DecodeBreakdown]] = {k: [] for k in kernels}

    def with_kernel(kernel: str) -> Callable[[], None]:
        def run() -> None:
            set_linear_kernel(llm.model, kernel)
            measure_decode_breakdown(llm, ids, 2, ContiguousKVCache)  # warm-up: repack, first calls
            rounds[kernel].append(measure_decode_breakdown(llm, ids, steps, ContiguousKVCache))

        return run

    # Each round warms its kernel up itself (switching kernels repacks the weights), so no warm-up round here.
    interleave({k: with_kernel(k) for k in kernels}, num_rounds, warmup=0, device=llm.device, check_load=False)
    set_linear_kernel(llm.model, "auto")
    return RoofRounds(gemv, context, steps, rounds)
