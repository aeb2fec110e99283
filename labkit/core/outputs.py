"""What ``LLM.generate`` returns, shaped like vLLM's ``RequestOutput``. Introduced in notebook 01."""

from __future__ import annotations

from dataclasses import dataclass

from labkit.core.metrics import RequestMetrics


@dataclass
class CompletionOutput:
    """One generated continuation. ``finish_reason`` is "stop" (EOS, stop token or string) or "length";
    "abort" if it was dropped, "error" if the engine step running it failed (``error`` says why)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    """A request's prompt, its completion(s) and its timings. Notebook 01."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (paged engines)
