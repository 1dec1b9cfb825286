"""Pure mapping between the core's engine requests and TensorRT-LLM's parameter objects.

Everything here is a function of its arguments (torch is imported only to build
`embedding_bias`). Sources (NVIDIA/TensorRT-LLM) are cited per function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from core.engine.trtllm.bindings import BindingApi
from core.errors import (
    ContextLengthExceeded,
    CoreError,
    EngineDead,
    EngineFailure,
    InvalidArgument,
    NotReady,
    Overloaded,
)
from core.guided import ebnf_choice
from core.types import EngineRequest, Guide, ResolvedSampling

if TYPE_CHECKING:
    import torch

    from core.tokenizer import Tokenizer

SEED_MASK = (1 << 64) - 1
"""The runtime's seed is an unsigned 64-bit integer; a client's signed seed is reduced to it."""

RuntimeFinish = Literal["END_ID", "STOP_WORDS", "LENGTH", "TIMED_OUT", "CANCELLED"]
"""The executor's FinishReason names (NOT_FINISHED aside); the LLM API's words map onto them."""

_LLM_FINISH: dict[str, RuntimeFinish] = {"length": "LENGTH", "timeout": "TIMED_OUT", "cancelled": "CANCELLED"}


def sampling_kwargs(s: ResolvedSampling, api: BindingApi, *, n: int, min_new_tokens: int) -> dict[str, object]:
    """SamplingConfig keywords for resolved sampling (`executor/samplingConfig.cpp`; the
    sampling defaults of docs/tensorrt-llm.md).

    Greedy sends no top_k, top_p or temperature (an all-default config is greedy); sampling
    sends them, never top_p <= 0 nor temperature 0. The seed is always sent, reduced to the
    runtime's unsigned 64 bits. min_tokens only when > 0 (the runtime's default is 1).
    """
    kw: dict[str, object] = {"beam_width": 1}
    if s.do_sample:
        if s.top_k is not None:
            kw["top_k"] = s.top_k
        if s.top_p is not None and s.top_p > 0:
            kw["top_p"] = s.top_p
        if s.temperature is not None and s.temperature > 0:
            kw["temperature"] = s.temperature
        if s.min_p is not None and api.min_p:
            kw["min_p"] = s.min_p
    kw[api.seed] = s.seed & SEED_MASK
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None:
            kw[name] = value
    if min_new_tokens > 0:
        kw[api.min_tokens] = min_new_tokens
    if n > 1:
        kw["num_return_sequences"] = n
    return kw


def local_stop_tokens(req: EngineRequest, extra_eos: Iterable[int]) -> frozenset[int]:
    """Single stop tokens the engine matches itself instead of the runtime.

    With min_new_tokens > 0 the runtime's stop words would ignore the minimum (`LlmRequest` checks
    stop words before min_tokens), so stop
    token ids and the model's other EOS ids are matched locally. With ignore_eos the LLM API
    sends `stop_words=[]` in some releases (`tensorrt_llm/executor/base_worker.py`,
    `_enqueue_request`: "stop_words=[] if ignore_eos", 2026 main) and the client's stop tokens
    in others (`tensorrt_llm/executor/worker.py`, 0.19-era main), so the client's stop tokens
    are matched locally there too, the same way in every release.
    """
    if req.min_new_tokens > 0:
        return frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else frozenset(extra_eos))
    if req.ignore_eos:
        return frozenset(req.stop_token_ids)
    return frozenset()


def stop_words_for(req: EngineRequest, extra_eos: Iterable[int]) -> list[list[int]]:
    """The executor's `stop_words`: stop strings' tokens, stop token ids and the model's EOS
    ids other than end_id as one-token words (`Request(stop_words=...)`), without duplicates; empty when
    min_new_tokens > 0 (the engine matches stop tokens itself then, `local_stop_tokens`)."""
    if req.min_new_tokens > 0:
        return []
    words: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    singles = sorted(req.stop_token_ids) + ([] if req.ignore_eos else sorted(extra_eos))
    for word in [*req.stop_words_ids, *([t] for t in singles)]:
        key = tuple(word)
        if word and key not in seen:
            seen.add(key)
            words.append(list(word))
    return words


@dataclass(frozen=True)
class SpecialIds:
    """The token ids TensorRT-LLM needs besides the prompt.

    Attributes:
        end_id: the EOS id the runtime stops on (the tokenizer's EOS, else the smallest EOS id).
        pad_id: the tokenizer's pad id, else end_id.
        extra_eos: the model's other EOS ids (sent as one-token stop words).
    """

    end_id: int
    pad_id: int
    extra_eos: frozenset[int]


def special_ids(tokenizer: Tokenizer) -> SpecialIds:
    """SpecialIds of a core.tokenizer.Tokenizer.

    Raises:
        RuntimeError: the tokenizer has no EOS token.
    """
    eos = tokenizer.hf.eos_token_id
    if eos is None:
        eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    if eos is None:
        raise RuntimeError("The tokenizer has no EOS token; TensorRT-LLM needs an end_id")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return SpecialIds(int(eos), int(pad), frozenset(tokenizer.eos_token_ids) - {int(eos)})


def embedding_bias(bias: Mapping[int, float], width: int) -> torch.Tensor:
    """A request's logit_bias as the dense float32 `embedding_bias` tensor of `width`, the
    model's unpadded vocabulary (`EngineLayout.vocab_size`; `SamplingParams.embedding_bias`:
    "shape is [vocab_size]").

    Raises:
        InvalidArgument: a token id at or above `width` ("sampling.logit_bias"). The core
            checks ids against the tokenizer, which can know more tokens than the model's
            embedding has rows (added special tokens).
    """
    outside = sorted(t for t in bias if not 0 <= t < width)
    if outside:
        raise InvalidArgument(
            f"logit_bias names token id {outside[0]}, outside this model's vocabulary of {width} tokens.",
            field="sampling.logit_bias",
        )
    import torch

    tensor = torch.zeros(width, dtype=torch.float32)
    for token, value in bias.items():
        tensor[token] = value
    return tensor


def binding_call(ctor: Callable[..., Any], what: str, field: str | None, **kwargs: Any) -> Any:
    """`ctor(**kwargs)` for a TensorRT-LLM binding or parameter class, its refusal as the
    client's error.

    The bindings check their arguments as they are built: pybind11/nanobind raise TypeError
    for a value of the wrong type, TLLM_CHECK a RuntimeError (`samplingConfig.cpp`,
    `request.cpp`), and tensor indexing IndexError; each is about the request's values.

    Raises:
        InvalidArgument: naming `field` (None: the request as a whole) and `what` was built.
    """
    try:
        return ctor(**kwargs)
    except (TypeError, ValueError, RuntimeError, IndexError) as e:
        raise InvalidArgument(f"TensorRT-LLM refused the {what}: {e}", field=field) from e


def new_logprobs(values: Sequence[float] | None, received: int, count: int) -> list[float] | None:
    """Per-token logprobs of the `count` new tokens of a streaming executor response.

    Every era returns every generated token's logprob so far (`LlmRequest::createResponse`:
    `result.logProbs = getLogProbs()`); a per-token list is accepted too. `received` is
    how many tokens of the sequence came before. None when the response has no usable values.
    """
    if values is None:
        return None
    values = list(values)
    if len(values) == count:
        return values
    if len(values) >= received + count:
        return values[received : received + count]
    return None


def classify_error(message: str) -> CoreError:
    """The core error for an executor error response (`executorImpl.cpp`: "Encountered an
    error when fetching new request: ..."), or an LLM API `RequestError` or ValueError
    (`llmapi/llm.py` `_check_arguments`, `executor/base_worker.py` `_deduce_max_tokens`)."""
    if "exceeds maximum input length" in message or "should not exceed max_num_tokens" in message:
        return ContextLengthExceeded(f"The prompt is longer than this engine accepts: {message}")
    if "default_max_tokens" in message or "max_seq_len" in message:
        return ContextLengthExceeded(f"The prompt leaves no room to generate on this engine: {message}")
    if "potentially greater than max input length" in message:
        return InvalidArgument(
            "With the max_utilization scheduler and no chunked context, prompt + max_new_tokens must fit the "
            f"engine's max input length; lower max_new_tokens. ({message})",
            field="stopping.max_new_tokens",
        )
    return EngineFailure(f"TensorRT-LLM failed the request: {message}")


def classify_enqueue_error(error: Exception, *, stopping: bool) -> CoreError:
    """The core error for an exception from enqueue_request (`executorImpl.cpp`: "Maximum
    queue size of N has been reached", "Shutdown called")."""
    message = str(error)
    if "Maximum queue size" in message:
        return Overloaded("The server is at capacity (the TensorRT-LLM queue is full); retry later.")
    if "Shutdown" in message:
        return NotReady("The engine is shutting down.") if stopping else EngineDead("The executor has shut down.")
    return EngineFailure(f"TensorRT-LLM refused the request: {message}")


def llm_finish(reason: str | None, stop_reason: int | str | None) -> RuntimeFinish | None:
    """The LLM API's `CompletionOutput.finish_reason` ('stop', 'length', 'timeout',
    'cancelled'; `tensorrt_llm/executor/result.py`) as the executor's FinishReason name:
    'stop' with a stop_reason (the matched stop token id or string) is STOP_WORDS, without
    one END_ID."""
    if not reason:
        return None
    if reason == "stop":
        return "STOP_WORDS" if stop_reason is not None else "END_ID"
    return _LLM_FINISH.get(reason)


def llm_sampling_kwargs(
    req: EngineRequest, *, end_id: int, pad_id: int, extra_eos: frozenset[int], logprobs: int
) -> dict[str, object]:
    """SamplingParams keywords for an engine request (`tensorrt_llm/sampling_params.py`).

    Greedy leaves temperature, top_p and top_k unset (the LLM API's own greedy test); sampling
    sends the resolved values (never top_p 0 nor temperature 0). Stop tokens are kept in the
    output (include_stop_str_in_output) because the pipeline trims their text itself; stop
    tokens the engine matches itself (`local_stop_tokens`) are not sent. `logprobs` is how many
    alternatives to ask for (0: none). `embedding_bias` is filled by the caller (needs torch).
    """
    s = req.sampling
    kw: dict[str, object] = {
        "max_tokens": req.max_new_tokens,
        "end_id": end_id,
        "pad_id": pad_id,
        "n": req.num_sequences,
        "seed": s.seed & SEED_MASK,
        "ignore_eos": req.ignore_eos,
        "include_stop_str_in_output": True,
        "detokenize": False,
    }
    if s.do_sample:
        for name in ("top_k", "top_p", "temperature", "min_p"):
            value = getattr(s, name)
            if value is not None and (name in ("top_k", "min_p") or value > 0):
                kw[name] = value
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None:
            kw[name] = value
    if req.min_new_tokens > 0:
        kw["min_tokens"] = req.min_new_tokens
    if req.min_new_tokens == 0 and not req.ignore_eos:
        stops = sorted(req.stop_token_ids) + sorted(extra_eos)
        if stops:
            kw["stop_token_ids"] = list(dict.fromkeys(stops))
    if req.bad_words_ids:
        kw["bad_token_ids"] = [w[0] for w in req.bad_words_ids]
    if logprobs:
        kw["logprobs"] = logprobs
    return kw


def llm_logprobs_wanted(req: EngineRequest, cap: int = 20) -> int:
    """How many logprob alternatives to ask the LLM API for: 0 unless the request wants
    logprobs; else enough that the sampled token is among them.

    Some 1.x TorchSampler releases key `CompletionOutput.logprobs` by the top-k tokens of the
    distribution (`torch.topk(log_softmax)`, `_torch/pyexecutor/sampler.py`,
    `handle_logprobs`), not by the sampled token. Greedy picks rank 1, so 1 is enough; top-k
    sampling picks among the top_k, so top_k (at most `cap`) is. Otherwise a sampled token
    outside the alternatives has no logprob, and the engine reports none (`logprob_values`).
    """
    if not req.logprobs:
        return 0
    s = req.sampling
    if s.do_sample and s.top_k:
        return max(1, min(int(s.top_k), cap))
    return 1


def logprob_values(entries: Sequence[Any], tokens: Sequence[int]) -> list[float | None]:
    """Per-token logprobs from `CompletionOutput.logprobs` entries: floats (early 1.x) or
    `{token_id: Logprob}` dicts; a token missing from its dict (top-k keyed logprobs, see
    `llm_logprobs_wanted`) or an entry missing altogether gives None, never a made-up 0.0."""
    out: list[float | None] = []
    for i, token in enumerate(tokens):
        entry = entries[i] if i < len(entries) else None
        if isinstance(entry, dict):
            entry = entry.get(token)
            entry = getattr(entry, "logprob", entry)
        out.append(float(entry) if entry is not None else None)
    return out


# ------------------------------------------------------------------------------ guided decoding

#: Our guide kinds -> the executor's GuidedDecodingParams.GuideType each is sent as. json_object
#: goes as the schema {"type": "object"} (the runtime's own JSON type compiles XGrammar's
#: builtin JSON grammar, which also takes arrays: `CompileBuiltinJSONGrammar` in
#: `batch_manager/guidedDecoder.cpp`); a choice list as an EBNF alternation. Lark grammars have
#: no guide type.
EXECUTOR_GUIDE_TYPES = {
    "json_object": "JSON_SCHEMA",
    "json_schema": "JSON_SCHEMA",
    "regex": "REGEX",
    "ebnf_grammar": "EBNF_GRAMMAR",
    "choice": "EBNF_GRAMMAR",
}
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def guided_kinds(guide_types: Iterable[str]) -> frozenset[str]:
    """Our guide kinds a release's GuideType names can carry."""
    names = set(guide_types)
    return frozenset(kind for kind, name in EXECUTOR_GUIDE_TYPES.items() if name in names)


def guide_text(guide: Guide) -> str:
    """The guide text sent with the guide's type (EXECUTOR_GUIDE_TYPES)."""
    if guide.kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if guide.kind == "choice":
        return ebnf_choice(guide.choices)
    return guide.spec


def llm_guided_kwargs(guide: Guide) -> dict[str, str]:
    """`tensorrt_llm.llmapi.GuidedDecodingParams` keywords (`sampling_params.py`: json,
    regex, grammar, json_object, structural_tag; one at a time), which the LLM API turns into the
    executor's guide types (`_get_guided_decoding_params`: json -> JSON_SCHEMA, regex -> REGEX,
    grammar -> EBNF_GRAMMAR), so both engines send the same guide."""
    name = EXECUTOR_GUIDE_TYPES[guide.kind]
    key = {"JSON_SCHEMA": "json", "REGEX": "regex", "EBNF_GRAMMAR": "grammar"}[name]
    return {key: guide_text(guide)}


def xgrammar_tokenizer_info(tokenizer: Tokenizer, end_id: int) -> dict[str, Any]:
    """The GuidedDecodingConfig fields that describe the tokenizer to XGrammar: the vocabulary
    as token strings in id order, the Hugging Face tokenizer's JSON (fast tokenizers; None
    otherwise, XGrammar then reads the vocabulary raw) and the stop token ids (the model's EOS
    ids, end_id first). Upstream builds the same in `tensorrt_llm/llmapi/tokenizer.py`
    `_xgrammar_tokenizer_info` (with the tokenizer's EOS alone) and
    `examples/generate_xgrammar_tokenizer_info.py` for Triton's C++ backend."""
    hf = tokenizer.hf
    vocab = hf.get_vocab()
    backend = getattr(hf, "backend_tokenizer", None)
    return {
        "encoded_vocab": [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])],
        "tokenizer_str": backend.to_str() if backend is not None else None,
        "stop_token_ids": [end_id, *sorted(tokenizer.eos_token_ids - {end_id})],
    }


def executor_priority(priority: int) -> float:
    """The executor's `Request(priority=...)` for a Trellis priority (lower first, 0 ordinary):
    a float in (0, 1), 0.5 for 0, decreasing with `priority`, so the executor's queue (higher
    first: bindings.BindingApi.priority) keeps Trellis's order; large values
    approach the ends."""
    return 0.5 - 0.5 * math.tanh(priority / 16.0)
