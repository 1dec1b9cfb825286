"""Tool calls of chat completions, as pure functions: the guide a `tool_choice` asks for, and the
turning of generated text into OpenAI `tool_calls`.

Request side (`tool_guide`), as vLLM's OpenAI server does it (`entrypoints/openai/protocol.py`,
`_get_guided_json_from_tool`):
  * a named function (`{"type": "function", "function": {"name": ...}}`): the output is that
    function's arguments, constrained by its `parameters` schema;
  * "required": the output is a JSON array of calls, `[{"name": ..., "parameters": {...}}, ...]`,
    each item one of the tools (its name as an enum, its parameters schema), at least one item
    (exactly one when `parallel_tool_calls` is false);
  * "auto": no constraint; the chat template gets the tools, and the output is read in the
    Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any text
    before them being the message content (NousResearch Hermes-2-Pro function calling, as
    vLLM's `hermes` tool parser reads it: the JSON between the tags; an unterminated last block
    up to the end of the output; a block that does not parse stays text).
  * "none": no constraint and no parsing.

Response side (`ToolCalls`): one parser per choice turns text deltas into content and tool-call
deltas. `rewrite_chunks` rewrites the `chat.completion.chunk` objects that
gateways.common.chat.translate renders (streaming): `delta.content` keeps only the content, and
`delta.tool_calls` carries `{"index", "id", "type": "function", "function": {"name",
"arguments"}}` when a call starts and `{"index", "function": {"arguments"}}` for more of its
arguments (the OpenAI SDK concatenates them per index); `rewrite_completion` does the same for a
whole `chat.completion` (`message.tool_calls`, content null when there is none). A choice that
called a tool and ended by EOS or a stop finishes with "tool_calls". Tool call ids are derived
from the completion id, so nothing here draws a random id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from trellis.generate.v1 import generate_pb2 as pb

START, END = "<tool_call>", "</tool_call>"

Mode = Literal["auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class FunctionSpec:
    """A tool's function as the request declared it (parameters: a JSON Schema object or None)."""

    name: str
    parameters: dict[str, Any] | None = None


def parameters_schema(f: FunctionSpec) -> dict[str, Any]:
    """A function's parameters schema; a function without one takes an empty object."""
    return f.parameters if f.parameters is not None else {"type": "object", "properties": {}}


def tool_guide(
    mode: Mode, functions: Sequence[FunctionSpec], *, name: str | None = None, parallel: bool = True
) -> pb.GuidedDecoding | None:
    """The guide of a tool_choice (module docstring); None for "auto".

    Args:
        mode: "auto", "required" or "named".
        functions: the request's tools.
        name: the named function (mode "named"; one of `functions`).
        parallel: `parallel_tool_calls` (false: a "required" array holds exactly one call).
    """
    if mode == "auto":
        return None
    if mode == "named":
        target = next(f for f in functions if f.name == name)
        return pb.GuidedDecoding(json_schema=json.dumps(parameters_schema(target)))
    items = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": parameters_schema(f)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return pb.GuidedDecoding(json_schema=json.dumps(schema))


