"""Anthropic Messages <-> Generate as pure functions (gateways.openai.messages_schema and
messages_translate): the chat a request means, the GenerateRequest, the message object and the
stream events of a scripted Generate stream, and the schema's refusals."""

from __future__ import annotations

import json

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.chat import translate as chat_translate
from gateways.common.status import GatewayError
from gateways.openai import messages_translate as mt
from gateways.openai.messages_schema import parse_count_tokens_request, parse_messages_request

TOOL = {"name": "get", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}


def body(**fields) -> dict:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_the_chat_a_request_means():
    req = parse_messages_request(
        body(
            system=[{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
            messages=[
                {"role": "user", "content": "Look it up."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Sure."},
                        {"type": "tool_use", "id": "t1", "name": "get", "input": {"q": "x"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "42"}]},
                        {"type": "text", "text": "And"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QQ=="}},
                        {"type": "tool_result", "tool_use_id": "t2", "content": "boom", "is_error": True},
                    ],
                },
            ],
            tools=[TOOL],
            tool_choice={"type": "tool", "name": "get", "disable_parallel_tool_use": True},
            stop_sequences=["a", "b", "c", "d", "e"],
            top_k=3,
            temperature=0,
        )
    )
    out = mt.to_generate_request(req, request_id="msg_1")
    got = [
        (m.role, [p.text or p.image_url.url for p in m.content], [(c.id, c.name, c.arguments) for c in m.tool_calls])
        for m in out.messages.messages
    ]
    assert got == [
        ("system", ["Be\nbrief."], []),
        ("user", ["Look it up."], []),
        ("assistant", ["Sure."], [("t1", "get", '{"q": "x"}')]),
        ("tool", ["42"], []),
        ("user", ["And", "data:image/png;base64,QQ=="], []),
        ("tool", ["Error: boom"], []),
    ]
    assert [m.tool_call_id for m in out.messages.messages if m.role == "tool"] == ["t1", "t2"]
    assert list(out.stopping.stop) == ["a", "b", "c", "d", "e"] and out.stopping.max_new_tokens == 8
    assert out.sampling.top_k == 3 and out.sampling.do_sample is False
    assert json.loads(out.guided_decoding.json_schema) == TOOL["input_schema"]  # the named tool's input
    assert [t.name for t in out.messages.tools] == ["get"]


@pytest.mark.parametrize(
    ("choice", "chat"),
    [({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none")],
)
def test_tool_choice(choice, chat):
    req = mt.to_chat_request(parse_messages_request(body(tools=[TOOL], tool_choice=choice)))
    assert req.tool_choice == chat and req.parallel_tool_calls is None
    out = mt.to_generate_request(parse_messages_request(body(tools=[TOOL], tool_choice=choice)), request_id="r")
    assert len(out.messages.tools) == (0 if chat == "none" else 1)
    assert out.HasField("guided_decoding") == (chat == "required")


def test_count_tokens_renders_the_same_chat():
    req = parse_count_tokens_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL]})
    tokenize = mt.tokenize_request(req)
    assert [m.role for m in tokenize.messages.messages] == ["user"] and tokenize.messages.tools[0].name == "get"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tools": [TOOL, TOOL]}, "tools: Tool names must be unique."),
        ({"tool_choice": {"type": "any"}}, "tool_choice: a tool must be called, but no tools are given."),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "g", "input": {}}]}]},
            "messages.0.content.0: 'tool_use' blocks are not allowed in 'user' messages.",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image", "source": {"type": "url", "url": "u"}}],
                            }
                        ],
                    }
                ]
            },
            "messages.0.content.0.content",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role: Input should be 'user' or 'assistant'"),
        ({"speed": "fast"}, "speed: not supported by this server"),
        ({"stop_sequences": "x"}, "stop_sequences: Input should be a valid list"),
    ],
)
def test_refusals_name_the_field(fields, message):
    with pytest.raises(GatewayError) as err:
        parse_messages_request(body(**fields))
    assert err.value.message.startswith(message), err.value.message


def test_neutral_values_of_unsupported_fields_are_accepted():
    req = parse_messages_request(body(thinking={"type": "disabled"}, speed="standard", metadata={"user_id": "u"}))
    assert req.max_tokens == 8


def response(*outputs: pb.SequenceOutput, usage: pb.Usage | None = None) -> spb.GenerateResponse:
    msg = spb.GenerateResponse(outputs=list(outputs))
    if usage is not None:
        msg.usage.CopyFrom(usage)
    return msg


#: A reply with reasoning, text and a Hermes tool call, its tags cut across messages.
PIECES = ["<th", "ink>plan", " it</th", "ink>Sure. <tool", '_call>{"name": "get", "arguments": {"q": 1}}</tool_call>']


def scripted_stream() -> list[spb.GenerateResponse]:
    msgs = [response(pb.SequenceOutput(text=t)) for t in PIECES]
    last = pb.SequenceOutput(finish_reason=pb.FINISH_REASON_EOS)
    return [*msgs, response(last, usage=pb.Usage(prompt_tokens=10, completion_tokens=9, cached_tokens=4))]


