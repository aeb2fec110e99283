"""Weight-only quantization on the CPU, side by side: decode ms/token, share of the read roof, prefill tok/s and
perplexity per format (labkit float32, int8, int4), and CTranslate2 on the same weights where it is installed.

``scripts/bench_quantization.py`` runs ``run`` and writes ``docs/benchmarks/quantization.md`` (and its .json). Decode
is timed at batch 1 in interleaved rounds (``labkit.measure.rounds``): a step's time from the request's token
timestamps, so engine overhead counts, as a user sees it. The roof is the memory's: one 256 MB float32 tensor summed
by the same threads (``labkit.core.quant.gemv.stream_read_bandwidth``); the share of it a format reaches is its weight
bytes per step over the step's time, over the roof. Introduced with notebook 14 (``14_quantization``).
"""

from __future__ import annotations

import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.core.llm import LLM
from labkit.core.model.linear import Linear
from labkit.core.model.source import bundled_model_path
from labkit.core.quant import QuantizationConfig, gemv, weight_bytes
from labkit.core.quant.gemv import stream_read_bandwidth
from labkit.core.quant.int4 import quantize_int4
from labkit.core.quant.int8 import quantize_int8
from labkit.core.sampling_params import SamplingParams
from labkit.measure.benchmarks.report import BUSY_SHARE, Hardware, md_table, report_header
from labkit.measure.corpus import generate_stories
from labkit.measure.rounds import Rounds, interleave

FORMATS: dict[str, str | QuantizationConfig | None] = {
    "float32": None, "int8": "int8", "int4-g32": QuantizationConfig("int4", 32),
    "int4-g64": QuantizationConfig("int4", 64)}
HELD_OUT_SEED = 777  # the bundled model was trained on stories of seeds 0, 1 and 1,000,000 + i: these are new ones


@dataclass(frozen=True)
class Sizes:
    model: str  # the speed model (a preset: random weights)
    decode_tokens: int
    prompt_len: int
    rounds: int
    ppl_stories: int


FULL = Sizes("smollm2-135m", 48, 256, 3, 40)
SMOKE = Sizes("labkit-tiny", 8, 32, 2, 4)


def perplexity(llm: LLM, text: str, window: int = 512) -> float:
    """exp(mean next-token loss) of ``text`` under ``llm.model``, in non-overlapping windows."""
    ids = llm.encode(text)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = torch.tensor(ids[start:start + window + 1])[None]  # (1, T + 1)
            if chunk.shape[1] < 2:
                break
            positions = torch.arange(chunk.shape[1] - 1)[None]
            logits = llm.model.compute_logits(llm.model(chunk[:, :-1], positions))  # (1, T, vocab)
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


def ct2_contenders(llm: LLM, prompt: list[int], n: int, threads: int, workdir: Path
                   ) -> tuple[dict[str, Callable[[], dict[str, float]]], str]:
    """CTranslate2 float32 and int8 (``int8_float32``) on the same weights, or why not."""
    try:
        import ctranslate2
        from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    except ImportError as error:
        return {}, f"CTranslate2 not run: {error} (pip install 'labkit[bench]')"
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
        return {}, f"CTranslate2 not run: the weights did not map onto transformers' Llama ({result})"
    hf.save_pretrained(workdir / "hf")
    for file in bundled_model_path().glob("tokenizer*"):  # the tokenizer labkit runs the preset with
        (workdir / "hf" / file.name).write_bytes(file.read_bytes())
    tokens = AutoTokenizer.from_pretrained(workdir / "hf").convert_ids_to_tokens(prompt)  # CTranslate2 takes strings
    contenders: dict[str, Callable[[], dict[str, float]]] = {}
    for name, compute in (("CTranslate2 float32", "float32"), ("CTranslate2 int8", "int8_float32")):
        out = workdir / compute
        converter = ctranslate2.converters.TransformersConverter(str(workdir / "hf"))
        converter.convert(str(out), quantization=compute, force=True)
        gen = ctranslate2.Generator(str(out), device="cpu", compute_type=compute, intra_threads=threads)

        def run(gen: ctranslate2.Generator = gen) -> dict[str, float]:
            start, times = time.perf_counter(), []
            for _ in gen.generate_tokens(tokens, max_length=n, min_length=n, sampling_topk=1):  # greedy, streamed
                times.append(time.perf_counter())
            return {"decode_ms": (times[-1] - times[0]) / (len(times) - 1) * 1e3,
                    "prefill_tok_s": len(tokens) / (times[0] - start)}
        contenders[name] = run
    return contenders, ""


