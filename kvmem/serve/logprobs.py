"""Logprobs in the OpenAI response shapes: completions' four parallel lists and chat's
``content`` entries.

Tokens are shown as their decoded text (special tokens included), or as ``token_id:N``
with the request's ``return_tokens_as_token_ids`` (vLLM's extension: byte-level pieces of
a multi-byte character all decode to U+FFFD and would collide). ``-inf`` becomes
-9999.0, as OpenAI and vLLM send it (JSON has no infinity). A completions position's
``top_logprobs`` holds the chosen token and the ``logprobs`` most likely ones (so k or
k + 1 entries; tokens whose text coincides collapse into one key), as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmem.engine.outputs import PositionLogprobs

_FLOOR = -9999.0


class TokenTexts:
    """Each token id's decoded text, cached (the vocabulary is fixed)."""

    def __init__(self, tokenizer, as_ids: bool = False) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self.as_ids = as_ids

    def ids(self) -> TokenTexts:
        """The same tokens shown as ``token_id:N``."""
        return TokenTexts(self._tokenizer, as_ids=True)

    def __call__(self, token_id: int) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id],
                                                                  skip_special_tokens=False)
        return text


def _lp(value: float) -> float:
    return max(value, _FLOOR)


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int],
                        entries: Sequence[PositionLogprobs | None],
                        initial_offset: int = 0) -> dict[str, Any]:
    """The completions ``logprobs`` object for ``token_ids``; an entry of None (the first
    prompt token, which nothing predicts) has no logprob and no alternatives."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = initial_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        token = texts(token_id)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_lp(entry.logprob))
        top = {token: _lp(entry.logprob)}
        for tid, value in entry.top:
            top.setdefault(texts(tid), _lp(value))
        top_logprobs.append(top)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
            "top_logprobs": top_logprobs}


def chat_logprobs(texts: TokenTexts, entries: Sequence[PositionLogprobs]) -> dict[str, Any]:
    """The chat ``logprobs`` object: one ``content`` item per generated token."""
    def item(token_id: int, value: float) -> dict[str, Any]:
        token = texts(token_id)
        return {"token": token, "logprob": _lp(value),
                "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(tid, v) for tid, v in e.top]}
                        for e in entries]}
