"""Text in and out: the tokenizer (prompt -> ids) and the incremental detokenizer (ids -> streamed text)."""
