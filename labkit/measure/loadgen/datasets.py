"""Synthetic request sets for the load generator: random lengths, shared prefixes, chat-like lengths.

Each dataset draws prompt and output lengths from a seed and fills prompts with in-domain text
(``labkit.measure.corpus``: the bundled model reads it as a story, so its answers stay readable). Lengths are
counted with a tokenizer (the bundled one unless you pass another); the server's usage record has
the final word, as in vLLM's benchmark.

* ``RandomDataset``: vLLM's ``random``: lengths uniform in ``[floor(L(1 - r)), ceil(L(1 + r))]`` for a
  range ratio ``r`` in [0, 1), optionally after a fixed shared prefix;
* ``SharedPrefixDataset``: vLLM's ``prefix_repetition``: a few long prefixes (a system prompt, a
  document), each shared by many requests with their own short suffix: prefix caching's best case;
* ``ChatLikeDataset``: heavy-tailed (lognormal) prompt and output lengths, like chat traffic
  (``labkit.measure.workloads.lognormal_lengths``): most requests short, a few many times longer.

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from labkit.measure.workloads import lognormal_lengths, prompt_ids_of_length


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: its prompt text, its length in tokens, and how many tokens to ask for. Notebook 09."""

    prompt: str
    prompt_len: int
    expected_output_len: int


class Dataset(Protocol):
    """What the load generator needs of a dataset: a name and seeded sampling. Notebook 09."""

    name: str

    def sample(self, tokenizer: Any, num_requests: int, seed: int) -> list[BenchRequest]: ...


def text_ids(tokenizer: Any, num_tokens: int, seed: int, bos: bool = True) -> list[int]:
    """``num_tokens`` ids of in-domain text from a seeded offset (BOS first when ``bos``).

    Stories all open alike ("Once upon a time, there was a"), so starting at a random offset keeps
    prompts from sharing a prefix by accident (which would flatter prefix caching).
    """
    rng = random.Random(seed)
    offset = rng.randrange(64)
    body = prompt_ids_of_length(tokenizer, num_tokens + offset + 1, rng.randrange(2**31))[1 + offset:]
    head = [tokenizer.bos_token_id] if bos and tokenizer.bos_token_id is not None else []
    return head + body[: num_tokens - len(head)]


def _text(tokenizer: Any, ids: list[int]) -> tuple[str, int]:
    """Prompt text for ``ids`` and its length as the server will count it (tokenized again, with BOS)."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return text, len(tokenizer.encode(text))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class RandomDataset:
    """Uniform lengths around ``input_len`` and ``output_len`` (vLLM's ``random``). Notebook 09."""

    input_len: int = 64
    output_len: int = 32
    range_ratio: float = 0.0
    prefix_len: int = 0  # tokens of one shared prefix in front of every prompt
    name: str = "random"

    def __post_init__(self) -> None:
        _check_positive(input_len=self.input_len, output_len=self.output_len)
        if self.input_len < 2:
            raise ValueError(f"input_len must be >= 2 (BOS and at least one token of text), got {self.input_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {self.prefix_len}")

    def length_ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(low, high) of prompt and output lengths, inclusive, as vLLM computes them (prompts >= 2 tokens)."""
        r = self.range_ratio
        inp = (max(2, math.floor(self.input_len * (1 - r))), math.ceil(self.input_len * (1 + r)))
        out = (max(1, math.floor(self.output_len * (1 - r))), max(1, math.ceil(self.output_len * (1 + r))))
        return inp, out

    def sample(self, tokenizer: Any, num_requests: int, seed: int) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)
        (i_lo, i_hi), (o_lo, o_hi) = self.length_ranges()
        input_lens = rng.integers(i_lo, i_hi + 1, size=num_requests)
        output_lens = rng.integers(o_lo, o_hi + 1, size=num_requests)
        prefix = text_ids(tokenizer, self.prefix_len, seed=seed + 10**9) if self.prefix_len else []
        requests = []
        for i in range(num_requests):
            n, text_seed = int(input_lens[i]), seed * 100_003 + i
            ids = prefix + text_ids(tokenizer, n, text_seed, bos=not prefix)  # one BOS, at the very front
            text, n = _text(tokenizer, ids)
            requests.append(BenchRequest(text, n, int(output_lens[i])))
        return requests


@dataclass(frozen=True)
class SharedPrefixDataset:
    """``num_prefixes`` long prefixes, each shared by every ``num_prefixes``-th request. Notebook 09."""

    num_prefixes: int = 4
    prefix_len: int = 128
    suffix_len: int = 16
    output_len: int = 32
    name: str = "shared-prefix"

    def __post_init__(self) -> None:
        _check_positive(num_prefixes=self.num_prefixes, prefix_len=self.prefix_len, suffix_len=self.suffix_len,
                        output_len=self.output_len)

    def sample(self, tokenizer: Any, num_requests: int, seed: int) -> list[BenchRequest]:
        prefixes = [text_ids(tokenizer, self.prefix_len, seed=seed * 7919 + k) for k in range(self.num_prefixes)]
        rng = random.Random(seed)
        requests = []
        for i in range(num_requests):
            suffix = text_ids(tokenizer, self.suffix_len, seed=rng.randrange(2**31), bos=False)
            # a paragraph break between prefix and suffix keeps the prefix's tokens as they were
            text = tokenizer.decode(prefixes[i % self.num_prefixes], skip_special_tokens=True) + "\n\n" + \
                tokenizer.decode(suffix, skip_special_tokens=True)
            requests.append(BenchRequest(text, len(tokenizer.encode(text)), self.output_len))
        return requests


@dataclass(frozen=True)
class ChatLikeDataset:
    """Heavy-tailed prompt and output lengths (lognormal around the medians), like chat. Notebook 09."""

    input_median: int = 48
    output_median: int = 48
    sigma: float = 0.8
    input_max: int = 512
    output_max: int = 256
    name: str = "chat-like"

    def __post_init__(self) -> None:
        _check_positive(input_median=self.input_median, output_median=self.output_median, input_max=self.input_max,
                        output_max=self.output_max)

    def sample(self, tokenizer: Any, num_requests: int, seed: int) -> list[BenchRequest]:
        lengths = lognormal_lengths(num_requests, self.input_median, self.output_median, self.sigma,
                                    self.input_max, self.output_max, seed, prompt_min=2)
        requests = []
        for i, r in enumerate(lengths.requests):
            text, n = _text(tokenizer, text_ids(tokenizer, r.prompt_len, seed=seed * 100_003 + i))
            requests.append(BenchRequest(text, n, r.output_len))
        return requests


DATASETS: dict[str, type] = {"random": RandomDataset, "shared-prefix": SharedPrefixDataset,
                             "chat-like": ChatLikeDataset}
