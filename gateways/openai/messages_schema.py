"""Wire models of Anthropic's Messages API: `POST /v1/messages` and `POST
/v1/messages/count_tokens` on the OpenAI gateway.

Field names and shapes are those of anthropic-sdk-python 2.10.0 (`anthropic/types/`:
`message_create_params.py`, `message_param.py`, `text_block_param.py`, `image_block_param.py`,
`tool_use_block_param.py`, `tool_result_block_param.py`, `thinking_block_param.py`,
`tool_param.py`, `tool_choice_*_param.py`, `message_count_tokens_params.py`). Only JSON shapes
and types are checked here, plus Anthropic's own ranges that are narrower than the core's
(temperature and top_p in [0, 1], max_tokens >= 1); the core checks the rest.

What is not served is refused with the field named (Anthropic's `invalid_request_error`):
server tools and tool types other than custom ones, documents, search results, `thinking`
enabled (the model reasons or not by itself; `--reasoning-parser` reads it out), `container`,
`mcp_servers`, `output_config`, `context_management`, `diagnostics`, `inference_geo`, `speed`
other than "standard", a top-level `cache_control`, and any field Anthropic does not define.
Fields without a generation effect are accepted and ignored: `metadata`, `service_tier`,
per-block `cache_control`, `citations` of text blocks, `user_profile_id`, `workspace_id`.
A `thinking` or `redacted_thinking` block of an earlier assistant turn is accepted and left out
of the prompt, as chat completions leave out an input message's reasoning.

`parse_messages_request(body)` and `parse_count_tokens_request(body)` are the entry points;
they raise GatewayError (INVALID_ARGUMENT) whose message leads with the offending field in
Anthropic's dotted spelling ("messages.0.content.1.type: ..."), which is also its `param`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import grpc
from pydantic import Field, ValidationError

from gateways.common.chat.schema import Wire
from gateways.common.schema import Int32, Int64, field_path, screen_fields
from gateways.common.status import GatewayError

_INVALID = grpc.StatusCode.INVALID_ARGUMENT

#: Accepted and ignored: no effect on generation here.
IGNORED_FIELDS = frozenset({"metadata", "service_tier", "user_profile_id", "workspace_id"})

#: Fields Anthropic defines that need what this server does not have, with the reason.
UNSUPPORTED_FIELDS = {
    "thinking": "extended thinking cannot be configured; a reasoning model thinks by itself and the gateway's "
    "--reasoning-parser returns its thinking blocks",
    "container": "containers are not supported",
    "mcp_servers": "MCP servers are not supported",
    "output_config": "output configuration (effort, output formats) is not supported",
    "output_format": "output formats are not supported; use a tool with tool_choice to constrain the output",
    "context_management": "context management is not supported",
    "diagnostics": "diagnostics are not supported",
    "inference_geo": "inference regions are not supported",
    "speed": "only the standard speed is supported",
    "cache_control": "automatic prompt caching markers are not supported (the core reuses prefixes by itself)",
}


def _neutral(name: str, value: Any) -> bool:
    """Whether an unsupported field's value asks for nothing, so it is accepted."""
    if value is None:
        return True
    if name == "thinking":
        return isinstance(value, dict) and value.get("type") == "disabled"
    if name == "speed":
        return bool(value == "standard")
    return False


class TextBlock(Wire):
    """`{"type": "text", "text"}` (`cache_control` and `citations` accepted and ignored)."""

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None


class Base64Source(Wire):
    """`{"type": "base64", "media_type", "data"}` of an image."""

    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(Wire):
    """`{"type": "url", "url"}` of an image."""

    type: Literal["url"]
    url: str


class ImageBlock(Wire):
    """`{"type": "image", "source"}`: sent to the core as chat completions send an image (the
    core refuses it unless the model takes images)."""

    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    cache_control: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        """The image as a URL: the URL itself, or a `data:` URL with the base64 content."""
        if isinstance(self.source, UrlSource):
            return self.source.url
        return f"data:{self.source.media_type};base64,{self.source.data}"


class ToolUseBlock(Wire):
    """`{"type": "tool_use", "id", "name", "input"}`: a call an assistant turn made."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(Wire):
    """`{"type": "tool_result", "tool_use_id", "content", "is_error"}`: the answer to a call;
    `content` is text or text blocks (images in a result are refused)."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        """The result as text (blocks joined with newlines); an error result is marked."""
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or ())
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(Wire):
    """`{"type": "thinking", "thinking", "signature"}` of an earlier turn (left out of the prompt)."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(Wire):
    """`{"type": "redacted_thinking", "data"}` of an earlier turn (left out of the prompt)."""

    type: Literal["redacted_thinking"]
    data: str


#: Content block types Anthropic defines that this server does not take.
UNSUPPORTED_BLOCKS = frozenset(
    {
        "document",
        "search_result",
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "container_upload",
        "mcp_tool_use",
        "mcp_tool_result",
    }
)

