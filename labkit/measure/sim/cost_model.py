"""A step's cost from its shape: a linear model fitted to the learner's own measured engine steps.

An engine step's time on a given device depends on what it computes: prompt tokens (compute-bound matmuls),
decode rows (each reads the weights once per step, whatever the batch), the keys attention reads, a fixed
launch-and-host cost per step, and one per prompt chunk (its own attention call and causal mask, its first
token's sampling: on a small model this is what a short prompt's prefill mostly costs). ``StepShape`` counts
those for one ``SchedulerOutput``; ``StepCostModel.fit`` finds the seconds per unit of each (a non-negative fit to
the median relative error) from steps measured on the real engine (``RecordingScheduler`` notes each step's shape
while ``StepStats`` times it). The simulator then prices every step the real scheduler plans with it.
Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.core.sched.output import SchedulerOutput
from labkit.core.sched.scheduler import Scheduler

FEATURES = ("step", "prefill_seqs", "prefill_tokens", "prefill_attention", "decode_rows", "decode_context")


@dataclass(frozen=True)
class StepShape:
    """What one step computes. Notebook 12."""

    num_prefill_tokens: int  # prompt (or recomputed) tokens
    prefill_attention: float  # sum over prefill chunks of tokens x mean keys each attends to (quadratic part)
    num_decode_rows: int  # sequences computing one token
    decode_context: int  # keys the decode rows read, all rows together
    num_prefill_seqs: int  # sequences running a prompt chunk this step

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepShape:
        """The shape of a planned step (before the runner advances ``num_computed_tokens``)."""
        prefill, attention, rows, context, chunks = 0, 0.0, 0, 0, 0
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            if n == 1 and start >= seq.num_prompt_tokens:
                rows, context = rows + 1, context + start + 1
            else:
                prefill, attention, chunks = prefill + n, attention + n * (start + (n + 1) / 2), chunks + 1
        return cls(prefill, attention, rows, context, chunks)

    def features(self) -> np.ndarray:
        return np.array([1.0, self.num_prefill_seqs, self.num_prefill_tokens, self.prefill_attention,
                         self.num_decode_rows, self.decode_context])


@dataclass
class StepCostModel:
    """Seconds per step = coefficients . features (``FEATURES``). Notebook 12."""

    coefficients: np.ndarray  # (len(FEATURES),) seconds per unit, all >= 0

    def __post_init__(self) -> None:
        self.coefficients = np.asarray(self.coefficients, dtype=float)
        if self.coefficients.shape != (len(FEATURES),) or (self.coefficients < 0).any():
            raise ValueError(f"a cost model has {len(FEATURES)} non-negative coefficients, one per feature "
                             f"{FEATURES}, got {self.coefficients.tolist()}")

    @classmethod
    def of(cls, **seconds_per_unit: float) -> StepCostModel:
        """A model from named coefficients (the others 0), e.g. ``StepCostModel.of(step=0.01, decode_rows=1e-3)``."""
        unknown = set(seconds_per_unit) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost model features {sorted(unknown)}; the features are {FEATURES}")
        return cls(np.array([seconds_per_unit.get(name, 0.0) for name in FEATURES]))

    def step_time(self, shape: StepShape) -> float:
        return float(self.coefficients @ shape.features())

    @classmethod
    def fit(cls, shapes: list[StepShape], seconds: list[float]) -> StepCostModel:
        """Non-negative fit to the *median* relative error (least absolute deviations, by iteratively reweighted
        least squares), each step weighted by 1 / its time so that the many short decode steps count as much as
        the few long prefills; a feature whose best weight is negative is dropped.

        Why the median and not least squares with outlier rejection: on a shared machine another program only
        ever slows a step down, and a least-squares fit follows those slow steps; rejecting the steps far from a
        first fit, as an earlier labkit did, can also throw away the few steps of a rare kind (a short prompt's
        chunk beside running decodes) that alone pin down the fixed cost per prompt chunk (in one smoke-size
        calibration it dropped all three). A least-absolute-deviations fit gives every step a bounded pull, so a
        few slowed steps cannot drag it, and no step is thrown away."""
        if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
            raise ValueError(f"fitting needs at least {len(FEATURES)} measured steps with a time each, got "
                             f"{len(shapes)} shapes and {len(seconds)} times")
        x = np.stack([s.features() for s in shapes])  # (steps, features)
        y = np.asarray(seconds, dtype=float)  # (steps,)
        if (y <= 0).any():
            raise ValueError(f"every measured step time must be positive, got {float(y.min())} s")
        coef = cls._nonnegative_fit(x, y, np.ones_like(y))
        for _ in range(50):  # IRLS for the L1 loss: weight each step by 1 / |its relative residual|
            residual = np.abs(x @ coef / y - 1)  # (steps,) relative
            new = cls._nonnegative_fit(x, y, 1.0 / np.sqrt(np.maximum(residual, 1e-4)))
            if np.allclose(new, coef, rtol=1e-7, atol=1e-15):
                break
            coef = new
        return cls(coef)

    @staticmethod
    def _nonnegative_fit(x: np.ndarray, y: np.ndarray, extra: np.ndarray) -> np.ndarray:
        """Weighted least squares on relative error (row weight ``extra / y``), negative coefficients dropped."""
        w = extra / y  # (steps,)
        active = [j for j in range(x.shape[1]) if x[:, j].any()]
        while True:
            coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
            if (coef >= 0).all():
                break
            active = [j for j, c in zip(active, coef) if c >= 0]  # drop the negative ones and fit again
        full = np.zeros(x.shape[1])
        full[active] = coef
        return full

    def describe(self) -> dict[str, float]:
        return dict(zip(FEATURES, self.coefficients.tolist()))


class RecordingScheduler(Scheduler):
    """labkit's scheduler, noting the shape of every step it plans (``LLM(..., scheduler_cls=RecordingScheduler)``);
    a step's shape pairs with the engine's ``StepStats`` of the same step. Notebook 12."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.shapes: list[StepShape] = []

    def schedule(self, now: float) -> SchedulerOutput:
        out = super().schedule(now)
        if out.seqs:  # an empty plan runs no step and records no StepStats
            self.shapes.append(StepShape.of(out))
        return out
