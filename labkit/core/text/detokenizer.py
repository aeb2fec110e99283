"""Incremental detokenisation: turn one new token id at a time into new text, safely.

A token can end in the middle of a multi-byte UTF-8 character, and some tokenizers change how a
token reads depending on what precedes it. So we decode a small window ending at the new token,
compare with the same window without it, and emit only text that is complete (no trailing U+FFFD).
Stop strings are matched on the text, and the last few characters are held back from streaming
until we know they do not begin a stop string. Introduced in notebook 01 (``01_anatomy_of_a_request``).
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Keeps the output text of one sequence up to date, token by token. Notebook 01."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids)
        # A few prompt tokens of context so the first output token decodes as it would mid-text.
        self.prefix_offset = max(len(self.token_ids) - 5, 0)
        self.read_offset = len(self.token_ids)
        self.stop = list(stop or [])
        self.text = ""
        self.streamed = 0  # characters of self.text already handed out by pop_delta
        self.stop_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str | None:
        """Add one token; returns the stop string if this token completed one (text is cut before it)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        search_from = max(len(self.text) - max((len(s) for s in self.stop), default=0) + 1, 0)
        self.text += delta
        for s in self.stop:
            idx = self.text.find(s, search_from)
            if idx != -1:
                self.text = self.text[:idx]
                self.stop_reason = s
                return s
        return None

    def pop_delta(self, finished: bool) -> str:
        """Text not yet streamed. While running, hold back what could still become a stop string."""
        hold = 0 if finished or not self.stop else max(len(s) for s in self.stop) - 1
        end = max(len(self.text) - hold, self.streamed)
        delta = self.text[self.streamed : end]
        self.streamed = end
        return delta
