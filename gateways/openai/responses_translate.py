"""OpenAI Responses <-> chat completions <-> the core's Generate contract, as pure functions and
one per-stream renderer (no I/O, no clock, no random ids: they are passed in).

Request: `to_chat_request` maps a checked ResponsesRequest, with the conversation of the
response it continues, onto a ChatCompletionRequest; the chat translation
(gateways.common.chat.translate) then builds the GenerateRequest, so the chat template, tools,
tool_choice guides and `text.format` guides work as on chat completions. Items become chat
messages: `instructions` a leading system message, `developer` the system role, a
`function_call` an assistant message's tool call (consecutive calls, and the assistant text
before them, are one message), a `function_call_output` a "tool" message; a `reasoning` item is
left out (gateways.openai.responses_schema.ReasoningItem).

Response: the chat translation renders the core's messages as a `chat.completion` (or its
chunks), its Hermes tool-call parser (gateways.common.chat.tools) splitting text and calls, and
`response_object` / `ResponseEvents` render that as a Responses `response` object (openai-python
3.52.0 `types/responses/response.py`) or its server-sent events
(`types/responses/response_stream_event.py`). With the gateway's `--reasoning-parser`, the
model's reasoning is a `reasoning` output item before the others (`response_reasoning_item.py`:
`content` of `reasoning_text` parts, `summary` empty) and streams as
`response.reasoning_text.delta` / `.done` events inside its content part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from trellis.generate.v1 import generate_pb2 as pb

from gateways.common import framing as wire
from gateways.common.chat import schema as chat
from gateways.common.fields import Field, FieldTable, by_rule, client_error
from gateways.common.guided import JsonSchemaFormat, ResponseFormatJsonObject, ResponseFormatJsonSchema
from gateways.common.status import GatewayError
from gateways.openai.responses_schema import (
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputText,
    MessageItem,
    OutputText,
    ReasoningItem,
    Refusal,
    ResponsesRequest,
    ToolChoiceFunction,
)

Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem

#: The Responses API's word per core finish reason: a spent budget (max_output_tokens, a time
#: limit) leaves the response "incomplete"; a cancelled or failed sequence has no word, so it
#: fails the response (gateways.common.streaming.finish_word).
FINISH_WORDS: dict[int, str] = {
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_TIME_LIMIT: "length",
    pb.FINISH_REASON_EOS: "stop",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop",
}

#: The GenerateRequest paths the core may name in an error, in the Responses API's names.
NAMES = FieldTable(
    (
        *by_rule("input", "messages", "text", "token_ids"),
        Field("model", "model", None),
        *by_rule("priority", "priority"),
        *by_rule("temperature", "sampling.temperature", "sampling.do_sample"),
        *by_rule("top_p", "sampling.top_p"),
        *by_rule("max_output_tokens", "stopping.max_new_tokens"),
        *by_rule("tools", "tools", "guided_decoding.json_schema"),
        *by_rule("text.format", "guided_decoding.json_object", "guided_decoding.json_schema"),
    )
)


def client_names(req: ResponsesRequest | None) -> dict[str, str]:
    """The Responses API's name for each GenerateRequest path (see NAMES); `text.format` names
    the guide when the request has one that is not plain text and no tool_choice forces a call
    (whose guide wins: gateways.common.chat.translate.to_generate_request)."""
    given: list[str] = []
    if req is not None:
        given = [name for name, value in req if value is not None]
        forced = req.tools and (req.tool_choice == "required" or isinstance(req.tool_choice, ToolChoiceFunction))
        if req.format is not None and req.format.type != "text" and not forced:
            given.append("format")
    return NAMES.names(given)


def in_client_terms(err: GatewayError, req: ResponsesRequest | None) -> GatewayError:
    """A core error in the Responses API's names (a path below `messages` is `input`, since
    items and chat messages do not line up one to one)."""
    if err.param is not None and err.param.startswith("messages"):
        return GatewayError(err.code, err.message, param="input", reason=err.reason)
    return client_error(err, client_names(req), prefix=False)


# ------------------------------------------------------------------------------- request


def to_chat_request(req: ResponsesRequest, history: Sequence[Item] = ()) -> chat.ChatCompletionRequest:
    """The chat completion request that asks the core for this response. A tool_choice that
    forces a call takes the output's guide; `text.format` guides it otherwise.

    Args:
        req: a request checked by `parse_responses_request`.
        history: the items of the conversation this response continues (the stored input and
            output of `previous_response_id`'s chain), before `req`'s input.
    """
    messages: list[chat.Message] = []
    if req.instructions is not None:
        messages.append(chat.Message(role="system", content=req.instructions))
    messages.extend(to_messages([*history, *req.items()]))
    fmt = req.format
    response_format: ResponseFormatJsonObject | ResponseFormatJsonSchema | None = None
    if isinstance(fmt, FormatJsonObject):
        response_format = ResponseFormatJsonObject(type="json_object")
    elif isinstance(fmt, FormatJsonSchema):
        spec = JsonSchemaFormat(name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict)
        response_format = ResponseFormatJsonSchema(type="json_schema", json_schema=spec)
    tools = None
    if req.tools:
        tools = [
            chat.ToolDefinition(
                type="function",
                function=chat.FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in req.tools
        ]
    choice: Any = req.tool_choice
    if isinstance(choice, ToolChoiceFunction):
        choice = chat.NamedToolChoice(type="function", function=chat.FunctionName(name=choice.name))
    return chat.ChatCompletionRequest(
        messages=messages,
        model=req.model,
        temperature=req.temperature,
        top_p=req.top_p,
        max_completion_tokens=req.max_output_tokens,
        stream=req.stream,
        user=req.user,
        response_format=response_format,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        priority=req.priority,
    )


def to_messages(items: Sequence[Item]) -> list[chat.Message]:
    """Chat messages for Responses input items (module docstring)."""
    out: list[chat.Message] = []
    calls: list[chat.ToolCallWire] = []
    text: str | list[chat.ContentPart] | None = None  # the assistant text the calls follow

    def flush() -> None:
        nonlocal calls, text
        if calls:
            out.append(chat.Message(role="assistant", content=text, tool_calls=calls))
        elif text is not None:
            out.append(chat.Message(role="assistant", content=text))
        calls, text = [], None

    for item in items:
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, FunctionCallItem):
            function = chat.CalledFunction(name=item.name, arguments=item.arguments)
            calls.append(chat.ToolCallWire(id=item.call_id, type="function", function=function))
            continue
        if isinstance(item, MessageItem) and item.role == "assistant" and not calls:
            flush()
            text = _content(item.content)
            continue
        flush()
        if isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            out.append(chat.Message(role="tool", tool_call_id=item.call_id, content=output))
        else:
            out.append(chat.Message(role=item.role, content=_content(item.content)))
    flush()
    return out


def _content(content: str | Sequence[InputText | InputImage | OutputText | Refusal]) -> str | list[chat.ContentPart]:
    if isinstance(content, str):
        return content
    parts: list[chat.ContentPart] = []
    for part in content:
        if isinstance(part, InputImage):
            parts.append(chat.ImagePart(type="image_url", image_url=_image(part)))
        elif isinstance(part, Refusal):
            parts.append(chat.TextPart(type="text", text=part.refusal))
        else:
            parts.append(chat.TextPart(type="text", text=part.text))
    return parts


def _image(part: InputImage) -> chat.ImageUrl:
    detail = None if part.detail == "original" else part.detail
    return chat.ImageUrl(url=part.image_url or "", detail=detail)


# ------------------------------------------------------------------------------ response


@dataclass(frozen=True, slots=True)
class Ids:
    """The ids of one response: `resp_<key>`, and its output items' `msg_<key>_<n>`,
    `fc_<key>_<n>` / `rs_<key>_<n>` (n: the item's output index)."""

    key: str

    @property
    def response(self) -> str:
        """The response id."""
        return f"resp_{self.key}"

    def message(self, index: int) -> str:
        """The id of the message item at output index `index`."""
        return f"msg_{self.key}_{index}"

    def call(self, index: int) -> str:
        """The id of the function call item at output index `index`."""
        return f"fc_{self.key}_{index}"

    def reasoning(self, index: int) -> str:
        """The id of the reasoning item at output index `index`."""
        return f"rs_{self.key}_{index}"


def skeleton(req: ResponsesRequest, *, ids: Ids, created_at: int, model: str) -> dict[str, Any]:
    """The `response` object of a request before it has output: status "in_progress", the
    request's settings echoed as OpenAI echoes them (`text.format` `{"type": "text"}`,
    `tool_choice` "auto", `parallel_tool_calls` true, `truncation` "disabled" and empty
    metadata when unset; temperature and top_p null when unset, since the engine's defaults
    apply)."""
    fmt = req.format
    tool_choice: Any = req.tool_choice or "auto"
    if isinstance(tool_choice, ToolChoiceFunction):
        tool_choice = tool_choice.model_dump()
    return {
        "id": ids.response,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.stored,
        "temperature": req.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "tool_choice": tool_choice,
        "tools": [t.model_dump() for t in req.tools or ()],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": req.user,
        "metadata": dict(req.metadata or {}),
    }


def usage_object(usage: pb.Usage) -> dict[str, Any]:
    """`{"input_tokens", "input_tokens_details": {"cached_tokens", "cache_write_tokens": 0},
    "output_tokens", "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens"}`
    (`ResponseUsage`; the core reports cache hits, not cache writes)."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def finished(response: dict[str, Any], finish: str | None, usage: pb.Usage) -> dict[str, Any]:
    """`response` with its end: status "completed", or "incomplete" with `incomplete_details`
    `{"reason": "max_output_tokens"}` when the budget ran out; usage set."""
    incomplete = finish == "length"
    response["status"] = "incomplete" if incomplete else "completed"
    response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
    response["usage"] = usage_object(usage)
    return response


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An output `message` item with one `output_text` part (`ResponseOutputMessage`)."""
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [text_part(text)],
    }


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A `reasoning` output item with one `reasoning_text` part and no summary
    (`ResponseReasoningItem`)."""
    return {
        "id": item_id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [reasoning_part(text)],
    }


def reasoning_part(text: str) -> dict[str, Any]:
    """A `reasoning_text` content part (`response_reasoning_item.Content`, and the content
    part events' `PartReasoningText`)."""
    return {"type": "reasoning_text", "text": text}


def text_part(text: str) -> dict[str, Any]:
    """An `output_text` content part (`ResponseOutputText`)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A `function_call` output item (`ResponseFunctionToolCall`)."""
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def response_object(
    completion: Mapping[str, Any], response: dict[str, Any], ids: Ids, usage: pb.Usage
) -> dict[str, Any]:
    """The finished `response` for a whole answer, from the chat translation's `chat.completion`
    (`to_completion`, one choice): a reasoning item for the reasoning (with a reasoning parser,
    when there is some), a message item for the text (when there is text or no call), then a
    function_call item per tool call. When the budget ran out, the last item is the one cut
    short ("incomplete"), as in a stream.

    Raises:
        GatewayError: INTERNAL, the completion has no choice.
    """
    if not completion["choices"]:
        raise GatewayError(grpc.StatusCode.INTERNAL, "The model server returned no output.")
    choice = completion["choices"][0]
    finish = choice["finish_reason"]
    status = "incomplete" if finish == "length" else "completed"
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning"):
        output.append(reasoning_item(ids.reasoning(0), message["reasoning"], "completed"))
    content = message.get("content")
    calls = message.get("tool_calls") or []
    if content or not calls:
        output.append(message_item(ids.message(len(output)), content or "", "completed"))
    for call in calls:
        function = call["function"]
        output.append(
            call_item(ids.call(len(output)), call["id"], function["name"], function["arguments"], "completed")
        )
    output[-1]["status"] = status
    response["output"] = output
    return finished(response, finish, usage)


def sse(event: Mapping[str, Any]) -> bytes:
    """One Responses event: `event: <type>` and `data: <json>` (the SDK reads `data`, and
    clients dispatching on the event name read `event`)."""
    return wire.named_sse_event(event["type"], event)


def error_code(status: int) -> str:
    """The `response.error.code` of a failure (`ResponseError`): "rate_limit_exceeded" for a
    429, else "server_error"."""
    return "rate_limit_exceeded" if status == 429 else "server_error"


@dataclass
class ResponseEvents:
    """The server-sent events of one streamed response (module docstring), in OpenAI's order:
    `response.created`, `response.in_progress`, then per output item `output_item.added`, its
    content (`content_part.added`, `output_text.delta`..., `output_text.done`,
    `content_part.done`; for a reasoning item the same with `reasoning_text.delta`...,
    `reasoning_text.done`; or `function_call_arguments.delta`..., `.done`) and
    `output_item.done`, and last `response.completed` or `response.incomplete`; a failure
    after the start ends it with `error` then `response.failed`. Every event carries
    `sequence_number`, from 0.

    Attributes:
        response: the `response` object, its output growing as items finish.
        ids: the response's ids.
    """

    response: dict[str, Any]
    ids: Ids
    sequence: int = 0
    started: bool = False
    finish: str | None = None
    _open: dict[str, Any] | None = None  # the output item being streamed
    _parts: list[bytes] = field(default_factory=list)
    _text_delta: wire.Template | None = None  # the open message's output_text.delta event

    def _emit(self, event: dict[str, Any]) -> None:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        self._parts.append(sse(event))

    def _flush(self) -> bytes:
        data = b"".join(self._parts)
        self._parts.clear()
        return data

    def _start(self) -> None:
        if not self.started:
            self.started = True
            self._emit({"type": "response.created", "response": dict(self.response)})
            self._emit({"type": "response.in_progress", "response": dict(self.response)})

    def begin(self) -> bytes:
        """The opening events (once)."""
        self._start()
        return self._flush()

    def chunk(self, chunk: Mapping[str, Any]) -> bytes:
        """The events of one `chat.completion.chunk` of choice 0 (content and tool-call deltas,
        finish reason)."""
        self._start()
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning"):
                self._reasoning(delta["reasoning"])
            if delta.get("content"):
                self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                self._call(call)
            if choice["finish_reason"] is not None:
                self.finish = choice["finish_reason"]
        return self._flush()

    def text(self, text: str) -> bytes:
        """The events of a plain text delta."""
        self._start()
        if text:
            self._text(text)
        return self._flush()

    def _text(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "message":
            self._close("completed")
            item = self._open_message()
        part = item["content"][0]
        part["text"] += text
        template = self._text_delta
        if template is None:
            event = {
                "type": "response.output_text.delta",
                "item_id": item["id"],
                "output_index": len(self.response["output"]),
                "content_index": 0,
            }
            template = self._text_delta = wire.Template(
                lambda delta, number: sse({**event, "delta": delta, "logprobs": [], "sequence_number": number}), 2
            )
        self._parts.append(template.fill(text, self.sequence))
        self.sequence += 1

    def _reasoning(self, text: str) -> None:
        item = self._open
        if item is None or item["type"] != "reasoning":
            self._close("completed")
            index = len(self.response["output"])
            item = reasoning_item(self.ids.reasoning(index), "", "in_progress")
            item["content"] = []
            self._emit({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
            part = reasoning_part("")
            event = {"item_id": item["id"], "output_index": index, "content_index": 0, "part": dict(part)}
            self._emit({"type": "response.content_part.added", **event})
            item["content"] = [part]
            self._open = item
        item["content"][0]["text"] += text
        self._emit(
            {
                "type": "response.reasoning_text.delta",
                "item_id": item["id"],
                "output_index": len(self.response["output"]),
                "content_index": 0,
                "delta": text,
            }
        )

    def _open_message(self) -> dict[str, Any]:
        """Start a message item with an empty output_text part."""
        self._text_delta = None
        index = len(self.response["output"])
        item = message_item(self.ids.message(index), "", "in_progress")
        item["content"] = []
        self._emit({"type": "response.output_item.added", "output_index": index, "item": dict(item)})
        part = text_part("")
        event = {"item_id": item["id"], "output_index": index, "content_index": 0, "part": dict(part)}
        self._emit({"type": "response.content_part.added", **event})
        item["content"] = [part]
        self._open = item
        return item

    def _call(self, call: Mapping[str, Any]) -> None:
        function = call.get("function") or {}
        arguments = function.get("arguments") or ""
        if "id" in call:  # a new call
            self._close("completed")
            index = len(self.response["output"])
            self._open = call_item(self.ids.call(index), call["id"], function.get("name") or "", "", "in_progress")
            self._emit({"type": "response.output_item.added", "output_index": index, "item": dict(self._open)})
        item = self._open
        if item is None or item["type"] != "function_call" or not arguments:
            return
        item["arguments"] += arguments
        self._emit(
            {
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": len(self.response["output"]),
                "delta": arguments,
            }
        )

    def _close(self, status: str) -> None:
        """End the open item: its done events, then it joins the output."""
        item = self._open
        if item is None:
            return
        self._open = None
        index = len(self.response["output"])
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            self._emit({"type": "response.output_text.done", **common, "text": part["text"], "logprobs": []})
            self._emit({"type": "response.content_part.done", **common, "part": part})
        elif item["type"] == "reasoning":
            part = item["content"][0]
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            self._emit({"type": "response.reasoning_text.done", **common, "text": part["text"]})
            self._emit({"type": "response.content_part.done", **common, "part": part})
        else:
            self._emit(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "name": item["name"],
                    "arguments": item["arguments"],
                }
            )
        self._emit({"type": "response.output_item.done", "output_index": index, "item": item})
        self.response["output"].append(item)

    def complete(self, usage: pb.Usage) -> dict[str, Any]:
        """Close the output and finish the response object (events wait for `end`); an answer
        with neither text nor a call gets an empty message, as a non-streamed one does. The
        last item is "incomplete" when the budget ran out."""
        self._start()
        status = "incomplete" if self.finish == "length" else "completed"
        items = [*self.response["output"], *([self._open] if self._open else [])]
        if all(item["type"] == "reasoning" for item in items):
            self._close("completed")
            self._open_message()
        self._close(status)
        return finished(self.response, self.finish, usage)

    def end(self) -> bytes:
        """The last events of a finished response (after `complete`)."""
        kind = "response.incomplete" if self.response["status"] == "incomplete" else "response.completed"
        self._emit({"type": kind, "response": self.response})
        return self._flush()

    def fail(self, err: GatewayError, status: int) -> bytes:
        """The events of a failure after the start: `error` (the error object's code, message
        and param), then `response.failed` with `error` set."""
        self._start()
        code = err.reason.lower() if err.reason else None
        self._emit({"type": "error", "code": code, "message": err.message, "param": err.param})
        self._open = None
        self.response["status"] = "failed"
        self.response["error"] = {"code": error_code(status), "message": err.message}
        self._emit({"type": "response.failed", "response": self.response})
        return self._flush()


def input_item_records(items: Sequence[Item], ids: Ids) -> list[dict[str, Any]]:
    """The request's input items as `input_items` lists them (`ResponseItem`s): each with an id
    (its own, or `<kind>_<key>_in<n>`), messages with their content as parts (a string is one
    `input_text`, or `output_text` for an assistant) and status "completed"."""
    out: list[dict[str, Any]] = []
    for n, item in enumerate(items):
        record = item.model_dump(exclude_none=True)
        if isinstance(item, MessageItem):
            record["id"] = item.id or f"msg_{ids.key}_in{n}"
            record["type"] = "message"
            if isinstance(item.content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                part: dict[str, Any] = {"type": kind, "text": item.content}
                if kind == "output_text":
                    part["annotations"] = []
                record["content"] = [part]
        elif isinstance(item, FunctionCallItem):
            record["id"] = item.id or f"fc_{ids.key}_in{n}"
        elif isinstance(item, ReasoningItem):
            record["id"] = item.id or f"rs_{ids.key}_in{n}"
        else:
            record["id"] = item.id or f"fco_{ids.key}_in{n}"
        record.setdefault("status", "completed")
        out.append(record)
    return out
