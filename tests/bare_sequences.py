"""Real engine sequences without an engine, for tests that drive the block manager by hand."""

from __future__ import annotations

from labkit.core.metrics import RequestMetrics
from labkit.core.sampling_params import SamplingParams
from labkit.core.sequence import Sequence
from labkit.core.text.detokenizer import IncrementalDetokenizer


class _Decoder:
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, token_ids))


def make_seq(seq_id: int, prompt: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, prompt=None, prompt_token_ids=list(prompt), params=SamplingParams(),
                    detokenizer=IncrementalDetokenizer(_Decoder(), prompt), generator=None,
                    metrics=RequestMetrics(0.0), max_model_len=10**9)
