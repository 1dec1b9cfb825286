"""Wire models of OpenAI's Responses API request (`POST /v1/responses`), after openai-python
3.52.0 `types/responses/response_create_params.py` and the input item types it names
(`easy_input_message_param.py`, `response_input_param.py`: `Message`, `FunctionCallOutput`,
`response_function_tool_call_param.py`, `response_reasoning_item_param.py`).

Served: `input` (a string, or a list of `message`, `function_call`, `function_call_output` and
`reasoning` items, the last an earlier response's reasoning, accepted and left out of the
prompt; message content as a string or `input_text` / `input_image` (by URL) / `output_text` /
`refusal` parts), `instructions`, `max_output_tokens`, `temperature`, `top_p`, function `tools`
with `tool_choice` and `parallel_tool_calls`, `text.format` (`text`, `json_object`,
`json_schema`), `stream` (with `stream_options.include_obfuscation`, which has no effect),
`metadata`, `user`, `store`, `previous_response_id`, `model`, and `truncation: "disabled"`.
Fields without a generation effect (`service_tier`, `safety_identifier`, prompt-cache hints)
are accepted and ignored. Fields that need what the core does not have (hosted tools,
background mode, conversations, stored prompts, reasoning settings, `include`, logprobs, ...)
are refused with the field named unless their value asks for nothing; any other field is
refused as unknown (OpenAI answers an unrecognised argument with 400).

`parse_responses_request(body)` is the entry point; it raises GatewayError (INVALID_ARGUMENT)
with `param` the offending field in OpenAI's spelling ("input[1].content[0].text",
"tools[0].type", "text.format.name").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import grpc
from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError

from gateways.common.chat.schema import MAX_TEMPERATURE, FunctionDefinition, Wire, to_gateway_error
from gateways.common.guided import NAME_PATTERN
from gateways.common.schema import Int32, field_path, screen_fields
from gateways.common.status import GatewayError

_INVALID = grpc.StatusCode.INVALID_ARGUMENT

#: OpenAI's limits on `metadata`: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512

#: Input item types served; the others (item_reference, hosted tool calls, ...) are refused.
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_PART_TYPES = ("input_text", "input_image", "output_text", "refusal")
_FORMAT_TYPES = ("text", "json_object", "json_schema")

#: Fields OpenAI defines that have no effect on generation here; accepted and ignored.
IGNORED_FIELDS = frozenset(
    {"service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options"}
)

#: Fields OpenAI defines that need features the core or this gateway does not have, with the
#: reason given to the client. A neutral value (null, false, empty, 0) is accepted.
UNSUPPORTED_FIELDS = {
    "background": "background responses are not supported",
    "conversation": "conversations are not supported; use previous_response_id",
    "prompt": "stored prompt templates are not supported",
    "reasoning": "reasoning settings are not supported",
    "include": "no additional output data can be included",
    "top_logprobs": "log probabilities are not supported on this route",
    "max_tool_calls": "max_tool_calls is not supported",
    "context_management": "context management is not supported",
    "moderation": "moderation is not supported",
    "image": "image generation is not supported",
    "access_programs": "access programs are not supported",
}


def _neutral(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == 0


class InputText(Wire):
    """`{"type": "input_text", "text"}` (a prompt-cache breakpoint is accepted and ignored)."""

    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: dict[str, Any] | None = None


class InputImage(Wire):
    """`{"type": "input_image", "image_url", "detail"}`: an image by URL or data URL (a
    `file_id` is refused: this server keeps no files)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: None = None
    detail: Literal["auto", "low", "high", "original"] | None = None


class OutputText(Wire):
    """`{"type": "output_text", "text", "annotations", "logprobs"}`: an earlier answer's text,
    as a response's output message carries it."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(Wire):
    """`{"type": "refusal", "refusal"}`: an earlier answer's refusal."""

    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[InputText | InputImage | OutputText | Refusal, Field(discriminator="type")]

_Status = Literal["in_progress", "completed", "incomplete"]


