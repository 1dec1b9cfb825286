"""Tokenizers for the core's unit tests: the demo byte-level BPE and a SentencePiece-style one."""

from __future__ import annotations

import json

import pytest

from core.tokenizer import Tokenizer

CORPUS = [
    "Hello world, this is a test of the streaming detokenizer.",
    "中文文本用于测试多字节字符。日本語のテキストも。",
    "Emoji 😀🎉👍🏽 and accents: café, naïve, façade.",
    "def __init__(self, value):\n    return value  # spaces   and\ttabs",
] * 20


@pytest.fixture(scope="session")
def bpe_tokenizer(tiny_model_dir) -> Tokenizer:
    """The demo model's byte-level BPE tokenizer (GPT-2 style, 'Ġ' marks spaces)."""
    return Tokenizer.load(tiny_model_dir)


@pytest.fixture(scope="session")
def sp_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer: Metaspace ('▁' marks spaces) with byte fallback tokens
    (<0xNN>), like Llama 2's, trained on a small corpus where most characters are rare."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def configure(tok):
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        return tok

    trained = configure(RawTokenizer(models.BPE(unk_token="<unk>")))
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trained.train_from_iterator([line for line in CORPUS if line.isascii()], trainer=trainer)
    spec = json.loads(trained.to_str())["model"]
    vocab = dict(spec["vocab"])
    for b in range(256):  # byte-fallback pieces are ordinary vocabulary entries, as in Llama 2
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    raw = configure(RawTokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>")))
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return Tokenizer(hf, [hf.eos_token_id])
