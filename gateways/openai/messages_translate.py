"""Anthropic Messages <-> the core's Generate contract, as pure functions, through chat
completions: a Messages request becomes the chat completions request it means
(`to_chat_request`), so the prompt, tools, guides and sampling follow one translation
(gateways.common.chat.translate); the core's messages are read by the chat renderers, whose
reasoning and tool-call parsers (gateways.common.reasoning, gateways.common.chat.tools) split
the text; and the chat records they give are rendered once more, in Anthropic's shapes
(`to_message`, `EventStream`).

Shapes are anthropic-sdk-python 2.10.0's (`anthropic/types/`): `message.py`, `usage.py`,
`text_block.py`, `tool_use_block.py`, `thinking_block.py`, `raw_message_*_event.py`,
`raw_content_block_*_event.py`, `text_delta.py`, `input_json_delta.py`, `thinking_delta.py`,
`signature_delta.py`.

Request rules: `system` becomes the first, system message (text blocks joined with newlines);
a user turn's text and image blocks become one user message, and each `tool_result` block a
"tool" message answering its `tool_use_id` (in block order); an assistant turn's text blocks
become its content and its `tool_use` blocks its tool calls (`input` as JSON text); thinking
blocks are left out. `tool_choice` auto/any/tool/none is chat's "auto"/"required"/named/"none",
`disable_parallel_tool_use` is `parallel_tool_calls: false`; `stop_sequences` is `stop`;
`top_k` (which chat completions lack) is set on the GenerateRequest directly.

Response rules: finish reasons are `FINISH_REASONS` (EOS "end_turn", a stop string
"stop_sequence" with the string matched, max_tokens or a time limit "max_tokens"); a message
that called a tool and ended by itself is "tool_use". `usage.input_tokens` is the prompt's
tokens that were not read from the prefix cache, `cache_read_input_tokens` those that were
(Usage.cached_tokens), as Anthropic counts them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common import fields
from gateways.common import framing as wire
from gateways.common.chat import schema as chat
from gateways.common.chat import translate as chat_translate
from gateways.common.status import GatewayError
from gateways.openai import messages_schema as ms

#: Anthropic's stop_reason per core finish reason; "tool_use" replaces the first two when the
#: message called a tool (gateways.common.chat.tools). CANCELLED and ERROR have no word: such a
#: message is an error (gateways.common.streaming.finish_word).
FINISH_REASONS: dict[int, str] = {
    pb.FINISH_REASON_EOS: "end_turn",
    pb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence",
    pb.FINISH_REASON_LENGTH: "max_tokens",
    pb.FINISH_REASON_TIME_LIMIT: "max_tokens",
}

#: The chat renderers' finish word of a message that called a tool.
_TOOL_CALLS = "tool_calls"

#: GenerateRequest paths the core may name in an error -> Anthropic's field.
CLIENT_NAMES = {
    "model": "model",
    "messages": "messages",
    "text": "messages",
    "token_ids": "messages",
    "tools": "tools",
    "guided_decoding.json_schema": "tools",
    "stopping.max_new_tokens": "max_tokens",
    "stopping.stop": "stop_sequences",
    "sampling.temperature": "temperature",
    "sampling.do_sample": "temperature",
    "sampling.top_p": "top_p",
    "sampling.top_k": "top_k",
    "sampling.seed": "seed",
}


def client_error(err: GatewayError) -> GatewayError:
    """`err` in Anthropic's terms: a GenerateRequest path the core named becomes the client's
    field (CLIENT_NAMES; "messages[0].content" -> "messages.0.content"), leading the message
    as Anthropic's errors do ("max_tokens: ...")."""
    param = err.param
    if param is None:
        return err
    name = CLIENT_NAMES.get(param)
    if name is None and param.startswith("messages["):
        name = param.replace("[", ".").replace("]", "")
    return fields.client_error(err, {param: name}) if name is not None else err


