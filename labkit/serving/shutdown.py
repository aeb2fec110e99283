"""Graceful shutdown under load: every stream ends properly, and the exit code says how it went.

On SIGINT or SIGTERM the server stops accepting connections, lets the running requests finish for
``--timeout-graceful-shutdown`` seconds, then stops the engine: each stream still open gets an error event
and ``data: [DONE]``, and a waiting non-streamed request a 503. uvicorn on its own would cancel those
requests' tasks after its timeout: the client's stream just stops, and the log fills with
``CancelledError`` tracebacks. A second Ctrl-C skips the wait.

Exit codes of ``python -m labkit.serving``: 0 stopped and every request finished; 2 could not start (bad
option, unknown model, port taken); 3 stopped, but requests still running after the grace period were ended.

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

from labkit.serving.responses import ActiveRequests

EXIT_OK = 0
EXIT_CANNOT_START = 2
EXIT_REQUESTS_ENDED = 3
FINAL_WRITE_TIMEOUT = 3.0  # seconds for the ended streams to write their last events
logger = logging.getLogger("uvicorn.error")  # uvicorn's configured logger: our lines sit with its own


class GracefulServer(uvicorn.Server):
    """uvicorn, with a shutdown that ends every stream with an error event and ``[DONE]``. Notebook 09.

    ``stop_engine(reason)`` stops the engine; it is called once the grace period is over (streams still
    running then get ``EngineDeadError(reason)``). ``num_ended`` counts the requests that were ended.
    """

    def __init__(self, config: uvicorn.Config, active: ActiveRequests, stop_engine: Callable[[str], None],
                 grace_period: float) -> None:
        super().__init__(config)
        self.active = active
        self.stop_engine = stop_engine
        self.grace_period = grace_period
        self.signal_name: str | None = None
        self.num_ended = 0

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, except that the signal is not raised again afterwards: the exit code reports the outcome."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(sig).name
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: end the running requests now
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # stop accepting
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):  # idle ones close; busy ones after this response
            connection.shutdown()
        loop = asyncio.get_running_loop()
        if self.active.count:
            logger.warning("shutting down%s: %d request(s) running, waiting up to %g s for them to finish",
                           f" on {self.signal_name}" if self.signal_name else "", self.active.count,
                           self.grace_period)
        deadline = loop.time() + self.grace_period
        while self.active.count and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        self.num_ended = self.active.count
        reason = f"this request was still running {self.grace_period:g} s after shutdown began"
        await loop.run_in_executor(None, self.stop_engine, reason)  # joins the engine thread: not on the loop
        deadline = loop.time() + FINAL_WRITE_TIMEOUT
        while (self.server_state.tasks or self.server_state.connections) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for task in self.server_state.tasks:  # a client that stopped reading: nothing else will end it
            task.cancel()
        if self.num_ended:
            logger.warning("ended %d request(s) with an error event after the %g s grace period",
                           self.num_ended, self.grace_period)
        if not self.force_exit:
            await self.lifespan.shutdown()  # as uvicorn's own shutdown does (a no-op with lifespan="off")
