"""Weight-only quantization on the CPU, side by side: decode ms/token, share of the read roof, prefill tok/s and
perplexity per format (labkit float32, int8, int4), and CTranslate2 on the same weights where it is installed.

``scripts/bench_quantization.py`` runs ``run`` and writes ``docs/benchmarks/quantization.md`` (and its .json). Decode
is timed at batch 1 in interleaved rounds (``labkit.measure.rounds``): a step's time from the request's token
timestamps, so engine overhead counts, as a user sees it. The roof is the memory's: one 256 MB float32 tensor summed
by the same threads (``labkit.core.quant.gemv.stream_read_bandwidth``); the share of it a format reaches is its weight
bytes per step over the step's time, over the roof. Also: the float32 step split into the linear layers, attention,
everything else and the engine (``labkit.measure.decode_roof.measure_decode_breakdown``, notebook 04's), and the
perplexity with an 8-bit KV cache (``RoundTripKV``). Introduced with notebook 14 (``14_quantization``).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.core.attention import resolve_attention_backend
from labkit.core.kv.quantized_pool import FP8_DTYPE, dequantize_int8_kv, quantize_int8_kv
from labkit.core.llm import LLM
from labkit.core.model.attention import CausalAttention
from labkit.core.model.layers import RMSNorm
from labkit.core.model.linear import Linear, set_linear_kernel
from labkit.core.model.source import bundled_model_path
from labkit.core.quant import QuantizationConfig, gemv, weight_bytes
from labkit.core.quant.gemv import stream_read_bandwidth
from labkit.core.quant.int4 import quantize_int4
from labkit.core.quant.int8 import quantize_int8
from labkit.core.sampling_params import SamplingParams
from labkit.measure.benchmarks.ct2_process import Ct2Process
from labkit.measure.benchmarks.report import BUSY_SHARE, Hardware, md_table, report_header
from labkit.measure.corpus import generate_stories
from labkit.measure.decode_roof import DecodeBreakdown, measure_decode_breakdown
from labkit.measure.rounds import Rounds, interleave

A8 = "int4-g32-a8"  # int4 weights; decode calls round their inputs to int8 (not weight-only)
A16 = {"int8": "int8-a16", "int4-g32": "int4-g32-a16", "int4-g64": "int4-g64-a16"}  # inputs rounded to int16
FORMATS: dict[str, str | QuantizationConfig | None] = {
    "float32": None, "int8": "int8", A16["int8"]: QuantizationConfig("int8", activations="int16"),
    "int4-g32": QuantizationConfig("int4", 32), A16["int4-g32"]: QuantizationConfig("int4", 32, activations="int16"),
    "int4-g64": QuantizationConfig("int4", 64), A16["int4-g64"]: QuantizationConfig("int4", 64, activations="int16"),
    A8: QuantizationConfig("int4", 32, activations="int8")}
# issue 35's speed-up goals over labkit float32's tok/s (each activation variant is held to its weights' goal)
SPEED_TARGETS = {"int8": 2.5, "int4-g32": 3.5, "int4-g64": 3.5, A8: 3.5}
SPEED_TARGETS.update({a16: SPEED_TARGETS[name] for name, a16 in A16.items()})
READ_ROOF = "streaming read (the roof)"  # the kernel table's own roof row: the float32 weights summed
ONEDNN_FLOAT32 = "float32, oneDNN / MKL"  # the float32 path before the GEMV kernel ran decode ("onednn")
PLAIN_NORM_FLOAT32 = "float32, RMSNorm on F.rms_norm"  # labkit's float32 with RMSNorm as before its C++ kernel
EAGER = {"float32": "float32, layer by layer", "int8": "int8, layer by layer"}  # without the decode plan
KV_FORMATS = ("int8", "fp8")  # kv_cache_dtype values whose perplexity is measured (weights float32)
CT2_CONTENDERS = {"CTranslate2 float32": "float32", "CTranslate2 int8": "int8_float32"}  # name -> compute_type
HELD_OUT_SEED = 777  # the bundled model was trained on stories of seeds 0, 1 and 1,000,000 + i: these are new ones


@dataclass(frozen=True)
class Sizes:
    model: str  # the speed model (a preset: random weights)
    decode_tokens: int
    prompt_len: int
    rounds: int
    ppl_stories: int


FULL = Sizes("smollm2-135m", 48, 256, 7, 40)  # 7 rounds: this VM's bandwidth drifts within a run
SMOKE = Sizes("labkit-tiny", 8, 32, 2, 4)


class RoundTripKV(CausalAttention):
    """Causal attention over K and V as an 8-bit pool gives them back (``QuantizedKVPool``'s formats: int8 with one
    scale per token and head, fp8 e4m3 with the per-layer scale 1.0): what every key and value a decode step reads
    has been through, so a perplexity under it is the perplexity with ``kv_cache_dtype`` set."""

    def __init__(self, kv_cache_dtype: str) -> None:
        self.kv_cache_dtype = kv_cache_dtype

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        if self.kv_cache_dtype == "int8":
            q, scale = quantize_int8_kv(x)  # per vector of head_dim (the last dimension)
            return dequantize_int8_kv(q, scale, x.dtype)
        return x.float().to(FP8_DTYPE).float().to(x.dtype)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return super().attend(layer_idx, q, self.round_trip(k), self.round_trip(v))


def perplexity(llm: LLM, text: str, window: int = 512, kv_cache_dtype: str = "auto") -> float:
    """exp(mean next-token loss) of ``text`` under ``llm.model``, in non-overlapping windows; with an 8-bit
    ``kv_cache_dtype``, every K and V rounded as the quantized pool stores them (``RoundTripKV``). A model whose
    layers round their inputs (``activations="int16"`` or ``"int8"``) runs every row on its GEMV kernel, the decode
    path (a window's rows would otherwise take the prefill path, float inputs, and score the weights alone)."""
    backend = RoundTripKV(kv_cache_dtype) if kv_cache_dtype != "auto" else None
    ids = llm.encode(text)
    q = llm.quantization
    kernel_rows = gemv.MAX_KERNEL_ROWS
    if q is not None and q.activations != "float":
        gemv.MAX_KERNEL_ROWS = window  # read at each call by labkit.core.quant.linear.quantized_matmul
    try:
        return _perplexity(llm, ids, window, backend)
    finally:
        gemv.MAX_KERNEL_ROWS = kernel_rows


def _perplexity(llm: LLM, ids: list[int], window: int, backend: RoundTripKV | None) -> float:
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[start:start + window + 1])[None]  # (1, T + 1)
            if chunk.shape[1] < 2:
                break
            positions = torch.arange(chunk.shape[1] - 1)[None]
            logits = llm.model.compute_logits(llm.model(chunk[:, :-1], positions, backend))  # (1, T, vocab)
            loss = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
            total, count = total + float(loss), count + chunk.shape[1] - 1
    return math.exp(total / count)


