"""Incremental detokenization: the text each new token adds, safe for multi-token characters.

Decoding a token alone loses the spaces and merges that depend on its neighbours, and a
token may end in the middle of a UTF-8 character. We decode a short window before the
new tokens and emit only the text beyond it, and hold back text ending in U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.token_ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def step(self, token_id: int) -> str:
        """Add one token; returns the newly readable text (possibly empty)."""
        self.token_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return text[len(prefix):]
