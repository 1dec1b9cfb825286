"""Serving-side tokenizer: raw token bytes, specials, chat rendering, spaces between specials."""

from __future__ import annotations

import pytest

from core.errors import InvalidArgument
from core.types import ChatMessage, ContentPart


def test_byte_level_token_bytes_reassemble_the_text(bpe_tokenizer):
    text = "café 😀 中文  x"
    ids = bpe_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(bpe_tokenizer.token_bytes(i) for i in ids).decode() == text
    assert bpe_tokenizer.token_text(ids[0]) == bpe_tokenizer.token_bytes(ids[0]).decode("utf-8", "replace")


def test_byte_fallback_token_bytes(sp_tokenizer):
    ids = sp_tokenizer.encode("中", add_special_tokens=False)
    assert b"".join(sp_tokenizer.token_bytes(i) for i in ids).strip() == "中".encode()


def test_specials_and_eos(bpe_tokenizer):
    assert bpe_tokenizer.is_special(2) and not bpe_tokenizer.is_special(300)
    assert {2, 7} <= bpe_tokenizer.eos_token_ids
    assert bpe_tokenizer.token_bytes(2) == b"<|eos|>"


def test_spaces_between_adjacent_special_tokens(bpe_tokenizer):
    ids = [4, 5, *bpe_tokenizer.encode("hi", add_special_tokens=False), 7]
    assert bpe_tokenizer.decode(ids, skip_special_tokens=False) == "<|system|> <|user|>hi<|end|>"
    assert bpe_tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False) == (
        "<|system|><|user|>hi<|end|>"
    )
    assert bpe_tokenizer.decode(ids) == "hi"


def test_chat_rendering_uses_the_model_template(bpe_tokenizer):
    text, ids = bpe_tokenizer.render_chat(
        [
            ChatMessage("system", (ContentPart(text="be brief"),)),
            ChatMessage("user", (ContentPart(text="a"), ContentPart(text="b"))),
        ]
    )
    assert text == "<|system|>be brief<|end|><|user|>a\nb<|end|><|assistant|>"
    assert ids == bpe_tokenizer.encode(text, add_special_tokens=False)


def test_chat_without_template_is_refused(sp_tokenizer):
    with pytest.raises(InvalidArgument) as e:
        sp_tokenizer.render_chat([ChatMessage("user", (ContentPart(text="x"),))])
    assert e.value.field == "messages"