def decode_contender(llm: LLM, prompt: list[int], n: int) -> Callable[[], dict[str, float]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)

    def run() -> dict[str, float]:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        times = out.metrics.token_times
        start = out.metrics.first_scheduled_time or out.metrics.arrival_time
        return {"decode_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3,
                "prefill_tok_s": len(prompt) / (times[0] - start)}
    return run


def roof_contender(num_bytes: int = 256 << 20) -> Callable[[], dict[str, float]]:
    """The streaming-read roof as a contender of the decode rounds: this VM's memory bandwidth drifts with its host's
    other guests (32 to 56 GB/s within an hour here), so each round's decodes are held to the roof of the same round.
    The fastest of three sums of one float32 tensor of ``num_bytes``, rows split as the kernels split them."""
    cols = 4096
    t = torch.ones(num_bytes // (4 * cols), cols)  # (rows, 4096) float32, pages touched once
    module = gemv.load_gemv(warn=False)

    def run() -> dict[str, float]:
        best = math.inf
        for _ in range(3):
            start = time.perf_counter()
            if module is not None:
                module.stream_sum(t, gemv.grain(t.shape[0], cols * 4))
            else:
                t.sum()
            best = min(best, time.perf_counter() - start)
        return {"roof_bytes_s": t.numel() * 4 / best}
    return run


def decode_share(res: Results, name: str) -> float:
    """``name``'s weight bytes per decode step over the step's time, over the read roof of the same round (median of
    the rounds); over the run's roof if the rounds have none."""
    r = res.rounds
    seconds = [ms / 1e3 for ms in r.get(name, "decode_ms")]
    roofs = r.get(READ_ROOF, "roof_bytes_s") if READ_ROOF in r.contenders else [res.roof_bytes_s] * len(seconds)
    return statistics.median(res.weight_bytes[name] / s / roof for s, roof in zip(seconds, roofs))


def ct2_contenders(llm: LLM, prompt: list[int], n: int, threads: int, workdir: Path
                   ) -> tuple[Ct2Process | None, str]:
    """CTranslate2 float32 and int8 (``int8_float32``) on the same weights, converted here and run in a child process
    of their own (``Ct2Process``: CTranslate2 in this process would slow PyTorch's threads), or why not."""
    try:
        import ctranslate2
        from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    except ImportError as error:
        return None, f"CTranslate2 not run: {error} (pip install 'labkit[bench]')"
    c = llm.model_config
    hf_config = AutoConfig.for_model("llama", vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                     intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                                     num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                                     num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                                     rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
                                     tie_word_embeddings=c.tie_word_embeddings, bos_token_id=1, eos_token_id=2)
    hf = LlamaForCausalLM(hf_config)
    result = hf.load_state_dict({k: v.contiguous() for k, v in llm.model.state_dict().items()}, strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:  # lm_head: tied to the embedding
        return None, f"CTranslate2 not run: the weights did not map onto transformers' Llama ({result})"
    hf.save_pretrained(workdir / "hf")
    for file in bundled_model_path().glob("tokenizer*"):  # the tokenizer labkit runs the preset with
        (workdir / "hf" / file.name).write_bytes(file.read_bytes())
    tokens = AutoTokenizer.from_pretrained(workdir / "hf").convert_ids_to_tokens(prompt)  # CTranslate2 takes strings
    models = {}
    for name, compute in CT2_CONTENDERS.items():
        out = workdir / compute
        converter = ctranslate2.converters.TransformersConverter(str(workdir / "hf"))
        converter.convert(str(out), quantization=compute, force=True)  # converting runs no generation here
        models[name] = (str(out), compute)
    return Ct2Process(models, tokens, n, threads), ""


KERNEL_A8 = "labkit GEMV int4 (group 32), int8 activations"
KERNEL_INT8_A16 = "labkit GEMV int8, int16 activations"
KERNEL_INT4_A16 = "labkit GEMV int4 (group 32), int16 activations"


def kernel_contenders(layers: int, out_features: int = 4096, in_features: int = 2048
                      ) -> tuple[dict[str, Callable[[], None]], dict[str, int]]:
    """Batch-1 products over ``layers`` weights of one shape (float32: layers x 32 MiB, past the caches), one call
    each: PyTorch's ``F.linear``, labkit's float32 ``Linear`` on its "onednn" choice (oneDNN) and on "auto" (the GEMV
    kernel, through the layer), and labkit's GEMV kernels called directly in float32, int8 and int4; with the bytes
    each reads. Plus ``READ_ROOF``: the same float32 bytes summed (the read roof, in the same rounds)."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(out_features, in_features, generator=gen) * 0.02 for _ in range(layers)]
    x = torch.randn(1, in_features, generator=gen)
    lins, auto_lins = [], []
    for w in ws:
        lin, auto = Linear(in_features, out_features, bias=False), Linear(in_features, out_features, bias=False)
        lin.weight.data, auto.weight.data = w.clone(), w.clone()
        lin.kernel.choice = "onednn"
        lins.append(lin)
        auto_lins.append(auto)
    q8 = [quantize_int8(w) for w in ws]
    q4 = [quantize_int4(w, 32) for w in ws]
    calls: dict[str, Callable[[int], object]] = {
        "F.linear (float32)": lambda i: torch.nn.functional.linear(x, ws[i]),
        "labkit Linear, oneDNN (float32)": lambda i: lins[i](x),
        "labkit Linear, auto (float32)": lambda i: auto_lins[i](x),
        "labkit GEMV float32": lambda i: gemv.gemv_f32(x, ws[i]),
        "labkit GEMV int8": lambda i: gemv.gemv_int8(x, *q8[i]),
        "labkit GEMV int4 (group 32)": lambda i: gemv.gemv_int4(x, *q4[i], 32),
        KERNEL_INT8_A16: lambda i: gemv.gemv_int8_a16(x, *q8[i]),
        KERNEL_INT4_A16: lambda i: gemv.gemv_int4_a16(x, *q4[i], 32),
        KERNEL_A8: lambda i: gemv.gemv_int4_a8(x, *q4[i], 32)}
    module = gemv.load_gemv(warn=False)
    if module is not None:  # the roof as the kernels are timed, not only once before the run
        calls[READ_ROOF] = lambda i: module.stream_sum(ws[i], gemv.grain(out_features, in_features * 4))
    f32 = out_features * in_features * 4
    nbytes = {name: f32 for name in calls}
    nbytes["labkit GEMV int8"] = out_features * in_features + out_features * 4
    nbytes["labkit GEMV int4 (group 32)"] = out_features * in_features // 2 + out_features * in_features // 32 * 4
    nbytes[KERNEL_A8] = nbytes[KERNEL_INT4_A16] = nbytes["labkit GEMV int4 (group 32)"]
    nbytes[KERNEL_INT8_A16] = nbytes["labkit GEMV int8"]

    def each(call: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                for i in range(layers):
                    call(i)
        return run
    return {name: each(call) for name, call in calls.items()}, {k: v * layers for k, v in nbytes.items()}


@dataclass
class Results:
    sizes: Sizes
    roof_bytes_s: float
    rounds: Rounds
    weight_bytes: dict[str, int]
    ppl: dict[str, float]
    ct2_note: str
    kernels: Rounds | None = None
    kernel_bytes: dict[str, int] | None = None
    split: dict[str, list[DecodeBreakdown]] | None = None  # float32 contender -> one step split per round
    kv_ppl: dict[str, float] | None = None  # kv_cache_dtype -> perplexity (float32 weights)


def step_splits(llms: dict[str, LLM], prompt: list[int], steps: int, num_rounds: int
                ) -> dict[str, list[DecodeBreakdown]]:
    """Each float32 contender's decode step split (linear layers, attention, everything else, engine), interleaved."""
    splits: dict[str, list[DecodeBreakdown]] = {name: [] for name in llms}

    def split(name: str) -> Callable[[], None]:
        llm = llms[name]
        backend = resolve_attention_backend(llm.engine.config.attention_backend, "cpu", llm.dtype)

        def run() -> None:
            splits[name].append(measure_decode_breakdown(llm, prompt, steps, backend))
        return run
    interleave({name: split(name) for name in llms}, num_rounds, warmup=0, progress=False, check_load=False)
    return splits


def run(sizes: Sizes, threads: int, progress: bool = True) -> Results:
    """Every measurement of the report, in one process."""
    roof = stream_read_bandwidth()
    prompt_text = " ".join(generate_stories(8, seed=5))
    # labkit's formats with the decode plan (labkit.core.engine.decode_plan); the same weights (same seed) layer by
    # layer, on oneDNN, and with RMSNorm on F.rms_norm (neither of which a plan runs)
    llms = {name: LLM(sizes.model, quantization=q, max_num_seqs=1, decode_plan=True) for name, q in FORMATS.items()}
    for name, eager in EAGER.items():
        llms[eager] = LLM(sizes.model, quantization=FORMATS[name], max_num_seqs=1)
    llms[ONEDNN_FLOAT32] = LLM(sizes.model, max_num_seqs=1)
    set_linear_kernel(llms[ONEDNN_FLOAT32].model, "onednn")
    llms[PLAIN_NORM_FLOAT32] = LLM(sizes.model, max_num_seqs=1)
    for module in llms[PLAIN_NORM_FLOAT32].model.modules():
        if isinstance(module, RMSNorm):
            module.use_kernel = False
    prompt = llms["float32"].encode(prompt_text)[: sizes.prompt_len]
    contenders = {name: decode_contender(llm, prompt, sizes.decode_tokens) for name, llm in llms.items()}
    contenders[READ_ROOF] = roof_contender()  # in every round: the roof each round's decodes are held to
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ct2, note = ct2_contenders(llms["float32"], prompt, sizes.decode_tokens, threads, Path(tmp))
        except Exception as error:  # noqa: BLE001  a converter or runtime failure is reported, not fatal
            ct2, note = None, f"CTranslate2 not run: {type(error).__name__}: {str(error)[:200]}"
        with ct2 if ct2 is not None else contextlib.nullcontext():
            others = {name: ct2.contender(name) for name in CT2_CONTENDERS} if ct2 is not None else {}
            rounds = interleave({**contenders, **others}, sizes.rounds, progress=progress)
    bytes_ = {name: weight_bytes(llm.model) for name, llm in llms.items()}
    planned = [name for name in FORMATS if llms[name].engine.runner.decode_plan.steps == 0]  # type: ignore[union-attr]
    if planned:  # a plan that never ran would make the rows above "layer by layer" under another name
        raise RuntimeError(f"the decode plan did not run for {', '.join(planned)}: "
                           f"{llms[planned[0]].engine.runner.decode_plan.why_not}")  # type: ignore[union-attr]
    # The split times every linear-layer and attention call: the layer-by-layer path (a plan makes neither call)
    split = step_splits({name: llms[name] for name in (EAGER["float32"], ONEDNN_FLOAT32)}, prompt,
                        sizes.decode_tokens, sizes.rounds)
    for llm in llms.values():
        llm.close()
    text = "\n\n".join(generate_stories(sizes.ppl_stories, seed=HELD_OUT_SEED))
    ppl = {}
    for name, q in FORMATS.items():
        with LLM(str(bundled_model_path()), quantization=q) as llm:
            ppl[name] = perplexity(llm, text)
    with LLM(str(bundled_model_path())) as llm:
        kv_ppl = {kv: perplexity(llm, text, kv_cache_dtype=kv) for kv in KV_FORMATS}
    kernels, kernel_bytes = kernel_contenders(8 if sizes is FULL else 2)
    kernel_rounds = interleave(kernels, sizes.rounds + 2, progress=progress)
    if READ_ROOF in kernels:  # a roof is the most the memory gave: a VM's bandwidth drifts with its host's load
        roof = max(roof, kernel_bytes[READ_ROOF] / kernel_rounds.median(READ_ROOF))
    roof = max([roof, *rounds.get(READ_ROOF, "roof_bytes_s")])
    return Results(sizes, roof, rounds, bytes_, ppl, note, kernel_rounds, kernel_bytes, split, kv_ppl)


def near(value: float, target: float) -> str:
    """Two decimals, or three where two would round a miss up to the target (3.497 -> "3.50", not met)."""
    return f"{value:.3f}" if abs(value - target) < 0.01 else f"{value:.2f}"


def round_roofs(res: Results) -> str:
    """The hardware table's roof line: the decode rounds' roofs, and the most the memory gave in the run."""
    run_max = (f"{res.roof_bytes_s / 1e9:.1f} GB/s at most in the run (its start, the decode rounds, the kernel "
               "table's rounds)")
    if READ_ROOF not in res.rounds.contenders:
        return f"{run_max}; float32 tensors of 256 MB summed by the same threads"
    lo, hi = res.rounds.spread(READ_ROOF, "roof_bytes_s")
    return (f"{res.rounds.median(READ_ROOF, 'roof_bytes_s') / 1e9:.1f} GB/s in the decode rounds (range "
            f"{lo / 1e9:.1f}-{hi / 1e9:.1f}); {run_max}; float32 tensors of 256 MB summed by the same threads")


def report(res: Results, command: str, hw: Hardware, wall_s: float, other_load: float | None) -> str:
    r, roof = res.rounds, res.roof_bytes_s
    rows = []
    for name in r.contenders:
        if name == READ_ROOF:
            continue
        ms = r.median(name, "decode_ms")
        lo, hi = r.spread(name, "decode_ms")
        share = f"{decode_share(res, name):.2f}" if name in res.weight_bytes else "-"
        mb = f"{res.weight_bytes[name] / 1e6:.1f}" if name in res.weight_bytes else "-"
        delta = (res.ppl[name] / res.ppl["float32"] - 1) * 100 if name in res.ppl else 0.0
        ppl = f"{res.ppl[name]:.3f} ({delta:+.2f}%)" if name in res.ppl else "-"
        # float32's ms over this row's, round by round, median: the goals' ratio, shown as they show it
        speed_up = statistics.median(r.ratios("float32", name, "decode_ms"))
        shown = near(speed_up, SPEED_TARGETS[name]) if name in SPEED_TARGETS else f"{speed_up:.2f}"
        rows.append([name, mb, f"{ms:.2f} ({lo:.2f}-{hi:.2f})", f"{shown}x", share,
                     f"{r.median(name, 'prefill_tok_s'):.0f}", ppl])
    lines = report_header("Benchmark: weight-only quantization on the CPU", command, hw, wall_s, other_load,
                          extra_rows=[
        ["streaming-read roof", round_roofs(res)]])
    lines += [
        f"Decode at batch 1 on `{res.sizes.model}` "
        f"({'random weights' if res.sizes.model != 'labkit-tiny' else 'bundled'}), a {res.sizes.prompt_len}-token "
        f"prompt, {res.sizes.decode_tokens} tokens, {r.num_rounds} interleaved "
        "rounds (median, range). tok/s vs float32: float32's decode time over the row's, round by round, median (the "
        "goals' ratio). Share of roof: the linear layers' weight bytes per step over the step's time, over "
        "the read roof measured in the same round (the embedding row, the KV cache and the activations are left out: "
        "a lower bound on the bytes), median of the rounds. "
        "Perplexity: the bundled trained model (`labkit-tiny`) on held-out stories (the training grammar, seed "
        f"{HELD_OUT_SEED}, which training did not use).", "",
        md_table(["format", "weight MB", "decode ms/token", "tok/s vs float32", "share of read roof",
                  "prefill tok/s", "perplexity (vs float32)"], rows), "",
    ]
    if res.ct2_note:
        lines += [res.ct2_note, ""]
    if res.split:
        lines += split_section(res), ""
    if res.kv_ppl:
        base = res.ppl["float32"]
        kv_rows = [["auto (float32)", f"{base:.3f} (+0.00%)"]] + [
            [kv, f"{v:.3f} ({(v / base - 1) * 100:+.2f}%)"] for kv, v in res.kv_ppl.items()]
        lines += ["## KV cache formats: perplexity", "",
                  "The bundled model (float32 weights) on the same held-out stories, every key and value rounded as "
                  "the 8-bit pool stores it (int8: one float32 scale per token and head; fp8: e4m3 with the per-layer "
                  "scale 1.0, vLLM's default without calibration) before attention reads it.", "",
                  md_table(["kv_cache_dtype", "perplexity (vs auto)"], kv_rows), ""]
    if res.kernels is not None and res.kernel_bytes is not None:
        k = res.kernels
        krows = []
        kroof = res.kernel_bytes[READ_ROOF] / k.median(READ_ROOF) if READ_ROOF in k.contenders else roof
        for name in k.contenders:
            sec = k.median(name)
            krows.append([name, f"{res.kernel_bytes[name] / 2**20:.0f}", f"{sec * 1e3:.2f}",
                          f"{res.kernel_bytes[name] / sec / 1e9:.1f}", f"{res.kernel_bytes[name] / sec / kroof:.2f}",
                          f"{statistics.median(k.ratios('F.linear (float32)', name)):.2f}x"])
        lines += ["## The GEMV kernels alone (batch 1, weights past the caches)", "",
                  f"Eight (or, smoke, two) 4096 x 2048 layers, one call each, {k.num_rounds} interleaved rounds "
                  "(median). GB/s: the weight bytes read over the time; share of read roof: over the streaming "
                  "read of the same float32 weights in the same rounds (its row); speed-up: F.linear's time over "
                  "the kernel's, round by round.", "",
                  md_table(["kernel", "weight MiB", "ms", "GB/s", "share of read roof", "speed-up vs F.linear"],
                           krows), ""]
    # The int4 is "group 32 or 64": both weight-only group sizes get the speed line (the perplexity bound it
    # states is group 32's), with float32 and with int16 activations (weight-only in vLLM's W8A16 / W4A16 sense);
    # the int8-activation variant is shown beside them, named as not weight-only.
    goals = [("int8 tok/s >= 2.5x labkit float32", "int8", "float32", SPEED_TARGETS["int8"]),
             ("int8, int16 activations (int8-a16) >= 2.5x", A16["int8"], "float32", SPEED_TARGETS["int8"]),
             ("int4 (group 32) tok/s >= 3.5x labkit float32", "int4-g32", "float32", SPEED_TARGETS["int4-g32"]),
             ("int4 (group 32), int16 activations (int4-g32-a16) >= 3.5x", A16["int4-g32"], "float32",
              SPEED_TARGETS["int4-g32"]),
             ("int4 (group 64) tok/s >= 3.5x labkit float32", "int4-g64", "float32", SPEED_TARGETS["int4-g64"]),
             ("int4 (group 64), int16 activations (int4-g64-a16) >= 3.5x", A16["int4-g64"], "float32",
              SPEED_TARGETS["int4-g64"]),
             ("int4 group 32 with int8 activations (int4-g32-a8, not weight-only)", A8, "float32", SPEED_TARGETS[A8]),
             ("int8 >= 1.0x CTranslate2 int8", "int8", "CTranslate2 int8", 1.0),
             ("float32 >= 1.5x CTranslate2 float32", "float32", "CTranslate2 float32", 1.5)]
    goal_rows = []
    for claim, a, b, target in goals:
        if b not in r.contenders or a not in r.contenders:
            goal_rows.append([claim, "not measured", "-"])
            continue
        ratio = statistics.median(r.ratios(b, a, "decode_ms"))
        goal_rows.append([claim, f"{near(ratio, target)}x", "met" if ratio >= target else "not met"])
    share = decode_share(res, "float32")
    goal_rows.append(["float32 decode >= 0.6 of the read roof", near(share, 0.6), "met" if share >= 0.6 else "not met"])
    # issue 35's perplexity bounds: int8 1%, int4 5%, whatever the activations
    limits = {name: 1.0 if name.startswith("int8") else 5.0 for name in FORMATS if name != "float32"}
    for name, limit in limits.items():
        if name not in res.ppl:
            continue
        delta = (res.ppl[name] / res.ppl["float32"] - 1) * 100
        goal_rows.append([f"{name} perplexity increase <= {limit:g}%", f"{delta:+.2f}%",
                          "met" if delta <= limit else "not met"])
    for kv, value in (res.kv_ppl or {}).items():
        delta = (value / res.ppl["float32"] - 1) * 100
        goal_rows.append([f"KV {kv} perplexity increase <= 1%", f"{delta:+.2f}%", "met" if delta <= 1.0 else "not met"])
    lines += ["## Goals (issue 35)", "", md_table(["goal", "measured", ""], goal_rows), ""]
    if other_load is not None and other_load > BUSY_SHARE:
        lines += [f"**Other processes kept {other_load:.0%} of the CPUs busy during this run: the timed rows above "
                  "(and the timing goals' met / not met) are not evidence either way; re-run on a quiet machine.** "
                  "The perplexity rows do not depend on load.", ""]
    lines += ["## Notes", "", NOTES, ""]
    return "\n".join(lines)


def split_section(res: Results) -> str:
    """The float32 decode step split into its parts, per contender (medians over the rounds)."""
    assert res.split is not None
    rows = []
    for name, runs in res.split.items():
        parts = {part: statistics.median(b.shares()[part] for b in runs) * 1e3 for part in runs[0].shares()}
        step_ms = statistics.median(b.step_s for b in runs) * 1e3
        linear_s = parts["linear layers"] / 1e3
        rate = res.weight_bytes[name] / linear_s
        rows.append([name, f"{step_ms:.2f}", *(f"{v:.2f}" for v in parts.values()), f"{rate / 1e9:.1f}",
                     f"{rate / res.roof_bytes_s:.2f}"])
    heads = ["float32 path", "step ms (untimed)", "linear layers ms", "attention ms", "everything else ms",
             "engine ms", "linear layers GB/s", "their share of read roof"]
    n = len(next(iter(res.split.values())))
    runs = res.split[EAGER["float32"]]
    rest_ms = statistics.median(sum(v for k, v in b.shares().items() if k != "linear layers") for b in runs) * 1e3
    step_ms = statistics.median(b.step_s for b in runs) * 1e3
    bounds = ", ".join(f"{name} at most {step_ms / (rest_ms + res.weight_bytes[name] / res.roof_bytes_s * 1e3):.2f}x"
                       for name in ("int8", "int4-g32") if name in res.weight_bytes)
    return "\n".join([
        "## Where a float32 decode step goes", "",
        f"The same model at batch 1 after the same prompt, {res.sizes.decode_tokens} decode steps, {n} interleaved "
        "rounds (median): once untimed inside (the step), once with a timer around every linear-layer call and every "
        "attention call (`labkit.measure.decode_roof.measure_decode_breakdown`, notebook 04's split; the timers add "
        "a few µs per call). Both run layer by layer: the decode plan makes none of the calls the timers wrap. "
        f"\"{EAGER['float32']}\" is labkit's float32 without the plan (decode-shaped calls on its C++ GEMV kernel); "
        f"\"{ONEDNN_FLOAT32}\" is the path before that kernel (`set_linear_kernel(model, \"onednn\")`). The linear "
        "layers' GB/s: their weight bytes per step over their time inside the step.", "",
        md_table(heads, rows), "",
        f"Layer by layer, everything but the linear layers takes {rest_ms:.2f} ms of the float32 step "
        f"({step_ms:.2f} ms). If a quantized format left that part unchanged and streamed its weights at the full "
        f"read roof, its tok/s over float32's would be {bounds}: the part of the step that is not weights, not the "
        f"GEMV kernels, bounds the speed-up goals at this model size. {plan_line(res)}"])


def plan_line(res: Results) -> str:
    """What the decode plan took off a step, from the decode rounds (the same rounds, so the same bandwidth)."""
    r = res.rounds
    lines = []
    for name, eager in EAGER.items():
        if name in r.contenders and eager in r.contenders:
            saved = statistics.median(a - b for a, b in zip(r.get(eager, "decode_ms"), r.get(name, "decode_ms")))
            lines.append(f"{name} {saved:.2f} ms a step ({statistics.median(r.ratios(eager, name, 'decode_ms')):.2f}x "
                         f"the tok/s)")
    return ("The decode plan (`decode_plan=True`: each step as prebuilt C++ calls, no per-layer Python) takes off, "
            f"round by round in the decode rounds: {'; '.join(lines)}." if lines else "")


NOTES = """\
* Formats: int8 is symmetric per output channel (one float32 scale per row); int4 is symmetric per group of 32 (or 64)
  inputs, two values per byte (element 2j in the low nibble), one float32 scale per group. Every linear layer is
  quantized, lm_head included; the embedding table stays float32 (a lookup reads one row per token).
* Decode-shaped calls (up to 16 rows) run labkit's C++ GEMV kernels (`labkit/core/quant/csrc/gemv_cpu.cpp`, -O3
  -march=native: AVX-512 here), which read the int8/int4 bytes once and widen them in registers; prefill dequantizes
  each layer for the call and runs one matrix product, which is why quantized prefill is slower than float32 here.
* int4-g32-a8: the int4-g32 weights, and each decode call's inputs rounded to int8 (one float32 scale, amax / 127,
  per 32 inputs; `QuantizationConfig("int4", activations="int8")`, llama.cpp's Q4_0 x Q8_0 scheme): AVX-512 VNNI's
  integer dot product (vpdpbusd) multiplies 64 weights per instruction. With float inputs the int4 kernel is bound by
  the instructions that widen nibbles to floats, not by memory (the kernel table: int4's GB/s is well under int8's).
  Not weight-only: its perplexity is scored with every row on the kernel, inputs rounded.
* The "-a16" rows: the same int8 / int4 weights, and each decode call's inputs rounded to int16 (one float32 scale,
  amax / 32767, per 32 inputs; `QuantizationConfig("int8", activations="int16")`): AVX-512 VNNI's vpdpwssd multiplies
  32 weights (widened to int16 by one instruction) per instruction, where the float kernels spend about two
  instructions per 16 weights widening them to floats before each multiply-add. The integer sums are exact; x's
  rounding errs by at most amax / 65534 an input, so a group's dot product by at most what rounding x to float16
  could cost at its largest input (tested: the kernels' error on outlier-heavy inputs is under float16 inputs'):
  weight-only in vLLM's W8A16 / W4A16 sense, where activations are 16-bit. Their perplexity is scored with every row
  on the kernel, inputs rounded.
* The rows "float32", "int8", "int4-g32", "int4-g64", their "-a16" variants and "int4-g32-a8" run with the decode plan
  (`LLM(..., decode_plan=True)`, `labkit.core.engine.decode_plan`): each decode step as a prebuilt list of C++ calls
  (GEMV kernels, RMSNorm, RoPE, SwiGLU's gate, the K/V write, paged decode attention) instead of module by module, the
  CPU's counterpart of CUDA graphs; the same arithmetic (same tokens, tested). The "layer by layer" rows are the same
  weights without it.
* labkit's float32 decode runs decode-shaped calls (up to 16 rows) on the same C++ float32 GEMV kernel
  (`labkit.core.model.linear`'s "auto" choice; prefill stays on oneDNN); the row "float32, oneDNN / MKL" is the path
  before it, weights in (in, out) memory, oneDNN or MKL (`set_linear_kernel(model, "onednn")`), the same weights.
* RMSNorm on float32 CPU rows runs on the same C++ module (`rms_norm_f32`: one pass over the row) instead of
  `F.rms_norm`, which runs as six small PyTorch ops on a CPU (~25 us per row, 61 rows per decode step here); the row
  "float32, RMSNorm on F.rms_norm" is labkit's float32 layer by layer without it (`RMSNorm.use_kernel = False`), timed
  in the same rounds (compare it with "float32, layer by layer": the kernel's effect in this run; a difference of a
  few percent is within the spread of three rounds on this VM).
* int4 kernel: the inner loop found each group's scale by a 64-bit division (`g0 / group`) once per 16 bytes; a
  pointer that steps once per group instead took the kernel from 18.6 to 22.3 GB/s (8 layers 4096 x 2048, 15
  interleaved rounds, against 22.8 GB/s for int8 in the same run; one-off script, results bit-identical, on an AMD
  EPYC VM). A first version decoding 64 weights per iteration with four accumulators was slower there (19.3 GB/s).
  On a 2-core Intel Xeon VM, with the software prefetch of the next note, two 32-weight chunks per iteration, each
  with its own table and accumulators, was faster: 4096 x 2048 layers 19.6-20.3 -> 21.8-22.1 GB/s (group 32),
  smollm2-135m's shapes 0-5% (one-off script, two runs); it is the kernel now.
* GEMV kernels (AVX-512) ask for the weight bytes 4 KB ahead of those they read (`_mm_prefetch`): on the Intel VM
  (8 layers 4096 x 2048, interleaved rounds, one-off script) 2 KB ahead took float32 25 -> 27 GB/s, int8 15 -> 18,
  int4 12-13 -> 16-18, int4 with int8 activations 20-21 -> 31-35; 256 bytes ahead was slower than none. 4 KB rather
  than 2: smollm2-135m's 121 layers of a step, each weight read once, int4-g32-a16 +4%, int4-g32-a8 +7%, float32 and
  int8-a16 within 1% (one-off script, interleaved rounds). The hardware prefetcher alone kept too few lines in
  flight for one core at these kernels' rate. The same prefetch made the roof's plain sum slower (24 -> 19 GB/s), so
  the roof is measured without it.
* Each thread reads its range of a layer's rows as four runs side by side (row k of each run in turn), not front to
  back: more streams of weight bytes in flight than one stream gets, however far ahead it is prefetched.
  smollm2-135m's 121 layers of a step, each weight read once (one-off script, interleaved rounds): int8 14.9 ->
  20.4-20.7 GB/s, int8-a16 16.4 -> 22.3, float32 23.7 -> 26.0-26.4. A batch of one runs the int4 int16-activation
  kernel four rows at once, one from each run, their instructions interleaved (one row's chain of dependent
  instructions left the core waiting): int4-g32-a16 18.1 GB/s for two adjacent rows at once, 21.8-25.1 for four runs.
  Each row's arithmetic is unchanged (the same bits, tested).
* CTranslate2 runs the same weights, converted from a transformers Llama checkpoint of them (greedy tokens checked
  equal to labkit's on the bundled model), `compute_type` "float32" and "int8_float32", `intra_threads` = torch's
  threads; decode ms/token from `generate_tokens`' streamed timestamps. It runs in a child process of its own
  (`labkit.measure.benchmarks.ct2_process`), timed in the same interleaved rounds: once CTranslate2 (which brings its
  own OpenMP runtime) had generated in the benchmark's process, PyTorch's threads there answered slowly at every
  parallel region (a 576 x 576 GEMV 14 -> 57-66 us; labkit's float32 decode 24-28 -> 36-38 ms per token) until the
  process ended; this report's labkit rows before that change carried that handicap.
* KV perplexity rounds K and V in the model's own causal attention (`RoundTripKV`), exactly as `QuantizedKVPool`
  writes and reads them, rather than scoring through the engine (which computes logits for the last position only);
  the engine's int8/fp8 pools are tested for greedy agreement in tests/core/quant.
* Not measured here: anything on a GPU. On CUDA, decode-shaped calls run Triton int8 / int4 GEMV kernels
  (`labkit/core/quant/triton_gemv.py`), checked on the CPU under Triton's interpreter and compiled ahead of time for
  sm_80 and sm_90 without register spills; `scripts/gpu_check.py` times them against the 16-bit layer when a GPU is
  lent (`torch._weight_int8pack_mm` was not timed).
* The roof is measured in every decode round (the format table's shares are per round, over that round's roof),
  in the kernel table's rounds (its shares), and once before the run; the most of all of them is the roof of the step
  split and of the speed-up bounds. A VM's memory bandwidth can drift with its host's other guests, which the load
  figure cannot see: on an AMD EPYC VM the same 256 MB read ran at 32.9, 35.4 and 56.4 GB/s in three runs within an
  hour; on an Intel Xeon VM it held at 27.7-31.5 GB/s over seven runs one day and at 25.3-25.8 GB/s (dips to 13)
  over three runs the next day, when the same step's work outside its linear layers also took twice as long
  (4.9 -> 9.6-9.8 ms layer by layer) and float32 prefill ran at under half the rate: every ratio moved with it.
* The machine is a shared 2-core VM: other processes' load is in the hardware table, and with load above ~10% the
  timings (and every ratio built from them) are unreliable; the perplexity figures do not depend on load."""

