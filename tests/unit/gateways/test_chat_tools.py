"""The tool-call module of chat completions (gateways.common.chat.tools): the guides a
tool_choice asks for, and the Hermes / named / required readings of generated text, fed in
arbitrary pieces (streaming) and whole (non-streaming)."""

from __future__ import annotations

import json

import pytest

from gateways.common.chat.tools import FunctionSpec, ToolCalls, tool_guide

F = FunctionSpec("get", {"type": "object", "properties": {"q": {"type": "string"}}})
G = FunctionSpec("put", None)


def chunk(text: str, finish: str | None = None, role: bool = False) -> dict:
    delta = {"role": "assistant", "content": text} if role else {"content": text}
    return {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def stream(calls: ToolCalls, pieces: list[str], finish: str = "stop") -> list[dict]:
    chunks = [chunk(p, role=i == 0) for i, p in enumerate(pieces[:-1])] + [chunk(pieces[-1], finish, len(pieces) == 1)]
    return [c["choices"][0] for c in calls.rewrite_chunks(chunks)]


def assembled(choices: list[dict]) -> tuple[str, list[dict], str | None]:
    """What the OpenAI SDK would rebuild: content, calls by index, finish reason."""
    content, calls, reason = "", {}, None
    for c in choices:
        content += c["delta"].get("content") or ""
        for d in c["delta"].get("tool_calls", []):
            entry = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = entry["id"] or d.get("id")
            entry["name"] = entry["name"] or d["function"].get("name")
            entry["arguments"] += d["function"]["arguments"]
        reason = c["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_named_guide_is_the_function_parameters():
    assert json.loads(tool_guide("named", [F, G], name="get").json_schema) == F.parameters
    assert json.loads(tool_guide("named", [F, G], name="put").json_schema) == {"type": "object", "properties": {}}
    assert tool_guide("auto", [F]) is None


def test_required_guide_is_an_array_of_calls():
    schema = json.loads(tool_guide("required", [F, G]).json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get"], ["put"]]
    assert json.loads(tool_guide("required", [F], parallel=False).json_schema)["maxItems"] == 1


HERMES = (
    'Sure.\n<tool_call>\n{"name": "get", "arguments": {"q": "x"}}\n</tool_call>\n'
    '<tool_call>{"name": "put", "arguments": "{}"}</tool_call>'
)


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11, len(HERMES)])
def test_hermes_calls_in_any_pieces(size):
    pieces = [HERMES[i : i + size] for i in range(0, len(HERMES), size)]
    content, calls, reason = assembled(stream(ToolCalls("auto", "chatcmpl-abc"), pieces))
    assert content == "Sure.\n" and reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get", {"q": "x"}), ("put", {})]
    assert [c["id"] for c in calls] == ["call_abc_0_0", "call_abc_0_1"]


@pytest.mark.parametrize(
    ("text", "content", "names"),
    [
        ("no tools here", "no tools here", []),
        ("a <tool_c", "a <tool_c", []),  # a start tag cut short stays text at the end
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ('<tool_call>{"name": "get", "arguments": {}}', None, ["get"]),  # unterminated last block
        ('<tool_call>{"name": "get"', '<tool_call>{"name": "get"', []),
    ],
)
def test_hermes_edges(text, content, names):
    completion = {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}
    choice = ToolCalls("auto", "chatcmpl-1").rewrite_completion(completion)["choices"][0]
    assert choice["message"]["content"] == content
    assert [c["function"]["name"] for c in choice["message"].get("tool_calls", [])] == names
    assert choice["finish_reason"] == ("tool_calls" if names else "stop")


def test_named_streams_the_arguments_under_one_call():
    content, calls, reason = assembled(stream(ToolCalls("named", "chatcmpl-1", "get"), ['{"q"', ': "', 'x"}']))
    assert content == "" and reason == "tool_calls"
    assert calls == [{"id": "call_1_0_0", "name": "get", "arguments": '{"q": "x"}'}]


def test_required_reads_the_array_and_keeps_complete_items_of_a_cut_one():
    text = '[{"name": "get", "parameters": {"q": "a"}}, {"name": "put", "parameters": {}}]'
    content, calls, reason = assembled(stream(ToolCalls("required", "chatcmpl-1"), [text[:20], text[20:]]))
    assert reason == "tool_calls" and [c["name"] for c in calls] == ["get", "put"] and content == ""
    cut = '[{"name": "get", "parameters": {"q": "a"}}, {"name": "pu'
    content, calls, reason = assembled(stream(ToolCalls("required", "chatcmpl-1"), [cut], finish="length"))
    assert [c["name"] for c in calls] == ["get"] and reason == "length"  # cut by max_tokens: not "tool_calls"
    content, calls, _ = assembled(stream(ToolCalls("required", "chatcmpl-1"), ["[{"], finish="length"))
    assert calls == [] and content == "[{"


def test_lmi_finish_words_become_tool_calls_too():
    calls = ToolCalls("named", "chatcmpl-1", "get", frozenset({"eos_token", "stop_sequence"}))
    assert assembled(stream(calls, ["{}"], finish="eos_token"))[2] == "tool_calls"