class MessageItem(Wire):
    """A message (`EasyInputMessageParam`, `Message`, or an output message passed back): a role
    and content (a string or parts)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: _Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Wire):
    """A function call the model made (`ResponseFunctionToolCallParam`)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: _Status | None = None


class FunctionCallOutputItem(Wire):
    """The caller's result of a function call (`FunctionCallOutput`): text, or `input_text`
    parts (joined)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: _Status | None = None
    name: str | None = None


class SummaryText(Wire):
    """`{"type": "summary_text", "text"}`: a reasoning summary."""

    type: Literal["summary_text"]
    text: str


class ReasoningText(Wire):
    """`{"type": "reasoning_text", "text"}`: reasoning text."""

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Wire):
    """An earlier response's reasoning passed back (`ResponseReasoningItemParam`). It is left
    out of the prompt, as chat completions leave out an input message's reasoning: reasoning
    templates (Qwen3, DeepSeek-R1) drop past turns' reasoning themselves. `encrypted_content`
    is refused unless null: this server never produces it."""

    type: Literal["reasoning"]
    summary: list[SummaryText]
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    id: str | None = None
    status: _Status | None = None


def _item_type(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")  # type: ignore[no-any-return]
    return getattr(value, "type", None) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]

#: Validates stored conversation items (they were valid input or output items when stored).
ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(FunctionDefinition):
    """`{"type": "function", "name", "description", "parameters", "strict"}` (`FunctionToolParam`):
    chat completions' function definition, flattened beside its type."""

    type: Literal["function"]


class ToolChoiceFunction(Wire):
    """`{"type": "function", "name"}`: call this function."""

    type: Literal["function"]
    name: str


class FormatText(Wire):
    """`{"type": "text"}`: free text (the default)."""

    type: Literal["text"]


class FormatJsonObject(Wire):
    """`{"type": "json_object"}`: any JSON object."""

    type: Literal["json_object"]


