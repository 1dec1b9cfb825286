"""Every range and cross-field rule of a Generate request, in one place.

Gateways check only their schema's JSON shapes and types; the values are checked here, once,
so every interface gives the same answer (TGI's two diverging frequency_penalty rules are the
cautionary tale). Each failure raises InvalidArgument naming the GenerateRequest field path
(e.g. "sampling.top_p") with a sentence a user understands; an unknown model raises
ModelNotFound.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from core.errors import ContextLengthExceeded, InvalidArgument, ModelNotFound
from core.guided import check_guide
from core.sampling import NEUTRAL
from core.types import EngineInfo, GenerationRequest, ResolvedSampling
from logclip import clip

MAX_TOP_LOGPROBS = 20
MAX_BAD_WORDS = 64
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
MAX_TOOLS = 128
#: Messages of one chat request: a bound on the template's work per request, far above real
#: conversations (an empty message costs nothing on the length bound but a render each).
MAX_MESSAGES = 4096
#: A session id (GenerateRequest.session_id): an opaque key, kept in the session store with its
#: sequence, so its length is bounded (and counted in the store's bytes, core.sessions).
MAX_SESSION_ID_CHARS = 256
#: GenerateRequest.tenant: whom a gateway serves the request for (a key's name or digest, or
#: the fairness header); it names a label value and a session scope, so it is bounded.
MAX_TENANT_CHARS = 128
#: A tool's name (OpenAI's rule for function names).
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class Limits:
    """Configured bounds (CoreConfig) together with the engine's (EngineInfo)."""

    served_model: str
    engine: EngineInfo
    max_new_tokens: int
    max_stop_sequences: int
    max_n: int
    #: Other names requests may use for the served model (--served-model-name).
    model_aliases: tuple[str, ...] = ()
    #: Longest prompt text, in characters, that can possibly fit the context: a prompt longer
    #: than this is refused before tokenization (see `check_prompt_size`). None: no bound.
    max_prompt_chars: int | None = None
    #: Longest stop sequence or bad word, in characters.
    max_stop_chars: int = 4096
    #: Most logit_bias entries per request.
    max_logit_bias: int = 1024


def validate_request(req: GenerationRequest, limits: Limits) -> None:
    """Check everything that does not need the tokenized prompt.

    Raises:
        ModelNotFound: req.model names another model.
        InvalidArgument: any value out of range or contradicting another field.
    """
    if req.model and req.model != limits.served_model and req.model not in limits.model_aliases:
        raise ModelNotFound(
            f"The model '{clip(req.model)}' is not served here; this server serves '{limits.served_model}'.",
            field="model",
        )
    _check_input(req, limits)
    check_prompt_size(req, limits)
    _check_sampling(req, limits)
    _check_stopping(req, limits)
    _check_output(req)
    _check_guided(req)
    if len(req.tenant) > MAX_TENANT_CHARS:
        raise InvalidArgument(f"tenant must be at most {MAX_TENANT_CHARS} characters.", field="tenant")
    if req.session_id is not None:
        if not req.session_id:
            raise InvalidArgument("session_id must not be empty when set.", field="session_id")
        if len(req.session_id) > MAX_SESSION_ID_CHARS:
            raise InvalidArgument(
                f"The session id '{clip(req.session_id, 32)}' is longer than {MAX_SESSION_ID_CHARS} characters.",
                field="session_id",
            )
        n = req.sampling.n or 1
        if n > 1 or (req.sampling.best_of or 1) > 1:
            raise InvalidArgument(
                "A continued session generates one sequence; n and best_of must be 1.", field="session_id"
            )