def kernel_contenders(layers: int, out_features: int = 4096, in_features: int = 2048
                      ) -> tuple[dict[str, Callable[[], None]], dict[str, int]]:
    """Batch-1 products over ``layers`` weights of one shape (float32: layers x 32 MiB, past the caches), one call
    each: PyTorch's ``F.linear``, labkit's float32 ``Linear`` (oneDNN), and labkit's GEMV kernels in float32, int8 and
    int4; with the bytes each reads."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(out_features, in_features, generator=gen) * 0.02 for _ in range(layers)]
    x = torch.randn(1, in_features, generator=gen)
    lins = []
    for w in ws:
        lin = Linear(in_features, out_features, bias=False)
        lin.weight.data = w.clone()
        lins.append(lin)
    q8 = [quantize_int8(w) for w in ws]
    q4 = [quantize_int4(w, 32) for w in ws]
    calls: dict[str, Callable[[int], object]] = {
        "F.linear (float32)": lambda i: torch.nn.functional.linear(x, ws[i]),
        "labkit Linear, oneDNN (float32)": lambda i: lins[i](x),
        "labkit GEMV float32": lambda i: gemv.gemv_f32(x, ws[i]),
        "labkit GEMV int8": lambda i: gemv.gemv_int8(x, *q8[i]),
        "labkit GEMV int4 (group 32)": lambda i: gemv.gemv_int4(x, *q4[i], 32)}
    f32 = out_features * in_features * 4
    nbytes = {name: f32 for name in calls}
    nbytes["labkit GEMV int8"] = out_features * in_features + out_features * 4
    nbytes["labkit GEMV int4 (group 32)"] = out_features * in_features // 2 + out_features * in_features // 32 * 4

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


def run(sizes: Sizes, threads: int, progress: bool = True) -> Results:
    """Every measurement of the report, in one process."""
    roof = stream_read_bandwidth()
    prompt_text = " ".join(generate_stories(8, seed=5))
    llms = {name: LLM(sizes.model, quantization=q, max_num_seqs=1) for name, q in FORMATS.items()}
    prompt = llms["float32"].encode(prompt_text)[: sizes.prompt_len]
    contenders = {name: decode_contender(llm, prompt, sizes.decode_tokens) for name, llm in llms.items()}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ct2, note = ct2_contenders(llms["float32"], prompt, sizes.decode_tokens, threads, Path(tmp))
        except Exception as error:  # noqa: BLE001  a converter or runtime failure is reported, not fatal
            ct2, note = {}, f"CTranslate2 not run: {type(error).__name__}: {str(error)[:200]}"
        rounds = interleave({**contenders, **ct2}, sizes.rounds, progress=progress)
    bytes_ = {name: weight_bytes(llm.model) for name, llm in llms.items()}
    for llm in llms.values():
        llm.close()
    text = "\n\n".join(generate_stories(sizes.ppl_stories, seed=HELD_OUT_SEED))
    ppl = {}
    for name, q in FORMATS.items():
        with LLM(str(bundled_model_path()), quantization=q) as llm:
            ppl[name] = perplexity(llm, text)
    kernels, kernel_bytes = kernel_contenders(8 if sizes is FULL else 2)
    kernel_rounds = interleave(kernels, sizes.rounds + 2, progress=progress)
    return Results(sizes, roof, rounds, bytes_, ppl, note, kernel_rounds, kernel_bytes)


def report(res: Results, command: str, hw: Hardware, wall_s: float, other_load: float | None) -> str:
    r, roof = res.rounds, res.roof_bytes_s
    base_ms = r.median("float32", "decode_ms")
    rows = []
    for name in r.contenders:
        ms = r.median(name, "decode_ms")
        lo, hi = r.spread(name, "decode_ms")
        share = f"{res.weight_bytes[name] / (ms / 1e3) / roof:.2f}" if name in res.weight_bytes else "-"
        mb = f"{res.weight_bytes[name] / 1e6:.1f}" if name in res.weight_bytes else "-"
        delta = (res.ppl[name] / res.ppl["float32"] - 1) * 100 if name in res.ppl else 0.0
        ppl = f"{res.ppl[name]:.3f} ({delta:+.2f}%)" if name in res.ppl else "-"
        rows.append([name, mb, f"{ms:.2f} ({lo:.2f}-{hi:.2f})", f"{base_ms / ms:.2f}x", share,
                     f"{r.median(name, 'prefill_tok_s'):.0f}", ppl])
    lines = report_header("Benchmark: weight-only quantization on the CPU", command, hw, wall_s, other_load,
                          extra_rows=[
        ["streaming-read roof", f"{roof / 1e9:.1f} GB/s (one 256 MB float32 tensor summed, same threads)"]])
    lines += [
        f"Decode at batch 1 on `{res.sizes.model}` "
        f"({'random weights' if res.sizes.model != 'labkit-tiny' else 'bundled'}), a {res.sizes.prompt_len}-token "
        f"prompt, {res.sizes.decode_tokens} tokens, {r.num_rounds} interleaved "
        "rounds (median, range). Share of roof: the linear layers' weight bytes per step over the step's time, over "
        "the roof (the embedding row, the KV cache and the activations are left out: a lower bound on the bytes). "
        "Perplexity: the bundled trained model (`labkit-tiny`) on held-out stories (the training grammar, seed "
        f"{HELD_OUT_SEED}, which training did not use).", "",
        md_table(["format", "weight MB", "decode ms/token", "tok/s vs float32", "share of read roof",
                  "prefill tok/s", "perplexity (vs float32)"], rows), "",
    ]
    if res.ct2_note:
        lines += [res.ct2_note, ""]
    if res.kernels is not None and res.kernel_bytes is not None:
        k = res.kernels
        krows = []
        for name in k.contenders:
            sec = k.median(name)
            krows.append([name, f"{res.kernel_bytes[name] / 2**20:.0f}", f"{sec * 1e3:.2f}",
                          f"{res.kernel_bytes[name] / sec / 1e9:.1f}", f"{res.kernel_bytes[name] / sec / roof:.2f}",
                          f"{statistics.median(k.ratios('F.linear (float32)', name)):.2f}x"])
        lines += ["## The GEMV kernels alone (batch 1, weights past the caches)", "",
                  f"Eight (or, smoke, two) 4096 x 2048 layers, one call each, {k.num_rounds} interleaved rounds "
                  "(median). GB/s: the weight bytes read over the time; the roof is the streaming read above; "
                  "speed-up: F.linear's time over the kernel's, round by round.", "",
                  md_table(["kernel", "weight MiB", "ms", "GB/s", "share of read roof", "speed-up vs F.linear"],
                           krows), ""]
    goals = [("int8 tok/s >= 2.5x labkit float32", "int8", "float32", 2.5),
             ("int4 (group 32) tok/s >= 3.5x labkit float32", "int4-g32", "float32", 3.5),
             ("int8 >= 1.0x CTranslate2 int8", "int8", "CTranslate2 int8", 1.0),
             ("float32 >= 1.5x CTranslate2 float32", "float32", "CTranslate2 float32", 1.5)]
    goal_rows = []
    for claim, a, b, target in goals:
        if b not in r.contenders:
            goal_rows.append([claim, "not measured", "-"])
            continue
        ratio = statistics.median(r.ratios(b, a, "decode_ms"))
        goal_rows.append([claim, f"{ratio:.2f}x", "met" if ratio >= target else "not met"])
    share = res.weight_bytes["float32"] / (base_ms / 1e3) / roof
    goal_rows.append(["float32 decode >= 0.6 of the read roof", f"{share:.2f}", "met" if share >= 0.6 else "not met"])
    for name, limit in (("int8", 1.0), ("int4-g32", 5.0)):
        delta = (res.ppl[name] / res.ppl["float32"] - 1) * 100
        goal_rows.append([f"{name} perplexity increase <= {limit:g}%", f"{delta:+.2f}%",
                          "met" if delta <= limit else "not met"])
    lines += ["## Goals (issue 35)", "", md_table(["goal", "measured", ""], goal_rows), ""]
    if other_load is not None and other_load > BUSY_SHARE:
        lines += [f"**Other processes kept {other_load:.0%} of the CPUs busy during this run: the timed rows above "
                  "(and the timing goals' met / not met) are not evidence either way; re-run on a quiet machine.** "
                  "The perplexity rows do not depend on load.", ""]
    lines += ["## Notes", "", NOTES, ""]
    return "\n".join(lines)


NOTES = """\
* Formats: int8 is symmetric per output channel (one float32 scale per row); int4 is symmetric per group of 32 (or 64)
  inputs, two values per byte (element 2j in the low nibble), one float32 scale per group. Every linear layer is
  quantized, lm_head included; the embedding table stays float32 (a lookup reads one row per token).
