"""The Responses API's pure parts: request checks (gateways/openai/responses_schema.py), items
to chat messages and the GenerateRequest, the response object and its events
(responses_translate.py), and the memory store (responses_store.py)."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from trellis.generate.v1 import generate_pb2 as pb

from gateways.common.chat import translate as chat_translate
from gateways.common.config import load
from gateways.common.status import GatewayError
from gateways.openai import responses_translate as rt
from gateways.openai.config import add_arguments, load_settings
from gateways.openai.responses_schema import ITEMS, parse_responses_request
from gateways.openai.responses_store import MemoryStore, NoStore, StoredResponse, make_store

TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
IDS = rt.Ids("k")
EVENTS = TypeAdapter(ResponseStreamEvent)


def parse(**fields):
    return parse_responses_request({"input": "hi", **fields})


# --------------------------------------------------------------------------- schema


def test_string_input_is_one_user_message():
    req = parse()
    (item,) = req.items()
    assert item.role == "user" and item.content == "hi"
    assert req.stored and req.format is None


def test_neutral_values_of_unsupported_fields_and_ignored_fields_are_accepted():
    req = parse(
        background=False, include=[], reasoning=None, top_logprobs=0, service_tier="auto", truncation="disabled"
    )
    assert req.truncation == "disabled"


def test_previous_response_id_alone_needs_no_input():
    assert parse_responses_request({"previous_response_id": "resp_1"}).items() == []


@pytest.mark.parametrize(
    ("fields", "param", "reason"),
    [
        ({"nope": 1}, "nope", "UNKNOWN_PARAMETER"),
        ({"tools": [TOOL, {"type": "file_search"}]}, "tools[1].type", "UNSUPPORTED_PARAMETER"),
        ({"tools": 1.5}, "tools", None),
        ({"tools": "function"}, "tools", None),
        ({"tool_choice": 1.5}, "tool_choice", None),
        ({"conversation": "conv_1"}, "conversation", "UNSUPPORTED_PARAMETER"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", None),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", None),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text", None),
        ({"metadata": {"k" * 65: "v"}}, "metadata", None),
    ],
)
def test_refusals_name_the_field(fields, param, reason):
    with pytest.raises(GatewayError) as err:
        parse(**fields)
    assert err.value.param == param
    if reason:
        assert err.value.reason == reason


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(GatewayError):
        parse_responses_request([])


# --------------------------------------------------------------------------- request


def test_items_become_chat_messages():
    req = parse(
        instructions="Be brief.",
        input=[
            {"role": "developer", "content": "d"},
            {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "let me see", "annotations": []}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
            {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]},
        ],
    )
    messages = rt.to_chat_request(req).messages
    assert [m.role for m in messages] == [
        "system",
        "developer",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
        "user",
    ]
    assert messages[0].content == "Be brief."
    assistant = messages[3]
    assert assistant.content[0].text == "let me see"
    assert [c.id for c in assistant.tool_calls] == ["c1", "c2"]
    assert messages[4].tool_call_id == "c1" and messages[5].content == "two"
    assert messages[6].content is None and messages[6].tool_calls[0].id == "c3"
    assert messages[7].content[0].image_url.url.startswith("data:")


def test_history_comes_before_the_input():
    history = ITEMS.validate_python([{"role": "user", "content": "first"}, rt.message_item("m", "answer", "completed")])
    messages = rt.to_chat_request(parse(input="second"), history).messages
    assert [(m.role, m.content if isinstance(m.content, str) else m.content[0].text) for m in messages] == [
        ("user", "first"),
        ("assistant", "answer"),
        ("user", "second"),
    ]


def test_generate_request_fields():
    req = parse(
        max_output_tokens=7,
        temperature=0,
        top_p=0.5,
        tools=[TOOL],
        tool_choice={"type": "function", "name": "f"},
    )
    out = chat_translate.to_generate_request(rt.to_chat_request(req), request_id="r")
    assert out.stopping.max_new_tokens == 7 and not out.sampling.do_sample and out.sampling.top_p == 0.5
    assert [t.name for t in out.messages.tools] == ["f"]
    assert json.loads(out.guided_decoding.json_schema) == TOOL["parameters"]


def test_text_format_json_schema_is_a_guide():
    fmt = {"type": "json_schema", "name": "r", "schema": {"type": "object"}, "strict": True}
    out = chat_translate.to_generate_request(rt.to_chat_request(parse(text={"format": fmt})), request_id="r")
    assert json.loads(out.guided_decoding.json_schema) == {"type": "object"}
    out = chat_translate.to_generate_request(
        rt.to_chat_request(parse(text={"format": {"type": "json_object"}})), request_id="r"
    )
    assert out.guided_decoding.json_object


def test_a_forced_call_takes_the_guide_over_text_format():
    """The OpenAI Agents SDK sends an agent's output type with tool_choice "required"."""
    fmt = {"type": "json_schema", "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "string"}}}}
    req = parse(tools=[TOOL], tool_choice="required", text={"format": fmt})
    out = chat_translate.to_generate_request(rt.to_chat_request(req), request_id="r")
    assert json.loads(out.guided_decoding.json_schema)["type"] == "array"
    assert rt.in_client_terms(GatewayError.invalid("bad", "guided_decoding.json_schema"), req).param == "tools"
    auto = parse(tools=[TOOL], text={"format": fmt})
    assert rt.in_client_terms(GatewayError.invalid("bad", "guided_decoding.json_schema"), auto).param == "text.format"


def test_core_errors_in_the_responses_names():
    req = parse(max_output_tokens=3, text={"format": {"type": "json_object"}})
    named = rt.in_client_terms(GatewayError.invalid("too many", "stopping.max_new_tokens"), req)
    assert named.param == "max_output_tokens"
    assert rt.in_client_terms(GatewayError.invalid("bad", "guided_decoding.json_object"), req).param == "text.format"
    assert rt.in_client_terms(GatewayError.invalid("long", "messages[3].content"), req).param == "input"


# --------------------------------------------------------------------------- response


USAGE = pb.Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2)


