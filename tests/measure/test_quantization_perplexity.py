"""The quantization report's perplexity: int4 weights with int8 activations are scored with every row on their GEMV
kernel (inputs rounded as a decode step rounds them), not on the prefill path, which would score the weights alone."""

from __future__ import annotations

from labkit import LLM
from labkit.core.quant import QuantizationConfig, gemv
from labkit.measure.benchmarks.quantization_report import perplexity
from labkit.measure.corpus import generate_stories


def test_int8_activations_are_scored_on_the_kernel(bundled_path) -> None:
    text = "\n\n".join(generate_stories(2, seed=777))
    with LLM(str(bundled_path), quantization=QuantizationConfig("int4", 32)) as weights_only:
        plain = perplexity(weights_only, text, window=128)
    rows = gemv.MAX_KERNEL_ROWS
    with LLM(str(bundled_path), quantization=QuantizationConfig("int4", 32, activations="int8")) as a8:
        rounded = perplexity(a8, text, window=128)
    assert gemv.MAX_KERNEL_ROWS == rows  # put back
    assert rounded != plain  # the same weights: only the rounded inputs can tell them apart
    assert abs(rounded / plain - 1) < 0.02  # and they cost little
