"""``InputProcessor``: prompts in, validated ``Sequence`` objects out (vLLM's ``Processor``).

    processor = InputProcessor(engine, tokenizer, vocab_size=32000, eos_token_ids=frozenset({2}), device=device)
    (group,) = processor.make_sequences(["Once upon a time"], [SamplingParams(max_tokens=8)])

Every request of a call is checked (prompt, token ids, lengths, sampling params, whether the engine could
ever serve it) before any of them reaches the engine, so a bad prompt raises at once with a message that
names it and the limit, and the engine never holds half a batch. Introduced in notebook 01
(``01_anatomy_of_a_request``).
"""

from __future__ import annotations

import json
import math
import numbers
import random
import threading
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch
from transformers import PreTrainedTokenizerBase

from labkit.core.engine.base import Engine
from labkit.core.metrics import RequestMetrics
from labkit.core.model.source import ModelSource
from labkit.core.sampling_params import SamplingParams
from labkit.core.sequence import Sequence
from labkit.core.text.detokenizer import IncrementalDetokenizer
from labkit.core.text.tokenizer import SafeDecoder

Prompt = str | list[int]


def is_token_id(value: object) -> bool:
    """An int (or numpy/torch-style integer scalar), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def generation_eos_ids(source: ModelSource) -> frozenset[int]:
    """EOS ids from the checkpoint's generation_config.json (e.g. a chat model's end-of-turn token)."""
    if source.checkpoint is None or not (source.checkpoint / "generation_config.json").is_file():
        return frozenset()
    eos = json.loads((source.checkpoint / "generation_config.json").read_text()).get("eos_token_id")
    return frozenset(eos if isinstance(eos, list) else ([] if eos is None else [eos]))


def eos_token_ids(source: ModelSource, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Every id that ends a request: the model config's, generation_config.json's and the tokenizer's EOS."""
    tokenizer_eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    return frozenset(source.config.eos_token_ids) | generation_eos_ids(source) | tokenizer_eos


class InputProcessor:
    """Turns prompts and ``SamplingParams`` into validated ``Sequence`` objects (vLLM's ``Processor``).

    Introduced in notebook 01 (``01_anatomy_of_a_request``). ``seed`` seeds the sampled requests that
    carry no seed of their own, so a whole run is reproducible. Safe to call from several threads
    (``AsyncLLM`` makes requests on the server's event loop while its engine thread steps).
    """

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_token_ids: frozenset[int], device: torch.device, seed: int = 0) -> None:
        self.engine = engine
        self.device = device  # where sampled requests' generators live
        self.tokenizer = tokenizer
        self.decoder = SafeDecoder(tokenizer)  # a preset's ids beyond the tokenizer decode to U+FFFD
        self.vocab_size = vocab_size
        self.max_model_len: int = engine.config.max_model_len  # type: ignore[assignment]
        self.eos_token_ids = eos_token_ids
        self._rng = random.Random(seed)
        self._next_id = 0
        self._lock = threading.Lock()  # the request counter and the RNG are shared by every caller

    def encode(self, prompt: Prompt, index: int = 0) -> list[int]:
        """Prompt -> token ids (strings get the tokenizer's special tokens, e.g. BOS), with clear errors."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError(f"prompt {index} is empty; give at least one character or token id")
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise ValueError(f"prompt {index} ({len(prompt)} characters) encodes to no tokens")
            return ids
        if isinstance(prompt, (list, tuple)):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is an empty token list; give at least one token id")
            for t in prompt:
                if not is_token_id(t):
                    raise TypeError(f"prompt {index}: token ids must be ints, got {type(t).__name__} {t!r}")
                if not 0 <= t < self.vocab_size:
                    raise ValueError(f"prompt {index}: token id {t} is outside the vocabulary [0, {self.vocab_size})")
            return [int(t) for t in prompt]
        raise TypeError(f"prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}")

    def check_lengths(self, ids: list[int], params: SamplingParams, index: int) -> None:
        """Raise unless the prompt leaves room for its max_tokens within max_model_len."""
        n, limit = len(ids), self.max_model_len
        if n >= limit:
            raise ValueError(f"prompt {index} has {n} tokens, which leaves no room to generate within "
                             f"max_model_len {limit}; shorten it to at most {limit - 1}")
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(f"prompt {index}: {n} prompt tokens + max_tokens {params.max_tokens} exceeds "
                             f"max_model_len {limit}; lower max_tokens to at most {limit - n}")

    @staticmethod
    def broadcast(prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None
                  ) -> tuple[list[Prompt], list[SamplingParams]]:
        """One prompt or many, one SamplingParams for all or one each (vLLM's rules) -> two equal-length lists."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_token_id(prompts[0])):
            prompts = [prompts]  # type: ignore[list-item]
        if isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return prompts, [params] * len(prompts)
        if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                             "give one, or one per prompt")
        return prompts, params

    @staticmethod
    def check_arrivals(arrival_times: Seq[float] | None, n: int) -> list[float]:
        """Arrival offsets (seconds after the call), one per prompt; all 0 when not given."""
        if arrival_times is None:
            return [0.0] * n
        offsets = list(arrival_times)
        if len(offsets) != n:
            raise ValueError(f"got {len(offsets)} arrival_times for {n} prompts; give one per prompt")
        for i, t in enumerate(offsets):  # nan would never arrive (the engine would wait forever), nor would inf
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf:
                raise ValueError(f"arrival_times[{i}] must be a number of seconds >= 0 and finite, got {t!r}")
        return [float(t) for t in offsets]

    def make_sequences(self, prompts: Seq[Prompt], params: Seq[SamplingParams], arrival_time: float | None = None
                       ) -> list[list[Sequence]]:
        """One list of sequences per prompt (n of them when SamplingParams.n > 1), every one validated.

        Nothing is added to the engine: the caller queues them (``Engine.run``), at their arrival time.
        """
        now = time.perf_counter() if arrival_time is None else arrival_time
        encoded = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling params {i} must be a SamplingParams, got {type(p).__name__}")
            p.verify()  # again: its fields may have been changed since it was made
            ids = self.encode(prompt, i)
            self.check_lengths(ids, p, i)
            encoded.append(ids)
        with self._lock:
            groups = [self._make_group(prompt, ids, p, now) for prompt, ids, p in zip(prompts, encoded, params)]
        for group in groups:
            for seq in group:
                self.engine.validate(seq)  # e.g. the KV pool could never hold it
        return groups

    def _make_group(self, prompt: Prompt, ids: list[int], params: SamplingParams, now: float) -> list[Sequence]:
        group: list[Sequence] = []
        for j in range(params.n):
            seed = params.seed + j if params.seed is not None else self._rng.randrange(2**62)
            generator = None if params.greedy else torch.Generator(device=self.device).manual_seed(seed)
            group.append(Sequence(
                seq_id=self._next_id, prompt=prompt if isinstance(prompt, str) else None, prompt_token_ids=ids,
                params=params,
                detokenizer=IncrementalDetokenizer(self.decoder, ids, params.stop, params.skip_special_tokens),
                generator=generator, metrics=RequestMetrics(arrival_time=now), max_model_len=self.max_model_len,
                eos_token_ids=self.eos_token_ids, parent=group[0] if group else None,  # samples share the prompt's KV
            ))
            self._next_id += 1
        return group