def _system(system: str | list[ms.TextBlock] | None) -> list[chat.Message]:
    if not system:
        return []
    text = system if isinstance(system, str) else "\n".join(b.text for b in system)
    return [chat.Message(role="system", content=text)]


def _user(m: ms.MessageParam) -> list[chat.Message]:
    if isinstance(m.content, str):
        return [chat.Message(role="user", content=m.content)]
    out: list[chat.Message] = []
    parts: list[chat.TextPart | chat.ImagePart] = []

    def flush() -> None:
        if parts:
            out.append(chat.Message(role="user", content=list(parts)))
            parts.clear()

    for block in m.content:
        if isinstance(block, ms.ToolResultBlock):
            flush()
            out.append(chat.Message(role="tool", tool_call_id=block.tool_use_id, content=block.text))
        elif isinstance(block, ms.TextBlock):
            parts.append(chat.TextPart(type="text", text=block.text))
        elif isinstance(block, ms.ImageBlock):
            parts.append(chat.ImagePart(type="image_url", image_url=chat.ImageUrl(url=block.url)))
    flush()
    return out


def _assistant(m: ms.MessageParam) -> chat.Message:
    if isinstance(m.content, str):
        return chat.Message(role="assistant", content=m.content)
    text = "".join(b.text for b in m.content if isinstance(b, ms.TextBlock))
    calls = [
        chat.ToolCallWire(
            id=b.id,
            type="function",
            function=chat.CalledFunction(name=b.name, arguments=json.dumps(b.input, ensure_ascii=False)),
        )
        for b in m.content
        if isinstance(b, ms.ToolUseBlock)
    ]
    return chat.Message(role="assistant", content=text or None, tool_calls=calls or None)


def chat_messages(req: ms.CountTokensRequest) -> list[chat.Message]:
    """The chat messages of a Messages request (module docstring, request rules)."""
    out = _system(req.system)
    for m in req.messages:
        if m.role == "user":
            out.extend(_user(m))
        else:
            out.append(_assistant(m))
    return out


def _tool_choice(choice: ms.ToolChoice | None) -> tuple[str | chat.NamedToolChoice | None, bool | None]:
    """Chat's tool_choice and parallel_tool_calls for Anthropic's tool_choice."""
    if choice is None:
        return None, None
    if isinstance(choice, ms.ToolChoiceNone):
        return "none", None
    parallel = False if choice.disable_parallel_tool_use else None
    if isinstance(choice, ms.ToolChoiceTool):
        return chat.NamedToolChoice(type="function", function=chat.FunctionName(name=choice.name)), parallel
    return ("required" if isinstance(choice, ms.ToolChoiceAny) else "auto"), parallel


def to_chat_request(req: ms.CountTokensRequest) -> chat.ChatCompletionRequest:
    """The chat completions request a Messages request means (module docstring).

    The result is built without chat's own checks (its limits are OpenAI's, e.g. at most four
    stop strings): `req` was checked against Anthropic's schema.

    Raises:
        GatewayError: the conversation ends with an assistant turn (a prefill, which the chat
            template cannot continue).
    """
    if req.messages and req.messages[-1].role == "assistant":
        raise GatewayError.invalid(
            "messages: a final assistant message (a prefill to continue) is not supported by this server; end "
            "with a user message.",
            param="messages",
        )
    tools = [
        chat.ToolDefinition(
            type="function",
            function=chat.FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema),
        )
        for t in req.tools or ()
    ]
    choice, parallel = _tool_choice(req.tool_choice)
    values: dict[str, Any] = {
        "messages": chat_messages(req),
        "model": req.model,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
    }
    if isinstance(req, ms.MessagesRequest):
        values.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences or None,
            stream=req.stream,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
        )
    fields = chat.ChatCompletionRequest.model_fields
    return chat.ChatCompletionRequest.model_construct(**{k: v for k, v in values.items() if k in fields})


