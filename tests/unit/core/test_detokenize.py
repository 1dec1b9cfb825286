"""Incremental detokenization: only whole UTF-8 characters, spaces kept, same text as a full decode."""

from __future__ import annotations

import random

import pytest

from core.detokenize import REPLACEMENT, ByteDetokenizer, IncrementalDetokenizer

TEXTS = [
    "Hello world, this is a test.",
    " leading space and  double  spaces",
    "中文文本用于测试",
    "Emoji 😀🎉👍🏽 end",
    "mixed: café 😀 中文 naïve",
    "line one\nline two\n\n  indented",
]


def stream(tokenizer, prompt_ids, ids, skip_special=True):
    detok = IncrementalDetokenizer(lambda x: tokenizer.decode(x, skip_special_tokens=skip_special), prompt_ids)
    deltas = [detok.push([t]) for t in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("name", ["bpe_tokenizer", "sp_tokenizer"])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode_and_never_splits_a_character(request, name, text):
    tok = request.getfixturevalue(name)
    prompt = tok.encode("Prompt:", add_special_tokens=False)
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, prompt, ids)
    expected = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert "".join(deltas) == expected
    assert all(REPLACEMENT not in d for d in deltas)


def test_multibyte_characters_are_split_across_byte_tokens_in_the_fixture(bpe_tokenizer, sp_tokenizer):
    """Guard: the cases above really exercise partial UTF-8 (a single token decodes to U+FFFD)."""
    for tok, text in ((bpe_tokenizer, "😀"), (sp_tokenizer, "中")):
        ids = tok.encode(text, add_special_tokens=False)
        assert len(ids) > 1
        assert any(REPLACEMENT in tok.decode(ids[:k]) for k in range(1, len(ids)))


def test_emoji_is_emitted_once_complete(bpe_tokenizer):
    ids = bpe_tokenizer.encode("😀", add_special_tokens=False)
    deltas = stream(bpe_tokenizer, [], ids)
    assert deltas[:-2] == [""] * (len(ids) - 1)
    assert "".join(deltas) == "😀"


def test_sentencepiece_first_generated_token_keeps_its_leading_space(sp_tokenizer):
    word = next(
        i
        for i in range(sp_tokenizer.vocab_size)
        if (sp_tokenizer.hf.convert_ids_to_tokens(i) or "")[:1] == "▁"
        and len(sp_tokenizer.hf.convert_ids_to_tokens(i)) > 2
    )
    prompt = sp_tokenizer.encode("Hello", add_special_tokens=False)
    alone = sp_tokenizer.decode([word])
    assert not alone.startswith(" ")  # decoding the token alone drops its space
    assert "".join(stream(sp_tokenizer, prompt, [word])) == " " + alone


def test_incomplete_character_at_the_end_is_flushed_as_replacement(bpe_tokenizer):
    ids = bpe_tokenizer.encode("😀", add_special_tokens=False)[:-1]
    deltas = stream(bpe_tokenizer, [], ids)
    assert all(d == "" for d in deltas[:-1])
    assert deltas[-1].endswith(REPLACEMENT)


def test_special_tokens_skipped_or_kept(bpe_tokenizer):
    ids = [*bpe_tokenizer.encode("hi", add_special_tokens=False), 2]
    assert "".join(stream(bpe_tokenizer, [], ids)) == "hi"
    assert "".join(stream(bpe_tokenizer, [], ids, skip_special=False)) == "hi<|eos|>"


def test_empty_push_emits_nothing(bpe_tokenizer):
    detok = IncrementalDetokenizer(bpe_tokenizer.decode)
    assert detok.push([]) == ""
    assert detok.flush() == ""


# ------------------------------------------------------------------ byte-exact detokenization


def test_byte_exactness_is_detected_per_tokenizer(bpe_tokenizer, sp_tokenizer):
    assert bpe_tokenizer.byte_exact  # ByteLevel decoder alone, no clean-up pass
    assert not sp_tokenizer.byte_exact  # Metaspace / byte fallback: decoding is not byte concatenation


# One text memo for every detokenizer of the tests below, as the pipeline shares one: what a
# detokenizer learns (with special tokens skipped or not) must hold for every other.
SHARED_TEXTS: dict[int, str] = {}


@pytest.mark.parametrize("skip_special", [True, False, True])
def test_byte_detokenizer_equals_the_tokenizers_decode_over_many_sequences(bpe_tokenizer, skip_special):
    """Random id sequences (every kind of token: whole words, partial UTF-8 bytes, special
    tokens, invalid byte runs) stream to exactly the tokenizer's own decode, in pieces of any
    size (one token at a time in a third of them), and never split a character while more may
    come."""
    tok = bpe_tokenizer
    rng = random.Random(1234)
    specials = sorted(tok.special_ids)
    byte_tokens = [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1 and tok.token_bytes(i)[0] >= 0x80]
    assert byte_tokens and specials
    for n in range(2000):
        length = rng.randint(1, 40)
        ids = [
            rng.choice(specials) if r < 0.05 else rng.choice(byte_tokens) if r < 0.4 else rng.randrange(tok.vocab_size)
            for r in (rng.random() for _ in range(length))
        ]
        if n % 3 == 0:  # real text, multi-byte characters split across byte tokens
            ids = tok.encode(rng.choice(TEXTS) + rng.choice(TEXTS), add_special_tokens=False)
        detok = ByteDetokenizer(tok.token_bytes, tok.special_ids if skip_special else (), SHARED_TEXTS)
        deltas, at = [], 0
        while at < len(ids):
            k = 1 if n % 3 == 1 else rng.randint(1, 3)
            deltas.append(detok.push(ids[at : at + k]))
            at += k
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special, spaces_between_special_tokens=False)
        if n % 3 == 0:  # valid text: a character split across tokens waits for its last byte
            assert all(REPLACEMENT not in d for d in deltas)


def test_the_pipeline_streams_byte_exact_text_like_the_windowed_detokenizer(bpe_tokenizer):
    tok = bpe_tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        byte_level = ByteDetokenizer(tok.token_bytes, tok.special_ids)
        fast = "".join(byte_level.push([t]) for t in ids) + byte_level.flush()
        assert fast == "".join(stream(tok, [], ids))
