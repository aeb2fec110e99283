"""The capstone's benchmark: your engine, labkit's ``chunked`` and transformers' ``generate``, on one workload.

Each contender is a function that runs the whole workload once and returns every request's output tokens.
``interleaved_rounds`` runs them round after round with ``labkit.measure.rounds.interleave``, rotating who goes first,
so that a noisy neighbour or a CPU warming up hits every contender alike; the device is synchronised before the clock
is read. Throughput is the workload's output tokens over the wall time of a round, and every ratio comes from the
rounds of that one run: benchmarks compare side by side in one run, report ratios and name the hardware.

transformers' side is how ``scripts/bench_engines.py`` runs it: ``generate`` on batches of ``max_num_seqs`` prompts
in arrival order, left-padded, each batch run until its longest request is done, EOS neither stopping a row nor being
masked out (labkit's ``ignore_eos``). Introduced in notebook 10 (``10_profiling_host_overhead``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from labkit.core.device import resolve_device, resolve_dtype
from labkit.measure.rounds import interleave

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from labkit.core.llm import LLM
    from labkit.core.sampling_params import SamplingParams

Contender = Callable[[], list[list[int]]]  # runs the workload once; every request's output tokens


@dataclass
class Rounds:
    """Tokens per second of every contender in every round of one interleaved run. Notebook 10."""

    output_tokens: int  # what the workload asks for, per round
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def tokens_per_s(self, name: str) -> list[float]:
        return [self.output_tokens / s for s in self.seconds[name]]

    def median(self, name: str) -> float:
        return statistics.median(self.tokens_per_s(name))

    def ratios(self, a: str, b: str) -> list[float]:
        """a's throughput over b's, round by round (the two ran back to back in each round)."""
        return [sb / sa for sa, sb in zip(self.seconds[a], self.seconds[b])]

    def table(self) -> str:
        names = list(self.seconds)
        lines = [f"{'':<34}" + "".join(f"{'round ' + str(r + 1):>10}" for r in range(len(self.seconds[names[0]])))
                 + f"{'median':>10}   output tokens/s"]
        for name in names:
            lines.append(f"{name:<34}" + "".join(f"{x:10.1f}" for x in self.tokens_per_s(name))
                         + f"{self.median(name):10.1f}")
        lines.append("")
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                r = self.ratios(a, b)
                spread = f" (rounds: {min(r):.2f}-{max(r):.2f})" if len(r) > 1 else ""
                lines.append(f"{a} / {b}: {statistics.median(r):.2f}x{spread}")
        return "\n".join(lines)


def interleaved_rounds(contenders: dict[str, Contender], output_tokens: int, num_rounds: int,
                       device: str | torch.device = "cpu", progress: bool = True) -> Rounds:
    """Run every contender once per round, rotating the order, timing each with the device synchronised."""

    def without_tokens(run: Contender) -> Callable[[], None]:
        def timed() -> None:
            run()  # interleave keeps what a contender returns as its metrics: output tokens are none

        return timed

    timed = interleave({name: without_tokens(run) for name, run in contenders.items()}, num_rounds, warmup=0,
                       device=resolve_device(device), progress=progress, check_load=False)
    return Rounds(output_tokens, {name: timed.get(name, "seconds") for name in contenders})


def llm_contender(llm: LLM, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> Contender:
    """A labkit engine running the workload with ``LLM.generate``."""

    def run() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(list(prompts), list(params), use_tqdm=False)]

    return run


def transformers_contender(model: str, prompts: Sequence[list[int]], output_lens: Sequence[int], batch_size: int,
                           device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32") -> Contender:
    """transformers' ``generate`` on padded batches of ``batch_size`` prompts, in order, each run to its longest."""
    from transformers import AutoModelForCausalLM  # late: only the benchmark needs it

    from labkit.core.model.source import resolve_model_source

    dev = resolve_device(device)
    checkpoint = resolve_model_source(model).checkpoint
    if checkpoint is None:
        raise ValueError(f"{model!r} is a preset with random weights: transformers has no checkpoint to load")
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=resolve_dtype(dtype, dev)).to(dev).eval()
    pad = 0

    @torch.inference_mode()
    def run() -> list[list[int]]:
        outputs: list[list[int]] = []
        for i in range(0, len(prompts), batch_size):
            ids, lens = prompts[i:i + batch_size], output_lens[i:i + batch_size]
            width, new = max(len(p) for p in ids), max(lens)
            input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in ids], device=dev)  # (B, width)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ids], device=dev)  # (B, width)
            # eos_token_id=[]: EOS neither ends a row nor is masked out, as labkit's ignore_eos (min_new_tokens would
            # forbid EOS, and the greedy tokens would part ways wherever the model picks it)
            out = hf.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new, eos_token_id=[],
                              pad_token_id=pad)  # (B, width + new)
            outputs += [row[width:width + n].tolist() for row, n in zip(out, lens)]  # each request's own tokens
        return outputs

    return run


def plot_throughput(rounds: Rounds, ax: Axes, colors: Sequence[str] = ("tab:green", "tab:blue", "tab:gray")) -> Axes:
    """Bars: each contender's median tokens/s; error bars: the rounds' range; dots: every round."""
    names = list(rounds.seconds)
    medians = [rounds.median(n) for n in names]
    low = [m - min(rounds.tokens_per_s(n)) for n, m in zip(names, medians)]
    high = [max(rounds.tokens_per_s(n)) - m for n, m in zip(names, medians)]
    ax.bar(range(len(names)), medians, yerr=[low, high], capsize=6, color=list(colors)[: len(names)])
    for k, name in enumerate(names):
        ax.plot([k] * len(rounds.seconds[name]), rounds.tokens_per_s(name), "o", color="black", ms=3)
    ax.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names])
    ax.set_ylabel("output tokens / s")
    ax.grid(True, axis="y", alpha=0.3)
    return ax
