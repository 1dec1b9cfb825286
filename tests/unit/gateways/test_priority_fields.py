"""Each schema's scheduling priority reaches GenerateRequest.priority (vLLM's `priority`
extension on the OpenAI schemas, LMI's parameters.priority, Triton's parameter, the WebSocket
frame's field), and a wrong type is refused in the schema's terms."""

from __future__ import annotations

import json

import pytest

from gateways.common.chat import completion_schema, completion_translate
from gateways.common.chat import schema as chat_schema
from gateways.common.chat import translate as chat_translate
from gateways.common.status import GatewayError
from gateways.lmi import schema as lmi_schema
from gateways.lmi import translate as lmi_translate
from gateways.openai import responses_schema, responses_translate
from gateways.triton import translate as triton_translate
from gateways.ws import schema as ws_schema
from gateways.ws import translate as ws_translate


def test_chat_priority():
    req = chat_schema.parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "priority": -3})
    assert chat_translate.to_generate_request(req, request_id="r").priority == -3
    unset = chat_schema.parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    assert chat_translate.to_generate_request(unset, request_id="r").priority == 0
    with pytest.raises(GatewayError) as e:
        chat_schema.parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "priority": "high"})
    assert e.value.param == "priority"


def test_completions_priority():
    req = completion_schema.parse_completion_request({"prompt": "hi", "priority": 7})
    assert [g.priority for g in completion_translate.to_generate_requests(req, completion_id="c")] == [7]


def test_responses_priority():
    req = responses_schema.parse_responses_request({"input": "hi", "priority": 2})
    chat = responses_translate.to_chat_request(req)
    assert chat_translate.to_generate_request(chat, request_id="r").priority == 2


def test_lmi_priority():
    req = lmi_schema.parse_rolling({"inputs": "hi", "parameters": {"priority": -1}})
    opts = lmi_translate.render_options(req.inputs, req.parameters, stream=False, tgi_compat=False)
    assert lmi_translate.to_generate_request(req.inputs, req.parameters, opts, request_id="r").priority == -1
    with pytest.raises(GatewayError) as e:
        lmi_schema.parse_rolling({"inputs": "hi", "parameters": {"priority": 1.5}})
    assert "parameters.priority" in (e.value.param or e.value.message)


def test_triton_priority():
    tr = triton_translate.to_generate_request(
        {"text_input": "hi", "parameters": {"priority": 4}}, model="mock", request_id="r"
    )
    assert tr.request.priority == 4
    with pytest.raises(GatewayError) as e:
        triton_translate.to_generate_request({"text_input": "hi", "priority": "x"}, model="mock", request_id="r")
    assert "priority" in e.value.message


def test_websocket_priority():
    frame = ws_schema.parse_frame(
        json.dumps({"prompts": [{"request_id": "a", "prompt": "hi"}], "priority": -2}), max_prompts=4
    )
    req = ws_translate.to_generate_request(frame, frame.prompts[0], ws_schema.GenerationConfig())
    assert req.priority == -2
    with pytest.raises(GatewayError) as e:
        ws_schema.parse_frame(
            json.dumps({"prompts": [{"request_id": "a", "prompt": "hi"}], "priority": 1.5}), max_prompts=4
        )
    assert "priority" in e.value.message