_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")

Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(Wire):
    """`{"role": "user" | "assistant", "content": str | [blocks]}`."""

    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolParam(Wire):
    """A custom tool: `{"name", "description", "input_schema"}` (`type` "custom" or absent;
    `strict`, `cache_control` and the other per-tool hints accepted and ignored)."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None
    defer_loading: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[Any] | None = None


class ToolChoiceAuto(Wire):
    """`{"type": "auto"}`: the model decides."""

    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Wire):
    """`{"type": "any"}`: the model calls one of the tools."""

    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Wire):
    """`{"type": "tool", "name"}`: the model calls that tool."""

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Wire):
    """`{"type": "none"}`: the model calls no tool."""

    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class CountTokensRequest(Wire):
    """A `POST /v1/messages/count_tokens` body: the prompt part of a Messages request."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """A `POST /v1/messages` body. Unset sampling fields take the engine's defaults, except that
    sampling is on unless temperature is 0 (Anthropic samples, at temperature 1 by default)."""

    max_tokens: Annotated[Int32, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Int32 | None = None
    # Not Anthropic's: vLLM takes it on its Messages route too, for reproducible samples.
    seed: Int64 | None = None


R = TypeVar("R", bound=CountTokensRequest)

#: Fields holding a tagged union, with the tags pydantic puts after them in error locations.
_TAGGED = {"source": ("base64", "url"), "tool_choice": ("auto", "any", "tool", "none")}


def dotted(loc: tuple[int | str, ...] | list[int | str]) -> str:
    """A field location in Anthropic's spelling: `("messages", 0, "content")` ->
    "messages.0.content" (union and block-type tags left out)."""
    loc = [part for i, part in enumerate(loc) if not (i and part in _TAGGED.get(str(loc[i - 1]), ()))]
    path = field_path(loc, tags=_BLOCK_TYPES)
    return path.replace("[", ".").replace("]", "")


def to_gateway_error(e: ValidationError) -> GatewayError:
    """The most specific pydantic error as a GatewayError (the deepest location explains a
    union's failure best), worded as Anthropic words its own: "max_tokens: Field required"."""
    errors = e.errors(include_url=False)
    param = max((dotted(err["loc"]) for err in errors), key=len)
    found = [err for err in errors if dotted(err["loc"]) == param]
    reasons = " or ".join(dict.fromkeys(str(err["msg"]).removeprefix("Value error, ") for err in found))
    return GatewayError.invalid(f"{param}: {reasons}", param=param)


def _parse(model: type[R], body: Any) -> R:
    checked = screen_fields(
        body,
        model.model_fields,
        ignored=IGNORED_FIELDS,
        unsupported=UNSUPPORTED_FIELDS,
        neutral=_neutral,
        unknown_message=lambda name: f"{name}: Extra inputs are not permitted",
        unsupported_message=lambda name, why: f"{name}: not supported by this server: {why}.",
    )
    _refuse_unsupported_blocks(checked)
    try:
        req = model.model_validate(checked)
    except ValidationError as e:
        raise to_gateway_error(e) from None
    _check(req)
    return req


def _refuse_unsupported_blocks(body: dict[str, Any]) -> None:
    """Name a block type Anthropic defines but this server does not take (pydantic would call
    it an unknown tag), and a server tool (a tool with a `type` other than "custom")."""
    messages = body.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        content = m.get("content") if isinstance(m, dict) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in UNSUPPORTED_BLOCKS:
                raise GatewayError(
                    _INVALID,
                    f"messages.{i}.content.{j}: '{kind}' blocks are not supported by this server.",
                    param=f"messages.{i}.content.{j}.type",
                    reason="UNSUPPORTED_PARAMETER",
                )
    tools = body.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            raise GatewayError(
                _INVALID,
                f"tools.{i}: server tools ('{kind}') are not supported by this server; only custom tools are.",
                param=f"tools.{i}.type",
                reason="UNSUPPORTED_PARAMETER",
            )


def _check(req: CountTokensRequest) -> None:
    """Rules across fields: tool_result blocks only in user turns, tool_use blocks only in
    assistant turns; a named tool_choice names a tool; tool names are unique."""
    for i, m in enumerate(req.messages):
        for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
            wrong = (isinstance(block, ToolResultBlock) and m.role != "user") or (
                isinstance(block, ToolUseBlock | ThinkingBlock | RedactedThinkingBlock) and m.role != "assistant"
            )
            if wrong:
                raise GatewayError.invalid(
                    f"messages.{i}.content.{j}: '{block.type}' blocks are not allowed in '{m.role}' messages.",
                    param=f"messages.{i}.content.{j}.type",
                )
    names = [t.name for t in req.tools or ()]
    if len(set(names)) != len(names):
        raise GatewayError.invalid("tools: Tool names must be unique.", param="tools")
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceTool) and choice.name not in names:
        raise GatewayError.invalid(
            f"tool_choice.name: no tool named '{choice.name}' is in tools.", param="tool_choice.name"
        )
    if isinstance(choice, ToolChoiceAny | ToolChoiceTool) and not names:
        raise GatewayError.invalid("tool_choice: a tool must be called, but no tools are given.", param="tool_choice")


def parse_messages_request(body: Any) -> MessagesRequest:
    """Check a parsed JSON body of `POST /v1/messages`.

    Raises:
        GatewayError: INVALID_ARGUMENT, `param` naming the field, `reason` UNKNOWN_PARAMETER,
            UNSUPPORTED_PARAMETER or INVALID_ARGUMENT.
    """
    return _parse(MessagesRequest, body)


def parse_count_tokens_request(body: Any) -> CountTokensRequest:
    """Check a parsed JSON body of `POST /v1/messages/count_tokens` (as parse_messages_request)."""
    return _parse(CountTokensRequest, body)
