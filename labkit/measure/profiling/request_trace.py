"""Following one request through the engine, stage by stage: a per-step timeline.

``trace_request`` does what ``LLM.generate`` does for a single prompt, but one engine step at a time,
recording where the time went: tokenize, then each step's prepare / forward / sample / detokenize
(the first step that yields a token is the prefill, the rest are decode steps), and the text each
step adds to the stream. ``time_stream`` times ``LLM.stream`` as a user sees it. Introduced in
notebook 01 (``01_anatomy_of_a_request``); later notebooks trace other engines the same way.
"""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field

from labkit.core.llm import LLM, Prompt
from labkit.core.metrics import RequestMetrics
from labkit.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepRecord:
    """One engine step of a traced request (notebook 01). Times are seconds since the request was submitted."""

    index: int
    phase: str  # "prefill" until the request's first token exists, then "decode"
    start: float
    end: float
    num_computed_tokens: int  # token positions the model ran this step (the naive engine reruns all)
    stage_times: dict[str, float]  # e.g. prepare / forward / sample / detokenize, seconds
    token_id: int | None  # the token this step produced (None for a step that produced none)
    text_delta: str  # text the step released to the stream (may be "" mid-character or near a stop string)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class RequestTrace:
    """Where one request's time went, from submission to its last token. Notebook 01."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str | None
    submit_time: float  # time.perf_counter() when the request was handed to trace_request
    tokenize_time: float  # seconds spent turning the prompt into token ids (0 for token-id prompts)
    steps: list[StepRecord] = field(default_factory=list)
    metrics: RequestMetrics | None = None  # the engine's own timestamps (arrival stamped before tokenizing)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prefill_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.phase == "prefill"]

    @property
    def decode_steps(self) -> list[StepRecord]:
        return [s for s in self.steps if s.phase == "decode"]

    @property
    def token_step_durations(self) -> list[float]:
        """Seconds of the step that produced each output token (index 0: the prefill's token)."""
        return [s.duration for s in self.steps if s.token_id is not None]

    def stage_totals(self) -> dict[str, float]:
        """Seconds per stage over the whole request: tokenize, then each step stage summed."""
        totals = {"tokenize": self.tokenize_time}
        for s in self.steps:
            for stage, seconds in s.stage_times.items():
                totals[stage] = totals.get(stage, 0.0) + seconds
        return totals


def _check_idle(llm: LLM) -> None:
    if llm.engine.has_unfinished_requests():
        raise ValueError(
            f"the engine still holds {len(llm.engine.unfinished_seq_ids())} unfinished request(s); "
            "trace_request times one request alone, so finish or abort the others first"
        )


def trace_request(llm: LLM, prompt: Prompt, params: SamplingParams | None = None) -> RequestTrace:
    """Run one request to completion, one engine step at a time, and return its timeline.

    The output is the same as ``llm.generate(prompt, params)`` (same engine, same sampling, the same
    ``Engine.run`` loop), so the timings describe exactly the request a user would have run. The engine
    must hold no other request. If an engine step fails the request, ``RequestFailedError`` is raised.
    """
    params = params or SamplingParams()
    if params.n != 1:
        raise ValueError(f"trace_request follows one sequence; got SamplingParams(n={params.n})")
    _check_idle(llm)
    submit = time.perf_counter()
    ids = llm.encode(prompt)  # the tokenize stage (a token-id prompt is only validated)
    tokenize_time = time.perf_counter() - submit
    # The input processor builds the Sequence (detokenizer, stop rules) from the ids, as generate would.
    (group,) = llm.input_processor.make_sequences([ids], [params], submit)
    (seq,) = group
    if isinstance(prompt, str):
        seq.prompt = prompt
    trace = RequestTrace(prompt_token_ids=list(ids), output_token_ids=[], text="", finish_reason=None,
                         submit_time=submit, tokenize_time=tokenize_time, metrics=seq.metrics)
    engine, outputs = llm.engine, llm.output_processor
    num_stats, had_output = len(engine.step_stats), 0
    # The request arrived before it was tokenized (start=submit), as in generate.
    with closing(llm.engine.run([group], start=submit)) as steps:
        for _ in steps:
            if seq.error is not None:  # its step failed (no StepStats to read): make_outputs below raises
                break
            if len(engine.step_stats) != num_stats + 1:
                raise RuntimeError(f"engine {llm.engine_name!r} ran a step without recording its StepStats")
            stats = engine.step_stats[-1]
            trace.steps.append(StepRecord(
                index=len(trace.steps),
                phase="prefill" if had_output == 0 else "decode",
                start=stats.start - submit, end=stats.end - submit,
                num_computed_tokens=stats.num_computed_tokens,
                stage_times=dict(stats.stage_times),
                token_id=seq.output_token_ids[-1] if seq.num_output_tokens > had_output else None,
                text_delta=outputs.pop_delta(seq),
            ))
            num_stats, had_output = len(engine.step_stats), seq.num_output_tokens
    outputs.make_outputs([group])  # raises RequestFailedError if an engine step failed it
    trace.output_token_ids = list(seq.output_token_ids)
    trace.text = seq.text
    trace.finish_reason = seq.finish_reason.value if seq.finish_reason else None
    return trace


@dataclass
class StreamTrace:
    """When each piece of ``LLM.stream``'s text reached the caller. Notebook 01."""

    deltas: list[str]
    times: list[float]  # seconds from calling stream() to receiving each delta

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def time_to_first_delta(self) -> float:
        return self.times[0]

    @property
    def gaps(self) -> list[float]:
        """Seconds between consecutive deltas: the inter-token latency a user of the stream sees."""
        return [b - a for a, b in zip(self.times, self.times[1:])]


def time_stream(llm: LLM, prompt: Prompt, params: SamplingParams | None = None) -> StreamTrace:
    """Consume ``llm.stream(prompt, params)`` and timestamp every delta (tokenize included in the first)."""
    _check_idle(llm)
    deltas: list[str] = []
    times: list[float] = []
    start = time.perf_counter()
    for delta in llm.stream(prompt, params):
        times.append(time.perf_counter() - start)
        deltas.append(delta)
    if not deltas:
        raise ValueError("the stream produced no text (the request finished without any visible output)")
    return StreamTrace(deltas=deltas, times=times)
