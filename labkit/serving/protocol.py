"""The OpenAI-compatible request bodies, and how a request becomes engine input (or a clear 400).

A server takes input from strangers, so every field is checked before any work starts, and a bad
request gets a 400 that names the field, the value and the limit, in OpenAI's error format
(``{"error": {"message", "type", "param", "code"}}``). The models are strict (``"5"`` is not an int,
``true`` is not a number) and reject unknown fields, as OpenAI's API does; fields OpenAI defines but
labkit does not implement are accepted only at their neutral value (``presence_penalty: 0``...).
Token limits come from the model: the prompt must leave room in ``max_model_len``, and ``max_tokens``
may not ask for more than the room left. vLLM's extensions ``top_k``, ``ignore_eos`` and
``return_token_ids`` are accepted too (load generators send ``ignore_eos`` to fix output lengths).

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from labkit.core.sampling_params import MAX_SEED, SamplingParams

MAX_STOP_STRINGS = 4  # OpenAI's limit


class RequestError(Exception):
    """A request the server refuses: HTTP status, message, and the offending field. Notebook 09."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.error_type = error_type
        self.code = code

    def body(self) -> dict[str, Any]:
        """OpenAI's error body (the ``openai`` client turns it into ``BadRequestError`` etc.)."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    # strict: no silent "5" -> 5 coercion; forbid: a typo in a field name is an error, not ignored
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    """``stream_options`` of a streamed request: ``include_usage`` asks for the final usage chunk. Notebook 09."""

    include_usage: bool = False


class _GenerationFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1  # vLLM extension; -1 disables
    n: int = Field(1, ge=1, le=1)  # one completion per request on this server
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)  # SamplingParams' own bound: one source for the limit
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens
    return_token_ids: bool = False  # vLLM extension: put the token ids in each choice
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extension; `vllm bench serve` sends 1.0
    logit_bias: dict[str, float] | None = None

    # OpenAI fields labkit does not implement, and the values that mean "off" (accepted, ignored). Completions'
    # logprobs is a count, and 0 is not "off" there (OpenAI returns the sampled token's logprob), so only null is.
    NEUTRAL: ClassVar[dict[str, tuple[object, ...]]] = {
        "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (1.0,),
        "logit_bias": (None, {}), "logprobs": (None,), "echo": (False,), "best_of": (None, 1),
        "suffix": (None,), "top_logprobs": (None, 0)}

    def check_supported(self) -> None:
        """Refuse fields labkit accepts only at their neutral value, and options that need another one."""
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name, None)
            if name in type(self).model_fields and not any(_same(value, n) for n in neutral):
                raise RequestError(f"{name}={json.dumps(value)} is not supported by this server; leave it out "
                                   f"or send {json.dumps(neutral[0])}", name)
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", "stream_options")

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
        return stop

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def _same(value: object, neutral: object) -> bool:
    """Equal and of the same kind: in Python 0 == False, but `logprobs: 0` is not `logprobs: false`."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


class CompletionRequest(_GenerationFields):
    """Body of ``POST /v1/completions``. Notebook 09."""

    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    """One text part of a chat message's content (OpenAI's list form). Notebook 09."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """One chat message: a role and its content. Notebook 09."""

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationFields):
    """Body of ``POST /v1/chat/completions``. Notebook 09."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    NEUTRAL: ClassVar[dict[str, tuple[object, ...]]] = {**_GenerationFields.NEUTRAL, "logprobs": (None, False)}

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise RequestError(f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                               f"({self.max_completion_tokens}) disagree; send one of them", "max_completion_tokens")

    @property
    def output_limit(self) -> tuple[int | None, str]:
        """The output limit asked for, and the field it came in."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


# ---- parsing: bytes -> a validated request, or a RequestError that says what is wrong ----

def _describe(error: dict[str, Any]) -> tuple[str, str | None]:
    """One pydantic error as (message, param): the field's dotted path, what was wrong, the value sent."""
    loc = [str(p) for p in error.get("loc", ())]
    # drop union-branch names pydantic adds, e.g. ("prompt", "str") or ("content", "list[TextPart]", 0, "text")
    path = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool")]
    field = ".".join(path) or None
    kind = error.get("type", "")
    if kind == "missing":
        return f"missing required field '{field}'", field
    if kind == "extra_forbidden":
        return f"unrecognized request argument '{field}'", field
    msg = error.get("msg", "invalid value").removeprefix("Value error, ")
    return f"{field or 'request body'}: {msg}, got {_shown(error.get('input'))}", field


def _shown(value: object) -> str:
    """A value as the client sent it, short (ASCII, so any text survives)."""
    try:
        return json.dumps(value, default=str)[:200]
    except (ValueError, RecursionError):
        return type(value).__name__


