"""What crosses between ``AsyncLLM``'s engine thread and its async consumers: token deltas and commands.

Introduced in notebook 09 (``09_serving_and_metrics``), with ``labkit.serving.async_engine``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any

from labkit.sequence import Sequence


@dataclass(frozen=True)
class TokenDelta:
    """One streamed piece of a request: its new token(s), their text, and whether it is done. Notebook 09.

    The engine samples one token per request per step, so ``token_ids`` has one id; ``text`` may be ""
    (a token that ends mid-character, or text held back while it could still become a stop string).
    """

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    time: float  # time.perf_counter() when the step produced the token


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or never started). Notebook 09."""


@dataclass
class _Stream:
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[TokenDelta | BaseException]
    num_emitted: int = 0


@dataclass
class _Command:
    kind: str  # "add" | "abort" | "state"
    stream: _Stream | None = None
    request_id: int | None = None
    reply: concurrent.futures.Future[Any] | None = field(default=None, repr=False)
