"""vLLM's extra parameters on chat and legacy completions (gateways/common/chat/vllm.py): what
each sets on the GenerateRequest, the guides, the refusals naming the field, and the chat-only
extras (echo, template options, continuous usage, prompt_logprobs) in the pure translation."""

from __future__ import annotations

import json

import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.chat import completion_translate, translate
from gateways.common.chat.completion_schema import parse_completion_request
from gateways.common.chat.schema import parse_chat_request
from gateways.common.status import GatewayError

USER = [{"role": "user", "content": "hi"}]

EXTRAS = {
    "top_k": 5,
    "min_p": 0.25,
    "repetition_penalty": 1.5,
    "length_penalty": 0.5,
    "min_tokens": 3,
    "stop_token_ids": [7, 9],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 100,
    "bad_words": ["bad"],
    "ignore_eos": True,
    "guided_decoding_backend": "xgrammar",
    "request_id": "mine",
    "priority": 0,
    "use_beam_search": False,
}


def check_extras(g: spb.GenerateRequest) -> None:
    s, st, o = g.sampling, g.stopping, g.output
    assert (s.top_k, s.min_p, s.repetition_penalty, s.length_penalty) == (5, 0.25, 1.5, 0.5)
    assert list(s.bad_words) == ["bad"]
    assert (st.min_new_tokens, list(st.stop_token_ids), st.include_stop_str_in_output) == (3, [7, 9], True)
    assert (st.truncate_input_tokens, st.ignore_eos) == (100, True)
    assert o.HasField("skip_special_tokens") and not o.skip_special_tokens
    assert o.HasField("spaces_between_special_tokens") and not o.spaces_between_special_tokens


def test_chat_extras_map_onto_the_core_fields():
    req = parse_chat_request({"messages": USER, **EXTRAS})
    check_extras(translate.to_generate_request(req, request_id="r"))


def test_completion_extras_map_onto_the_core_fields():
    req = parse_completion_request({"prompt": "hi", **EXTRAS, "add_special_tokens": True})
    (g,) = completion_translate.to_generate_requests(req, completion_id="c")
    check_extras(g)


def test_top_k_minus_one_turns_top_k_off():
    req = parse_chat_request({"messages": USER, "top_k": -1})
    g = translate.to_generate_request(req, request_id="r")
    assert g.sampling.HasField("top_k") and g.sampling.top_k == 0


