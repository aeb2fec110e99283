"""How to pick the next token, per request, with vLLM's names and defaults.

Introduced in notebook 01 (``01_anatomy_of_a_request``); the samplers behind temperature,
top-k and top-p are built in notebook 02.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass, field

MIN_TEMPERATURE = 1e-5  # below this (but above 0) logits / temperature can overflow: use 0 for greedy
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; n samples use seed, seed + 1, ...


@dataclass
class SamplingParams:
    """Per-request generation settings (vLLM's ``SamplingParams`` subset). Notebook 01.

    temperature 0 means greedy. ``max_tokens=None`` means "until the context is full".
    ``seed`` makes a sampled request reproducible whatever else runs beside it.
    Every bad value raises at once, naming the field, the value and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise TypeError(f"{name} must be a list, got {type(value).__name__} {value!r}")
            setattr(self, name, list(value))
        self.verify()

    def verify(self) -> None:
        """Check every field (``LLM`` calls this again before any work: the fields are mutable)."""
        self._check_int("n", self.n, 1)
        if self.max_tokens is not None:
            self._check_int("max_tokens", self.max_tokens, 1)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise TypeError(f"temperature must be a number, got {type(t).__name__} {t!r}")
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy) and finite, got {t}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {t}: smaller values "
                             "overflow logits / temperature; use temperature=0 for greedy decoding")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or (k < 1 and k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {k!r}")
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, int):
                raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__} {self.seed!r}")
            if not 0 <= self.seed <= MAX_SEED - self.n + 1:
                raise ValueError(f"seed must be in [0, {MAX_SEED - self.n + 1}] (n={self.n} samples use seed .. "
                                 f"seed + n - 1), got {self.seed}")
        for s in self.stop:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        for tok in self.stop_token_ids:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise ValueError(f"stop_token_ids must be non-negative ints, got {tok!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @staticmethod
    def _check_int(name: str, value: object, minimum: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _reject_unknown_options(init):  # type: ignore[no-untyped-def]
    """A misspelt option (``max_token=5``) names itself and the accepted ones, instead of a bare TypeError."""
    accepted = [f.name for f in dataclasses.fields(SamplingParams)]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise TypeError(f"SamplingParams got unknown option(s) {', '.join(unknown)}; "
                            f"it accepts: {', '.join(accepted)}")
        if len(args) > len(accepted):
            raise TypeError(f"SamplingParams takes at most {len(accepted)} positional arguments, got {len(args)}")
        init(self, *args, **kwargs)

    return checked


SamplingParams.__init__ = _reject_unknown_options(SamplingParams.__init__)  # type: ignore[method-assign]
