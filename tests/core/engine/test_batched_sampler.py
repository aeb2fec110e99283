"""Sampling batched on the device (``labkit.core.sampler.sample``): the same tokens as sampling each row on its
own (``sample_row``, the readable reference of notebook 02), the same generator states afterwards, and one
device -> host transfer per call (no ``.item()``, no ``torch.multinomial``, whose checks each wait for the device)."""

from __future__ import annotations

import random

import pytest
import torch

from labkit.core.sampler import draw, sample, sample_row
from labkit.core.sampling_params import SamplingParams


def random_case(rng: random.Random) -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
    vocab, batch = rng.choice([5, 50, 2048, 49152]), rng.randint(1, 6)
    dtype = rng.choice([torch.float32, torch.float64])
    logits = torch.randn(batch, vocab, dtype=dtype, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    logits *= rng.choice([0.5, 3.0, 10.0])
    if rng.random() < 0.3:  # many ties, as logits computed in bfloat16 have
        logits = logits.to(torch.bfloat16).to(dtype)
    params = [SamplingParams(temperature=0.0) if rng.random() < 0.25 else
              SamplingParams(temperature=rng.choice([0.1, 0.7, 1.0, 1.3, rng.uniform(0.05, 3.0)]),
                             top_k=rng.choice([-1, -1, 1, 3, 40, vocab, vocab + 5]),
                             top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.99, rng.random()])) for _ in range(batch)]
    return logits, params, [rng.randrange(2**32) for _ in range(batch)]


def generators(params: list[SamplingParams], seeds: list[int]) -> list[torch.Generator | None]:
    return [None if p.greedy else torch.Generator().manual_seed(s) for p, s in zip(params, seeds)]


def test_batched_sampling_draws_what_each_row_draws_alone() -> None:
    rng = random.Random(0)
    for _ in range(200):
        logits, params, seeds = random_case(rng)
        batched, alone = generators(params, seeds), generators(params, seeds)
        want = [int(logits[i].argmax()) if p.greedy else sample_row(logits[i], p, g)
                for i, (p, g) in enumerate(zip(params, alone))]
        assert sample(logits, params, batched) == want, params
        for a, b in zip(batched, alone):  # and every generator is left where the row-by-row path leaves it
            assert a is None or torch.equal(a.get_state(), b.get_state())


def test_draw_is_multinomials_own_method() -> None:
    probs = torch.rand(1000, dtype=torch.float64).softmax(-1)
    for seed in range(50):
        want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(draw(probs, torch.Generator().manual_seed(seed)), want)


def test_one_transfer_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"tolist": 0}
    tolist = torch.Tensor.tolist

    def counting_tolist(self: torch.Tensor) -> object:
        calls["tolist"] += 1
        return tolist(self)

    def no_sync(*args: object, **kwargs: object) -> object:
        raise AssertionError("waits for the device")

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", no_sync)
    monkeypatch.setattr(torch, "multinomial", no_sync)
    logits = torch.randn(6, 300)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=20),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.5,
                                                                                             top_k=5),
              SamplingParams(temperature=1.2, top_p=0.5)]
    tokens = sample(logits, params, generators(params, list(range(6))))
    assert calls["tolist"] == 1 and len(tokens) == 6 and all(isinstance(t, int) for t in tokens)
    assert tokens[0] == int(torch.argmax(logits[0])) and tokens[3] == int(torch.argmax(logits[3]))