def test_chat_template_options_go_with_the_messages():
    body = {
        "messages": [*USER, {"role": "assistant", "content": "Hel"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    g = translate.to_generate_request(parse_chat_request(body), request_id="r")
    assert g.messages.HasField("add_generation_prompt") and not g.messages.add_generation_prompt
    assert g.messages.continue_final_message
    assert json.loads(g.messages.template_kwargs) == {"enable_thinking": False}
    plain = translate.to_generate_request(parse_chat_request({"messages": USER}), request_id="r")
    assert not plain.messages.HasField("add_generation_prompt") and not plain.messages.template_kwargs


GUIDES = [
    ({"guided_json": {"type": "object"}}, pb.GuidedDecoding(json_schema='{"type": "object"}')),
    ({"guided_json": '{"type": "object"}'}, pb.GuidedDecoding(json_schema='{"type": "object"}')),
    ({"guided_regex": "[ab]+"}, pb.GuidedDecoding(regex="[ab]+")),
    ({"guided_choice": ["yes", "no"]}, pb.GuidedDecoding(choice=pb.Choices(choices=["yes", "no"]))),
    ({"guided_grammar": 'root ::= "a"'}, pb.GuidedDecoding(ebnf_grammar='root ::= "a"')),
    ({"structured_outputs": {"regex": "[ab]+"}}, pb.GuidedDecoding(regex="[ab]+")),
    ({"structured_outputs": {"json": {"type": "object"}}}, pb.GuidedDecoding(json_schema='{"type": "object"}')),
    ({"structured_outputs": {"choice": ["a"]}}, pb.GuidedDecoding(choice=pb.Choices(choices=["a"]))),
    ({"structured_outputs": {"grammar": "g"}}, pb.GuidedDecoding(ebnf_grammar="g")),
    ({"structured_outputs": {"json_object": True}}, pb.GuidedDecoding(json_object=True)),
]


@pytest.mark.parametrize("fields, guide", GUIDES)
def test_guides(fields, guide):
    chat = translate.to_generate_request(parse_chat_request({"messages": USER, **fields}), request_id="r")
    assert chat.guided_decoding == guide
    (completion,) = completion_translate.to_generate_requests(
        parse_completion_request({"prompt": "x", **fields}), completion_id="c"
    )
    assert completion.guided_decoding == guide


def test_completions_take_response_format():
    req = parse_completion_request({"prompt": "x", "response_format": {"type": "json_object"}})
    (g,) = completion_translate.to_generate_requests(req, completion_id="c")
    assert g.guided_decoding == pb.GuidedDecoding(json_object=True)


FORCED = {"type": "function", "function": {"name": "f"}}
TOOLS = [{"type": "function", "function": {"name": "f"}}]

REFUSED = [
    # (body fields, param, reason)
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "INVALID_ARGUMENT"),
    ({"guided_regex": "a", "structured_outputs": {"choice": ["a"]}}, "structured_outputs", "INVALID_ARGUMENT"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "INVALID_ARGUMENT"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag", "UNKNOWN_PARAMETER"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "INVALID_ARGUMENT"),
    ({"use_beam_search": True}, "use_beam_search", "UNSUPPORTED_PARAMETER"),
    ({"logits_processors": ["x"]}, "logits_processors", "UNSUPPORTED_PARAMETER"),
    ({"allowed_token_ids": [1]}, "allowed_token_ids", "UNSUPPORTED_PARAMETER"),
    ({"cache_salt": "s"}, "cache_salt", "UNSUPPORTED_PARAMETER"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids", "UNSUPPORTED_PARAMETER"),
    ({"top_k": "5"}, "top_k", "INVALID_ARGUMENT"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids[0]", "INVALID_ARGUMENT"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "INVALID_ARGUMENT"),
]


@pytest.mark.parametrize("fields, param, reason", REFUSED)
def test_refusals_name_the_field(fields, param, reason):
    for parse, body in ((parse_chat_request, {"messages": USER}), (parse_completion_request, {"prompt": "x"})):
        with pytest.raises(GatewayError) as info:
            parse({**body, **fields})
        assert (info.value.param, info.value.reason) == (param, reason), parse


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"add_special_tokens": True}, "add_special_tokens"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"documents": [{"text": "d"}]}, "documents"),
        ({"guided_regex": "a", "tools": TOOLS, "tool_choice": FORCED}, "guided_regex"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ],
)
def test_chat_only_refusals(fields, param):
    with pytest.raises(GatewayError) as info:
        parse_chat_request({"messages": USER, **fields})
    assert info.value.param == param


def test_neutral_values_are_accepted():
    parse_chat_request({"messages": USER, "add_special_tokens": False, "documents": [], "return_token_ids": False})
    parse_completion_request({"prompt": "x", "add_special_tokens": True, "vllm_xargs": {}})
    with pytest.raises(GatewayError) as info:
        parse_completion_request({"prompt": "x", "add_special_tokens": False})
    assert info.value.param == "add_special_tokens"


def state(body: dict) -> translate.StreamState:
    return translate.state_for(parse_chat_request(body), completion_id="c", created=1, model="m")


def message(*outputs: pb.SequenceOutput, prompt_count: int | None = None, usage: tuple[int, int] | None = None):
    m = spb.GenerateResponse(outputs=outputs)
    if prompt_count is not None:
        m.prompt_token_count = prompt_count
    if usage:
        m.usage.prompt_tokens, m.usage.completion_tokens = usage
    return m


def out(text: str, tokens: int, finish: int = 0) -> pb.SequenceOutput:
    o = pb.SequenceOutput(index=0, text=text, finish_reason=finish)
    for _ in range(tokens):
        o.tokens.add(id=5, text="x")
    return o


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk():
    body = {
        "messages": USER,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    req = parse_chat_request(body)
    assert translate.to_generate_request(req, request_id="r").output.tokens
    s = state(body)
    assert not translate.plain_deltas(s)
    assert translate.to_chunks(message(prompt_count=4), s) == []
    first = translate.to_chunks(message(out("ab", 2)), s)
    last = translate.to_chunks(message(out("c", 1, pb.FINISH_REASON_LENGTH), usage=(4, 3)), s)
    assert first[0]["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert last[0]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert translate.usage_chunk(s)["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    without = state({**body, "stream_options": {"continuous_usage_stats": True}})  # vLLM: needs include_usage
    assert "usage" not in translate.to_chunks(message(out("ab", 2)), without)[0]


def test_completion_continuous_usage_sums_the_prompts():
    body = {
        "prompt": ["a", "b"],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    req = parse_completion_request(body)
    s = completion_translate.state_for(req, completion_id="c", created=1, model="m")
    completion_translate.to_chunks(0, message(prompt_count=2), s)
    completion_translate.to_chunks(1, message(prompt_count=3), s)
    (chunk,) = completion_translate.to_chunks(1, message(out("x", 1)), s)
    assert chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}


def test_chat_echo_leads_with_the_assistants_final_message():
    body = {"messages": [*USER, {"role": "assistant", "content": "Once"}], "echo": True}
    s = state({**body, "stream": True})
    assert not translate.plain_deltas(s)
    (chunk,) = translate.to_chunks(message(out(" upon", 1)), s)
    assert chunk["choices"][0]["delta"]["content"] == "Once upon"
    done = translate.to_completion([message(out(" upon", 1, pb.FINISH_REASON_LENGTH), usage=(3, 1))], state(body))
    assert done["choices"][0]["message"]["content"] == "Once upon"
    user_last = state({"messages": USER, "echo": True})
    assert user_last.echo == ""


def test_chat_prompt_logprobs_are_top_level():
    s = state({"messages": USER, "prompt_logprobs": 1})
    first = spb.GenerateResponse()
    first.prompt_tokens.add(id=1, text="<|user|>")
    tok = first.prompt_tokens.add(id=2, text="hi", logprob=-1.0)
    tok.top_logprobs.add(id=2, text="hi", logprob=-1.0)
    done = translate.to_completion([first, message(out("x", 1, pb.FINISH_REASON_LENGTH), usage=(2, 1))], s)
    assert done["prompt_logprobs"] == [None, {"2": {"logprob": -1.0, "rank": 1, "decoded_token": "hi"}}]
    assert "prompt_logprobs" not in translate.to_completion(
        [message(out("x", 1, pb.FINISH_REASON_LENGTH), usage=(2, 1))], state({"messages": USER})
    )


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "fields, guide",
    [
        ({"response_format": {"type": "json", "value": SCHEMA}}, pb.GuidedDecoding(json_schema=json.dumps(SCHEMA))),
        (
            {"response_format": {"type": "json_schema", "value": {"name": "a", "schema": SCHEMA}}},
            pb.GuidedDecoding(json_schema=json.dumps(SCHEMA)),
        ),
        ({"response_format": {"type": "regex", "value": "a+"}}, pb.GuidedDecoding(regex="a+")),
        ({"grammar": {"type": "json", "value": SCHEMA}}, pb.GuidedDecoding(json_schema=json.dumps(SCHEMA))),
        ({"grammar": {"type": "json_object", "value": None}}, None),
    ],
)
def test_tgi_structured_output_shapes_on_chat(fields, guide):
    if guide is None:
        with pytest.raises(GatewayError) as info:
            parse_chat_request({"messages": USER, **fields})
        assert info.value.param == "grammar"
        return
    g = translate.to_generate_request(parse_chat_request({"messages": USER, **fields}), request_id="r")
    assert g.guided_decoding == guide


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"response_format": {"type": "json", "value": 5}}, "response_format"),
        ({"response_format": {"type": "grammar", "value": "x"}}, "response_format"),
        ({"grammar": "x"}, "grammar"),
        ({"grammar": {"type": "regex", "value": "a"}, "guided_regex": "b"}, "guided_regex"),
    ],
)
def test_tgi_shapes_that_are_not_one(fields, param):
    with pytest.raises(GatewayError) as info:
        parse_chat_request({"messages": USER, **fields})
    assert info.value.param == param
