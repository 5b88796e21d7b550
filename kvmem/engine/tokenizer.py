"""Text <-> token ids, chat templates, and streaming detokenization.

Wraps a ``tokenizers`` tokenizer.json with what serving needs: the model's chat template
(rendered with jinja2 the way HuggingFace tokenizers do), its end-of-sequence ids, and
an incremental detokenizer that never emits a broken UTF-8 piece.

Encoding releases the GIL (a long prompt takes seconds), so a server that encodes on a
worker thread keeps answering meanwhile; text that is not valid Unicode (a lone UTF-16
surrogate such as ``"\\ud800"``, which JSON allows) is an InvalidRequestError.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from kvmem.engine.errors import InvalidRequestError, PromptTooLongError
from kvmem.errors import KvmemError
from kvmem.files import read_bounded
from kvmem.units import MiB

REPLACEMENT_CHAR = "\ufffd"


class ChatTemplateError(KvmemError):
    """Messages that the model's chat template cannot render (or no template)."""


def check_unicode(text: str, param: str | None = "prompt") -> None:
    """Raise InvalidRequestError unless ``text`` encodes to UTF-8 (no lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{param or 'text'} is not valid Unicode: a lone surrogate "
            f"{text[e.start]!r} at character {e.start}", param=param) from None


# far above a real tokenizer.json (Gemma 3's, 262k tokens, is about 33 MB)
TOKENIZER_LIMIT = 256 * MiB


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(read_bounded(path, "tokenizer file")) if path.exists() else {}
    except ValueError:  # not JSON, or not UTF-8
        return {}


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


class Tokenizer:
    def __init__(self, tokenizer_json: Path, tokenizer_config: dict[str, Any] | None = None,
                 extra_eos_ids: set[int] | None = None) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_buffer(
            read_bounded(tokenizer_json, "tokenizer", TOKENIZER_LIMIT))
        cfg = tokenizer_config or {}
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.eos_token = _token_content(cfg.get("eos_token"))
        self.chat_template: str | None = cfg.get("chat_template") or None
        if isinstance(self.chat_template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.eos_token_ids: set[int] = set(extra_eos_ids or ())
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            self.eos_token_ids.add(self._tok.token_to_id(self.eos_token))
        self._template = None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer:
        """From a checkpoint directory (tokenizer.json, tokenizer_config.json, config.json,
        generation_config.json: the last two add end-of-sequence ids)."""
        eos = _ids(_read_json(path / "config.json").get("eos_token_id"))
        eos |= _ids(_read_json(path / "generation_config.json").get("eos_token_id"))
        return cls(path / "tokenizer.json", _read_json(path / "tokenizer_config.json"), eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True,
               param: str | None = "prompt", max_model_len: int | None = None) -> list[int]:
        """Token ids; ``add_special_tokens`` adds e.g. BOS where the model's tokenizer does
        (pass False for text rendered by the chat template, which already has them).
        Text that is not valid Unicode raises InvalidRequestError naming ``param``; with
        ``max_model_len``, text of that many tokens or more raises PromptTooLongError."""
        check_unicode(text, param)
        # The batch call releases the GIL while it works (encode holds it), so other threads,
        # an HTTP server's event loop among them, run while a long prompt is encoded; the
        # "fast" one skips character offsets, which makes it ~2.5x faster and its result
        # cheap to free (freeing is done holding the GIL).
        encoding = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        if max_model_len is not None and len(encoding) >= max_model_len:
            raise PromptTooLongError.for_length(len(encoding), max_model_len)  # ids not copied
        return encoding.ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` (e.g. ``"Ġhello"``), None if out of range."""
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for a conversation, rendered by the model's chat template."""
        import jinja2

        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use the completions API")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ChatTemplateError("each message needs a 'role' and a 'content'")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def detokenizer(self, prompt_ids: list[int] | None = None,
                    skip_special_tokens: bool = True) -> DetokenizerState:
        return DetokenizerState(self, prompt_ids or [], skip_special_tokens)


def _jinja_env():
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False,
                                                                    indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class DetokenizerState:
    """Turns a growing list of output ids into text deltas for streaming.

    Decodes a short window of recent ids and holds text back while it ends in an
    incomplete UTF-8 sequence, so every emitted delta is valid text and the deltas
    joined equal the decoded whole.
    """

    _CONTEXT = 5  # ids decoded before the new ones, so leading-space rules apply correctly

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - self._CONTEXT)

    def step(self, token_id: int) -> str:
        """Add one generated id; return the new text it completes (possibly "")."""
        self.ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back (an unfinished UTF-8 sequence at the end of generation)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]