def validate_engine_support(resolved: ResolvedSampling, req: GenerationRequest, info: EngineInfo) -> None:
    """Refuse sampling features the engine cannot honour (never silently ignore them).

    Raises:
        InvalidArgument: naming the field (e.g. num_beams > 1 on an engine without beam search).
    """
    s = req.sampling
    if req.guide is not None:
        check_guide(req.guide, info.guided_decoding, info.engine)
    if resolved.num_beams > info.max_num_beams:
        if info.max_num_beams == 1:
            msg = (
                f"num_beams={resolved.num_beams} asks for beam search, which the {info.engine} engine "
                "does not support; use num_beams=1."
            )
        else:
            msg = f"num_beams must be at most {info.max_num_beams} on this engine, got {resolved.num_beams}."
        raise InvalidArgument(msg, field="sampling.num_beams")
    if resolved.num_beams == 1:
        if s.length_penalty is not None and s.length_penalty != 1.0:
            raise InvalidArgument(
                "length_penalty only applies to beam search (num_beams > 1); leave it unset or 1.",
                field="sampling.length_penalty",
            )
        if s.early_stopping:
            raise InvalidArgument(
                "early_stopping only applies to beam search (num_beams > 1); leave it unset or false.",
                field="sampling.early_stopping",
            )
    top = req.output.top_logprobs or 0
    if top > info.max_top_logprobs:
        if info.max_top_logprobs == 0:
            msg = f"The {info.engine} engine reports only the chosen token's logprob; use top_logprobs 0."
        else:
            msg = f"The {info.engine} engine reports at most {info.max_top_logprobs} top_logprobs, got {top}."
        raise InvalidArgument(msg, field="output.top_logprobs")
    if req.output.prompt_logprobs is not None and not info.supports_prompt_logprobs:
        raise InvalidArgument(
            f"prompt_logprobs is not available from the {info.engine} engine as it is running.",
            field="output.prompt_logprobs",
        )
    for name in sorted(info.unsupported_sampling_fields):
        value = getattr(s, name, None)
        if value is not None and value != getattr(NEUTRAL, name, None):
            raise InvalidArgument(f"{name} is not supported by the {info.engine} engine.", field=f"sampling.{name}")


def resolve_max_new_tokens(req: GenerationRequest, prompt_len: int, limits: Limits, default: int) -> int:
    """The max_new_tokens to use for a prompt of prompt_len tokens.

    An unset value takes `default` (or, with StoppingParams.fill_context, the rest of the
    context), lowered to fit the context and the configured bound. A set value must fit.
    min_new_tokens must not exceed the result (StoppingParams.min_new_tokens).

    Raises:
        ContextLengthExceeded: the prompt is longer than the engine accepts or leaves no room,
            or prompt + max_new_tokens is too long.
        InvalidArgument: min_new_tokens exceeds the max_new_tokens in effect.
    """
    ctx = limits.engine.max_context_length
    field = _input_field(req)
    max_input = limits.engine.max_input_length
    if max_input is not None and prompt_len > max_input:
        raise ContextLengthExceeded(
            f"The prompt has {prompt_len} tokens, more than the {max_input} this engine accepts; "
            "shorten the prompt or set truncate_input_tokens.",
            field=field,
        )
    if prompt_len >= ctx:
        raise ContextLengthExceeded(
            f"The prompt has {prompt_len} tokens, but the model's context is {ctx} tokens and at least one "
            "must be left for generation; shorten the prompt or set truncate_input_tokens.",
            field=field,
        )
    asked = req.stopping.max_new_tokens
    if asked is None:
        wanted = ctx if req.stopping.fill_context else default
        max_new = max(1, min(wanted, limits.max_new_tokens, ctx - prompt_len))
    elif prompt_len + asked > ctx:
        raise ContextLengthExceeded(
            f"The prompt has {prompt_len} tokens and max_new_tokens is {asked}, which exceeds the model's "
            f"context of {ctx} tokens; ask for at most {ctx - prompt_len} new tokens.",
            field="stopping.max_new_tokens",
        )
    else:
        max_new = asked
    min_new = req.stopping.min_new_tokens
    if min_new is not None and min_new > max_new:
        given = "" if asked is not None else ", the default for this prompt; set max_new_tokens"
        raise InvalidArgument(
            f"min_new_tokens ({min_new}) must not exceed max_new_tokens ({max_new}{given}).",
            field="stopping.min_new_tokens",
        )
    return max_new


def prompt_chars_bound(max_context_length: int, max_token_chars: int) -> int:
    """The most characters a prompt that fits `max_context_length` tokens can have.

    Every token stands for at most `max_token_chars` characters of input (the longest entry of
    the vocabulary; a byte-level token's string has one character per byte, and a character is
    at least one byte), so a text of more characters has more tokens than the context holds.
    """
    return max_context_length * max(1, max_token_chars)


