"""Compared systems run interleaved and repeated, warm-up excluded; medians with the spread of the rounds.

Run A then B once and a neighbour waking up during B decides the comparison. Run them round after round, rotating
who goes first, and a noisy neighbour or a CPU warming up hits every contender alike; the median of the rounds is
the figure, the rounds' range its spread, and a ratio is taken round by round (the two ran back to back).
Introduced in notebook 03 (``03_kv_cache``); used by every notebook that compares systems.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from labkit.measure.load import LoadReport, measure_load
from labkit.measure.timing import time_call

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# One run of a contender. It may return its own metrics (tokens/s, TTFT p50, ...); its wall time is always recorded
# as "seconds".
Contender = Callable[[], Mapping[str, float] | None]


def default_rounds(smoke: bool) -> int:
    """Rounds for a comparison: 3 at full size (a median needs three), 2 in smoke mode.

    A verdict's 5% t-test (``labkit.measure.significance``) needs the rounds to agree more closely the fewer there
    are (t above 6.31 with 2 rounds, 2.92 with 3), so smoke mode says "too close to call" more often; more rounds
    would cost every comparison's time again per round (3 rounds of notebook 03's naive-vs-kvcache cell took 2.6
    of its 3.1 minutes at full size), so the counts stay and the test, not the count, sets the error rate.
    """
    return 2 if smoke else 3


@dataclass
class Rounds:
    """Every contender's metrics in every round of one interleaved run. Notebook 03."""

    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # contender -> metric -> per round
    load: LoadReport | None = None  # the machine before timing

    @property
    def contenders(self) -> list[str]:
        return list(self.values)

    @property
    def num_rounds(self) -> int:
        first = next(iter(self.values.values()), {})
        return len(first.get("seconds", []))

    def get(self, contender: str, metric: str) -> list[float]:
        if contender not in self.values:
            raise KeyError(f"no contender {contender!r}; measured: {', '.join(self.values)}")
        if metric not in self.values[contender]:
            raise KeyError(f"contender {contender!r} has no metric {metric!r}; it has: "
                           f"{', '.join(self.values[contender])}")
        return self.values[contender][metric]

    def median(self, contender: str, metric: str = "seconds") -> float:
        return statistics.median(self.get(contender, metric))

    def spread(self, contender: str, metric: str = "seconds") -> tuple[float, float]:
        """(lowest, highest) over the rounds."""
        values = self.get(contender, metric)
        return min(values), max(values)

    def ratios(self, a: str, b: str, metric: str = "seconds") -> list[float]:
        """a's metric over b's, round by round."""
        return [x / y if y else float("inf") for x, y in zip(self.get(a, metric), self.get(b, metric))]

    def add(self, contender: str, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.values.setdefault(contender, {}).setdefault(name, []).append(float(value))

    def table(self, metric: str = "seconds", unit: str = "", fmt: str = ".1f") -> str:
        """One line per contender: every round, the median and the spread."""
        n = self.num_rounds
        lines = [f"{'':<28}" + "".join(f"{'round ' + str(r + 1):>10}" for r in range(n)) + f"{'median':>10}  {unit}"]
        for name in self.contenders:
            vals = self.get(name, metric)
            lines.append(f"{name:<28}" + "".join(f"{v:10{fmt}}" for v in vals) + f"{statistics.median(vals):10{fmt}}")
        if self.load is not None and self.load.busy:
            lines.append(f"(taken under load: {self.load.summary()})")
        return "\n".join(lines)


def interleave(contenders: Mapping[str, Contender], num_rounds: int, warmup: int = 1,
               device: str | torch.device = "cpu", progress: bool = True, check_load: bool = True,
               before_round: Callable[[int], None] | None = None) -> Rounds:
    """Run every contender ``warmup`` times untimed, then once per round for ``num_rounds`` rounds, rotating the order.

    Each run is timed with the device synchronised before and after (``labkit.measure.timing.time_call``); a
    contender's returned metrics are kept beside its ``seconds``. ``before_round(r)``, when given, runs untimed
    before round ``r``'s first contender (not before the warm-up): what every contender of the round shares, such as
    fresh prompts, is made there so that it is the same for all of them.
    """
    from tqdm.auto import tqdm

    if num_rounds < 1:
        raise ValueError(f"num_rounds must be at least 1, got {num_rounds}")
    if not contenders:
        raise ValueError("interleave needs at least one contender")
    dev = torch.device(device)
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    rounds = Rounds(load=measure_load(0.3) if check_load else None)
    for r in tqdm(range(num_rounds), desc="rounds", disable=not progress):
        if before_round is not None:
            before_round(r)
        for name in names[r % len(names):] + names[: r % len(names)]:
            metrics, seconds = time_call(contenders[name], dev)
            rounds.add(name, {"seconds": seconds, **(metrics or {})})
    return rounds


def plot_rounds(rounds: Rounds, ax: Axes, metric: str = "seconds", ylabel: str | None = None,
                contenders: Sequence[str] | None = None, colors: Sequence[str] | None = None) -> Axes:
    """Bars: each contender's median; error bars: the rounds' range; black dots: every round."""
    names = list(contenders or rounds.contenders)
    medians = [rounds.median(n, metric) for n in names]
    low = [m - rounds.spread(n, metric)[0] for n, m in zip(names, medians)]
    high = [rounds.spread(n, metric)[1] - m for n, m in zip(names, medians)]
    palette = list(colors) if colors else [f"C{i}" for i in range(len(names))]
    ax.bar(range(len(names)), medians, yerr=[low, high], capsize=6, color=palette[: len(names)])
    for k, name in enumerate(names):
        vals = rounds.get(name, metric)
        ax.plot([k] * len(vals), vals, "o", color="black", ms=3)
    ax.set_xticks(range(len(names)), [n.replace(" (", "\n(") for n in names])
    ax.set_ylabel(ylabel or metric)
    ax.grid(True, axis="y", alpha=0.3)
    note = f"median of {rounds.num_rounds} interleaved rounds; bars: range"
    if rounds.load is not None and rounds.load.busy:
        note += "; taken under load"
    ax.set_title(note, fontsize=8, loc="right")
    return ax