def parse_request(model: type[_GenerationFields], data: dict[str, Any]) -> Any:
    """Validate a decoded JSON body (``labkit.serving.limits.decode_json``); raise ``RequestError`` (400)
    naming field, value and limit."""
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    req.check_supported()
    return req


def validation_error(errors: Sequence[Any]) -> RequestError:
    """Pydantic's errors as one 400 naming the field. A union field (prompt, stop, content) reports one error
    per branch: show the first, say how many."""
    message, param = _describe(errors[0])
    if len(errors) > 1 and all(_describe(e)[1] == param for e in errors):
        message = f"{param}: wrong type, got {_shown(errors[0].get('input'))}; expected {_expected(param)}"
    elif len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return RequestError(message, param)


def _expected(param: str | None) -> str:
    hints = {"prompt": "a string, a list of token ids, or a list of one string",
             "stop": "a string or a list of strings", "messages": "a list of {role, content} objects"}
    top = (param or "").split(".")[0]
    if top == "messages":
        return "messages as {role: system|user|assistant, content: string or [{type: text, text}]}"
    return hints.get(top, "the type in the OpenAI API reference")


# ---- engine input ----

@dataclass(frozen=True)
class RequestCapacity:
    """The most tokens one request can hold in this engine (prompt + output - 1: the last sampled token
    needs no KV slot), and why (``labkit.serving.limits.request_capacity``). Notebook 09."""

    num_tokens: int
    reason: str


def check_lengths(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, prompt_field: str,
                  max_tokens_field: str = "max_tokens", capacity: RequestCapacity | None = None) -> int:
    """The output limit to use: ``max_tokens``, or all the room left when it is None (within ``max_model_len``
    and what the engine can hold). Raises RequestError naming the field that is over its limit."""
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"{prompt_field} has {num_prompt_tokens} tokens, but this model's max_model_len is {max_model_len} "
            f"(prompt + output); shorten it to at most {max_model_len - 1} tokens", prompt_field)
    room = max_model_len - num_prompt_tokens
    fits = room if capacity is None else capacity.num_tokens - num_prompt_tokens + 1
    if capacity is not None and fits < 1:
        raise RequestError(f"{prompt_field} has {num_prompt_tokens} tokens, but {capacity.reason}; shorten it to "
                           f"at most {capacity.num_tokens} tokens", prompt_field)
    if max_tokens is None:  # the client left the output open: whatever fits
        return min(room, fits)
    if max_tokens > room:
        raise RequestError(
            f"{max_tokens_field} {max_tokens} is too large: the prompt has {num_prompt_tokens} tokens and "
            f"max_model_len is {max_model_len}, so {max_tokens_field} can be at most {room}", max_tokens_field)
    if max_tokens > fits:
        raise RequestError(f"{max_tokens_field} {max_tokens} is too large: {capacity.reason if capacity else ''}, and "
                           f"the prompt has {num_prompt_tokens}, so {max_tokens_field} can be at most {fits}",
                           max_tokens_field)
    return max_tokens


def sampling_params(req: _GenerationFields, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(n=1, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed,
                              max_tokens=max_tokens, stop=req.stop_list(), ignore_eos=req.ignore_eos)
    except (ValueError, TypeError) as exc:  # SamplingParams' own messages name the field and limit
        field = str(exc).split(" ")[0]
        raise RequestError(str(exc), field if field in type(req).model_fields else None) from None


def completion_input(req: CompletionRequest, tokenizer: Any, vocab_size: int) -> list[int]:
    """Prompt token ids of a completion request (text is tokenized with special tokens, e.g. BOS)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise RequestError(f"prompt: this server takes one prompt per request, got a list of {len(prompt)}; "
                               "send them as separate requests", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if prompt == "":
            raise RequestError("prompt is empty; send at least one character or token id", "prompt")
        return [int(t) for t in tokenizer.encode(prompt)]
    if not prompt:
        raise RequestError("prompt is an empty list of token ids; send at least one", "prompt")
    for t in prompt:
        if not 0 <= t < vocab_size:
            raise RequestError(f"prompt: token id {t} is outside the vocabulary [0, {vocab_size})", "prompt")
    return list(prompt)  # type: ignore[arg-type]


def chat_input(req: ChatCompletionRequest, tokenizer: Any, check_text: Callable[[str, str], None] | None = None
               ) -> list[int]:
    """Prompt token ids of a chat request: the tokenizer's chat template, ending with the assistant's turn.
    ``check_text(text, field)`` sees the rendered prompt before the (slower) tokenizer does."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template; use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if check_text is not None:
        check_text(text, "messages")
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]  # the template writes BOS itself
