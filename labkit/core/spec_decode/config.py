"""The ``speculative_config`` option, with vLLM's keys, checked when the engine is built.

``LLM(..., speculative_config={"method": "ngram", "num_speculative_tokens": 3})`` proposes by prompt lookup;
``{"method": "draft_model", "num_speculative_tokens": 3, "draft_num_layers": 2}`` by a draft made of the target's
first layers (labkit derives it at load time: no second checkpoint). ``rejection_sampler_cls`` plugs in a learner's
acceptance rule (notebook 13's Build task). Introduced in notebook 13 (``13_speculative_decoding``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from labkit.core.spec_decode.rejection_sampler import RejectionSampler

METHODS = ("ngram", "draft_model")


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config: {name} must be an int >= 1, got {value!r}")


@dataclass
class SpeculativeConfig:
    """What proposes, how many tokens, and which rule verifies them (vLLM's keys). Notebook 13."""

    method: str = "ngram"  # "ngram" (prompt lookup) or "draft_model"
    num_speculative_tokens: int = 3  # k: tokens proposed per decode step
    prompt_lookup_max: int = 3  # ngram: the longest suffix looked up in the sequence so far
    prompt_lookup_min: int = 1  # ngram: the shortest
    model: str | None = None  # vLLM's draft checkpoint; labkit derives its draft from the target instead
    draft_num_layers: int = 1  # draft_model: how many of the target's first layers the draft keeps
    rejection_sampler_cls: type[RejectionSampler] = RejectionSampler

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        _positive_int("num_speculative_tokens", self.num_speculative_tokens)
        _positive_int("prompt_lookup_max", self.prompt_lookup_max)
        _positive_int("prompt_lookup_min", self.prompt_lookup_min)
        _positive_int("draft_num_layers", self.draft_num_layers)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min {self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max {self.prompt_lookup_max}")
        if self.model is not None:
            raise ValueError("speculative_config: a separate draft checkpoint (model=...) is not supported; labkit "
                             "derives the draft from the target's first layers: use method='draft_model' with "
                             "draft_num_layers")
        if not (isinstance(self.rejection_sampler_cls, type) and issubclass(self.rejection_sampler_cls,
                                                                             RejectionSampler)):
            raise TypeError("speculative_config: rejection_sampler_cls must be a subclass of "
                            f"labkit.core.spec_decode.RejectionSampler, got {self.rejection_sampler_cls!r}")

    @classmethod
    def from_option(cls, value: SpeculativeConfig | dict[str, Any]) -> SpeculativeConfig:
        """The option as given to ``LLM``: a dict with vLLM's keys (unknown keys are an error) or a config."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"speculative_config must be a dict (vLLM's keys) or a SpeculativeConfig, got {value!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(unknown)}; it accepts: "
                             f"{', '.join(known)}")
        return cls(**value)

    def check_model(self, num_hidden_layers: int) -> None:
        """A draft must be smaller than its target: at least one layer fewer."""
        if self.method == "draft_model" and self.draft_num_layers >= num_hidden_layers:
            raise ValueError(f"speculative_config: draft_num_layers {self.draft_num_layers} must be below the "
                             f"target's {num_hidden_layers} layers (the draft is the target's first layers)")
