"""Incremental detokenisation: multi-byte UTF-8, stop strings across tokens, held-back streaming."""

from __future__ import annotations

from labkit.core.text.detokenizer import IncrementalDetokenizer


def feed(tokenizer, text: str, stop: list[str] | None = None):  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("Hello")
    ids = tokenizer.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tokenizer, prompt, stop)
    deltas = []
    for i, t in enumerate(ids):
        hit = det.append(t)
        deltas.append(det.pop_delta(finished=hit is not None or i == len(ids) - 1))
        if hit is not None:
            break
    return det, deltas, ids


def test_multibyte_text_streams_without_broken_characters(tokenizer) -> None:
    text = " café, naïve — 日本語 ☕ ok"
    det, deltas, ids = feed(tokenizer, text)
    assert len(ids) > len(text.split())  # some characters span several byte-level tokens
    assert "".join(deltas) == det.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_spanning_tokens_cuts_the_text(tokenizer) -> None:
    text = " The cat sat on the mat. The end. More text follows."
    det, deltas, ids = feed(tokenizer, text, stop=["The end"])
    assert det.stop_reason == "The end"
    assert det.text == " The cat sat on the mat. "
    assert "".join(deltas) == det.text  # nothing of the stop string was ever streamed


def test_held_back_text_is_released_when_no_stop_matches(tokenizer) -> None:
    det, deltas, _ = feed(tokenizer, " one two three four", stop=["zebra!"])
    assert det.stop_reason is None
    assert "".join(deltas) == det.text == " one two three four"
