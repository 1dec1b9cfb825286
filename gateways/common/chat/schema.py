"""Wire models of OpenAI chat completions: the OpenAI gateway's `POST /v1/chat/completions`, and
the LMI gateway's `/invocations` when the body has `messages` (so they live here, shared).

The request table is LMI's chat completions schema (DJL-Serving's `chat_input_output_schema.md`,
"Request Schema") plus OpenAI's `max_completion_tokens` and `stream_options`. Only JSON shapes
and types are checked here, plus the ranges that are OpenAI's own and narrower than the core's
(temperature <= 2); every general range is the core's, checked once for every schema
(core.validation), the number of stop strings included (the core's --max-stop-sequences).
Integers must also fit the proto field they travel in (int32 or int64).

Structured output (`response_format`) and tools (`tools`, `tool_choice`,
`parallel_tool_calls`, assistant `tool_calls` and `tool` messages) have their shapes checked
here (gateways.common.guided, gateways.common.chat.tools map them). Fields OpenAI defines but
the core cannot honour (the legacy `functions`/`function_call`, audio, ...) are refused with the
field named, as are fields OpenAI does not define; OpenAI itself answers an unrecognised
argument with 400. Fields without a generation effect (`user`, `metadata`, `store`, ...) are
accepted and ignored.

`parse_chat_request(body)` is the entry point; it raises GatewayError (INVALID_ARGUMENT) with
`param` set to the offending field in OpenAI's spelling (e.g. "messages[0].content[1].type").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateways.common.chat import vllm
from gateways.common.chat.vllm import VllmExtras
from gateways.common.guided import NAME_PATTERN, ResponseFormat, tgi_grammar_guide
from gateways.common.schema import INT32_MAX, INT32_MIN, Int32, Int64, field_path, json_type, screen_fields
from gateways.common.status import GatewayError

_INVALID = grpc.StatusCode.INVALID_ARGUMENT

MAX_TEMPERATURE = 2.0  # OpenAI's upper bound; the core only requires >= 0.

_TOKEN_ID = re.compile(r"-?[0-9]+")
# Discriminator values of content parts and response formats, which pydantic puts in error
# locations after the index or the field.
_PART_TYPES = ("text", "image_url")
_FORMAT_TYPES = ("text", "json_object", "json_schema")

# Fields OpenAI defines that have no effect on generation here; accepted and ignored (`user`
# too, but it is type-checked as a field of the seed's table).
IGNORED_FIELDS = frozenset({"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})

# Fields OpenAI defines that need features the core does not have, with the reason given to
# the client. A neutral value (null, empty, "none", text-only) is accepted.
UNSUPPORTED_FIELDS = {
    "functions": "the legacy function calling is not supported; use tools",
    "function_call": "the legacy function calling is not supported; use tool_choice",
    "audio": "audio output is not supported",
    "modalities": "only the text modality is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning effort is not supported",
    "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported",
}

# vLLM's chat-only parameters the core cannot honour (add_special_tokens: the chat template
# supplies the special tokens; neutral when false, vLLM's default for chat).
_CHAT_UNSUPPORTED = {
    **vllm.UNSUPPORTED,
    "add_special_tokens": "adding the tokenizer's special tokens to a rendered chat is not supported",
    "chat_template": "a chat template in the request is not supported; the model's own is used",
    "documents": "documents for retrieval-augmented templates are not supported",
}


def _neutral(name: str, value: Any) -> bool:
    """Whether an unsupported field's value asks for nothing (so it can be accepted)."""
    if value is None:
        return True
    if name == "functions":
        return bool(value == [])
    if name == "function_call":
        return bool(value == "none")
    if name == "modalities":
        return bool(value == ["text"])
    if name == "add_special_tokens":
        return value is False
    if name == "documents":
        return bool(value == [])
    return vllm.neutral(name, value)


def check_logit_bias(cls: type, value: dict[str, float] | None) -> dict[str, float] | None:
    """pydantic validator of `logit_bias`: keys are token ids (int32 as decimal strings)."""
    for key in value or {}:
        if not _TOKEN_ID.fullmatch(key):
            raise ValueError(f"keys must be token ids (integers as strings), got {key!r}")
        if not INT32_MIN <= int(key) <= INT32_MAX:
            raise ValueError(f"token id {key} is out of range")
    return value


