"""Loading a tokenizer from a checkpoint folder, offline, without remote code.

Introduced in notebook 01 (``01_anatomy_of_a_request``), where tokenisation is timed as a stage.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The folder's Hugging Face tokenizer; never downloads, never runs code from the folder."""
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)


class SafeDecoder:
    """Wraps a tokenizer so ids it does not know decode to U+FFFD instead of raising.

    Presets have random weights and a larger vocabulary than the bundled tokenizer they borrow.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.size = len(tokenizer)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if all(t < self.size for t in token_ids):
            return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        parts, run = [], []
        for t in token_ids:
            if t < self.size:
                run.append(t)
                continue
            if run:
                parts.append(self.tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
                run = []
            parts.append("\ufffd ")
        if run:
            parts.append(self.tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
        return "".join(parts)
