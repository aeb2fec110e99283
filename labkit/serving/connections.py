"""What a connection may hold: read timeouts for a slow client, and a cap on concurrent connections.

uvicorn closes a keep-alive connection left idle after a response (``timeout_keep_alive``), but nothing bounds a
connection that has not finished sending its request: a client that sends one header line every few seconds
(slowloris), or a body that stops half-way, holds a socket and a file descriptor for as long as it likes. Production
servers bound both (nginx: ``client_header_timeout``, ``client_body_timeout``), and so does this one:

* **request head**: the request line and headers must be complete within ``timeout_request_header`` seconds of
  the connection opening (or, on a kept-alive connection, of the next request's first byte). The clock is not
  reset by each byte: trickling one header line at a time does not help. Past it: ``408 Request Timeout``, closed;
* **body stall**: while a body is read, no gap between two reads may exceed ``timeout_body_stall`` seconds (a slow
  but steady upload is fine; one that stops is closed, and the request it belonged to is dropped);
* **connections**: beyond ``limit_concurrency`` open connections, a new connection's request gets a ``503`` with
  an OpenAI-style error body naming the limit and ``Retry-After``, and the connection is closed.

Headers larger than h11's 16 KiB are a 400 (h11's own limit). ``ConnectionLimits`` holds the settings; the protocol
class uvicorn runs (``protocol_class``) applies them. Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from labkit.serving.protocol import RequestError

DEFAULT_TIMEOUT_REQUEST_HEADER = 10.0  # seconds: a real client sends its headers in milliseconds
DEFAULT_TIMEOUT_BODY_STALL = 10.0  # seconds without a byte while a body is read
DEFAULT_LIMIT_CONCURRENCY = 1024  # open connections (each one a file descriptor; 32 streams need 32)
TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
             b"content-length: %d\r\n\r\n%s")


@dataclass(frozen=True)
class ConnectionLimits:
    """How long a client may take to send a request, and how many connections may be open at once. Notebook 09."""

    timeout_request_header: float = DEFAULT_TIMEOUT_REQUEST_HEADER
    timeout_body_stall: float = DEFAULT_TIMEOUT_BODY_STALL
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY

    def __post_init__(self) -> None:
        for name in ("timeout_request_header", "timeout_body_stall"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
        limit = self.limit_concurrency
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit_concurrency must be an int >= 1 (open connections), got {limit!r}")


def over_capacity_app(limit: int) -> Any:
    """An ASGI app answering every request with a 503 that names the connection limit."""
    error = RequestError(f"the server is at its limit of {limit} open connections (--limit-concurrency); retry "
                         "shortly", error_type="server_error", status_code=503, code="too_many_connections")
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), (b"retry-after", b"1")]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head deadline, a body-stall timeout and a connection cap."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.limit_concurrency:  # itself included
            self.app = over_capacity_app(self.limits.limit_concurrency)  # its one request: a 503, then closed
        self._arm_head()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_timer is None:
            self._arm_head()  # the first byte of the next request on a kept-alive connection: its clock starts
        super().data_received(data)
        state = self.conn.their_state
        if state is not h11.IDLE:  # the head is complete (or the connection is done with)
            self._cancel("_head_timer")
        if state is h11.SEND_BODY:
            self._arm_body()  # bytes arrived: the stall clock starts again
        else:
            self._cancel("_body_timer")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel("_head_timer")
        self._cancel("_body_timer")
        super().connection_lost(exc)

    # ---- the timers ----

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _arm_head(self) -> None:
        self._cancel("_head_timer")
        self._head_timer = self.loop.call_later(self.limits.timeout_request_header, self._head_timed_out)

    def _arm_body(self) -> None:
        self._cancel("_body_timer")
        self._body_timer = self.loop.call_later(self.limits.timeout_body_stall, self._body_stalled)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._close(f"request head not complete within {self.limits.timeout_request_header:g} s "
                        "(--timeout-request-header)")

    def _body_stalled(self) -> None:
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        if self.flow.read_paused:  # the server stopped reading (the app is behind), not the client: wait on
            self._arm_body()
            return
        self._close(f"no request body bytes for {self.limits.timeout_body_stall:g} s (--timeout-body-stall)")

    def _close(self, why: str) -> None:
        """A 408 naming the bound if no response has started, then close (the app sees a disconnect)."""
        if self.cycle is None or not self.cycle.response_started:
            text = f"408 Request Timeout: {why}\n".encode()
            self.transport.write(TIMED_OUT % (len(text), text))
        self.logger.info("closed a slow connection from %s: %s", self.client, why)
        self.transport.close()


def protocol_class(limits: ConnectionLimits) -> type[LimitedH11Protocol]:
    """The protocol class uvicorn runs (``uvicorn.Config(http=...)``) with these limits."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})
