"""labkit's acceptance rule runs on the device (``verify_on_device``): the emitted tokens still follow the target's
distribution (notebook 13's own chi-square checks) and greedy requests still get the target's argmax, with no host
read per proposal (counted as PyTorch's scalar reads, ``aten._local_scalar_dense``) and one copy per step."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from labkit.core.sampling_params import SamplingParams
from labkit.core.spec_decode.rejection_sampler import RejectionSampler, verify_on_device
from labkit.course.ch13_speculative_decoding import distribution_problems, greedy_problems


class DeviceRule(RejectionSampler):
    """The device rule behind notebook 13's ``verify`` interface, so the chapter's checks can test it."""

    def verify(self, target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor,
               generator: torch.Generator | None) -> list[int]:
        ids = torch.tensor(draft_token_ids, dtype=torch.long)
        n, token = verify_on_device(target_probs, ids, draft_probs, generator).tolist()
        return [*draft_token_ids[:n], token]


class ScalarReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (float(), int(), .item(), indexing by a tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def test_the_device_rule_keeps_the_targets_distribution() -> None:
    assert distribution_problems(DeviceRule(), seed=0) == []
    assert greedy_problems(DeviceRule()) == []


def test_a_planted_bug_is_caught_by_the_same_checks() -> None:
    class AlwaysAccept(RejectionSampler):  # accepts every proposal: the draft's distribution leaks through
        def verify(self, target_probs: torch.Tensor, draft_token_ids: list[int], draft_probs: torch.Tensor,
                   generator: torch.Generator | None) -> list[int]:
            return [*draft_token_ids, int(target_probs[len(draft_token_ids)].argmax())]

    assert distribution_problems(AlwaysAccept(), seed=0)


class Seq:
    def __init__(self, spec: list[int], params: SamplingParams, seed: int) -> None:
        self.spec_token_ids, self.params = spec, params
        self.generator = torch.Generator().manual_seed(seed)


def test_no_host_read_per_proposal_and_one_copy_per_step() -> None:
    gen = torch.Generator().manual_seed(0)
    seqs = [Seq([3, 1, 4], SamplingParams(temperature=0.8, seed=1), 1), Seq([2, 2], SamplingParams(temperature=0), 2),
            Seq([], SamplingParams(temperature=1.0, seed=3), 3)]
    logits = torch.randn(4 + 3 + 1, 6, generator=gen)  # (R, V): k + 1 rows per sequence
    q = torch.softmax(torch.randn(3, 6, generator=gen), -1)
    with ScalarReads() as mode:
        got = RejectionSampler().verify_batch(logits, seqs, {id(seqs[0]): q})  # type: ignore[arg-type]
    assert mode.reads == 0  # the old rule read u, q(x), p(x) and the residual's sum per proposal
    assert [len(g) >= 1 for g in got] == [True] * 3 and all(0 <= t < 6 for g in got for t in g)
    greedy = logits[4:7].argmax(-1).tolist()  # sequence 2: accepted while equal to the argmax, then the argmax
    n = next((i for i, (x, t) in enumerate(zip([2, 2], greedy)) if x != t), 2)
    assert got[1] == [2, 2][:n] + [greedy[n]]
