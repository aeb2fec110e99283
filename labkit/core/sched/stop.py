"""The stop rule and finishing: once a request has its newest token, is it done, and why (vLLM's ``check_stop``).

The scheduler applies it in ``Scheduler.update_from_output`` (and engines ``naive`` and ``kvcache`` through
``append_token``); the naive engine calls it from its overridable ``NaiveEngine.check_stop``, the method notebook 02's
Task 3 replaces. Stop strings are matched on the text by the detokenizer, because a string can span several tokens
(or end inside one); the rule only reads what it found. The request itself (``Sequence``) is plain data: these
functions decide and record when it is done. Introduced in notebook 02 (``02_naive_generation``).
"""

from __future__ import annotations

from labkit.core.sequence import FinishReason, Sequence, SequenceStatus

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


def append_token(seq: Sequence, token_id: int, now: float) -> bool:
    """Record a sampled token and finish ``seq`` if the stop rule says so; True if it finished."""
    seq.record_token(token_id, now)
    stop = check_stop(seq)
    if stop is not None:
        finish(seq, *stop, now)
    return stop is not None


def finish(seq: Sequence, reason: FinishReason, stop_reason: str | int | None, now: float) -> None:
    """Mark ``seq`` finished with ``reason``; ``stop_reason``: the stop string or token id that ended it, if any."""
    seq.status = SequenceStatus.FINISHED
    seq.finish_reason = reason
    seq.stop_reason = stop_reason
    seq.metrics.finished_time = now


def abort(seq: Sequence, now: float) -> None:
    """The caller dropped ``seq`` (``abort_request``, a closed stream, an interrupted cell)."""
    finish(seq, FinishReason.ABORT, None, now)


def fail(seq: Sequence, cause: BaseException, step: int, now: float) -> None:
    """Finish ``seq`` with reason ERROR because engine step ``step`` raised ``cause`` while running it."""
    seq.error = f"engine step {step} failed: {type(cause).__name__}: {cause}"
    seq.error_cause = cause
    finish(seq, FinishReason.ERROR, None, now)