def to_generate_request(req: ms.MessagesRequest, *, request_id: str) -> spb.GenerateRequest:
    """The GenerateRequest of a Messages request: chat's, plus `top_k`.

    Raises:
        GatewayError: see `to_chat_request`.
    """
    out = chat_translate.to_generate_request(to_chat_request(req), request_id=request_id)
    if req.top_k is not None:
        out.sampling.top_k = req.top_k
    return out


def tokenize_request(req: ms.CountTokensRequest) -> spb.TokenizeRequest:
    """The TokenizeRequest counting a request's input tokens: the chat Generate would render.

    Raises:
        GatewayError: see `to_chat_request`.
    """
    generate = chat_translate.to_generate_request(to_chat_request(req), request_id="")
    return spb.TokenizeRequest(messages=generate.messages)


def state_for(req: ms.MessagesRequest, *, message_id: str, model: str, reasoning: str) -> chat_translate.StreamState:
    """The chat renderers' state for a Messages request (Anthropic's finish words; the
    gateway's reasoning parser name, "" for none)."""
    return chat_translate.state_for(
        to_chat_request(req),
        completion_id=message_id,
        created=0,
        model=model,
        finish_words=FINISH_REASONS,
        reasoning=reasoning,
    )


def usage(u: pb.Usage | None) -> dict[str, int]:
    """`{"input_tokens", "output_tokens", "cache_read_input_tokens",
    "cache_creation_input_tokens"}` (module docstring).

    Raises:
        GatewayError: no usage: the final message did not come.
    """
    chat_translate.usage_dict(u)  # raises when the final message is missing
    assert u is not None
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(word: str | None) -> str | None:
    """Anthropic's stop_reason for a chat renderer's finish word."""
    return "tool_use" if word == _TOOL_CALLS else word


def matched_stop(messages: Iterable[spb.GenerateResponse]) -> str | None:
    """The stop string that ended the output, if one did."""
    for msg in messages:
        for out in msg.outputs:
            if out.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and out.stop_sequence:
                return out.stop_sequence
    return None


def tool_use_id(call_id: str) -> str:
    """A tool_use block's id for a call id of the chat renderers ("call_..." -> "toolu_...")."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the `input` object; arguments that are not a JSON object (cut short
    by max_tokens) give {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def message_shell(message_id: str, model: str) -> dict[str, Any]:
    """A `message` object without content, stop reason or usage."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }


def to_message(
    messages: list[spb.GenerateResponse], state: chat_translate.StreamState, *, message_id: str
) -> dict[str, Any]:
    """The `message` object of a whole Generate stream (non-streaming response): content blocks
    thinking (with a reasoning parser), text, then tool_use; stop_reason and stop_sequence;
    usage.

    Raises:
        GatewayError: a finish reason without a word (CANCELLED, ERROR), or no final message.
    """
    completion = chat_translate.to_completion(messages, state)
    choice = completion["choices"][0]
    reply = choice["message"]
    content: list[dict[str, Any]] = []
    if reply.get("reasoning"):
        content.append({"type": "thinking", "thinking": reply["reasoning"], "signature": ""})
    if reply["content"]:
        content.append({"type": "text", "text": reply["content"]})
    for call in reply.get("tool_calls") or ():
        content.append(
            {
                "type": "tool_use",
                "id": tool_use_id(call["id"]),
                "name": call["function"]["name"],
                "input": tool_input(call["function"]["arguments"]),
            }
        )
    reason = stop_reason(choice["finish_reason"])
    out = message_shell(message_id, state.model)
    out.update(
        content=content,
        stop_reason=reason,
        stop_sequence=matched_stop(messages) if reason == "stop_sequence" else None,
        usage=usage(state.usage),
    )
    return out


def event(name: str, data: dict[str, Any]) -> bytes:
    """One SSE event with Anthropic's event name: `event: <name>` then `data: <json>`."""
    return wire.named_sse_event(name, data)


