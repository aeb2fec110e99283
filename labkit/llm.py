"""``LLM``: the offline front end, shaped like vLLM's, over any engine in ``ENGINES``.

    llm = LLM("labkit-tiny", engine="naive")
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))[0]
    out.outputs[0].text, out.metrics.ttft

Introduced in notebook 01 (``01_anatomy_of_a_request``).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import random
import time
from collections.abc import Iterable, Iterator, Sequence as Seq
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit.text.detokenizer import IncrementalDetokenizer
from labkit.device import resolve_device, resolve_dtype
from labkit.engine import ENGINES, Engine
from labkit.engine.base import StepFailedError
from labkit.metrics.request import RequestMetrics
from labkit.model import CausalLM, load_checkpoint, random_model
from labkit.model.source import BUNDLED_MODEL, ModelSource, resolve_model_source
from labkit.outputs import CompletionOutput, RequestOutput
from labkit.sampling_params import SamplingParams
from labkit.sequence import FinishReason, Sequence, SequenceStatus
from labkit.text.tokenizer import SafeDecoder, load_tokenizer

Prompt = str | list[int]


def generation_eos_ids(source: ModelSource) -> frozenset[int]:
    """EOS ids from the checkpoint's generation_config.json (e.g. a chat model's end-of-turn token)."""
    if source.checkpoint is None or not (source.checkpoint / "generation_config.json").is_file():
        return frozenset()
    eos = json.loads((source.checkpoint / "generation_config.json").read_text()).get("eos_token_id")
    return frozenset(eos if isinstance(eos, list) else ([] if eos is None else [eos]))


def default_engine() -> str:
    """The most advanced engine built so far (the last in teaching order)."""
    return list(ENGINES)[-1]


def is_token_id(value: object) -> bool:
    """An int (or numpy/torch-style integer scalar), but not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


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


