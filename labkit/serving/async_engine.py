"""``AsyncLLM``: the engine loop in a background thread; requests added and streamed concurrently.

``LLM.generate`` owns the loop: it adds a batch, steps until all are done, returns. A server cannot
work like that. Requests arrive while the engine is mid-run, each wants its tokens as they come, and
a client may leave at any moment. vLLM's ``AsyncLLM`` splits the two sides; so does this one:

* **the engine thread** loops forever: drain the command queue (add / abort / snapshot), run one
  engine step (the step every front end shares: a failed step fails only its own requests),
  hand each new token to its request's stream. It is the *only* thread that touches the engine, so
  the scheduler's queues never change under a running step;
* **the asyncio side** (the web server's event loop) tokenizes and validates a request with the
  ``LLM``'s input processor, puts an "add" command on the queue and awaits the request's
  ``asyncio.Queue``. Tokens cross threads with ``loop.call_soon_threadsafe`` (an asyncio queue is
  not thread-safe).

When a consumer stops early (a client disconnects, ``break``, cancellation), ``generate`` sends an
"abort": the engine thread drops the request before its next step and its KV blocks go back to the
pool at once, not when it would have finished.

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import AsyncIterator

from labkit.core.engine.base import StepFailedError
from labkit.core.engine.errors import EngineDeadError as CoreEngineDeadError
from labkit.core.llm import LLM
from labkit.core.sampling_params import SamplingParams
from labkit.core.sequence import FinishReason, Sequence, SequenceStatus
from labkit.serving.prometheus import EngineState, ServerMetrics
from labkit.serving.streams import EngineDeadError, TokenDelta, _Command, _Stream, coalesce_waiting, put_all
from labkit.serving.timings import ServerTimings

__all__ = ["HAND_OFFS", "AsyncLLM", "EngineDeadError", "TokenDelta"]
HAND_OFFS = ("per_token", "per_step")


class AsyncLLM:
    """An ``LLM`` whose engine steps in a background thread, serving many async consumers. Notebook 09.

        async_llm = AsyncLLM(LLM("labkit-tiny", engine="chunked")).start()
        async for delta in async_llm.generate("Once upon a time", SamplingParams(max_tokens=16)):
            print(delta.text, end="")
        async_llm.shutdown()
    """

    def __init__(self, llm: LLM, metrics: ServerMetrics | None = None, idle_wait: float = 0.05,
                 timings: ServerTimings | None = None, hand_off: str = "per_token", coalesce: bool = False) -> None:
        if hand_off not in HAND_OFFS:
            raise ValueError(f"hand_off must be one of {HAND_OFFS}, got {hand_off!r}")
        self.hand_off = hand_off  # how a step's tokens reach the event loop (see _deliver)
        self.coalesce = coalesce  # a consumer that fell behind takes its waiting deltas as one (streams.py)
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self.timings = timings  # where the engine thread's time goes (``--record-timings``); None: not recorded
        self.idle_wait = idle_wait  # seconds the idle engine thread sleeps between checks for work
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[int, _Stream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.num_steps = 0
        self.last_error: BaseException | None = None

    # ---- lifecycle ----

    def start(self) -> AsyncLLM:
        if self._thread is None:
            if self.metrics is not None:  # the pool's size on /metrics from the start, not after the first request
                self.metrics.update(self._state())
            self._thread = threading.Thread(target=self._loop, name="labkit-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def shutdown(self, timeout: float = 10.0, reason: str = "the engine was shut down") -> None:
        """Stop the engine thread; requests still streaming get ``EngineDeadError(reason)``."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self.llm.engine.abort_all()  # the loop has stopped: nothing else touches the engine now
        dead = EngineDeadError(reason)
        for stream in list(self._streams.values()):
            self._post(stream, dead)
        self._streams.clear()
        while True:  # commands nobody will run now: answer them, so no caller waits forever
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd.stream is not None:
                self._post(cmd.stream, dead)
            if cmd.reply is not None:
                cmd.reply.set_exception(dead)

    # ---- the asyncio side ----
    def make_request(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        """Tokenize and validate one request (raises ValueError/TypeError naming the problem). n must be 1."""
        if params.n != 1:
            raise ValueError(f"AsyncLLM serves one completion per request (n=1), got n={params.n}")
        (group,) = self.llm.input_processor.make_sequences([prompt], [params])  # LLM.generate's checks
        return group[0]

    async def generate(self, prompt: str | list[int] | Sequence, params: SamplingParams | None = None
                       ) -> AsyncIterator[TokenDelta]:
        """Add a request and yield its tokens as the engine produces them; abort it if the consumer leaves."""
        if not self.is_running:
            raise EngineDeadError("the engine thread is not running; call start()")
        cause = self.llm.death_cause()
        if cause is not None:  # a worker process the engine needs is gone: nothing new can be served
            raise CoreEngineDeadError(cause)
        seq = prompt if isinstance(prompt, Sequence) else self.make_request(prompt, params or SamplingParams())
        stream = _Stream(seq, asyncio.get_running_loop(), asyncio.Queue())
        self._send(_Command("add", stream=stream))
        finished = False
        held: BaseException | None = None  # found waiting behind coalesced tokens: raised once they are out
        try:
            while True:
                item = held if held is not None else await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine already dropped it
                    raise item
                if self.coalesce:
                    item, held = coalesce_waiting(stream.queue, item)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:  # cancelled, closed early, or the client went away: free its blocks now
                self.abort(seq.seq_id)

    def abort(self, request_id: int) -> None:
        """Drop a request before the engine's next step (safe from any thread)."""
        self._send(_Command("abort", request_id=request_id))

    def engine_state(self, timeout: float = 10.0) -> EngineState:
        """A snapshot taken by the engine thread between two steps (safe from any thread)."""
        if not self.is_running:
            raise EngineDeadError("the engine thread is not running")
        reply: concurrent.futures.Future[EngineState] = concurrent.futures.Future()
        self._send(_Command("state", reply=reply))
        return reply.result(timeout)

    def _send(self, command: _Command) -> None:
        self._commands.put(command)
        self._wake.set()

    # ---- the engine thread ----
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(self.idle_wait)  # nothing to do: sleep until a command arrives
                self._wake.clear()
                continue
            num_stats = len(self.llm.engine.step_stats)
            start = time.perf_counter()
            try:
                stepped = self.engine.step()
            except StepFailedError as exc:  # contained: its requests come back finished ("error"), the rest go on
                stepped = exc.failed + exc.finished
            except Exception as exc:  # noqa: BLE001  (an engine that does not contain its faults must not kill the server)
                self.last_error = exc
                self._fail_all(exc)
                if self.metrics is not None:
                    self.metrics.update(self._state())
                continue
            marks = [start, time.perf_counter()]  # the engine step, then the server's work after it
            self.num_steps += 1
            ready = self._collect(stepped)
            marks.append(time.perf_counter())
            if self.metrics is not None:  # before the tokens go out: a client that reads /metrics next sees it
                self.metrics.update(self._state())
            marks.append(time.perf_counter())
            self._deliver(ready)
            if self.timings is not None:
                self.timings.record_step(self.llm.engine.step_stats[num_stats:], [*marks, time.perf_counter()],
                                         [item for _, item in ready])
            if not stepped:  # nothing could be scheduled this step (e.g. waiting for KV blocks)
                self._wake.wait(0.001)

    def _drain(self) -> None:
        changed = False
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd.kind == "add" and cmd.stream is not None:
                seq = cmd.stream.seq
                self.engine.add_sequences([seq])
                self._streams[seq.seq_id] = cmd.stream
                if self.metrics is not None:
                    self.metrics.request_added(seq.num_prompt_tokens)
                changed = True
            elif cmd.kind == "abort" and cmd.request_id is not None:
                changed = self._abort_now(cmd.request_id) or changed
            elif cmd.kind == "state" and cmd.reply is not None:
                cmd.reply.set_result(self._state())
        if changed and self.metrics is not None:
            self.metrics.update(self._state())

    def _abort_now(self, request_id: int) -> bool:
        """Drop a request from the engine (its KV blocks go back now); engine thread only."""
        stream = self._streams.pop(request_id, None)
        seq = self.engine.abort_request(request_id)
        if seq is not None and self.metrics is not None:
            self.metrics.request_finished("abort", None)
        return stream is not None or seq is not None

    def _collect(self, stepped: list[Sequence]) -> list[tuple[_Stream, TokenDelta | BaseException]]:
        """Each stepped request's new token as a delta, or its step's error (finished ones leave ``_streams``)."""
        ready: list[tuple[_Stream, TokenDelta | BaseException]] = []
        for seq in stepped:
            stream = self._streams.get(seq.seq_id)
            if stream is None:
                continue
            if seq.finish_reason == FinishReason.ERROR:  # its step failed; the engine already dropped it
                del self._streams[seq.seq_id]
                if self.metrics is not None:
                    self.metrics.request_finished("error", None)
                dead = isinstance(seq.error_cause, CoreEngineDeadError)  # a 503 for the client, not a 500
                ready.append((stream, seq.error_cause if dead else RuntimeError(f"the {seq.error}")))
                continue
            new = seq.output_token_ids[stream.num_emitted:]
            if not new:
                continue
            stream.num_emitted = seq.num_output_tokens
            reason = seq.finish_reason.value if seq.finish_reason is not None else None
            delta = TokenDelta(request_id=seq.seq_id, token_ids=list(new),
                               text=self.llm.output_processor.pop_delta(seq), finished=seq.is_finished,
                               finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
                               num_output_tokens=seq.num_output_tokens, time=seq.metrics.token_times[-1])
            if self.metrics is not None:
                self.metrics.observe_tokens(seq.metrics.arrival_time, seq.metrics.token_times, len(new))
            if seq.is_finished:
                del self._streams[seq.seq_id]
                if self.metrics is not None:
                    e2e = seq.metrics.token_times[-1] - seq.metrics.arrival_time
                    self.metrics.request_finished(reason or "stop", e2e)
            ready.append((stream, delta))
        return ready

    def _post(self, stream: _Stream, item: TokenDelta | BaseException) -> None:
        self._post_all(stream.loop, [(stream, item)])

    def _post_all(self, loop: asyncio.AbstractEventLoop, items: list[tuple[_Stream, TokenDelta | BaseException]]
                  ) -> None:
        """Hand ``items`` to their streams on ``loop``: one wake-up of the loop for all of them."""
        try:
            loop.call_soon_threadsafe(put_all, items)
        except RuntimeError:  # the consumers' event loop is closed: nobody will read these requests
            for stream, _ in items:
                if threading.current_thread() is self._thread and not stream.seq.is_finished:
                    self._abort_now(stream.seq.seq_id)

    def _deliver(self, ready: list[tuple[_Stream, TokenDelta | BaseException]]) -> None:
        """A step's deltas to their consumers: one wake-up of the event loop per delta (``hand_off="per_token"``, each a
        write to the loop's self-pipe), or one per step for all of them (``"per_step"``, notebook 09 measures both)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, TokenDelta | BaseException]]] = {}
        for stream, item in ready:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        batches = [[pair] for pair in ready] if self.hand_off == "per_token" else list(by_loop.values())
        for items in batches:
            self._post_all(items[0][0].loop, items)
        if self.timings is not None:
            self.timings.add("wake_ups", 0.0, len(batches))

    def _fail_all(self, exc: BaseException) -> None:
        """A step raised something other than ``StepFailedError``: nothing is known to be consistent, so
        every request is aborted (its KV memory goes back) and its stream gets the error."""
        self.llm.engine.abort_all()
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            if self.metrics is not None:
                self.metrics.request_finished("error", None)
            self._post(stream, RuntimeError(f"the engine step failed: {type(exc).__name__}: {exc}"))

    def _state(self) -> EngineState:
        engine = self.llm.engine
        bm = engine.block_manager
        live = [s.seq for s in self._streams.values()]
        return EngineState(
            num_running=sum(s.status == SequenceStatus.RUNNING for s in live),
            num_waiting=sum(s.status == SequenceStatus.WAITING for s in live),
            kv_blocks_used=bm.num_used_blocks if bm is not None else None,
            kv_blocks_total=bm.num_blocks if bm is not None else None,
            num_preemptions=engine.num_preemptions,
            prefix_cache_queried_tokens=bm.num_queried_tokens if bm is not None else 0,
            prefix_cache_hit_tokens=bm.num_hit_tokens if bm is not None else 0,
            unfinished_request_ids=tuple(engine.unfinished_seq_ids()),
        )
