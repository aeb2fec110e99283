"""The oracles a build task's checker compares the learner's engine with: transformers' ``generate`` and labkit's own
parts, on the same prompts, greedy, so any difference in a token is a bug in the learner's part.

``transformers_greedy`` loads transformers' own model for the checkpoint once (cached) and continues each prompt
with ``generate(do_sample=False)``; ``first_difference`` names the first request and token where two runs differ,
so a checker can print the smallest failing case instead of a traceback. Introduced in notebook 02.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import torch

from labkit.core.model.source import resolve_model_source


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM  # late: only checkers need it
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no stray "Loading weights" bar in the learner's check cell
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@functools.lru_cache(maxsize=256)
def _greedy(path: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        # eos_token_id=[]: EOS neither ends the row nor is masked out, as labkit's ignore_eos (min_new_tokens would
        # forbid EOS and change the greedy token wherever EOS is the argmax)
        out = _hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0)
    return tuple(out[0, len(prompt_ids):].tolist())


def transformers_greedy(model: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (token ids), ``max_new_tokens`` each (EOS ignored)."""
    source = resolve_model_source(model)
    if source.checkpoint is None:
        raise ValueError(f"{model!r} is a preset with random weights: transformers has no checkpoint to compare with")
    path = str(source.checkpoint)
    return [list(_greedy(path, tuple(p), max_new_tokens)) for p in prompts]


def first_difference(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]],
                     names: Sequence[str] | None = None) -> str | None:
    """None when equal; else "request R: token i is X, expected Y" for the first request and position that differ."""
    for r, (g, w) in enumerate(zip(got, want)):
        name = names[r] if names is not None else f"request {r}"
        for i, (a, b) in enumerate(zip(g, w)):
            if a != b:
                return f"{name}: output token {i} is {a}, expected {b} (the tokens before it agree)"
        if len(g) != len(w):
            return f"{name}: {len(g)} output tokens, expected {len(w)}"
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    return None