@dataclass(slots=True)
class CallDelta:
    """News of one tool call: `id` and `name` when it starts, then `arguments` text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def wire(self) -> dict[str, Any]:
        """The `delta.tool_calls[]` entry."""
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, "arguments": self.arguments}
        out["function"] = function
        return out


class _Parser:
    """Text of one choice -> (content, call deltas); `finish` at the end of the choice."""

    def __init__(self, ids: _Ids):
        self.ids = ids
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[CallDelta]]:
        raise NotImplementedError

    def _start(self, name: str, arguments: str) -> CallDelta:
        delta = CallDelta(self.calls, arguments, self.ids.next(), name)
        self.calls += 1
        return delta


@dataclass(slots=True)
class _Ids:
    """Tool call ids of one choice: "call_<completion id part>_<choice>_<n>"."""

    prefix: str
    n: int = 0

    def next(self) -> str:
        self.n += 1
        return f"{self.prefix}_{self.n - 1}"


class _Named(_Parser):
    """The whole output is the arguments of one call of `name`."""

    def __init__(self, ids: _Ids, name: str):
        super().__init__(ids)
        self.name = name

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        if not text:
            return "", []
        if self.calls == 0:
            return "", [self._start(self.name, text)]
        return "", [CallDelta(0, text)]

    def finish(self) -> tuple[str, list[CallDelta]]:
        return ("", [self._start(self.name, "{}")]) if self.calls == 0 else ("", [])


class _Required(_Parser):
    """The output is a JSON array of `{"name", "parameters"}`: buffered, read at the end. Items
    complete before a cut (max_tokens) still become calls."""

    def __init__(self, ids: _Ids):
        super().__init__(ids)
        self.text: list[str] = []

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.text.append(text)
        return "", []

    def finish(self) -> tuple[str, list[CallDelta]]:
        text = "".join(self.text)
        calls = [
            self._start(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
            for item in _array_items(text)
            if isinstance(item, dict) and isinstance(item.get("name"), str)
        ]
        return ("", calls) if calls else (text, [])


def _array_items(text: str) -> list[Any]:
    """The complete items of a JSON array, also when the array itself was cut short."""
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        return []
    items: list[Any] = []
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return items
        try:
            item, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return items
        items.append(item)


class _Hermes(_Parser):
    """`<tool_call>{"name", "arguments"}</tool_call>` blocks in free text (module docstring)."""

    def __init__(self, ids: _Ids):
        super().__init__(ids)
        self.pending = ""  # text not yet given out: a possible start tag, or an open block
        self.in_call = False

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        self.pending += text
        content: list[str] = []
        calls: list[CallDelta] = []
        while True:
            if self.in_call:
                end = self.pending.find(END)
                if end < 0:
                    break
                block, self.pending = self.pending[:end], self.pending[end + len(END) :]
                self.in_call = False
                self._block(block, content, calls, closed=True)
            else:
                start = self.pending.find(START)
                if start < 0:
                    keep = _partial_tag(self.pending)
                    self._text(self.pending[: len(self.pending) - keep], content)
                    self.pending = self.pending[len(self.pending) - keep :]
                    break
                self._text(self.pending[:start], content)
                self.pending = self.pending[start + len(START) :]
                self.in_call = True
        return "".join(content), calls

    def finish(self) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        calls: list[CallDelta] = []
        if self.in_call:
            self._block(self.pending, content, calls, closed=False)
        else:
            self._text(self.pending, content)
        self.pending, self.in_call = "", False
        return "".join(content), calls

    def _text(self, text: str, content: list[str]) -> None:
        if text and not (self.calls and text.isspace()):  # whitespace between calls is layout
            content.append(text)

    def _block(self, block: str, content: list[str], calls: list[CallDelta], *, closed: bool) -> None:
        call = _hermes_call(block)
        if call is None:
            content.append(START + block + (END if closed else ""))
        else:
            calls.append(self._start(*call))


def _hermes_call(block: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a Hermes block, or None when it is not one."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that may begin a start tag."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCalls:
    """Tool-call reading of one chat completion (module docstring).

    Attributes:
        mode: how the output is read.
        completion_id: the completion's id, from which call ids are derived.
        name: the named function (mode "named").
        ended: the schema's finish words of a choice that ended by itself (EOS or a stop), which
            become "tool_calls" when the choice called a tool.
    """

    mode: Mode
    completion_id: str
    name: str | None = None
    ended: frozenset[str] = frozenset({"stop"})
    _parsers: dict[int, _Parser] = field(default_factory=dict)

    def _parser(self, index: int) -> _Parser:
        parser = self._parsers.get(index)
        if parser is None:
            ids = _Ids(f"call_{self.completion_id.removeprefix('chatcmpl-')[:24]}_{index}")
            if self.mode == "named":
                parser = _Named(ids, self.name or "")
            elif self.mode == "required":
                parser = _Required(ids)
            else:
                parser = _Hermes(ids)
            self._parsers[index] = parser
        return parser

    def rewrite_chunks(self, chunks: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chunks (one choice each) with content and tool calls apart; chunks left with
        nothing to say are dropped."""
        out = []
        for chunk in chunks:
            if not chunk["choices"]:
                out.append(chunk)
                continue
            choice = chunk["choices"][0]
            parser = self._parser(choice["index"])
            delta = choice["delta"]
            content, calls = parser.feed(delta.get("content") or "")
            reason = choice["finish_reason"]
            if reason is not None:
                more, tail = parser.finish()
                content, calls = content + more, calls + tail
                choice["finish_reason"] = self._reason(reason, parser)
            new: dict[str, Any] = {"role": delta["role"]} if "role" in delta else {}
            if content or "role" in delta:
                new["content"] = content if content or not parser.calls else None
            if calls:
                new["tool_calls"] = [c.wire() for c in calls]
            if "reasoning" in delta:  # split off before (gateways.common.reasoning)
                new["reasoning"] = delta["reasoning"]
            choice["delta"] = new
            if new or reason is not None or choice.get("logprobs"):
                out.append(chunk)
        return out

    def rewrite_completion(self, completion: dict[str, Any]) -> dict[str, Any]:
        """The completion with each choice's message split into content and `tool_calls`."""
        for choice in completion["choices"]:
            parser = self._parser(choice["index"])
            message = choice["message"]
            content, calls = parser.feed(message["content"] or "")
            more, tail = parser.finish()
            content += more
            merged: dict[int, CallDelta] = {}
            for c in calls + tail:
                if c.index in merged:
                    merged[c.index].arguments += c.arguments
                else:
                    merged[c.index] = CallDelta(c.index, c.arguments, c.id, c.name)
            if merged:
                message["content"] = content or None
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in merged.values()
                ]
                choice["finish_reason"] = self._reason(choice["finish_reason"], parser)
            else:
                message["content"] = content
        return completion

    def _reason(self, reason: str, parser: _Parser) -> str:
        """ "tool_calls" for a choice that called a tool and ended by itself."""
        return "tool_calls" if parser.calls and reason in self.ended else reason
