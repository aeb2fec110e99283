"""``LLM``: the offline front end, shaped like vLLM's, over any engine in ``ENGINES``.

    llm = LLM("labkit-tiny", engine="naive")
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))[0]
    out.outputs[0].text, out.metrics.ttft

A request's path: ``InputProcessor`` (tokenize, validate, build ``Sequence``s) -> the engine (``Engine.run``: add,
step, abort, the one loop every front end shares; each ``step`` schedules, runs the model and takes the tokens back)
-> ``OutputProcessor`` (streamed text, ``RequestOutput``s). ``docs/architecture.md`` walks one request through the
files. Introduced in notebook 01 (``01_anatomy_of_a_request``).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from contextlib import closing
from pathlib import Path

import torch
from tqdm.auto import tqdm

from labkit.core.device import resolve_device, resolve_dtype
from labkit.core.engine import Engine
from labkit.core.engine.errors import EngineDeadError
from labkit.core.engine.input_processor import InputProcessor, Prompt, eos_token_ids
from labkit.core.engine.output_processor import OutputProcessor, RequestFailedError
from labkit.core.model import CausalLM, load_checkpoint, random_model
from labkit.core.model.layers import MergedLinear
from labkit.core.model.linear import linear_kernels
from labkit.core.model.source import BUNDLED_MODEL, ModelSource, resolve_model_source
from labkit.core.outputs import RequestOutput
from labkit.core.presets import default_engine, engine_preset
from labkit.core.quant import QuantizationConfig, QuantizedMergedLinear, quantize_model, resolve_quantization
from labkit.core.quant.config import check_compute_dtype
from labkit.core.sampling_params import SamplingParams
from labkit.core.sequence import Sequence
from labkit.core.text.tokenizer import load_tokenizer

__all__ = ["LLM", "Prompt", "RequestFailedError"]


class LLM:
    """Load a model once; generate with any engine. Introduced in notebook 01 (``01_anatomy_of_a_request``).

    Args:
        model: the bundled model's name ("labkit-tiny"), a checkpoint folder, or a preset name.
        engine: a name from ``ENGINES`` (default: ``chunked``), or an ``Engine`` subclass
            (a learner's engine: its own class runs).
        device: "auto" (cuda, then mps, then cpu), or a torch device string.
        dtype: "auto" (bf16 on capable GPUs, float32 elsewhere), "float32", "bfloat16", "float16", "float64".
        seed: seeds unseeded sampled requests, so a whole run is reproducible.
        quantization: None, "int8" or "int4" (vLLM's name), or a ``QuantizationConfig`` (int4's group size, and
            ``activations="int16"`` or, for int4, ``"int8"`` to round decode calls' inputs too): quantization of
            every linear layer at load (``labkit.core.quant``, notebook 14).
        **engine_options: the engine's options (vLLM names, e.g. max_model_len).
    """

    def __init__(
        self,
        model: str | Path = BUNDLED_MODEL,
        engine: str | type[Engine] | None = None,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        seed: int = 0,
        quantization: str | QuantizationConfig | None = None,
        **engine_options: object,
    ) -> None:
        engine = engine or default_engine()
        preset = engine_preset(engine, engine_options)  # unknown engine or option: fail before loading anything
        self.source: ModelSource = resolve_model_source(model)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.quantization = resolve_quantization(quantization)  # unknown format: fail before loading
        if self.quantization is not None:
            check_compute_dtype(self.dtype)
        self.model_config = self.source.config
        config = preset.make_config(engine_options, self.model_config.max_position_embeddings)  # bad values too
        self.model: CausalLM = (
            random_model(self.model_config, self.device, self.dtype, seed=seed)
            if self.source.is_preset
            else load_checkpoint(self.source.checkpoint, self.device, self.dtype)  # type: ignore[arg-type]
        )
        if self.quantization is not None:  # before the engine sizes its KV pool: the freed float weights count
            quantize_model(self.model, self.quantization)
        self.tokenizer = load_tokenizer(self.source.tokenizer_path)
        self.engine_name: str = preset.name
        self.engine: Engine = preset.build(self.model, config)
        self.max_model_len: int = self.engine.config.max_model_len  # type: ignore[assignment]
        self.eos_token_ids = eos_token_ids(self.source, self.tokenizer)
        self.input_processor = InputProcessor(self.engine, self.tokenizer, self.model_config.vocab_size,
                                              self.eos_token_ids, self.device, seed)
        self.output_processor = OutputProcessor()
        self.closed = False

    def __repr__(self) -> str:
        return (f"LLM(model={self.source.name!r}, engine={self.engine_name!r}, device={self.device}, "
                f"dtype={self.dtype}, max_model_len={self.max_model_len}{', closed' if self.closed else ''})")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release everything this LLM holds: the engine's KV pool, CUDA graphs and worker thread, and the model's
        weights; on CUDA the freed memory goes back to the device (``torch.cuda.empty_cache``), so the next engine
        gets it. Requests still running are aborted. Safe to call twice; the LLM cannot generate afterwards.
        ``with LLM(...) as llm:`` closes it at the end of the block."""
        if self.closed:
            return
        self.closed = True
        self.engine.close()
        release_weights(self.model)
        if self.device.type == "cuda":
            gc.collect()  # tensors held only by reference cycles (a failed step's traceback) go first
            torch.cuda.empty_cache()

    def _check_open(self, finishing: bool = False) -> None:
        if self.closed:
            raise RuntimeError(f"this LLM ({self.source.name}, engine {self.engine_name!r}) is closed: close() "
                               "released its model and KV memory; create a new LLM")
        cause = self.death_cause()
        if cause is not None and not (finishing and self.engine.has_unfinished_requests()):
            raise EngineDeadError(cause)  # ``step`` (finishing) may still finish what the engine holds

    def death_cause(self) -> str | None:
        """Why this LLM's engine is dead (a worker process it needs is gone), or None while it is alive."""
        probe = getattr(self.engine, "death_cause", None)  # engines with worker processes (engine.workers) have it
        return probe() if callable(probe) else None

    def is_alive(self) -> bool:
        """False once closed, or once a worker process the engine needs has died (chapter 12's prefill worker): then
        every later call raises ``EngineDeadError`` naming the cause (vLLM's name); ``close()`` and make a new LLM.
        Safe to call from any thread (the server's ``/health`` does)."""
        return not self.closed and self.death_cause() is None

    def encode(self, prompt: Prompt, index: int = 0) -> list[int]:
        """Prompt -> token ids (strings get the tokenizer's special tokens, e.g. BOS), with clear errors."""
        self._check_open()
        return self.input_processor.encode(prompt, index)

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
        self._check_open()
        start = time.perf_counter()  # requests arrive before they are tokenized, as in vLLM
        prompts, params = self.input_processor.broadcast(prompts, sampling_params)
        offsets = self.input_processor.check_arrivals(arrival_times, len(prompts))
        groups = self.input_processor.make_sequences(prompts, params, start)
        mine = {id(s) for g in groups for s in g}
        with (tqdm(total=len(mine), desc=self.engine_name, unit="req", disable=not use_tqdm) as bar,
              closing(self.engine.run(groups, offsets, start)) as steps):
            for stepped in steps:
                bar.update(sum(s.is_finished and id(s) in mine for s in stepped))
        return self.output_processor.make_outputs(groups)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the new text of one request as its tokens are produced.

        Closing the generator early (``break``, an exception, a KeyboardInterrupt) aborts the request
        and frees its KV memory. If its engine step fails, ``RequestFailedError`` is raised.
        """
        self._check_open()
        if sampling_params is not None and sampling_params.n != 1:
            raise ValueError(f"stream takes n=1 (one sequence), got n={sampling_params.n}; use generate for n > 1")
        prompts, params = self.input_processor.broadcast(prompt, sampling_params)
        if len(prompts) != 1:
            raise ValueError("stream takes one prompt; use generate for many")
        (group,) = self.input_processor.make_sequences(prompts, params)
        seq, outputs = group[0], self.output_processor
        with closing(self.engine.run([group], start=seq.metrics.arrival_time)) as steps:
            for _ in steps:
                delta = outputs.pop_delta(seq)
                if delta:
                    yield delta
                if seq.is_finished:
                    break  # other requests (queued with add_request) may still run: not this stream's work
        outputs.make_outputs([group])  # raises RequestFailedError if its step failed

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> list[Sequence]:
        """Validate one prompt and queue its sequence(s) in the engine; drive it with ``step``.

        The low-level path (vLLM's ``llm_engine.add_request`` / ``step``) for notebooks that watch
        an engine work step by step. Returns the n sequences of the request.
        """
        self._check_open()
        prompts, params = self.input_processor.broadcast(prompt, sampling_params)
        if len(prompts) != 1:
            raise ValueError("add_request takes one prompt; use generate for many")
        (group,) = self.input_processor.make_sequences(prompts, params)
        self.engine.add_sequences(group)
        return group

    def step(self) -> list[Sequence]:
        """Run one engine iteration; returns the sequences that received a token.

        Unlike ``generate``, a failed step raises ``StepFailedError`` naming its sequences: whoever steps
        by hand sees the fault where it happened.
        """
        self._check_open(finishing=True)
        return self.engine.step()


def release_weights(model: CausalLM) -> None:
    """Free a model's weights: its parameters and buffers keep their shapes on the meta device (no storage), and the
    merged projections (``MergedLinear``, which hold the tensors the parameters are views of) and the linear kernels'
    repacked copies let go of theirs."""
    model.to("meta")
    for module in model.modules():
        for part in vars(module).values():
            if isinstance(part, MergedLinear):
                part.weight = part.bias = None
            elif isinstance(part, QuantizedMergedLinear):  # notebook 14's merged int8/int4 projections
                part.qweight = part.scales = part.bias = None
    for kernel in linear_kernels(model):  # and their oneDNN copies (labkit.core.model.linear)
        kernel.packed = kernel.packed_from = None
