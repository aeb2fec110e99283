"""What every engine shares: its config, per-step statistics and the add/step/abort interface.

``LLM`` drives any engine the same way (vLLM's shape): ``add_request`` queues a ``Sequence``,
``step`` runs one forward pass and returns the sequences that got a token. Introduced in
notebook 01 (``01_anatomy_of_a_request``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from labkit.device import synchronize
from labkit.model import CausalLM
from labkit.sequence import Sequence


@dataclass
class EngineConfig:
    """Options every engine accepts (vLLM's names). Engines subclass it to add their own."""

    max_model_len: int | None = None  # None: the model's max_position_embeddings


@dataclass
class StepStats:
    """What one engine step did and where its time went. Notebook 01; plotted again in 05, 07 and 10."""

    step: int
    start: float
    end: float
    num_seqs: int
    num_computed_tokens: int  # token positions run through the model (including recomputed ones)
    num_new_tokens: int  # tokens sampled: the useful output of the step
    stage_times: dict[str, float] = field(default_factory=dict)
    num_padding_tokens: int = 0  # positions computed only to square up a padded batch
    num_idle_slots: int = 0  # batch rows already finished but still computed
    is_prefill: bool = True  # whether any prompt tokens were processed this step
    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens among num_computed_tokens
    kv_blocks_used: int | None = None  # paged engines: blocks held during the step (before finished ones free)
    num_preemptions: int = 0  # paged engines: preemptions so far

    @property
    def duration(self) -> float:
        return self.end - self.start


class StageClock:
    """Times the stages of one step; each stage is also a named profiler range (``labkit::<stage>``).

    ``with clock.stage("forward"): ...`` times the block, synchronising the device at its end so that
    queued kernels count in the stage that launched them. The ranges let ``torch.profiler`` traces show
    schedule / prepare / forward / sample / detokenize for every step (notebook 10).
    """

    def __init__(self, device: torch.device, sync: bool = True) -> None:
        self.device = device
        self.sync = sync
        self.times: dict[str, float] = {}
        self.start = self.last = time.perf_counter()

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        with torch.profiler.record_function(f"labkit::{name}"):
            yield
            if self.sync:
                synchronize(self.device)
        # Counted from the previous stage's end, so the stages of a step add up to the whole step.
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.last
        self.last = now


class Engine(ABC):
    """Base class of every engine in ``ENGINES``."""

    name: ClassVar[str]
    config_class: ClassVar[type[EngineConfig]] = EngineConfig

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.device = model.device
        self.step_stats: list[StepStats] = []

    def validate(self, seq: Sequence) -> None:
        """Raise if this engine could never serve ``seq`` (called for every request before any is added)."""

    @abstractmethod
    def add_request(self, seq: Sequence) -> None: ...

    def step(self) -> list[Sequence]:
        """Run one iteration; return every sequence that received a token (finished ones included)."""
        with torch.profiler.record_function("labkit::step"):
            return self._step()

    @abstractmethod
    def _step(self) -> list[Sequence]: ...

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def abort_request(self, seq_id: int) -> Sequence | None:
        """Drop a request wherever it is; returns it (finished, reason "abort") if it was there."""

    def abort_all(self) -> list[Sequence]:
        return [s for s in (self.abort_request(i) for i in self.unfinished_seq_ids()) if s is not None]

    @abstractmethod
    def unfinished_seq_ids(self) -> list[int]: ...