def check_prompt_size(req: GenerationRequest, limits: Limits) -> None:
    """Refuse a prompt that cannot fit the context by its length in characters, before the
    tokenizer spends seconds and memory on it (a 10 MB prompt tokenizes for ~15 s).

    A text prompt with truncate_input_tokens is exempt: only its tail is tokenized
    (`tail_for_truncation`).

    Raises:
        ContextLengthExceeded: naming the input field.
    """
    bound = limits.max_prompt_chars
    if bound is None:
        return
    if req.text is not None:
        if req.stopping.truncate_input_tokens is not None:
            return
        size = len(req.text)
    elif req.messages is not None:
        size = sum(len(p.text or "") for m in req.messages for p in m.content)
    else:
        return
    if size > bound:
        ctx = limits.engine.max_context_length
        raise ContextLengthExceeded(
            f"The prompt has {size} characters, more than any prompt that fits the model's context of {ctx} "
            f"tokens can have ({bound}); shorten the prompt or set truncate_input_tokens.",
            field=_input_field(req),
        )


def tail_for_truncation(text: str, truncate: int, max_token_chars: int) -> str:
    """The end of `text` that holds at least `truncate` tokens and a margin, so that a text
    prompt with truncate_input_tokens is tokenized only as far as the truncation keeps it.

    A token covers at most `max_token_chars` characters, so the tail has at least
    `truncate + margin` tokens; the margin absorbs the tokens the cut itself changes (a token
    split in two at the cut is among the dropped leading ones).
    """
    keep = (truncate + _TRUNCATION_MARGIN_TOKENS) * max(1, max_token_chars)
    return text if len(text) <= keep else text[-keep:]


_TRUNCATION_MARGIN_TOKENS = 16


def _input_field(req: GenerationRequest) -> str:
    if req.messages is not None:
        return "messages"
    if req.token_ids is not None:
        return "token_ids"
    return "text"


