"""The stop rule: once a request has its newest token, is it done, and why (vLLM's ``check_stop``).

Every engine applies it through ``Sequence.append_token``; the naive engine calls it from its overridable
``NaiveEngine.check_stop``, the method notebook 02's Task 3 replaces. Stop strings are matched on the text by the
detokenizer, because a string can span several tokens (or end inside one); the rule only reads what it found.
Introduced in notebook 02 (``02_naive_generation``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from labkit.core.sequence import FinishReason

if TYPE_CHECKING:
    from labkit.core.sequence import Sequence

# (finish reason, stop reason): the stop reason is the stop string or stop token id that ended the request, if any.
StopDecision = tuple[FinishReason, str | int | None]


def check_stop(seq: Sequence) -> StopDecision | None:
    """Whether ``seq`` must finish now that its newest token is appended: (finish reason, stop reason), or None.

    In this order: a stop string the text now contains; an end-of-sequence token (unless ``ignore_eos``); a token of
    ``stop_token_ids`` (even with ``ignore_eos``); ``max_tokens`` output tokens; the context (``max_model_len``) full.
    """
    token = seq.output_token_ids[-1]
    params = seq.params
    if seq.detokenizer.stop_reason is not None:
        return FinishReason.STOP, seq.detokenizer.stop_reason
    if not params.ignore_eos and token in seq.eos_token_ids:
        return FinishReason.STOP, None
    if token in params.stop_token_ids:
        return FinishReason.STOP, token
    if params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH, None
    if seq.num_tokens >= seq.max_model_len:
        return FinishReason.LENGTH, None
    return None
