"""``OutputProcessor``: sequences out as what a caller reads (vLLM's ``OutputProcessor``).

After every step a streaming caller takes each sequence's new text (``pop_delta``); once a call's
requests are done, ``make_outputs`` turns them into ``RequestOutput``s in prompt order, and raises
``RequestFailedError`` (holding every output) if an engine step failed some of them. Introduced in
notebook 01 (``01_anatomy_of_a_request``).
"""

from __future__ import annotations

from labkit.core.outputs import CompletionOutput, RequestOutput
from labkit.core.sequence import FinishReason, Sequence, SequenceStatus


class RequestFailedError(RuntimeError):
    """Some requests of a ``generate`` (or ``stream``) call failed inside an engine step; the others completed.

    ``outputs`` holds every request's ``RequestOutput`` in prompt order: failed completions have
    ``finish_reason == "error"`` and an ``error`` message. ``failed`` lists (prompt index, message).
    The exception is chained (``__cause__``) to the first failure, so its traceback shows where it happened.
    Introduced in notebook 01 (``01_anatomy_of_a_request``).
    """

    def __init__(self, outputs: list[RequestOutput], failed: list[tuple[int, str]]) -> None:
        shown = "; ".join(f"prompt {i}: {msg}" for i, msg in failed[:3]) + ("; ..." if len(failed) > 3 else "")
        super().__init__(f"{len(failed)} of {sum(len(o.outputs) for o in outputs)} sequences failed ({shown}); "
                         "the others completed: every result is in this error's .outputs")
        self.outputs = outputs
        self.failed = failed


class OutputProcessor:
    """Streamed text per step and ``RequestOutput``s per request (vLLM's ``OutputProcessor``).

    Introduced in notebook 01 (``01_anatomy_of_a_request``). Stateless: each sequence's detokenizer
    remembers what it has already released.
    """

    def pop_delta(self, seq: Sequence) -> str:
        """The text ``seq`` released since the last call ("" mid-character, or while a stop string may
        still match); at the end, everything held back."""
        return seq.detokenizer.pop_delta(seq.is_finished)

    def make_output(self, group: list[Sequence]) -> RequestOutput:
        """One request's output: its n sequences as completions, timed by the first one's metrics."""
        first = group[0]
        outputs = [
            CompletionOutput(
                index=j, text=s.text, token_ids=list(s.output_token_ids),
                finish_reason=s.finish_reason.value if s.finish_reason else None, stop_reason=s.stop_reason,
                error=s.error,
            )
            for j, s in enumerate(group)
        ]
        return RequestOutput(
            request_id=str(first.seq_id), prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
            outputs=outputs, finished=all(s.status == SequenceStatus.FINISHED for s in group), metrics=first.metrics,
            num_cached_tokens=first.num_cached_tokens,
        )

    def make_outputs(self, groups: list[list[Sequence]]) -> list[RequestOutput]:
        """Every request's output in prompt order; raises ``RequestFailedError`` (with them all) if any failed."""
        outputs = [self.make_output(g) for g in groups]
        failed = [(i, s) for i, g in enumerate(groups) for s in g if s.finish_reason == FinishReason.ERROR]
        if failed:
            raise RequestFailedError(outputs, [(i, s.error or "") for i, s in failed]) from failed[0][1].error_cause
        return outputs
