"""The per-sequence state machine both TensorRT-LLM engines run.

The executor streams new tokens per response; the LLM API streams cumulative token lists.
Either way, each sequence goes through the same states, written once here:

  * a stop token the runtime was not given (`mapping.local_stop_tokens`) ends the sequence
    at its first occurrence past min_new_tokens, kept in the output like the runtime's stop
    words, and the engine must cancel the request (`Advance.stopped_locally`);
  * on the sequence's final update the runtime's finish reason is mapped:
    END_ID -> EOS with the end token left out of the output. The C++ executor never puts it
    there (issue #2190); the LLM API's PyTorch TorchSampler appends it before finishing
    (`_torch/pyexecutor/sampler.py`, `add_token` then `_handle_stop_criteria`), so a trailing
    end token is dropped here with its logprob. The EOS finish then travels in a separate,
    empty step after the tokens, because the pipeline drops the text of the last token of a
    step that finishes with EOS;
    STOP_WORDS -> STOP_SEQUENCE (with the token id when it was a stop token id), or EOS for
    one of the model's other EOS ids, the token kept; LENGTH, CANCELLED, TIMED_OUT as named;
  * a final update without a reason (0.11 executor results have no finish_reasons) is
    inferred: our cancel, a stop word at the tail, the length limit (the executor clips
    max_tokens to max_seq_len - prompt, `LlmRequest::validate`), else the end token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from core.engine.trtllm.mapping import RuntimeFinish
from core.types import EngineRequest, FinishReason, SequenceStep

_NAMED: dict[str, FinishReason] = {
    "LENGTH": FinishReason.LENGTH,
    "CANCELLED": FinishReason.CANCELLED,
    "TIMED_OUT": FinishReason.TIME_LIMIT,
}


@dataclass(frozen=True)
class Advance:
    """What one update did to a sequence.

    Attributes:
        step: the tokens (and finish, unless it trails) to report; None when nothing changed.
        trailing: an empty step carrying an EOS finish, reported after `step`.
        stopped_locally: the sequence ended on a locally matched stop token; the runtime is
            still generating it and must be cancelled.
    """

    step: SequenceStep | None = None
    trailing: SequenceStep | None = None
    stopped_locally: bool = False


@dataclass(eq=False)
class SequenceTracker:
    """State of one generated sequence of a TensorRT-LLM request.

    Args:
        index: the sequence's index (0..n-1).
        request: the engine request.
        end_id: the end token sent to the runtime.
        extra_eos: the model's other EOS ids.
        stop_words: the stop words the runtime was given (to infer a STOP_WORDS finish).
        local_stops: stop tokens matched here (`mapping.local_stop_tokens`).
        max_seq_len: the runtime's sequence limit, when it clips max_tokens to it.
    """

    index: int
    request: EngineRequest
    end_id: int
    extra_eos: frozenset[int]
    stop_words: Sequence[Sequence[int]] = ()
    local_stops: frozenset[int] = frozenset()
    max_seq_len: int | None = None
    received: int = 0
    generated: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def length_limit(self) -> int:
        """max_new_tokens as the runtime applies it."""
        limit = self.request.max_new_tokens
        if self.max_seq_len is not None:
            limit = min(limit, self.max_seq_len - len(self.request.prompt_ids))
        return limit

    def advance(
        self,
        tokens: list[int],
        logprobs: list[float | None] | None,
        *,
        final: bool,
        finish: RuntimeFinish | None = None,
        cancel_sent: bool = False,
    ) -> Advance:
        """Take the runtime's new tokens of this sequence (and, on its final update, its
        finish reason). `logprobs` are per new token, or None when not asked for."""
        self.received += len(tokens)
        if self.done:
            return Advance()
        req = self.request
        reason: FinishReason | None = None
        stop_token: int | None = None
        excluded_end = False
        local = False
        for i, token in enumerate(tokens):
            if token in self.local_stops and len(self.generated) + i + 1 > req.min_new_tokens:
                tokens, logprobs = tokens[: i + 1], (logprobs[: i + 1] if logprobs is not None else None)
                if token in req.stop_token_ids:
                    reason, stop_token = FinishReason.STOP_SEQUENCE, token
                else:
                    reason = FinishReason.EOS
                local = True
                break
        if reason is None and final:
            if finish == "END_ID" and tokens and tokens[-1] == self.end_id:
                tokens = tokens[:-1]
                logprobs = logprobs[:-1] if logprobs is not None else None
            self.generated += tokens
            reason, stop_token, excluded_end = self._finish(finish, cancel_sent)
        else:
            self.generated += tokens
        step = SequenceStep(self.index, tokens, logprobs)
        trailing = None
        if reason is not None:
            self.done = True
            if excluded_end and tokens:
                trailing = SequenceStep(self.index, [], [] if logprobs is not None else None, finish_reason=reason)
            else:
                step.finish_reason, step.stop_token_id = reason, stop_token
        if not step.token_ids and step.finish_reason is None:
            return Advance(None, trailing, local)
        return Advance(step, trailing, local)

    def _finish(self, name: RuntimeFinish | None, cancel_sent: bool) -> tuple[FinishReason, int | None, bool]:
        """(reason, stop token id, end token excluded) of a final update."""
        if name == "END_ID":
            return FinishReason.EOS, None, True
        if name is not None and name in _NAMED:
            return _NAMED[name], None, False
        matched = self._matched_stop_word()
        if name == "STOP_WORDS" or (matched is not None and not cancel_sent):
            if matched is not None and len(matched) == 1:
                token = matched[0]
                if token in self.request.stop_token_ids:
                    return FinishReason.STOP_SEQUENCE, token, False
                if token in self.extra_eos:
                    return FinishReason.EOS, None, False
            return FinishReason.STOP_SEQUENCE, None, False
        if cancel_sent:
            return FinishReason.CANCELLED, None, False
        if len(self.generated) >= self.length_limit:
            return FinishReason.LENGTH, None, False
        return FinishReason.EOS, None, True

    def _matched_stop_word(self) -> list[int] | None:
        """The (longest) stop word the generated tokens end with, or None."""
        best: list[int] | None = None
        generated = self.generated
        for word in self.stop_words:
            n = len(word)
            if n and n <= len(generated) and list(generated[-n:]) == list(word) and (best is None or n > len(best)):
                best = list(word)
        return best
