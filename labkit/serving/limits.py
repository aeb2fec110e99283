"""What a request may cost before the engine sees it: body size, JSON shape, Unicode, prompt length.

A server takes input from strangers, and one request must not stall the others. So every check here
is cheap and runs before anything expensive: the body is read up to a limit (413 beyond it), decoded as
strict UTF-8 JSON (deep nesting and lone surrogates get a 400 naming the field), and a prompt that
cannot fit ``max_model_len`` is refused from its length in characters, or its number of chat messages,
before a tokenizer or a chat template spends seconds on it. The bounds are sound: no token covers more
characters than the longest entry of the vocabulary, so a prompt is refused only when no tokenization
could fit it; where a tokenizer may drop text (a normalizer that strips, an ``<unk>`` that swallows a
run of characters) the character check stays off and only the body limit applies. Long lists (chat
messages, content parts) are validated a chunk at a time: one pydantic call holds Python's lock throughout,
and the event loop would wait for all of it.

Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.requests import ClientDisconnect, Request

from labkit.core.engine.base import Engine
from labkit.core.engine.engine_core import EngineCore
from labkit.serving.protocol import (
    ChatMessage,
    RequestCapacity,
    RequestError,
    TextPart,
    check_lengths,
    validation_error,
)

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024
BODY_BYTES_PER_TOKEN = 32  # a token id list or an escaped long token: room for max_model_len of them
DRAIN_LIMIT = 64 * 1024 * 1024  # read (and drop) an oversized body up to this, so the client gets its 413
NORMALIZER_MARGIN = 4  # Unicode composition (NFC) merges at most a few code points into one
VALIDATION_CHUNK = 512  # items per pydantic call: it holds the GIL throughout, so the event loop waits for it
_MESSAGES, _PARTS = TypeAdapter(list[ChatMessage]), TypeAdapter(list[TextPart])
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # JSON's only way to smuggle a surrogate into a str
# Normalizers and pre-tokenizers that never delete input text (others, e.g. Strip, may: the check stays off)
_KEEPS_TEXT = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "Replace", "ByteLevel", "Metaspace", "Digits",
               "Split", "Punctuation", "UnicodeScripts", "Sequence"}


def default_max_request_body_bytes(max_model_len: int) -> int:
    """4 MiB, or 32 bytes per token of ``max_model_len`` for very long contexts."""
    return max(DEFAULT_MAX_REQUEST_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 naming the limit. An oversized body is drained (up to ``DRAIN_LIMIT``)
    rather than left unread: closing a socket with unread data resets it, and the client would never see the 413."""
    declared = request.headers.get("content-length", "")
    size = int(declared) if declared.isdigit() else 0
    too_big = size > limit
    chunks: list[bytes] = []
    received = 0
    if size <= DRAIN_LIMIT:
        try:
            async for chunk in request.stream():
                received += len(chunk)
                too_big = too_big or received > limit
                if received > DRAIN_LIMIT:
                    break
                if not too_big:
                    chunks.append(chunk)
        except ClientDisconnect:
            raise RequestError("the client disconnected while sending the request", status_code=499) from None
    if too_big:
        raise RequestError(f"request body is {max(size, received)} bytes, more than this server accepts: "
                           f"{limit} bytes (--max-request-body-bytes)", status_code=413, code="request_too_large")
    return b"".join(chunks)


def decode_json(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object: strict UTF-8, bounded nesting, no lone surrogates anywhere."""
    try:
        text = body.decode("utf-8")  # strict: JSON on the wire is UTF-8 (RFC 8259), and no raw surrogates
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not valid UTF-8 (byte {exc.start}): send JSON encoded as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # json's parser recurses once per nesting level
        raise RequestError("request body nests JSON arrays or objects too deeply to parse; an OpenAI request "
                           "needs a handful of levels") from None
    except ValueError as exc:  # Python's limit on the digits of an integer (sys.get_int_max_str_digits)
        raise RequestError(f"request body has a number too long to read: {exc}; no field of an OpenAI request "
                           "needs more than 20 digits") from None
    if not isinstance(data, dict):
        raise RequestError(f"request body must be a JSON object, got {type(data).__name__}")
    if _SURROGATE_ESCAPE.search(text):  # rare: only then walk the whole tree
        check_unicode(data)
    return data


def _lone_surrogate(text: str) -> int | None:
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as exc:
        return exc.start


def check_unicode(data: Any) -> None:
    """Raise a 400 naming the first field (or field name) holding a lone surrogate such as ``\\ud800``:
    a tokenizer cannot encode it, and neither can a UTF-8 response. Iterative: depth costs no stack."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            at = _lone_surrogate(value)
            if at is not None:
                raise RequestError(f"{path}: invalid Unicode: a lone surrogate {value[at]!a} at character {at}; "
                                   "text must be valid UTF-8", path)
        elif isinstance(value, dict):
            for key, item in value.items():
                at = _lone_surrogate(key)
                if at is not None:
                    where = f"in {path}" if path else "at the top level"
                    raise RequestError(f"a field name {where} is not valid Unicode (a lone surrogate "
                                       f"{key[at]!a}); field names must be valid UTF-8", path or None)
                stack.append((item, f"{path}.{key}" if path else key))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}") for i, item in enumerate(value))


def _validate_chunked(adapter: TypeAdapter[list[Any]], items: list[Any], loc: tuple[str | int, ...]) -> list[Any]:
    validated: list[Any] = []
    for start in range(0, len(items), VALIDATION_CHUNK):
        try:
            validated.extend(adapter.validate_python(items[start:start + VALIDATION_CHUNK]))
        except ValidationError as exc:
            raise validation_error([{**e, "loc": (*loc, start + e["loc"][0], *e["loc"][1:])}
                                    for e in exc.errors()]) from None
    return validated


