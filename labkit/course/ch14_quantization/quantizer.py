"""Checker for notebook 14's Task 1: ``quantize_weight(weight, method, group_size, scales)``.

Mirrors ``labkit.core.quant.weights.quantize_weight``. The checker asks, in order: the shapes and dtypes of both
formats; int8's scale per output channel (rows of very different size); every value within half a step of its
original, and the largest at the end of the range (a scale that lets it overflow fails); saturation with given,
smaller scales (a missing clamp wraps around); int4's nibble order (labkit's kernel reads element 2j from the low
nibble); and inside the engine, greedy tokens of ``LLM(..., quantization=...)`` with the learner's quantizer equal
to labkit's.
"""

from __future__ import annotations

import torch

from labkit.core.quant.weights import Quantizer, dequantize_weight, quantize_weight
from labkit.course import Check, CheckResult, run_checker
from labkit.course.hints import Hints

QUANTIZER_HINTS = Hints(
    concept=("A row of a weight matrix is one output's dot product: what must every value of the row share so that "
             "the output is one integer dot product times one number? And which integer must the row's largest "
             "magnitude become so that no value falls outside the range?"),
    rule=("int8: one scale per output row, max|w| / 127 (1 for a row of zeros); q = round(w / scale), clamped to "
          "[-127, 127]. int4: one scale per group of group_size inputs of a row, max|w| / 7; q clamped to [-8, 7]; "
          "store q + 8 and pack two per byte, element 2j in the low nibble and 2j + 1 in the high one."),
    code=("int8: s = w.abs().amax(dim=1) / 127; s = torch.where(s > 0, s, 1); q = (w / s[:, None]).round()"
          ".clamp(-127, 127).to(torch.int8). int4: g = w.reshape(out, -1, group_size); s = g.abs().amax(2) / 7; "
          "u = ((g / s[..., None]).round().clamp(-8, 7) + 8).to(torch.uint8).flatten(1); "
          "packed = u[:, 0::2] | (u[:, 1::2] << 4)."),
    by_failure={
        "shapes": "int8 returns (int8 (out, in), scales (out,)); int4 (uint8 (out, in / 2), scales "
                  "(out, in / group_size)); both scales float32.",
        "axis": "A scale belongs to an output row (int8) or to a group of consecutive inputs of one row (int4), "
                "never to an input column.",
        "error": "Every dequantized value must be within half a step (scale / 2) of the original: round, do not "
                 "truncate, and let the largest magnitude map to the end of the range (127 or 7), not beyond it.",
        "clamp": "With a given scale some values can land past the range: they must saturate at the end of the "
                 "range, not wrap around when cast to 8 bits.",
        "zero": "A row or group of zeros needs a positive scale too (dividing by zero gives NaN).",
        "nibbles": "Which nibble holds which element is part of the format: labkit's kernel reads element 2j from "
                   "the low nibble (bits 0-3) and 2j + 1 from the high nibble.",
        "engine": "Inside the engine your quantizer's output is read by labkit's kernels: the format must match.",
    },
)


def test_weight(out: int = 48, n: int = 128, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (a per-column scale fails them), one row of zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n, generator=gen) * torch.logspace(-3, 1, out)[:, None]
    w[3] = 0.0
    return w


