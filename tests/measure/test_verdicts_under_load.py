"""The notebooks' comparisons, at smoke size, under an artificial load: every printed verdict agrees with the numbers
printed beside it, whichever way the busy machine tips the measurement.

A neighbour process (not a child of the test: see busy_neighbour.py) spins on one core for the whole module, as a
classroom laptop's video call would. Each comparison is the one a notebook concludes from (03: KV cache vs naive;
05/07: continuous vs static; 06: prefix caching; 07: preemption), measured with ``labkit.measure`` as the notebooks
do; the test reads the *printed* verdict back (``audit``): "[holds]" only when every round favoured the claim,
"[does NOT hold here]" only when every round went the other way; and the load was detected and reported.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator

import psutil
import pytest
from busy_neighbour import start_unrelated_spinner

from labkit.core.llm import LLM
from labkit.core.sampling_params import SamplingParams
from labkit.measure import Rounds, Verdict, audit, compare, interleave, trend

PROMPTS = ["Once upon a time, a little fox", "The rain fell on the old town and", "Tom had a red ball. He",
           "In the morning the sun rose over the hill, and the children"]
NUMBER = r"(-?\d+(?:\.\d+)?)"
# Timed as the notebooks run (the suite's per-step book-keeping checks would dominate the timings otherwise).
FAST = {"debug_checks": False}


@pytest.fixture(scope="module")
def neighbour() -> Iterator[int]:
    """One core kept busy by an unrelated process for the whole module."""
    pid = start_unrelated_spinner()
    assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    yield pid
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def check_printed_verdict(verdict: Verdict, rounds: Rounds) -> None:
    """The mark agrees with the round ratios printed in the same line; the load is detected and reported."""
    assert audit(str(verdict)) == [], str(verdict)
    assert rounds.load is not None and rounds.load.busy, rounds.load
    if not verdict.holds:
        assert "ran under load" in str(verdict) and "close other programs" in str(verdict)


def _tok_s(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> dict[str, float]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {"tok/s": sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)}


def test_kv_cache_vs_naive(neighbour: int) -> None:  # notebook 03
    params = [SamplingParams(max_tokens=12, ignore_eos=True)]
    with LLM("labkit-tiny", engine="naive", device="cpu") as naive, \
            LLM("labkit-tiny", engine="kvcache", device="cpu") as kv:
        rounds = interleave({"kvcache": lambda: _tok_s(kv, PROMPTS[:1], params),
                             "naive": lambda: _tok_s(naive, PROMPTS[:1], params)}, num_rounds=2, progress=False)
    verdict = compare(rounds, "kvcache", "naive", "tok/s", True, "the KV cache speeds up decoding", unit="tok/s")
    check_printed_verdict(verdict, rounds)


def test_continuous_vs_static_and_prefix_caching(neighbour: int) -> None:  # notebooks 05, 06, 07
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 16, 3, 14)]
    shared = "A long shared system prompt that every request starts with, so the prefix cache can reuse it. " * 2
    cached = [shared + p for p in PROMPTS]
    with LLM("labkit-tiny", engine="paged", device="cpu", max_num_seqs=4, **FAST) as static, \
            LLM("labkit-tiny", engine="continuous", device="cpu", max_num_seqs=2, **FAST) as cont, \
            LLM("labkit-tiny", engine="continuous", device="cpu", enable_prefix_caching=True, **FAST) as on:
        rounds = interleave({"continuous": lambda: _tok_s(cont, PROMPTS, params),
                             "static": lambda: _tok_s(static, PROMPTS, params),
                             "caching on": lambda: _tok_s(on, cached, params),
                             "caching off": lambda: _tok_s(cont, cached, params)}, num_rounds=2, progress=False)
    check_printed_verdict(compare(rounds, "continuous", "static", "tok/s", True, "continuous batching is faster",
                                  unit="tok/s", why_not="two slots against a batch of four"), rounds)
    check_printed_verdict(compare(rounds, "caching on", "caching off", "tok/s", True, "prefix caching pays",
                                  unit="tok/s"), rounds)


def test_preemption_trend(neighbour: int) -> None:  # notebook 07
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 4
    pools = (64, 8)
    llms = {n: LLM("labkit-tiny", engine="continuous", device="cpu", num_gpu_blocks=n, block_size=8,
                **FAST) for n in pools}
    try:
        rounds = interleave({f"{n} blocks": (lambda n=n: _tok_s(llms[n], PROMPTS, params)) for n in pools},
                            num_rounds=2, progress=False)
    finally:
        for llm in llms.values():
            llm.close()
    verdict = trend(list(pools), [rounds.get(f"{n} blocks", "tok/s") for n in pools], "falls",
                    "throughput falls as the pool shrinks", x_label=" blocks", rounds=rounds)
    check_printed_verdict(verdict, rounds)
    first = str(verdict).splitlines()[0]
    medians = [float(x) for x in re.findall(rf"blocks: {NUMBER}", first)]
    assert medians == pytest.approx([rounds.median(f"{n} blocks", "tok/s") for n in pools], abs=0.06)