def _check_input(req: GenerationRequest, limits: Limits) -> None:
    given = [x for x in (req.text, req.token_ids, req.messages) if x is not None]
    if not given:
        if req.session_id:
            return  # a live session supplies the input; checked again once the store is consulted
        raise InvalidArgument("The request has no input; set text, token_ids or messages.", field="text")
    if req.text is not None and req.text == "":
        raise InvalidArgument("The prompt text is empty.", field="text")
    if req.token_ids is not None:
        if not req.token_ids:
            raise InvalidArgument("token_ids is empty; send at least one token id.", field="token_ids")
        vocab = limits.engine.vocab_size
        bad = next((t for t in req.token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary [0, {vocab}).", field="token_ids")
    if req.messages is not None:
        if not req.messages:
            raise InvalidArgument("messages is empty; send at least one message.", field="messages")
        if len(req.messages) > MAX_MESSAGES:
            raise InvalidArgument(
                f"At most {MAX_MESSAGES} messages are allowed, got {len(req.messages)}.", field="messages"
            )
        for i, m in enumerate(req.messages):
            if not m.role:
                raise InvalidArgument(f"messages[{i}] has no role.", field=f"messages[{i}].role")
            for p in m.content:
                if p.image_url is not None:
                    raise InvalidArgument(
                        "This model accepts text only; image_url content parts are not supported.",
                        field=f"messages[{i}].content",
                    )
            if m.tool_calls and m.role != "assistant":
                raise InvalidArgument(
                    f"Only assistant messages carry tool_calls; messages[{i}] has role '{m.role}'.",
                    field=f"messages[{i}].tool_calls",
                )
            if m.role == "tool" and not m.tool_call_id:
                raise InvalidArgument(
                    f"messages[{i}] is a tool message without tool_call_id; name the call it answers.",
                    field=f"messages[{i}].tool_call_id",
                )
        _check_template(req)
    _check_tools(req)


#: apply_chat_template's own arguments and the variables it sets (transformers 4.5x
#: `PreTrainedTokenizerBase.apply_chat_template`): template kwargs must not replace them.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def _check_template(req: GenerationRequest) -> None:
    """Template kwargs are a JSON object without reserved names; continuing the final message
    needs it to be the assistant's and no generation prompt."""
    t = req.template
    field = "messages.template_kwargs"
    if t.kwargs:
        try:
            kwargs = json.loads(t.kwargs)
        except ValueError:
            raise InvalidArgument("template_kwargs is not valid JSON.", field=field) from None
        if not isinstance(kwargs, dict):
            raise InvalidArgument("template_kwargs must be a JSON object.", field=field)
        reserved = sorted(RESERVED_TEMPLATE_NAMES.intersection(kwargs))
        if reserved:
            raise InvalidArgument(
                f"template_kwargs must not set the template call's own argument '{reserved[0]}'.", field=field
            )
    if t.continue_final_message:
        if t.add_generation_prompt:
            raise InvalidArgument(
                "continue_final_message needs add_generation_prompt false: the final message cannot be continued "
                "after a new turn is opened.",
                field="messages.continue_final_message",
            )
        if req.messages and req.messages[-1].role != "assistant":
            raise InvalidArgument(
                "continue_final_message continues the final message, which must be the assistant's.",
                field="messages.continue_final_message",
            )


def _check_tools(req: GenerationRequest) -> None:
    """Tools need a chat; names follow OpenAI's rule and are unique; parameters are a JSON object."""
    if not req.tools:
        return
    if len(req.tools) > MAX_TOOLS:
        raise InvalidArgument(f"At most {MAX_TOOLS} tools are allowed, got {len(req.tools)}.", field="tools")
    seen: set[str] = set()
    for i, tool in enumerate(req.tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise InvalidArgument(
                f"tools[{i}].name must be 1 to 64 letters, digits, underscores or dashes, got {tool.name!r}.",
                field=f"tools[{i}].name",
            )
        if tool.name in seen:
            raise InvalidArgument(f"Two tools are named '{tool.name}'; names must be unique.", field=f"tools[{i}].name")
        seen.add(tool.name)
        if tool.parameters:
            try:
                params = json.loads(tool.parameters)
            except ValueError as e:
                raise InvalidArgument(
                    f"tools[{i}].parameters is not valid JSON: {e}.", field=f"tools[{i}].parameters"
                ) from None
            if not isinstance(params, dict):
                raise InvalidArgument(
                    f"tools[{i}].parameters must be a JSON Schema object.", field=f"tools[{i}].parameters"
                )


def _check_range(
    value: float | None,
    lo: float | None,
    hi: float | None,
    field: str,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    what: str = "",
) -> None:
    """Raise InvalidArgument naming `field` unless `value` (None: unset, fine) is finite and in
    the range from `lo` to `hi` (None: unbounded; open ends when told)."""
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidArgument(f"{field.split('.')[-1]} must be a finite number, got {value}.", field=field)
    low_bad = lo is not None and (value <= lo if lo_open else value < lo)
    high_bad = hi is not None and (value >= hi if hi_open else value > hi)
    if low_bad or high_bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        rng = f"{left}{'-inf' if lo is None else _fmt(lo)}, {'inf' if hi is None else _fmt(hi)}{right}"
        name = field.split(".")[-1]
        raise InvalidArgument(f"{name} must be in {rng}{what}, got {_fmt(value)}.", field=field)


def _fmt(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _check_sampling(req: GenerationRequest, limits: Limits) -> None:
    s = req.sampling
    _check_range(s.temperature, 0.0, None, "sampling.temperature")
    _check_range(s.top_k, 0, None, "sampling.top_k", what=" (0 disables top-k)")
    _check_range(s.top_p, 0.0, 1.0, "sampling.top_p", lo_open=True)
    _check_range(s.min_p, 0.0, 1.0, "sampling.min_p")
    _check_range(s.typical_p, 0.0, 1.0, "sampling.typical_p", lo_open=True)
    _check_range(s.repetition_penalty, 0.0, None, "sampling.repetition_penalty", lo_open=True)
    _check_range(s.presence_penalty, *PENALTY_RANGE, "sampling.presence_penalty")
    _check_range(s.frequency_penalty, *PENALTY_RANGE, "sampling.frequency_penalty")
    _check_range(s.length_penalty, None, None, "sampling.length_penalty")
    _check_range(s.n, 1, limits.max_n, "sampling.n")
    _check_range(s.best_of, 1, limits.max_n, "sampling.best_of")
    if s.best_of is not None and s.best_of < (s.n or 1):
        raise InvalidArgument(f"best_of ({s.best_of}) must be at least n ({s.n or 1}).", field="sampling.best_of")
    _check_range(s.num_beams, 1, None, "sampling.num_beams")
    vocab = limits.engine.vocab_size
    if len(req.logit_bias) > limits.max_logit_bias:
        raise InvalidArgument(
            f"At most {limits.max_logit_bias} logit_bias entries are allowed, got {len(req.logit_bias)}.",
            field="sampling.logit_bias",
        )
    for tok, bias in req.logit_bias.items():
        if not 0 <= tok < vocab:
            raise InvalidArgument(
                f"logit_bias names token id {tok}, outside the vocabulary [0, {vocab}).", field="sampling.logit_bias"
            )
        _check_range(bias, *LOGIT_BIAS_RANGE, "sampling.logit_bias")
    if len(req.bad_words) > MAX_BAD_WORDS:
        raise InvalidArgument(
            f"At most {MAX_BAD_WORDS} bad_words are allowed, got {len(req.bad_words)}.", field="sampling.bad_words"
        )
    if any(not w for w in req.bad_words):
        raise InvalidArgument("bad_words must not contain an empty string.", field="sampling.bad_words")
    _check_lengths(req.bad_words, limits.max_stop_chars, "sampling.bad_words", "bad word")


def _check_stopping(req: GenerationRequest, limits: Limits) -> None:
    st = req.stopping
    _check_range(st.max_new_tokens, 1, limits.max_new_tokens, "stopping.max_new_tokens")
    _check_range(st.min_new_tokens, 0, None, "stopping.min_new_tokens")
    if len(st.stop) > limits.max_stop_sequences:
        raise InvalidArgument(
            f"At most {limits.max_stop_sequences} stop sequences are allowed, got {len(st.stop)}.",
            field="stopping.stop",
        )
    if any(not s for s in st.stop):
        raise InvalidArgument("Stop sequences must not be empty strings.", field="stopping.stop")
    _check_lengths(st.stop, limits.max_stop_chars, "stopping.stop", "stop sequence")
    vocab = limits.engine.vocab_size
    bad = next((t for t in st.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidArgument(
            f"stop token id {bad} is outside the vocabulary [0, {vocab}).", field="stopping.stop_token_ids"
        )
    _check_range(st.time_limit_ms, 0, None, "stopping.time_limit_ms", lo_open=True)
    _check_range(st.truncate_input_tokens, 1, None, "stopping.truncate_input_tokens")


def _check_lengths(strings: tuple[str, ...], most: int, field: str, what: str) -> None:
    longest = max((len(x) for x in strings), default=0)
    if longest > most:
        raise InvalidArgument(f"A {what} may have at most {most} characters, got one of {longest}.", field=field)


def _check_guided(req: GenerationRequest) -> None:
    """A guided sequence ends on EOS once its output is complete: ignore_eos and min_new_tokens
    would keep it from ending (the guide allows nothing but EOS then)."""
    if req.guide is None:
        return
    if req.stopping.ignore_eos:
        raise InvalidArgument(
            "ignore_eos cannot be combined with guided_decoding: a guided output ends with EOS once it is complete.",
            field="stopping.ignore_eos",
        )
    if req.stopping.min_new_tokens:
        raise InvalidArgument(
            "min_new_tokens cannot be combined with guided_decoding: the guide decides where the output ends.",
            field="stopping.min_new_tokens",
        )


def _check_output(req: GenerationRequest) -> None:
    o = req.output
    _check_range(o.top_logprobs, 0, MAX_TOP_LOGPROBS, "output.top_logprobs")
    if o.top_logprobs and not o.logprobs:
        raise InvalidArgument("top_logprobs requires logprobs to be true.", field="output.top_logprobs")
    if o.tokens is False and o.logprobs:
        raise InvalidArgument(
            "logprobs are reported on the generated tokens; leave output.tokens unset or true to get them.",
            field="output.tokens",
        )
    _check_range(o.prompt_logprobs, 0, MAX_TOP_LOGPROBS, "output.prompt_logprobs")