class Wire(BaseModel):
    """Strict JSON types (no "1" for 1, no 1 for true) and no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class TextPart(Wire):
    """`{"type": "text", "text": "..."}`."""

    type: Literal["text"]
    text: str


class ImageUrl(Wire):
    """`{"url": "https://... | data:image/...;base64,...", "detail": "auto|low|high"}`."""

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Wire):
    """`{"type": "image_url", "image_url": {...}}` (the seed's "Vision/Image Support")."""

    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class CalledFunction(Wire):
    """`function` of a tool call: the name and the arguments as JSON text."""

    name: str
    arguments: str


class ToolCallWire(Wire):
    """A tool call an assistant message made: `{"id", "type": "function", "function"}`."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(Wire):
    """One conversation message (seed "Message"): role and content (string or parts); an
    assistant message may carry the `tool_calls` it made, and a "tool" message answers one
    (`tool_call_id`).

    An assistant message echoed back from a previous response may carry OpenAI's other
    response-only fields; they are accepted when empty (null, [], "") and refused otherwise.
    Its reasoning (`reasoning`, vLLM's field, or `reasoning_content`, its older name) is
    accepted and left out of the prompt: the contract's ChatMessage has no field for it, and
    reasoning templates (Qwen3, DeepSeek-R1) drop the reasoning of past turns themselves.
    """

    # "developer" is OpenAI's newer name for the system role; it is sent as "system", the role
    # chat templates know.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    tool_calls: list[ToolCallWire] | None = None
    function_call: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(Wire):
    """A tool's function: name, description, parameters (a JSON Schema object), strict (the
    output follows the schema whenever it is constrained here, so it is accepted as given)."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(Wire):
    """`{"type": "function", "function": {...}}`."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Wire):
    """`{"name": ...}` of a named tool choice."""

    name: str


class NamedToolChoice(Wire):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: FunctionName


class StreamOptions(Wire):
    """`stream_options`: `include_usage` adds a final chunk with usage and empty choices.

    `include_obfuscation` is accepted and has no effect (this server pads nothing).
    `continuous_usage_stats` (vLLM's) puts the usage so far on every chunk.
    """

    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = None


class ChatCompletionRequest(VllmExtras, Wire):
    """A chat completion request body (seed "Request Schema"), with vLLM's extras
    (gateways.common.chat.vllm) and its chat-only ones: `echo` (the reply's text is led by the
    final message's when that is the assistant's), `add_generation_prompt`,
    `continue_final_message`, `chat_template_kwargs` (to the model's chat template),
    `prompt_logprobs`.

    Unset fields are None: the core's (engine's) defaults then apply, except that sampling is
    on unless temperature is 0 (OpenAI samples by default). `logit_bias` keys are token ids as
    decimal strings, already checked to be integers.
    """

    messages: list[Message]
    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: Int32 | None = None
    max_tokens: Int32 | None = None
    max_completion_tokens: Int32 | None = None
    n: Int32 | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(le=MAX_TEMPERATURE, ge=0.0)] | None = None
    top_p: float | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extension: the scheduling priority, lower first (the core's --scheduling-policy).
    priority: Int32 | None = None
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0, le=INT32_MAX)] | None = None

    _logit_bias = field_validator("logit_bias")(check_logit_bias)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


def any_model(body: Any) -> Any:
    """`body` without its `model` (a gateway's --accept-any-model: one model is served, so
    whatever name a client sends means it, as TGI answers any name); any other value as it is."""
    if isinstance(body, dict) and "model" in body:
        return {k: v for k, v in body.items() if k != "model"}
    return body


def _tgi_formats(body: Any) -> Any:
    """TGI's shapes of structured output on chat (text-generation-inference router/src/lib.rs
    `GrammarType`, 3.x: `{"type": "json" | "json_object" | "json_schema" | "regex", "value":
    ...}`, in `response_format` as huggingface_hub's InferenceClient sends it, or in
    `grammar`) as vLLM's guided fields, which the chat table maps (OpenAI's response_format
    shapes, which carry no `value`, are left as they are).

    Raises:
        GatewayError: INVALID_ARGUMENT naming `response_format` or `grammar` for a TGI shape
            that is not one (gateways.common.guided.tgi_grammar_guide).
    """
    if not isinstance(body, dict):
        return body
    out = body
    for name in ("response_format", "grammar"):
        value = body.get(name)
        if value is None or (name == "response_format" and not (isinstance(value, dict) and "value" in value)):
            continue
        if not isinstance(value, dict):
            raise GatewayError.invalid(f"Invalid value for '{name}': expected an object, got {json_type(value)}.", name)
        guide = tgi_grammar_guide(value, name)
        kind = guide.WhichOneof("guide")
        as_vllm: dict[str, Any] = (
            {"guided_json": guide.json_schema}
            if kind == "json_schema"
            else {"guided_regex": guide.regex}
            if kind == "regex"
            else {"structured_outputs": {"json_object": True}}
        )
        (key,) = as_vllm
        if key in out:
            raise GatewayError.invalid(f"Only one guided decoding parameter may be given; got {name} and {key}.", key)
        out = {**{k: v for k, v in out.items() if k != name}, **as_vllm}
    return out


def parse_chat_request(body: Any) -> ChatCompletionRequest:
    """Check a parsed JSON body and return it as a ChatCompletionRequest.

    Raises:
        GatewayError: INVALID_ARGUMENT, `param` naming the field (OpenAI spelling), `reason`
            UNKNOWN_PARAMETER, UNSUPPORTED_PARAMETER or INVALID_ARGUMENT.
    """
    checked = screen_fields(
        _tgi_formats(body),
        ChatCompletionRequest.model_fields,
        ignored=IGNORED_FIELDS | vllm.IGNORED,
        unsupported={**UNSUPPORTED_FIELDS, **_CHAT_UNSUPPORTED},
        neutral=_neutral,
    )
    try:
        req = ChatCompletionRequest.model_validate(checked)
    except ValidationError as e:
        raise to_gateway_error(e) from None
    for i, m in enumerate(req.messages):
        _check_message(m, i)
    if req.stream_options is not None and not req.stream:
        raise GatewayError.invalid(
            "The parameter 'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    if req.prompt_logprobs is not None and req.stream:
        raise GatewayError.invalid(
            "The parameter 'prompt_logprobs' is not available when 'stream' is true.", param="prompt_logprobs"
        )
    _check_tools(req)
    _check_guides(req)
    return req


def _check_guides(req: ChatCompletionRequest) -> None:
    """vLLM's guides exclude each other (gateways.common.chat.vllm.guide), a response_format and
    a forced tool call."""
    if vllm.guide(req) is None:
        return
    constrained = req.response_format is not None and req.response_format.type != "text"
    if constrained or req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice):
        given = next(name for name in (*vllm.VLLM_GUIDES, "structured_outputs") if getattr(req, name) is not None)
        raise GatewayError.invalid(
            f"{given} cannot be combined with a response_format or a tool_choice that forces a call: both would "
            "constrain the output.",
            param=given,
        )


def _check_message(m: Message, i: int) -> None:
    """Refuse response-only fields that carry something (legacy function calls, audio)."""
    for name in ("function_call", "audio"):
        if getattr(m, name):
            raise GatewayError(
                _INVALID,
                f"The legacy function_call and audio are not supported by this server; messages[{i}].{name} "
                "must be empty.",
                param=f"messages[{i}].{name}",
                reason="UNSUPPORTED_PARAMETER",
            )


def _check_tools(req: ChatCompletionRequest) -> None:
    """tool_choice needs tools and names one of them; a forced call and a response_format
    cannot both constrain the output."""
    choice = req.tool_choice
    if choice is None or choice == "none":
        return
    if not req.tools:
        raise GatewayError.invalid(
            "Invalid value for 'tool_choice': tool_choice is only allowed when 'tools' are specified.",
            param="tool_choice",
        )
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in req.tools}:
        raise GatewayError.invalid(
            f"Invalid value for 'tool_choice': no tool named '{choice.function.name}' is in 'tools'.",
            param="tool_choice",
        )
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and req.response_format is not None and req.response_format.type != "text":
        raise GatewayError.invalid(
            "A response_format cannot be combined with a tool_choice that forces a call: both would constrain the "
            "output.",
            param="response_format",
        )


def _param(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location in OpenAI's spelling: "messages[0].content[1].type",
    "response_format.json_schema.name" (the response format's type tag left out)."""
    if len(loc) > 1 and loc[0] == "response_format" and loc[1] in _FORMAT_TYPES:
        loc = (loc[0], *loc[2:])
    return field_path(loc, tags=_PART_TYPES)


def to_gateway_error(e: ValidationError, spell: Callable[[tuple[int | str, ...]], str] = _param) -> GatewayError:
    """The most specific pydantic error as a GatewayError (unions report one error per member;
    the deepest location is the one that explains the problem). `spell` turns a pydantic
    location into the client's field path (chat completions' by default)."""
    errors = e.errors(include_url=False)
    param = max((spell(err["loc"]) for err in errors), key=len)
    found = [err for err in errors if spell(err["loc"]) == param]
    first = found[0]
    kind = first["type"]
    if kind == "missing":
        return GatewayError.invalid(f"Missing required parameter: '{param}'.", param=param)
    if kind == "extra_forbidden":
        return GatewayError(
            _INVALID, f"Unrecognized request argument supplied: {param}", param=param, reason="UNKNOWN_PARAMETER"
        )
    reasons = " or ".join(dict.fromkeys(_sentence(err["msg"]) for err in found))
    return GatewayError.invalid(f"Invalid value for '{param}': {reasons}.", param=param)


def _sentence(msg: str) -> str:
    msg = msg.removeprefix("Value error, ").rstrip(".")
    return msg[0].lower() + msg[1:]
