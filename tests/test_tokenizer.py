"""Tokenizer: the GGUF-built tokenizer against transformers' own GGUF tokenizer, chat
templates, end-of-sequence ids and streaming detokenization."""

from __future__ import annotations

import json

import pytest
from tiny_models import embedded_files, make_tiny_checkpoint

from kvmem.engine.tokenizer import ChatTemplateError, Tokenizer

TEXTS = [
    "Hello world!", "  leading spaces and 12345 digits", "naïve café — 日本語 🎉",
    "tabs\tand\nnewlines\n\n x", "<|im_start|>user\nhi<|im_end|>", "it's don't I'll",
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def hf_gguf_tokenizer():
    from transformers import AutoTokenizer

    from kvmem.engine.loader.gguf_convert import embedded_gguf

    path = embedded_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_embedded_tokenizer_matches_transformers(hf_gguf_tokenizer, text):
    tok = embedded_files().tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_embedded_chat_template_matches_transformers(hf_gguf_tokenizer):
    tok = embedded_files().tokenizer
    for generation_prompt in (True, False):
        assert tok.apply_chat_template(CHAT, add_generation_prompt=generation_prompt) == \
            hf_gguf_tokenizer.apply_chat_template(CHAT, tokenize=False,
                                                  add_generation_prompt=generation_prompt)


def test_embedded_eos_is_im_end():
    tok = embedded_files().tokenizer
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>")}


def test_special_tokens_are_skipped_on_decode(tmp_path):
    tok = Tokenizer.from_dir(make_tiny_checkpoint(tmp_path, "llama"))
    ids = tok.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


def test_eos_ids_come_from_config_and_generation_config(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 7]}))
    assert Tokenizer.from_dir(path).eos_token_ids == {258, 7}


@pytest.mark.parametrize("text", ["naïve café — 日本語 🎉 end", "plain ascii text", "🎉🎉 x"])
def test_streaming_deltas_are_whole_characters(tmp_path, text):
    """A byte-level tokenizer with no merges splits 🎉 into four byte tokens: the
    detokenizer must hold the first three back and never emit a broken character."""
    tok = Tokenizer.from_dir(make_tiny_checkpoint(tmp_path, "llama"))
    prompt = tok.encode("Q: ")
    ids = tok.encode(text)
    state = tok.detokenizer(prompt)
    deltas = [state.step(i) for i in ids]
    deltas.append(state.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    if "🎉" in text:
        assert "" in deltas[:-1]  # something was held back


def test_streaming_flush_emits_an_unfinished_character(tmp_path):
    tok = Tokenizer.from_dir(make_tiny_checkpoint(tmp_path, "llama"))
    state = tok.detokenizer()
    emoji = tok.encode("🎉")
    assert [state.step(i) for i in emoji[:2]] == ["", ""]
    assert state.flush() == "\ufffd"


def test_missing_chat_template_is_a_clear_error(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer.from_dir(path).apply_chat_template(CHAT)


def test_template_raise_exception_becomes_a_chat_template_error(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                "{% endif %}")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = Tokenizer.from_dir(path)
    with pytest.raises(ChatTemplateError, match="user first"):
        tok.apply_chat_template(CHAT)
    with pytest.raises(ChatTemplateError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
