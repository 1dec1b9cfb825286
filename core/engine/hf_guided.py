"""Guided decoding (structured output) for the HF engine, with llguidance.

llguidance (guidance-ai/llguidance, Rust with Python bindings) does the grammar work: it compiles
a guide (core.guided.llguidance_grammar) into an `LLMatcher` bound to the model's tokenizer,
computes the bitmask of the tokens that keep the output valid, and advances with each accepted
token. This module keeps what the engine needs around it:

  * `GuideMatchers`: the llguidance tokenizer of the served model (built once, at model load,
    for the logits' width) and compiled matchers cached per guide (LRU, `cache_size` entries);
    each batch row works on a deep copy (about 10 µs);
  * `mask_logits`: one bitmask for the batch, each guided row's part filled by its matcher
    (tens of µs a row), applied to the logits in one step, so rows with and without guides
    share a batch. The rows are filled on the engine's worker thread: llguidance's parallel
    executor (`fill_next_token_bitmask_par`) leaves its worker threads spinning, and on a
    two-core machine the torch operations right after it ran 15 to 40 times slower;
  * the engine advances a row's matcher with `consume_token` after each sampled token. Once the
    output is complete the mask allows only the EOS tokens, so the row ends on EOS like any
    other; matchers are never rolled back (no speculative tokens).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from core.errors import InvalidArgument
from core.guided import llguidance_grammar
from core.types import GUIDE_KINDS, Guide

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class GuidedRow(Protocol):
    """A batch row as `mask_logits` sees it: its matcher (None: not guided)."""

    matcher: Any


def supports(hf_tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The guide kinds the HF engine honours with this tokenizer: all of GUIDE_KINDS for a fast
    (Rust) tokenizer, which llguidance needs; none otherwise."""
    from transformers import PreTrainedTokenizerFast

    if isinstance(hf_tokenizer, PreTrainedTokenizerFast):
        return frozenset(GUIDE_KINDS)
    log.warning("guided decoding needs a fast tokenizer; %s is not one, so it is off", type(hf_tokenizer).__name__)
    return frozenset()


class GuideMatchers:
    """Compiled guides of one served model.

    Args:
        hf_tokenizer: the served model's transformers fast tokenizer.
        eos_token_ids: the model's EOS ids (allowed, and only they, once an output is complete).
        cache_size: compiled guides kept (least recently used ones are dropped).
    """

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase, eos_token_ids: Iterable[int], cache_size: int = 256):
        self._hf = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self.kinds = supports(hf_tokenizer)
        self._cache_size = cache_size
        self._cache: collections.OrderedDict[Guide, Any] = collections.OrderedDict()
        self._tokenizer: Any = None
        self.width = 0
        self._words = 0
        self.compilations = 0  # guides compiled so far (cache misses)

    def bind(self, width: int) -> None:
        """Build the llguidance tokenizer for logits `width` wide (the model's output rows, which
        may exceed the tokenizer's vocabulary: the extra ids are never allowed). About 1 s for a
        large vocabulary, so the engine calls this while loading the model."""
        import llguidance.hf

        hf: Any = self._hf  # a fast tokenizer (`supports`), which llguidance types by its backend class
        self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=width, eos_token=self._eos)
        self.width = width
        self._words = (width + 31) // 32

    def compiled(self, guide: Guide) -> Any:
        """The compiled `llguidance.LLMatcher` of `guide`, from the cache or compiled now (about
        1 ms for a JSON schema). It is a template: each row works on its `deep_copy()`.

        Raises:
            InvalidArgument: the guide does not compile (naming its field).
        """
        template = self._cache.get(guide)
        if template is None:
            template = self._compile(guide)
            self._cache[guide] = template
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(guide)
        return template

    def _compile(self, guide: Guide) -> Any:
        from llguidance import LLMatcher

        if self._tokenizer is None:
            raise RuntimeError("GuideMatchers.bind() must run before matchers are made")
        try:
            grammar = llguidance_grammar(guide)
        except ValueError as e:
            raise InvalidArgument(f"The {guide.kind} does not compile: {e}", field=guide.field) from None
        template = LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidArgument(f"The {guide.kind} does not compile: {template.get_error()}", field=guide.field)
        self.compilations += 1
        return template

    def _eos_words(self) -> np.ndarray[Any, np.dtype[np.int32]]:
        words = np.zeros(self._words, dtype=np.uint32)
        for t in self._eos:
            words[t // 32] |= np.uint32(1 << (t % 32))
        return words.view(np.int32)

    def mask_logits(self, rows: Sequence[GuidedRow], logits: torch.Tensor) -> torch.Tensor:
        """Mask, in place, the logits of every guided row to the tokens its guide allows.

        Args:
            rows: the batch's rows, in logits order.
            logits: [R, V] float logits (V <= `width`), already processed by penalties, bias
                and bans.

        Returns:
            `logits` (modified in place when any row is guided).
        """
        guided = [(row.matcher, i) for i, row in enumerate(rows) if row.matcher is not None]
        if not guided:
            return logits
        # llguidance's layout: token t is bit t % 32 of int32 word t // 32, set when allowed.
        # Rows without a guide keep every bit set. numpy unpacks the bits in one call.
        bitmask = np.full((len(rows), self._words), -1, dtype=np.int32)
        for matcher, i in guided:
            matcher.unsafe_compute_mask_ptr(bitmask[i].ctypes.data, self._words * 4)
            if matcher.is_error():  # llguidance hit one of its limits: end the output instead of masking all
                log.warning("guided row ends early: %s", matcher.get_error())
                bitmask[i] = self._eos_words()
        banned = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]] == 0
        if logits.device.type == "cpu":
            # numpy writes into the logits' own memory in one pass; torch's masked_fill_ goes
            # through its intra-op thread pool, several times slower for these small [R, V]
            # masks on two busy cores (16 x 4,096: about 0.4 ms against 2 to 6 ms a step).
            np.copyto(logits.numpy(), -np.inf, where=banned)
        else:
            logits.masked_fill_(torch.from_numpy(banned).to(logits.device), float("-inf"))
        return logits
