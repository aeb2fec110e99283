"""``LLMEngine``: the one add -> step -> outputs loop (vLLM's ``LLMEngine``).

    llm_engine = LLMEngine(engine, input_processor, OutputProcessor())
    groups = input_processor.make_sequences(prompts, params)
    with contextlib.closing(llm_engine.run(groups)) as steps:
        for stepped in steps:                      # after every engine step: the sequences that got a token
            ...                                    # stream their text, count the finished ones
    outputs = llm_engine.output_processor.make_outputs(groups)

``LLM.generate`` and ``LLM.stream``, ``trace_request``, the profiler's driver and ``AsyncLLM``'s engine
thread all run requests through it, so they share one set of rules:

* a failed engine step (``StepFailedError``) fails only its own sequences: they come back from ``step``
  finished with reason "error", and the others carry on;
* ``run`` queues each request at its arrival time (replaying traffic: metrics count from arrival);
* leaving ``run`` early (an exception, a KeyboardInterrupt, closing it) aborts its unfinished requests,
  so their KV memory goes back at once and the engine is ready for the next call.

Introduced in notebook 01 (``01_anatomy_of_a_request``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq

from labkit.core.engine.base import Engine, StepFailedError
from labkit.core.engine.input_processor import InputProcessor, Prompt
from labkit.core.engine.output_processor import OutputProcessor
from labkit.core.sampling_params import SamplingParams
from labkit.core.sequence import Sequence


class LLMEngine:
    """An engine with its input and output processors: add requests, step, take outputs. Notebook 01.

    The engine (``labkit.core.engine.ENGINES``) schedules and runs the model; this class is what every front
    end (``LLM``, ``AsyncLLM``, the request trace, the profiler) drives it through.
    """

    def __init__(self, engine: Engine, input_processor: InputProcessor, output_processor: OutputProcessor) -> None:
        self.engine = engine
        self.input_processor = input_processor
        self.output_processor = output_processor

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> list[Sequence]:
        """Validate one prompt and queue its sequence(s) now; returns the n sequences of the request."""
        prompts, plist = self.input_processor.broadcast(prompt, params)
        if len(prompts) != 1:
            raise ValueError("add_request takes one prompt; use generate for many")
        (group,) = self.input_processor.make_sequences(prompts, plist, arrival_time)
        self.add_sequences(group)
        return group

    def add_sequences(self, seqs: Iterable[Sequence]) -> None:
        """Queue sequences the input processor already built and validated."""
        for seq in seqs:
            self.engine.add_request(seq)

    def step(self) -> list[Sequence]:
        """Run one engine step; return the sequences that got a token, or that a failed step finished.

        A ``StepFailedError`` is contained: the failed step's sequences are already finished with reason
        "error" and out of the engine, so they are returned like finished ones (with any that finished normally
        in that step before the fault), and the others carry on.
        Any other exception (an engine that does not contain faults, a KeyboardInterrupt) propagates.
        """
        try:
            return self.engine.step()
        except StepFailedError as exc:
            return exc.failed + exc.finished

    def abort_request(self, seq_id: int) -> Sequence | None:
        """Drop one request wherever it is and free its KV memory; returns it if it was in the engine."""
        return self.engine.abort_request(seq_id)

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Abort every unfinished one of ``seqs`` (finished ones hold no engine state)."""
        for seq in seqs:
            if not seq.is_finished:
                self.engine.abort_request(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def run(self, groups: Seq[list[Sequence]], arrival_times: Seq[float] | None = None, start: float | None = None,
            before_step: Callable[[], None] | None = None) -> Iterator[list[Sequence]]:
        """Queue each group at ``start + arrival_times[i]`` and step until the engine is idle, yielding
        every step's sequences (``step``).

        Close it when leaving early (``contextlib.closing``): its unfinished requests are aborted then,
        as they are when anything raises inside it. ``before_step`` runs before every engine step (the
        profiler marks steps with it).
        """
        start = time.perf_counter() if start is None else start
        offsets = [0.0] * len(groups) if arrival_times is None else list(arrival_times)
        pending = sorted(((t, i) for i, t in enumerate(offsets)), reverse=True)  # ties keep prompt order (FCFS)
        try:
            while pending or self.has_unfinished_requests():
                now = time.perf_counter()
                while pending and start + pending[-1][0] <= now:
                    offset, i = pending.pop()
                    for seq in groups[i]:
                        seq.metrics.arrival_time = start + offset
                    self.add_sequences(groups[i])
                if not self.has_unfinished_requests():
                    time.sleep(max(0.0, start + pending[-1][0] - time.perf_counter()))  # idle until the next arrival
                    continue
                if before_step is not None:
                    before_step()
                yield self.step()
        finally:
            # An interrupt, an error or a consumer that stopped early must not leave these requests in the engine.
            self.abort(seq for group in groups for seq in group)
