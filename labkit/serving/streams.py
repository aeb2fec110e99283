"""What crosses between ``AsyncLLM``'s engine thread and its async consumers: token deltas and commands.

Introduced in notebook 09 (``09_serving_and_metrics``), with ``labkit.serving.async_engine``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from labkit.core.engine.errors import EngineDeadError as CoreEngineDeadError
from labkit.core.sequence import Sequence


@dataclass(frozen=True)
class TokenDelta:
    """One streamed piece of a request: its new token(s), their text, and whether it is done. Notebook 09.

    The engine samples one token per request per step, so ``token_ids`` has one id, unless a consumer that fell
    behind takes several waiting deltas as one (``merged``, ``AsyncLLM(coalesce=True)``); ``text`` may be ""
    (a token that ends mid-character, or text held back while it could still become a stop string).
    """

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    time: float  # time.perf_counter() when the step produced the (first) token

    def merged(self, later: TokenDelta) -> TokenDelta:
        """This delta and the next one of the same request as one: their tokens and text in order, ``later``'s
        state (finished, counts), this one's time (its first token waited longest)."""
        return dataclasses.replace(later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
                                   time=self.time)


class EngineDeadError(CoreEngineDeadError):
    """The engine thread is not running (stopped, or never started). A kind of the engine's own
    ``EngineDeadError`` (a worker process died), so one ``except`` catches both. Notebook 09."""

    def __init__(self, cause: str) -> None:
        RuntimeError.__init__(self, cause)  # the reason as given ("the engine was shut down")
        self.cause = cause


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


def put_all(items: list[tuple[_Stream, TokenDelta | BaseException]]) -> None:
    """Each item into its stream's queue; runs on the consumers' event loop (an asyncio queue is not thread-safe)."""
    for stream, item in items:
        stream.queue.put_nowait(item)


def coalesce_waiting(waiting: asyncio.Queue[TokenDelta | BaseException], first: TokenDelta
                     ) -> tuple[TokenDelta, BaseException | None]:
    """``first`` merged with every delta already waiting behind it in its stream's queue (a consumer that fell
    behind), and an error found waiting there, returned apart so that the tokens before it go out first."""
    item = first
    while not item.finished and not waiting.empty():
        nxt = waiting.get_nowait()
        if isinstance(nxt, BaseException):
            return item, nxt
        item = item.merged(nxt)
    return item, None