def completion(content, calls=(), finish="stop"):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": "f", "arguments": args}} for cid, args in calls
        ]
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}]}


def skeleton(**fields):
    return rt.skeleton(parse(**fields), ids=IDS, created_at=1, model="m")


def test_response_object_validates_as_the_sdk_type():
    out = rt.response_object(completion("hi", [("c1", "{}")], "tool_calls"), skeleton(tools=[TOOL]), IDS, USAGE)
    resp = Response.model_validate(out)
    assert [i.type for i in resp.output] == ["message", "function_call"]
    assert resp.output_text == "hi" and resp.output[1].id == "fc_k_1"
    assert resp.usage.input_tokens_details.cached_tokens == 2 and resp.usage.total_tokens == 8
    assert resp.status == "completed"


def test_a_cut_response_is_incomplete():
    resp = Response.model_validate(rt.response_object(completion("h", finish="length"), skeleton(), IDS, USAGE))
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete"


def test_a_response_without_choices_is_an_error():
    with pytest.raises(GatewayError):
        rt.response_object({"choices": []}, skeleton(), IDS, USAGE)


def events_of(data: bytes):
    out = []
    for block in data.decode().strip().split("\n\n"):
        name, payload = block.split("\n")
        event = EVENTS.validate_python(json.loads(payload.removeprefix("data: ")))
        assert name == f"event: {event.type}"
        out.append(event)
    return out


def chunk(delta, finish=None):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_events_for_text_then_calls():
    events = rt.ResponseEvents(skeleton(tools=[TOOL]), IDS)
    data = events.begin()
    data += events.chunk(chunk({"role": "assistant", "content": "Hi"}))
    data += events.text(" there")
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    data += events.chunk(chunk({"tool_calls": [call]}))
    data += events.chunk(chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "tool_calls"))
    events.complete(USAGE)
    data += events.end()
    got = events_of(data)
    assert [e.type for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in got] == list(range(len(got)))
    final = got[-1].response
    assert final.output_text == "Hi there" and final.output[1].arguments == '{"a": 1}'
    assert got[9].output_index == 1 and got[9].item.id == "fc_k_1"