def format_problems(fn: Quantizer) -> list[tuple[str, str]]:
    """(failure, class) for the checks that need no engine."""
    w = test_weight()
    problems: list[tuple[str, str]] = []
    for method, group in (("int8", 32), ("int4", 32), ("int4", 64)):
        q, s = fn(w.clone(), method, group)
        want_q, want_s = quantize_weight(w, method, group)
        if q.dtype != want_q.dtype or q.shape != want_q.shape or s.shape != want_s.shape or s.dtype != torch.float32:
            problems.append((f"{method} (group {group}): got {q.dtype} {tuple(q.shape)} and scales {s.dtype} "
                             f"{tuple(s.shape)}; expected {want_q.dtype} {tuple(want_q.shape)} and float32 "
                             f"{tuple(want_s.shape)}", "axis" if q.shape == want_q.shape else "shapes"))
            continue
        if not bool(torch.isfinite(s).all() and (s > 0).all()):
            problems.append((f"{method}: some scales are zero, negative or not finite (the row of zeros is row 3)",
                             "zero"))
            continue
        if method == "int4" and torch.equal(((q & 0x0F) << 4) | (q >> 4), want_q) and not torch.equal(q, want_q):
            problems.append(("int4: every byte holds the right two values in the wrong nibbles: element 2j belongs "
                             "in the low nibble (bits 0-3) and 2j + 1 in the high nibble", "nibbles"))
            continue
        back = dequantize_weight(q, s, method, group)
        step = s[:, None] if method == "int8" else s.repeat_interleave(group, dim=1)  # (out, 1) or (out, in)
        bad = (back - w).abs() > step * 0.5001 + 1e-12
        if bool(bad.any()):
            r, c = (int(i) for i in bad.nonzero()[0])
            ratio = s / want_s  # the same everywhere: the right axis, a scale of the wrong size
            axis = float(ratio.max() / ratio.min()) > 1.01
            why = ("scales shared along the wrong axis" if axis else
                   "the scale maps the largest magnitude past the end of the range" if float(ratio.max()) < 0.999
                   else "rounding")
            half = float(step[r, 0 if method == "int8" else c]) / 2
            problems.append((f"{method} (group {group}): w[{r}, {c}] = {float(w[r, c]):.4g} comes back as "
                             f"{float(back[r, c]):.4g}, more than half a step ({half:.3g}) away ({why})",
                             "axis" if axis else "error"))
            continue
        if method == "int4" and not torch.equal(q, want_q):
            problems.append(("int4: the values are right but the bytes differ from labkit's format: element 2j "
                             "belongs in the low nibble and 2j + 1 in the high nibble, each stored as q + 8",
                             "nibbles"))
    w = torch.tensor([[1.0, -1.0, 0.5, 0.0]])  # given scales half the needed size: values past the range
    q, _ = fn(w, "int8", 32, torch.tensor([0.5 / 127]))
    if q.tolist() != [[127, -127, 127, 0]]:
        problems.append((f"int8 with a given scale of 0.5/127: [1, -1, 0.5, 0] must saturate to [127, -127, 127, 0], "
                         f"got {q.tolist()}", "clamp"))
    w = torch.tensor([[1.0] * 32])
    q, _ = fn(w, "int4", 32, torch.tensor([[0.5 / 7]]))
    if dequantize_weight(q, torch.tensor([[1.0]]), "int4", 32).flatten().tolist() != [7.0] * 32:
        problems.append(("int4 with a given scale of 0.5/7: 32 ones must saturate to 7 (stored as 15), they did not",
                         "clamp"))
    return problems


def engine_problems(fn: Quantizer, model: str = "labkit-tiny") -> list[tuple[str, str]]:
    from labkit import LLM, SamplingParams
    from labkit.core.quant import QuantizationConfig, quantize_model

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["Once upon a time", "The little dog"]
    problems = []
    for method in ("int8", "int4"):
        with LLM(model, quantization=method) as ref:
            want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
        with LLM(model) as llm:
            quantize_model(llm.model, QuantizationConfig(method), quantizer=fn)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            bm = llm.engine.block_manager  # type: ignore[attr-defined]
            if got != want:
                problems.append((f"inside the engine, quantization={method!r} with your quantizer gave {got}, with "
                                 f"labkit's {want}", "engine"))
            if bm.num_free_blocks != bm.num_blocks:
                problems.append((f"{bm.num_blocks - bm.num_free_blocks} KV blocks still in use", "engine"))
    return problems


def check_quantize_weight(fn: Quantizer, model: str = "labkit-tiny") -> CheckResult:
    """Task 1: ``fn(weight, method, group_size=32, scales=None) -> (qweight, scales)``, labkit's formats."""

    def body(check: Check) -> None:
        for failure, because in format_problems(fn):
            check.expect(False, failure, because=because)
        if not check.result.failures:
            for failure, because in engine_problems(fn, model):
                check.expect(False, failure, because=because)

    return run_checker("", "", body, task_id="14.quantize_weight")