class FormatJsonSchema(Wire):
    """`{"type": "json_schema", "name", "schema", "description", "strict"}`: JSON valid against
    the schema (`strict` is accepted: the output always follows the schema here)."""

    type: Literal["json_schema"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextConfig(Wire):
    """`text`: the output's format (`verbosity` is refused unless null)."""

    format: TextFormat | None = None
    verbosity: None = None


class StreamOptions(Wire):
    """`stream_options`: `include_obfuscation` is accepted and has no effect."""

    include_obfuscation: bool | None = None


class ResponsesRequest(Wire):
    """A `POST /v1/responses` body. Unset fields are None (the core's defaults apply)."""

    input: str | list[InputItem] | None = None
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: Int32 | None = None
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None
    # vLLM's extension: the scheduling priority, lower first (the core's --scheduling-policy).
    priority: Int32 | None = None

    @property
    def format(self) -> FormatText | FormatJsonObject | FormatJsonSchema | None:
        """`text.format`, or None."""
        return self.text.format if self.text is not None else None

    @property
    def stored(self) -> bool:
        """Whether the response is kept for retrieval and chaining (`store`, true by default)."""
        return self.store is not False

    def items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]:
        """`input` as items (a string is one user message)."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Check a parsed JSON body and return it as a ResponsesRequest.

    Raises:
        GatewayError: INVALID_ARGUMENT, `param` naming the field (OpenAI spelling), `reason`
            UNKNOWN_PARAMETER, UNSUPPORTED_PARAMETER or INVALID_ARGUMENT.
    """
    checked = screen_fields(
        body,
        ResponsesRequest.model_fields,
        ignored=IGNORED_FIELDS,
        unsupported=UNSUPPORTED_FIELDS,
        neutral=lambda _, value: _neutral(value),
        lists=("input",),
    )
    _check_kinds(checked)
    try:
        req = ResponsesRequest.model_validate(checked)
    except ValidationError as e:
        raise to_gateway_error(e, _param) from None
    if req.input is None and req.previous_response_id is None:
        raise GatewayError.invalid("Missing required parameter: 'input'.", param="input")
    if req.stream_options is not None and not req.stream:
        raise GatewayError.invalid(
            "The parameter 'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    _check_metadata(req.metadata or {})
    _check_items(req.items())
    _check_tools(req)
    return req


def _unsupported(param: str, message: str) -> GatewayError:
    return GatewayError(_INVALID, message, param=param, reason="UNSUPPORTED_PARAMETER")


def _check_kinds(body: dict[str, Any]) -> None:
    """Refuse, by name, the tool, tool choice and input item kinds OpenAI defines and this
    server does not serve (before pydantic, whose union errors would list every member)."""
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise _unsupported(
                f"tools[{i}].type",
                f"The tool type {_quoted(tool.get('type'))} is not supported by this server; only function tools are.",
            )
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise _unsupported(
            "tool_choice.type",
            f"The tool_choice type {_quoted(choice.get('type'))} is not supported by this server; use "
            '"none", "auto", "required" or {"type": "function", "name": ...}.',
        )
    items = body.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if isinstance(item, dict) and kind not in ITEM_TYPES:
            raise _unsupported(
                f"input[{i}].type",
                f"Input items of type {_quoted(kind)} are not supported by this server; the types served are "
                f"{', '.join(ITEM_TYPES)}.",
            )


def _quoted(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else repr(value)


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA:
        raise GatewayError.invalid(
            f"Invalid value for 'metadata': at most {MAX_METADATA} pairs are allowed, got {len(metadata)}.",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise GatewayError.invalid(
                f"Invalid value for 'metadata.{key[:MAX_METADATA_KEY]}': keys are at most {MAX_METADATA_KEY} "
                f"characters and values at most {MAX_METADATA_VALUE}.",
                param="metadata",
            )


def _check_items(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]) -> None:
    """An image needs a URL; only assistant messages carry output text and refusals, and only
    the others carry input parts."""
    for i, item in enumerate(items):
        if not isinstance(item, MessageItem) or isinstance(item.content, str):
            continue
        for j, part in enumerate(item.content):
            where = f"input[{i}].content[{j}]"
            if isinstance(part, InputImage) and not part.image_url:
                raise GatewayError.invalid(
                    f"Missing required parameter: '{where}.image_url'.", param=f"{where}.image_url"
                )
            assistant = item.role == "assistant"
            if isinstance(part, OutputText | Refusal) != assistant:
                raise GatewayError.invalid(
                    f"Invalid value for '{where}.type': {part.type} parts belong to "
                    f"{'other' if assistant else 'assistant'} messages.",
                    param=f"{where}.type",
                )


def _check_tools(req: ResponsesRequest) -> None:
    """tool_choice needs tools and names one of them. (A forced call with a `text.format` is
    accepted, as OpenAI accepts it: the output is the call, and the format is for text answers,
    which such a response has none of; the OpenAI Agents SDK sends both when an agent with an
    output type must use a tool.)"""
    choice = req.tool_choice
    if choice is None or choice == "none":
        return
    if not req.tools:
        raise GatewayError.invalid(
            "Invalid value for 'tool_choice': tool_choice is only allowed when 'tools' are specified.",
            param="tool_choice",
        )
    if isinstance(choice, ToolChoiceFunction) and choice.name not in {t.name for t in req.tools}:
        raise GatewayError.invalid(
            f"Invalid value for 'tool_choice': no tool named '{choice.name}' is in 'tools'.", param="tool_choice"
        )


def _param(loc: tuple[int | str, ...]) -> str:
    """A pydantic location in OpenAI's spelling: item and part tags after an index left out
    ("input[0].content[1].text"), and the format's tag after `text.format`."""
    if loc[:2] == ("text", "format") and len(loc) > 2 and loc[2] in _FORMAT_TYPES:
        loc = (*loc[:2], *loc[3:])
    return field_path(loc, tags=(*ITEM_TYPES, *_PART_TYPES))