def test_events_of_an_empty_answer_still_have_a_message():
    events = rt.ResponseEvents(skeleton(), IDS)
    data = events.chunk(chunk({"role": "assistant", "content": ""}, "stop"))
    events.complete(USAGE)
    got = events_of(data + events.end())
    assert got[-1].type == "response.completed" and got[-1].response.output[0].content[0].text == ""
    assert "response.output_item.added" in [e.type for e in got]


def test_failure_events():
    events = rt.ResponseEvents(skeleton(), IDS)
    data = events.text("x")
    data += events.fail(GatewayError.invalid("gone", None), 503)
    got = events_of(data)
    assert [e.type for e in got[-2:]] == ["error", "response.failed"]
    assert got[-1].response.error.code == "server_error" and got[-2].message == "gone"
    assert rt.error_code(429) == "rate_limit_exceeded"


def test_input_item_records():
    items = parse(
        input=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "id": "msg_own"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "o"},
        ]
    ).items()
    records = rt.input_item_records(items, IDS)
    assert [r["id"] for r in records] == ["msg_k_in0", "msg_own", "fc_k_in2", "fco_k_in3"]
    assert records[0]["content"] == [{"type": "input_text", "text": "a"}]
    assert records[1]["content"][0]["type"] == "output_text"
    assert all(r["status"] == "completed" for r in records)


# --------------------------------------------------------------------------- store


def record(rid: str) -> StoredResponse:
    return StoredResponse(response={"id": rid}, input_items=[], context=[])


async def test_memory_store_drops_the_least_recently_used():
    store = MemoryStore(2)
    await store.put(record("a"))
    await store.put(record("b"))
    assert await store.get("a") is not None  # a is now the most recent
    await store.put(record("c"))
    assert await store.get("b") is None and len(store) == 2
    assert await store.delete("a") and not await store.delete("a")


async def test_no_store_and_make_store():
    store = NoStore()
    await store.put(record("a"))
    assert await store.get("a") is None and not await store.delete("a")
    assert isinstance(make_store("memory", 3, 60), MemoryStore)
    assert isinstance(make_store("none", 3, 60), NoStore)
    with pytest.raises(ValueError):
        make_store("disk", 3, 60)
    with pytest.raises(ValueError):
        MemoryStore(0)


# --------------------------------------------------------------------------- flags


def test_store_flags_and_their_environment():
    config = load(
        "openai", 8000, add_arguments, ["--response-store", "redis://h:1/0", "--response-store-ttl", "60"], {}
    )
    settings = load_settings(config)
    assert settings.response_store == "redis://h:1/0" and settings.response_store_ttl == 60
    config = load("openai", 8000, add_arguments, [], {"TRELLIS_GATEWAY_RESPONSE_STORE_MAX": "5"})
    assert load_settings(config).response_store_max == 5 and load_settings(config).response_store == "memory"


@pytest.mark.parametrize(
    "argv", [["--response-store", "disk"], ["--response-store-max", "0"], ["--response-store-ttl", "x"]]
)
def test_bad_store_flags_are_usage_errors(argv):
    with pytest.raises(SystemExit):
        load("openai", 8000, add_arguments, argv, {})


def test_only_the_last_item_of_a_cut_response_is_incomplete():
    out = rt.response_object(completion("a", [("c1", "{}"), ("c2", '{"x"')], "length"), skeleton(), IDS, USAGE)
    assert [i["status"] for i in out["output"]] == ["completed", "completed", "incomplete"]
    events = rt.ResponseEvents(skeleton(), IDS)
    events.text("a")
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}
    events.chunk(chunk({"tool_calls": [call]}, "length"))
    final = events.complete(USAGE)
    assert [i["status"] for i in final["output"]] == ["completed", "incomplete"]