def state(**fields):
    req = parse_messages_request(body(tools=[TOOL], **fields))
    return mt.state_for(req, message_id="msg_abc", model="m", reasoning="qwen3")


def test_the_message_of_a_stream():
    msg = Message.model_validate(mt.to_message(scripted_stream(), state(), message_id="msg_abc"))
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"]
    assert msg.content[0].thinking == "plan it" and msg.content[1].text == "Sure. "
    assert msg.content[2].input == {"q": 1} and msg.content[2].id.startswith("toolu_")
    assert msg.stop_reason == "tool_use"
    assert (msg.usage.input_tokens, msg.usage.cache_read_input_tokens, msg.usage.output_tokens) == (6, 4, 9)


def test_stream_events_parse_with_the_sdk_models_and_rebuild_the_message():
    events = mt.EventStream(state(), "msg_abc")
    raw = events.start() + b"".join(events.message(m) for m in scripted_stream()) + events.end()
    adapter = TypeAdapter(RawMessageStreamEvent)
    parsed = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        obj = json.loads(data.removeprefix("data: "))
        assert name == f"event: {obj['type']}"
        if obj["type"] != "ping":
            parsed.append(adapter.validate_python(obj))
    kinds = [(e.type, getattr(e, "index", None)) for e in parsed]
    assert kinds[0] == ("message_start", None) and kinds[-2:] == [("message_delta", None), ("message_stop", None)]
    starts = [e.content_block.type for e in parsed if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    block0 = [e.delta for e in parsed if e.type == "content_block_delta" and e.index == 0]
    assert [d.type for d in block0[-1:]] == ["signature_delta"] and block0[-1].signature == ""
    thinking = "".join(d.thinking for d in block0[:-1])
    arguments = "".join(e.delta.partial_json for e in parsed if e.type == "content_block_delta" and e.index == 2)
    assert thinking == "plan it" and json.loads(arguments) == {"q": 1}
    assert parsed[-2].delta.stop_reason == "tool_use" and parsed[-2].usage.input_tokens == 6


@pytest.mark.parametrize(
    ("reasoning", "pieces"),
    [
        ("", ["Hel", "lo", ' "x"\n']),
        ("qwen3", [" ", "<th", "ink>plan", " it</th", "ink>Sure", ". ", "Hel", "lo"]),
        ("qwen3", ["Hel", "lo <think>", "not reasoning</think>"]),
        ("deepseek_r1", ["plan", " it</", "think>", "Sure", "."]),
        ("deepseek_r1", ["cut", " short </thi"]),
    ],
)
def test_plain_steps_render_as_the_messages_they_stand_for(reasoning, pieces):
    """A stream without tools may get its text as steps (the route asks for them): the events
    are the bytes the same text in whole messages gives, reasoning split out of it alike."""
    req = parse_messages_request(body())
    plain = mt.state_for(req, message_id="msg_abc", model="m", reasoning=reasoning)
    assert chat_translate.plain_deltas(plain)
    final = response(pb.SequenceOutput(finish_reason=pb.FINISH_REASON_LENGTH), usage=pb.Usage(completion_tokens=3))
    whole = mt.EventStream(plain, "msg_abc")
    expected = whole.start() + b"".join(whole.message(response(pb.SequenceOutput(text=t))) for t in pieces)
    expected += whole.message(final) + whole.end()
    stepped = mt.EventStream(mt.state_for(req, message_id="msg_abc", model="m", reasoning=reasoning), "msg_abc")
    got = stepped.start() + b"".join(stepped.text(t) for t in pieces) + stepped.text("")
    got += stepped.message(final) + stepped.end()
    assert got == expected


def test_a_stop_sequence_and_a_cut_call():
    stop = pb.SequenceOutput(text="a", finish_reason=pb.FINISH_REASON_STOP_SEQUENCE, stop_sequence="END")
    msg = mt.to_message([response(stop, usage=pb.Usage(prompt_tokens=1, completion_tokens=1))], state(), message_id="x")
    assert (msg["stop_reason"], msg["stop_sequence"]) == ("stop_sequence", "END")
    events = mt.EventStream(state(), "x")
    events.message(response(stop, usage=pb.Usage(prompt_tokens=1, completion_tokens=1)))
    assert b'"stop_sequence":"END"' in events.end()
    assert mt.tool_input('{"q": ') == {} and mt.tool_input("[1]") == {}


def test_a_cancelled_or_incomplete_stream_is_an_error():
    cancelled = pb.SequenceOutput(finish_reason=pb.FINISH_REASON_CANCELLED)
    with pytest.raises(GatewayError):
        mt.EventStream(state(), "x").message(response(cancelled))
    with pytest.raises(GatewayError):
        mt.EventStream(state(), "x").end()  # no final message, no usage
