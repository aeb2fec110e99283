"""Seeded workloads: lists of requests with prompt and output lengths, saved as JSONL.

Batching and scheduling are judged on a *workload*, not on one prompt: how long the prompts are, how
long the outputs, and how much both vary. A static batch runs until its longest request finishes, so
a heterogeneous workload (a few long requests among many short ones) is where batching wastes most.
Introduced in notebook 05 (``05_static_batching``); reused by notebooks 06-09 and the benchmarks.

    wl = load_workload("heterogeneous_64")            # lengths only, from data/workloads/
    wl = materialise(wl, llm.tokenizer, seed=0)        # prompts of exactly prompt_len token ids
    outs = llm.generate(wl.prompts(), sampling_params_for(wl))   # each output exactly output_len tokens

Lengths are counted in tokens. Generators are pure: the same arguments give the same workload.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from labkit.core.sampling_params import SamplingParams
from labkit.measure.corpus import long_text

WORKLOADS_DIR = Path(__file__).resolve().parents[2] / "data" / "workloads"
HEADER_KEY = "workload"  # the first line of a workload file names it; request lines never have this key


@dataclass
class WorkloadRequest:
    """One request: how many prompt tokens, how many output tokens, when it arrives. Notebook 05.

    ``prompt_token_ids`` (set by ``materialise``) is what gets sent; ``prompt`` is its text, for reading.
    """

    prompt_len: int
    output_len: int
    arrival_time: float = 0.0  # seconds after the workload starts; 0 for offline (all at once)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.arrival_time < 0:
            raise ValueError(f"arrival_time must be >= 0, got {self.arrival_time}")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(f"prompt_token_ids has {len(self.prompt_token_ids)} tokens but prompt_len is "
                             f"{self.prompt_len}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; fields that are None are left out, so length-only files stay small."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class Workload:
    """A named, seeded list of requests. Notebook 05."""

    name: str
    requests: list[WorkloadRequest]
    seed: int | None = None  # None for workloads that involve no randomness (fixed_lengths)
    description: str = ""  # how it was generated, for the reader of a data file

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompt_lens(self) -> list[int]:
        return [r.prompt_len for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.output_len for r in self.requests]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + output: the engine's max_model_len must be at least this."""
        return max((r.prompt_len + r.output_len for r in self.requests), default=0)

    def prompts(self) -> list[str | list[int]]:
        """What to pass to ``LLM.generate``: token ids where materialised (exact lengths), else the text."""
        out: list[str | list[int]] = []
        for i, r in enumerate(self.requests):
            if r.prompt_token_ids is not None:
                out.append(list(r.prompt_token_ids))
            elif r.prompt is not None:
                out.append(r.prompt)
            else:
                raise ValueError(f"request {i} of workload {self.name!r} has lengths only; "
                                 "call materialise(workload, tokenizer) first")
        return out

    def summary(self) -> str:
        p, o = sorted(self.prompt_lens), sorted(self.output_lens)
        return (f"{self.name}: {len(self)} requests, prompt tokens {self.num_prompt_tokens} "
                f"(min {p[0]}, median {p[len(p) // 2]}, max {p[-1]}), output tokens {self.num_output_tokens} "
                f"(min {o[0]}, median {o[len(o) // 2]}, max {o[-1]})") if self.requests else f"{self.name}: empty"

    def to_jsonl(self, path: str | Path) -> Path:
        """Write a header line (name, seed, description) then one JSON object per request."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {HEADER_KEY: self.name, "seed": self.seed, "description": self.description,
                  "num_requests": len(self)}
        lines = [json.dumps(header)] + [json.dumps(r.to_dict()) for r in self.requests]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_jsonl(cls, path: str | Path) -> Workload:
        """Read ``to_jsonl``'s format; a file of request lines only is named after the file."""
        path = Path(path)
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        header: dict[str, Any] = {}
        if rows and HEADER_KEY in rows[0]:
            header = rows.pop(0)
        requests = [WorkloadRequest(**row) for row in rows]
        if "num_requests" in header and header["num_requests"] != len(requests):
            raise ValueError(f"{path}: header says {header['num_requests']} requests, file has {len(requests)}")
        return cls(name=header.get(HEADER_KEY, path.stem), requests=requests, seed=header.get("seed"),
                   description=header.get("description", ""))


def load_workload(name: str) -> Workload:
    """A workload shipped in data/workloads/ (made by scripts/make_workloads.py), by name."""
    path = WORKLOADS_DIR / f"{name}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in WORKLOADS_DIR.glob("*.jsonl"))
        raise FileNotFoundError(f"no workload {name!r} in {WORKLOADS_DIR}; available: {', '.join(known) or 'none'}")
    return Workload.from_jsonl(path)