* Decode-shaped calls (up to 16 rows) run labkit's C++ GEMV kernels (`labkit/core/quant/csrc/gemv_cpu.cpp`, -O3
  -march=native: AVX-512 here), which read the int8/int4 bytes once and widen them in registers; prefill dequantizes
  each layer for the call and runs one matrix product, which is why quantized prefill is slower than float32 here.
* labkit's float32 decode in the table above runs its usual path (oneDNN / MKL, `labkit.core.model.linear`); the
  float32 GEMV kernel is compared with it only in the kernel table, not wired into the engine.
* CTranslate2 runs the same weights, converted from a transformers Llama checkpoint of them (greedy tokens checked
  equal to labkit's on the bundled model), `compute_type` "float32" and "int8_float32", `intra_threads` = torch's
  threads; decode ms/token from `generate_tokens`' streamed timestamps.
* Not measured here: the float32 step split into weights, attention, everything else and the engine (notebook 04 and
  `scripts/bench_kvcache.py` split labkit's step); anything on a GPU (no GPU on this machine: no Triton int4/int8
  GEMV kernel was written, and `torch._weight_int8pack_mm` was not timed on CUDA); KV int8/fp8 perplexity (the KV
  formats are tested for greedy agreement in tests/core/quant).
* The machine is a shared 2-core VM: other processes' load is in the hardware table, and with load above ~10% the
  timings (and every ratio built from them) are unreliable; the perplexity figures do not depend on load."""