def prevalidate_messages(data: dict[str, Any]) -> None:
    """Validate a long list of chat messages, or of one message's content parts, a chunk at a time (in place):
    a 100k-item list in one pydantic call would keep every other thread, the event loop included, waiting."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        parts = message.get("content") if isinstance(message, dict) else None
        if isinstance(parts, list) and len(parts) > VALIDATION_CHUNK:
            message["content"] = _validate_chunked(_PARTS, parts, ("messages", i, "content"))
    if len(messages) > VALIDATION_CHUNK:
        data["messages"] = _validate_chunked(_MESSAGES, messages, ("messages",))


def _keeps_text(spec: dict[str, Any] | None) -> bool:
    """Whether a tokenizer.json normalizer or pre-tokenizer never deletes characters."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind not in _KEEPS_TEXT or (kind in ("Split", "Punctuation") and spec.get("behavior") == "Removed"):
        return False
    if kind == "Replace":  # a literal no longer than its replacement; a regex could collapse runs of characters
        pattern = (spec.get("pattern") or {}).get("String")
        return pattern is not None and len(pattern) <= len(spec.get("content") or "")
    parts = spec.get("normalizers") or spec.get("pretokenizers") or []
    return all(_keeps_text(p) for p in parts)


def max_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token can cover (its longest vocabulary entry), or None when this
    tokenizer may drop text or fold a run of unknown characters into one ``<unk>``: then no bound holds."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast (Rust) tokenizer; others: no bound
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    fuses_unknowns = model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback")
    strips = any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or [])
    if model.get("type") != "BPE" or fuses_unknowns or strips \
            or not (_keeps_text(spec.get("normalizer")) and _keeps_text(spec.get("pre_tokenizer"))):
        return None
    return max(len(token) for token in tokenizer.get_vocab())  # byte-level entries: one character per byte


def min_message_tokens(tokenizer: Any) -> int:
    """Tokens the chat template adds for every message, at least: its special (atomic) tokens, counted on
    empty messages of each role. 0 when the template renders some message with none, or refuses to."""
    special = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    cost = []
    for role in ("system", "user", "assistant"):
        try:
            texts = [tokenizer.apply_chat_template([{"role": role, "content": ""}] * n, tokenize=False)
                     for n in (1, 2)]
        except Exception:  # noqa: BLE001  (a template may refuse a conversation shape: no bound then)
            return 0
        counts = [sum(t in special for t in tokenizer.encode(text, add_special_tokens=False)) for text in texts]
        cost.append(counts[1] - counts[0])
    return max(0, min(cost))


@dataclass(frozen=True)
class PromptLimits:
    """How long a prompt can be, known before tokenizing it. Notebook 09.

    ``max_token_chars``: the most characters one token covers (None: no sound bound for this tokenizer);
    ``min_message_tokens``: the fewest tokens the chat template spends per message (0: unknown).
    """

    max_model_len: int
    max_token_chars: int | None
    min_message_tokens: int

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, max_model_len: int) -> PromptLimits:
        if not getattr(tokenizer, "chat_template", None):
            return cls(max_model_len, max_token_chars(tokenizer), 0)
        return cls(max_model_len, max_token_chars(tokenizer), min_message_tokens(tokenizer))

    @property
    def max_prompt_chars(self) -> int | None:
        if self.max_token_chars is None:
            return None
        return NORMALIZER_MARGIN * self.max_model_len * self.max_token_chars

    def check_text(self, text: str, field: str) -> None:
        """Refuse text that no tokenization could fit into ``max_model_len``."""
        limit = self.max_prompt_chars
        if limit is not None and len(text) > limit:
            raise RequestError(
                f"{field} has {len(text)} characters: it cannot fit this model's max_model_len of {self.max_model_len} "
                f"tokens (no token covers more than {self.max_token_chars} characters, so nothing over {limit} "
                "characters can fit); shorten it", field)

    def check_raw(self, data: dict[str, Any]) -> None:
        """The pre-check on the decoded body, before validation: prompt characters, message counts."""
        prompt = data.get("prompt")
        texts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
        for text in texts:
            if isinstance(text, str):
                self.check_text(text, "prompt")
        if isinstance(prompt, list) and len(prompt) >= self.max_model_len and all(type(t) is int for t in prompt):
            check_lengths(len(prompt), None, self.max_model_len, "prompt")  # token ids: the count is the length
        messages = data.get("messages")
        if isinstance(messages, list) and self.min_message_tokens \
                and len(messages) * self.min_message_tokens >= self.max_model_len:
            most = (self.max_model_len - 1) // self.min_message_tokens
            raise RequestError(
                f"messages has {len(messages)} messages: the chat template spends at least {self.min_message_tokens} "
                f"tokens on each, so at most {most} fit this model's max_model_len of {self.max_model_len}", "messages")


def request_capacity(engine: Engine) -> RequestCapacity | None:
    """What the KV pool (and a scheduler that recomputes a preempted request in one step) allows; None: no limit
    beyond max_model_len."""
    found: list[RequestCapacity] = []
    bm = engine.block_manager
    if bm is not None:
        found.append(RequestCapacity(bm.num_blocks * bm.block_size, f"this server's KV cache holds "
                                     f"{bm.num_blocks * bm.block_size} tokens ({bm.num_blocks} blocks of "
                                     f"{bm.block_size}; --num-gpu-blocks)"))
    if isinstance(engine, EngineCore) and not engine.scheduler.enable_chunked_prefill:
        budget = engine.scheduler.max_num_batched_tokens
        found.append(RequestCapacity(budget, f"engine '{engine.name}' recomputes a preempted request in one step "
                                     f"of at most max_num_batched_tokens {budget} tokens"))
    return min(found, key=lambda c: c.num_tokens, default=None)
