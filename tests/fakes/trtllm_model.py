"""A deterministic stand-in for a decoder-only model, used by the TensorRT-LLM doubles.

Logits are a pure function of the token sequence (its length and last four tokens), so greedy
decoding is deterministic and tests can compute the expected tokens and logprobs themselves
(`FakeModel.greedy`). Token ids below `rare_below` (the demo tokenizer's special tokens) get a
large negative offset so that they only appear when a test biases towards them (for example a
logit_bias of +100 on EOS id 2), which keeps greedy output free of accidental EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def _key(tokens: Sequence[int]) -> int:
    h = _FNV_OFFSET ^ len(tokens)
    for t in tokens[-4:]:
        h = ((h ^ (t & _MASK)) * _FNV_PRIME) & _MASK
    return h & ((1 << 63) - 1)


@dataclass(frozen=True)
class FakeModel:
    """Deterministic logits over a (padded) vocabulary.

    Attributes:
        vocab_size: logits width (the engine's padded vocabulary).
        rare_below: ids below this are penalized by `rare_penalty` (special tokens).
        rare_penalty: the penalty, in logits.
    """

    vocab_size: int
    rare_below: int = 16
    rare_penalty: float = 30.0

    def logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """float32 [vocab_size] logits of the next token after `tokens` (non-empty)."""
        g = torch.Generator().manual_seed(_key(tokens))
        x = torch.randn(self.vocab_size, generator=g, dtype=torch.float32) * 3.0
        x[: self.rare_below] -= self.rare_penalty
        return x

    def greedy(self, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        """The first `n` greedy tokens after `prompt` and their logprobs (no bias, penalties
        or stop conditions)."""
        seq = list(prompt)
        tokens, logprobs = [], []
        for _ in range(n):
            lp = self.logits(seq).log_softmax(-1)
            tok = int(lp.argmax())
            tokens.append(tok)
            logprobs.append(float(lp[tok]))
            seq.append(tok)
        return tokens, logprobs
