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


ENCODE_TEXTS = ["def __init__(self, config):", "café 😀 中文  x", "", "  \n\t lead", "a<|eos|>b <|eos|>", "x" * 300]


@pytest.mark.parametrize("name", ["bpe_tokenizer", "sp_tokenizer"])
def test_encode_gives_the_ids_of_transformers_own_call(request, name):
    """The Rust tokenizer is called directly when that is what transformers would do; the ids
    are the same as the transformers call's, with and without special tokens, also once the
    Rust tokenizer was set to truncate or split special tokens (then transformers encodes)."""
    tok = request.getfixturevalue(name)

    def expected(text: str, add: bool) -> list[int]:
        return list(tok.hf(text, add_special_tokens=add)["input_ids"])

    for text in ENCODE_TEXTS:
        for add in (True, False):
            assert tok.encode(text, add_special_tokens=add) == expected(text, add)
    backend = tok.hf.backend_tokenizer
    backend.enable_truncation(max_length=3)
    try:
        assert tok.encode(ENCODE_TEXTS[-1]) == expected(ENCODE_TEXTS[-1], True)
        assert len(tok.encode(ENCODE_TEXTS[-1])) > 3
    finally:
        backend.no_truncation()
    tok.hf.split_special_tokens = True
    try:
        assert tok.encode(ENCODE_TEXTS[4]) == expected(ENCODE_TEXTS[4], True)
    finally:
        tok.hf.split_special_tokens = False


@pytest.mark.parametrize("name", ["bpe_tokenizer", "sp_tokenizer"])
def test_spans_are_utf8_byte_offsets_of_each_token(request, name):
    tok = request.getfixturevalue(name)
    text = "héllo wörld, 日本"
    ids = tok.encode(text)
    spans = tok.spans(text, ids)
    assert len(spans) == len(ids)
    data = text.encode()
    assert all(0 <= start <= stop <= len(data) for start, stop in spans)
    assert spans[-1][1] == len(data)  # the last token ends the text
    assert tok.spans(text, [*ids, 0]) == []  # ids of another text: no mapping


def test_chat_template_options(tiny_model_dir):
    """add_generation_prompt false leaves the assistant's turn unopened, continue_final_message
    leaves the last message open, and template kwargs reach the template (vLLM's
    chat_template_kwargs)."""
    from core.tokenizer import Tokenizer
    from core.types import ChatTemplateOptions

    tok = Tokenizer.load(tiny_model_dir)  # its own: the template is replaced below
    chat = [ChatMessage("user", (ContentPart(text="a"),)), ChatMessage("assistant", (ContentPart(text="Hel"),))]
    closed, _ = tok.render_chat(chat, template=ChatTemplateOptions(add_generation_prompt=False))
    assert closed == "<|user|>a<|end|><|assistant|>Hel<|end|>"
    open_, ids = tok.render_chat(
        chat, template=ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    )
    assert open_ == "<|user|>a<|end|><|assistant|>Hel" and ids == tok.encode(open_, add_special_tokens=False)
    tok.hf.chat_template = "{{ greeting | default('none') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text, _ = tok.render_chat(chat[:1], template=ChatTemplateOptions(kwargs='{"greeting": "hi:"}'))
    assert text == "hi:a"
    assert tok.render_chat(chat[:1])[0] == "nonea"