# ---- generators ----

def _check_range(name: str, lo: int, hi: int) -> None:
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 1 <= low <= high, got ({lo}, {hi})")


def fixed_lengths(n: int, prompt_len: int, output_len: int, name: str | None = None) -> Workload:
    """``n`` identical requests: the baseline where static batching wastes nothing. Notebook 05."""
    return Workload(name=name or f"fixed_{n}x{prompt_len}+{output_len}",
                    requests=[WorkloadRequest(prompt_len, output_len) for _ in range(n)], seed=None,
                    description=f"fixed_lengths(n={n}, prompt_len={prompt_len}, output_len={output_len})")


def uniform_lengths(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int,
                    name: str | None = None) -> Workload:
    """``n`` requests with lengths drawn uniformly from inclusive (low, high) ranges. Notebook 05."""
    _check_range("prompt_range", *prompt_range)
    _check_range("output_range", *output_range)
    rng = random.Random(seed)
    requests = [WorkloadRequest(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(n)]
    return Workload(name=name or f"uniform_{n}", requests=requests, seed=seed,
                    description=f"uniform_lengths(n={n}, prompt_range={tuple(prompt_range)}, "
                                f"output_range={tuple(output_range)}, seed={seed})")


def lognormal_lengths(
    n: int,
    prompt_median: int,
    output_median: int,
    sigma: float,
    prompt_max: int,
    output_max: int,
    seed: int,
    prompt_min: int = 1,
    output_min: int = 1,
    name: str | None = None,
) -> Workload:
    """``n`` requests with heavy-tailed ("heterogeneous") lengths. Notebook 05.

    Each length is exp(N(ln median, sigma)) rounded, clipped to [min, max]: most requests are near
    the median, a few are many times longer, as in real chat traffic. sigma = 1 spans about 5x either
    side of the median for the middle 90%. Clipping (rather than redrawing) means the longest requests
    sit exactly at the max, as a serving system's max_model_len would cut them.
    """
    _check_range("prompt (min, max)", prompt_min, prompt_max)
    _check_range("output (min, max)", output_min, output_max)
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")
    rng = random.Random(seed)

    def draw(median: int, lo: int, hi: int) -> int:
        return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))

    requests = [WorkloadRequest(draw(prompt_median, prompt_min, prompt_max),
                                draw(output_median, output_min, output_max)) for _ in range(n)]
    return Workload(name=name or f"lognormal_{n}", requests=requests, seed=seed,
                    description=f"lognormal_lengths(n={n}, prompt_median={prompt_median}, "
                                f"output_median={output_median}, sigma={sigma}, prompt_max={prompt_max}, "
                                f"output_max={output_max}, seed={seed}, prompt_min={prompt_min}, "
                                f"output_min={output_min})")


# ---- turning lengths into requests an engine can run ----

def prompt_ids_of_length(tokenizer: PreTrainedTokenizerBase, num_tokens: int, seed: int) -> list[int]:
    """Exactly ``num_tokens`` ids of in-domain text (``corpus.long_text``), BOS first if the tokenizer has one."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    num_words = max(8, num_tokens)  # a word is at least one token, so this is usually enough at once
    while True:
        ids = bos + list(tokenizer.encode(long_text(num_words, seed), add_special_tokens=False))
        if len(ids) >= num_tokens:
            return [int(t) for t in ids[:num_tokens]]
        num_words *= 2


def materialise(workload: Workload, tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> Workload:
    """A copy of ``workload`` whose requests carry prompts of exactly ``prompt_len`` token ids. Notebook 05.

    Token ids, not text, are what make the length exact: decoding and re-encoding text can merge or
    split tokens. Each request gets different text (its own seed drawn from ``seed``), so prompts do not
    share long prefixes by accident (that would flatter prefix caching in notebook 06).
    """
    rng = random.Random(seed)
    requests = []
    for r in workload.requests:
        ids = prompt_ids_of_length(tokenizer, r.prompt_len, rng.randrange(2**31))
        text = tokenizer.decode(ids, skip_special_tokens=True)
        requests.append(dataclasses.replace(r, prompt=text, prompt_token_ids=ids))
    return dataclasses.replace(workload, requests=requests)


def sampling_params_for(workload: Workload) -> list[SamplingParams]:
    """One SamplingParams per request: greedy, ignoring EOS, so each generates exactly ``output_len`` tokens."""
    return [SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True) for r in workload.requests]