class LLM:
    """Load a model once; generate with any engine. Introduced in notebook 01.

    Args:
        model: the bundled model's name ("labkit-tiny"), a checkpoint folder, or a preset name.
        engine: a name from ``ENGINES``; defaults to the last (most complete) engine.
        device: "auto" (cuda, then mps, then cpu), or a torch device string.
        dtype: "auto" (bf16 on capable GPUs, float32 elsewhere), "float32", "bfloat16", "float16", "float64".
        seed: seeds unseeded sampled requests, so a whole run is reproducible.
        **engine_options: the engine's options (vLLM names, e.g. max_model_len).
    """

    def __init__(
        self,
        model: str | Path = BUNDLED_MODEL,
        engine: str | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        **engine_options: object,
    ) -> None:
        engine = engine or default_engine()
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; engines are (in teaching order): {', '.join(ENGINES)}")
        engine_cls = ENGINES[engine]
        accepted = [f.name for f in dataclasses.fields(engine_cls.config_class)]
        unknown = sorted(set(engine_options) - set(accepted))
        if unknown:
            raise ValueError(
                f"engine {engine!r} does not take option(s) {', '.join(unknown)}; it accepts: {', '.join(accepted)}"
            )
        self.source: ModelSource = resolve_model_source(model)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_config = self.source.config
        self.model: CausalLM = (
            random_model(self.model_config, self.device, self.dtype, seed=seed)
            if self.source.is_preset
            else load_checkpoint(self.source.checkpoint, self.device, self.dtype)  # type: ignore[arg-type]
        )
        self.tokenizer = load_tokenizer(self.source.tokenizer_path)
        self.decoder = SafeDecoder(self.tokenizer)
        config = engine_cls.config_class(**engine_options)  # type: ignore[arg-type]
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is None:
            config.max_model_len = limit
        elif not is_token_id(config.max_model_len) or not 1 < config.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}] (the model's max_position_embeddings), "
                             f"got {config.max_model_len!r}")
        self.max_model_len: int = config.max_model_len
        self.engine_name = engine
        self.engine: Engine = engine_cls(self.model, config)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids) | generation_eos_ids(self.source) | (
            {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        )
        self._rng = random.Random(seed)
        self._next_id = 0

    def __repr__(self) -> str:
        return (f"LLM(model={self.source.name!r}, engine={self.engine_name!r}, device={self.device}, "
                f"dtype={self.dtype}, max_model_len={self.max_model_len})")

    # ---- input checking: every request is validated before any work starts ----

    def encode(self, prompt: Prompt, index: int = 0) -> list[int]:
        """Prompt -> token ids (strings get the tokenizer's special tokens, e.g. BOS), with clear errors."""
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError(f"prompt {index} is empty; give at least one character or token id")
            ids = list(self.tokenizer.encode(prompt))
            if not ids:
                raise ValueError(f"prompt {index} ({len(prompt)} characters) encodes to no tokens")
            return ids
        if isinstance(prompt, (list, tuple)):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is an empty token list; give at least one token id")
            vocab = self.model_config.vocab_size
            for t in prompt:
                if not is_token_id(t):
                    raise TypeError(f"prompt {index}: token ids must be ints, got {type(t).__name__} {t!r}")
                if not 0 <= t < vocab:
                    raise ValueError(f"prompt {index}: token id {t} is outside the vocabulary [0, {vocab})")
            return [int(t) for t in prompt]
        raise TypeError(f"prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}")

    def _check_lengths(self, ids: list[int], params: SamplingParams, index: int) -> None:
        n = len(ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt {index} has {n} tokens, which leaves no room to generate within "
                             f"max_model_len {self.max_model_len}; shorten it to at most {self.max_model_len - 1}")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt {index}: {n} prompt tokens + max_tokens {params.max_tokens} exceeds "
                             f"max_model_len {self.max_model_len}; lower max_tokens to at most "
                             f"{self.max_model_len - n}")

    def _make_sequences(self, prompts: Seq[Prompt], params: Seq[SamplingParams], arrival_time: float | None = None
                        ) -> list[list[Sequence]]:
        """One list of sequences per prompt (n of them when SamplingParams.n > 1)."""
        now = time.perf_counter() if arrival_time is None else arrival_time
        encoded = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling params {i} must be a SamplingParams, got {type(p).__name__}")
            p.verify()  # again: its fields may have been changed since it was made
            ids = self.encode(prompt, i)
            self._check_lengths(ids, p, i)
            encoded.append(ids)
        groups = []
        for prompt, ids, p in zip(prompts, encoded, params):
            group = []
            for j in range(p.n):
                seed = p.seed + j if p.seed is not None else self._rng.randrange(2**62)
                gen = None if p.greedy else torch.Generator(device=self.device).manual_seed(seed)
                group.append(Sequence(
                    seq_id=self._next_id, prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=ids, params=p,
                    detokenizer=IncrementalDetokenizer(self.decoder, ids, p.stop, p.skip_special_tokens),
                    generator=gen, metrics=RequestMetrics(arrival_time=now), max_model_len=self.max_model_len,
                    eos_token_ids=self.eos_token_ids, parent=group[0] if group else None,
                ))
                self._next_id += 1
            groups.append(group)
        for group in groups:
            for seq in group:
                self.engine.validate(seq)
        return groups

    @staticmethod
    def _broadcast(prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None
                   ) -> tuple[list[Prompt], list[SamplingParams]]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and is_token_id(prompts[0])):
            prompts = [prompts]  # type: ignore[list-item]
        if isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; "
                            f"got {type(prompts).__name__}")
        prompts = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return prompts, [params] * len(prompts)
        if isinstance(params, (str, bytes, dict)) or not isinstance(params, Iterable):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        return prompts, params

    # ---- running ----

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        arrival_times: Seq[float] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results in prompt order. Invalid input raises before any work.

        ``arrival_times`` (seconds after the call, one per prompt) replay traffic: a request joins the
        engine only once its time has come, and its metrics count from that arrival.

        If an engine step fails, only the requests in that step fail; the others run to completion, and
        then ``RequestFailedError`` is raised with every result in its ``outputs`` (failed completions
        have ``finish_reason == "error"``). A KeyboardInterrupt (the notebook's ■) aborts this call's
        requests, frees their KV memory and propagates: the next cell can use the engine at once.
        """
        start = time.perf_counter()  # requests arrive before they are tokenized, as in vLLM
        prompts, params = self._broadcast(prompts, sampling_params)
        offsets = self._check_arrivals(arrival_times, len(prompts))
        groups = self._make_sequences(prompts, params, start)
        self._run(groups, offsets, start, use_tqdm)
        outputs = [self._to_output(g) for g in groups]
        self._raise_if_failed(groups, outputs)
        return outputs

    @staticmethod
    def _raise_if_failed(groups: list[list[Sequence]], outputs: list[RequestOutput]) -> None:
        failed = [(i, s) for i, g in enumerate(groups) for s in g if s.finish_reason == FinishReason.ERROR]
        if failed:
            raise RequestFailedError(outputs, [(i, s.error or "") for i, s in failed]) from failed[0][1].error_cause

    @staticmethod
    def _check_arrivals(arrival_times: Seq[float] | None, n: int) -> list[float]:
        if arrival_times is None:
            return [0.0] * n
        offsets = list(arrival_times)
        if len(offsets) != n:
            raise ValueError(f"got {len(offsets)} arrival_times for {n} prompts; give one per prompt")
        for i, t in enumerate(offsets):
            if isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0:
                raise ValueError(f"arrival_times[{i}] must be a number of seconds >= 0, got {t!r}")
        return [float(t) for t in offsets]

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> list[Sequence]:
        """Validate one prompt and queue its sequence(s) in the engine; drive it with ``step``.

        The low-level path (vLLM's ``llm_engine.add_request`` / ``step``) for notebooks that watch
        an engine work step by step. Returns the n sequences of the request.
        """
        prompts, params = self._broadcast(prompt, sampling_params)
        if len(prompts) != 1:
            raise ValueError("add_request takes one prompt; use generate for many")
        (group,) = self._make_sequences(prompts, params)
        for seq in group:
            self.engine.add_request(seq)
        return group

    def step(self) -> list[Sequence]:
        """Run one engine iteration; returns the sequences that received a token."""
        return self.engine.step()

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the new text of one request as its tokens are produced.

        Closing the generator early (``break``, an exception, a KeyboardInterrupt) aborts the request
        and frees its KV memory. If its engine step fails, ``RequestFailedError`` is raised.
        """
        if sampling_params is not None and sampling_params.n != 1:
            raise ValueError(f"stream takes n=1 (one sequence), got n={sampling_params.n}; use generate for n > 1")
        (seq,) = self.add_request(prompt, sampling_params)
        try:
            while not seq.is_finished:
                try:
                    self.engine.step()
                except StepFailedError:
                    pass  # ours is finished with reason "error" if it was in the failed step; checked below
                delta = seq.detokenizer.pop_delta(seq.is_finished)
                if delta:
                    yield delta
        finally:
            if not seq.is_finished:  # the consumer stopped early (break, exception, interrupt)
                self.engine.abort_request(seq.seq_id)
        self._raise_if_failed([[seq]], [self._to_output([seq])])

    def _run(self, groups: list[list[Sequence]], offsets: list[float], start: float, use_tqdm: bool) -> None:
        # Requests join in arrival order; ties keep prompt order (FCFS).
        pending = sorted(((t, i) for i, t in enumerate(offsets)), reverse=True)
        total = sum(len(g) for g in groups)
        mine = {id(s) for g in groups for s in g}
        try:
            with tqdm(total=total, desc=f"{self.engine_name}", unit="req", disable=not use_tqdm) as bar:
                while pending or self.engine.has_unfinished_requests():
                    now = time.perf_counter()
                    while pending and start + pending[-1][0] <= now:
                        offset, i = pending.pop()
                        for seq in groups[i]:
                            seq.metrics.arrival_time = start + offset
                            self.engine.add_request(seq)
                    if not self.engine.has_unfinished_requests():
                        time.sleep(max(0.0, start + pending[-1][0] - time.perf_counter()))  # idle until the next arrival
                        continue
                    try:
                        stepped = self.engine.step()
                    except StepFailedError as exc:  # its sequences are finished ("error"); the rest carry on
                        stepped = exc.failed
                    bar.update(sum(s.is_finished and id(s) in mine for s in stepped))
        except BaseException:
            # An interrupt (or any error) mid-run must not leave this call's requests in the engine.
            for group in groups:
                for seq in group:
                    if not seq.is_finished:
                        self.engine.abort_request(seq.seq_id)
            raise

    def _to_output(self, group: list[Sequence]) -> RequestOutput:
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