@dataclass
class EventStream:
    """Anthropic's stream events for one Messages request, from the chat renderers' chunks.

    `start()` gives message_start and a ping; `message(msg)` the events of one Generate
    message; `end()` closes the open block and gives message_delta (stop_reason,
    stop_sequence, usage) and message_stop. A block is opened by its first delta
    (content_block_start, then content_block_delta: thinking_delta, text_delta or
    input_json_delta) and closed (content_block_stop) when a block of another kind or another
    tool call starts, or at the end. A thinking block's last delta is a signature_delta, as
    Anthropic sends it; its signature is empty (nothing is signed here).

    Attributes:
        state: the chat renderers' state (state_for).
        message_id: "msg_<unique>".
    """

    state: chat_translate.StreamState
    message_id: str
    index: int = -1
    kind: str | None = None
    call_blocks: dict[int, int] = field(default_factory=dict)
    finish: str | None = None
    stop_sequence: str | None = None
    _text_delta: wire.Template | None = None  # the open text block's text_delta event

    def start(self) -> bytes:
        """message_start (usage unknown yet: zeros; message_delta carries it) and a ping."""
        shell = message_shell(self.message_id, self.state.model)
        shell["usage"] = {"input_tokens": 0, "output_tokens": 0}
        return event("message_start", {"type": "message_start", "message": shell}) + event("ping", {"type": "ping"})

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.kind = kind
        out.append(
            event("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )
        return out

    def _close(self) -> list[bytes]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(self._delta(self.index, {"type": "signature_delta", "signature": ""}))
        self.kind = None
        out.append(event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        return out

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def message(self, msg: spb.GenerateResponse) -> bytes:
        """The events of one Generate message.

        Raises:
            GatewayError: a finish reason without a word (CANCELLED, ERROR).
        """
        out: list[bytes] = []
        for chunk in chat_translate.to_chunks(msg, self.state):
            for choice in chunk["choices"]:
                out.extend(self._choice(choice))
        for seq in msg.outputs:
            if seq.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and seq.stop_sequence:
                self.stop_sequence = seq.stop_sequence
        return b"".join(out)

    def _choice(self, choice: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        delta = choice["delta"]
        if reasoning := delta.get("reasoning"):
            if self.kind != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta(self.index, {"type": "thinking_delta", "thinking": reasoning}))
        if text := delta.get("content"):
            out += self._text(text)
        for call in delta.get("tool_calls") or ():
            function = call["function"]
            if "id" in call:
                block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"], "input": {}}
                out += self._open("tool_use", block)
                self.call_blocks[call["index"]] = self.index
            if function["arguments"]:
                index = self.call_blocks[call["index"]]
                out.append(self._delta(index, {"type": "input_json_delta", "partial_json": function["arguments"]}))
        if choice["finish_reason"] is not None:
            self.finish = choice["finish_reason"]
        return out

    def text(self, text: str) -> bytes:
        """The events of a plain decode step's text (core_call.Step; the route asks for steps
        when chat_translate.plain_deltas holds: no tool calls to parse): what `message` gives
        for a message with that text alone. Reasoning is split out of it until the reasoning
        section is over; then the text goes straight into the open text block."""
        if not self.state.plain_text(0):
            chunk = chat_translate.step_chunk(self.state, text)
            return b"" if chunk is None else b"".join(self._choice(chunk["choices"][0]))
        return b"".join(self._text(text)) if text else b""

    def _text(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.kind != "text" or self._text_delta is None:
            out += self._open("text", {"type": "text", "text": ""})
            index = self.index
            self._text_delta = wire.Template(lambda value: self._delta(index, {"type": "text_delta", "text": value}))
        out.append(self._text_delta.fill_text(text))
        return out

    def end(self) -> bytes:
        """The events after the last message of a complete stream.

        Raises:
            GatewayError: the final message was not seen.
        """
        counts = usage(self.state.usage)
        reason = stop_reason(self.finish)
        delta = {"stop_reason": reason, "stop_sequence": self.stop_sequence if reason == "stop_sequence" else None}
        return b"".join(
            [
                *self._close(),
                event("message_delta", {"type": "message_delta", "delta": delta, "usage": counts}),
                event("message_stop", {"type": "message_stop"}),
            ]
        )
